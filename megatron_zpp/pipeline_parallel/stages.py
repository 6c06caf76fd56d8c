"""Which layers each pipeline stage (and virtual stage) holds.

Without interleaving, stage p holds a contiguous block; the first and last stages may
hold fewer layers (they also carry the embedding and the output layer), and the middle
stages split the rest evenly. With V virtual stages, the model is cut into PP x V chunks
of equal size and stage p holds chunks p, p + PP, p + 2 PP, ... (Megatron's interleaving)."""
from __future__ import annotations


def stage_layers(num_layers: int, pp: int, stage: int, first: int | None = None, last: int | None = None
                 ) -> list[int]:
    if pp == 1:
        return list(range(num_layers))
    sizes = [None] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    rest = num_layers - sum(s for s in sizes if s is not None)
    free = [i for i, s in enumerate(sizes) if s is None]
    if free:
        if rest % len(free):
            raise ValueError(f"{rest} layers do not split evenly over {len(free)} stages")
        for i in free:
            sizes[i] = rest // len(free)
    elif rest:
        raise ValueError(f"first + last stage layers must equal --num-layers {num_layers}")
    start = sum(sizes[:stage])
    return list(range(start, start + sizes[stage]))


def virtual_stage_layers(num_layers: int, pp: int, layers_per_chunk: int, stage: int) -> list[list[int]]:
    """Layers of each of this stage's virtual chunks, in chunk order."""
    chunks = num_layers // (pp * layers_per_chunk)
    return [list(range((v * pp + stage) * layers_per_chunk, (v * pp + stage + 1) * layers_per_chunk))
            for v in range(chunks)]
