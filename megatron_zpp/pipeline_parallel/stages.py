"""Which layers each pipeline stage (and virtual stage) holds.

Without interleaving, stage p holds a contiguous block; the first and last stages may
hold fewer layers (they also carry the embedding and the output layer), and the middle
stages split the rest evenly. With V virtual stages, the model is cut into PP x V chunks
of equal size and stage p holds chunks p, p + PP, p + 2 PP, ... (Megatron's interleaving).

`build_rank_chunks` is the one builder of a rank's model: its (TP, PP) slice's chunks on the
meta device, for training (with its real groups) and for everything that needs any rank's
shapes without its processes (the checkpoint layout, the memory estimator, the simulator, a dry
run: with `stand_in_context`'s groups)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..config import Config, ParallelConfig
from ..model import GPT, ParallelContext
from ..topology import Group


def stage_layers(num_layers: int, pp: int, stage: int, first: int | None = None, last: int | None = None) -> list[int]:
    if pp == 1:
        return list(range(num_layers))
    sizes: list[int | None] = [None] * pp
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
    counts = [s for s in sizes if s is not None]  # every stage has its count by now
    start = sum(counts[:stage])
    return list(range(start, start + counts[stage]))


def virtual_stage_layers(num_layers: int, pp: int, layers_per_chunk: int, stage: int) -> list[list[int]]:
    """Layers of each of this stage's virtual chunks, in chunk order."""
    chunks = num_layers // (pp * layers_per_chunk)
    return [
        list(range((v * pp + stage) * layers_per_chunk, (v * pp + stage + 1) * layers_per_chunk)) for v in range(chunks)
    ]


@dataclass(frozen=True)
class ChunkPlacement:
    """One model chunk of a pipeline stage: its layers and the ends it owns."""

    layer_ids: list[int]
    pre_process: bool  # the embedding: first chunk of the first stage
    post_process: bool  # final norm, output layer and loss: last chunk of the last stage


def stage_chunks(cfg: ParallelConfig, num_layers: int, pp_rank: int) -> list[ChunkPlacement]:
    """This stage's chunks: one, or V virtual stages with interleaving."""
    pp = cfg.pipeline_model_parallel_size
    if cfg.num_layers_per_virtual_pipeline_stage:
        layer_sets = virtual_stage_layers(num_layers, pp, cfg.num_layers_per_virtual_pipeline_stage, pp_rank)
    else:
        layer_sets = [
            stage_layers(
                num_layers, pp, pp_rank, cfg.decoder_first_pipeline_num_layers, cfg.decoder_last_pipeline_num_layers
            )
        ]
    last = len(layer_sets) - 1
    return [
        ChunkPlacement(layers, pp_rank == 0 and v == 0, pp_rank == pp - 1 and v == last)
        for v, layers in enumerate(layer_sets)
    ]


def build_stage_model(cfg: Config, vocab_size: int, ctx: ParallelContext, pp_rank: int) -> list[GPT]:
    """This stage's model chunks, uninitialized, on the current default device (the
    meta device gives shapes and names only)."""
    return [
        GPT(cfg.model, vocab_size, ctx, c.layer_ids, c.pre_process, c.post_process)
        for c in stage_chunks(cfg.parallel, cfg.model.num_layers, pp_rank)
    ]


def stand_in_context(
    cfg: Config, tp_rank: int = 0, cp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0
) -> ParallelContext:
    """The ParallelContext of TP rank `tp_rank` / CP rank `cp_rank` (and, with routed experts, expert-parallel
    rank `ep_rank` / expert-TP rank `etp_rank`) of `cfg`, with stand-in groups (the config's sizes, no
    process group): all that building the model reads of its groups (which experts a rank holds, how each
    is cut)."""
    p = cfg.parallel

    def stand_in(role: str, size: int, rank: int) -> Group | None:
        return Group(role, tuple(range(size)), rank, "intra_node") if size > 1 else None

    return ParallelContext(
        tp=stand_in("tp", p.tensor_model_parallel_size, tp_rank),
        sequence_parallel=p.sequence_parallel,
        cp=stand_in("cp", p.context_parallel_size, cp_rank),
        cp_algo=p.cp_algo,
        all_scan_blocks=p.all_scan_blocks or 1,
        ep=stand_in("ep", p.expert_model_parallel_size, ep_rank),
        etp=stand_in("etp", p.expert_tp_size, etp_rank),
    )


def build_rank_chunks(
    cfg: Config, vocab_size: int, pp_rank: int, ctx: ParallelContext, dtype: torch.dtype = torch.float32
) -> list[GPT]:
    """The one builder of a rank's model: pipeline stage `pp_rank`'s chunks for the TP rank of `ctx`
    (training's real groups, or `stand_in_context(cfg, tp_rank)`), on the meta device in `dtype`:
    shapes, names, TP splits and init rules, no memory. `vocab_size` is the padded vocabulary."""
    with torch.device("meta"), unset_fake_temporarily():  # plain meta tensors under a dry run's FakeTensorMode too
        chunks = build_stage_model(cfg, vocab_size, ctx, pp_rank)
        return [chunk.to(dtype=dtype) for chunk in chunks]  # meta to meta: the same parameter objects
