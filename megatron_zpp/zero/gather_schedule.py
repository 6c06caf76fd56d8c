"""A chunk's ZeRO units in the order the model uses them, and the module hooks that need only the
units (no engine state): the forward's gather waits of --overlap-param-gather, ZeRO-3's gather with
prefetch and its release after a block's forward. The engine (zero_engine.py) installs them."""

from __future__ import annotations

from ..recompute import recomputing
from .sharded_params import START_UNITS, FlatUnit


def gather_all(units: list[FlatUnit], backward: bool = False) -> None:
    """Issue every unit's gather, then wait for them all (the transfers overlap each other)."""
    for u in units:
        u.start_gather(backward)
    for u in units:
        u.wait_gather()


def backward_order(chunk, units: list[FlatUnit]) -> list[FlatUnit]:
    """The units of a chunk in the order their backward ends:
    a tied output layer on the last stage (the embedding), the head, the blocks last to
    first, the embedding lookup. Known from the model, not from the data."""
    by_name = {u.name: u for u in units}
    emb = by_name.get("embedding")
    order = [emb] if emb is not None and chunk.post_process and not chunk.pre_process else []
    order += [by_name["head"]] if "head" in by_name else []
    order += reversed([u for u in units if u.module is not None])
    order += [emb] if emb is not None and emb not in order else []
    return order + [u for u in units if u not in order]


def install_gather_waits(chunk, units: dict[str, FlatUnit]) -> None:
    """--overlap-param-gather (stages 1-2): the step leaves each unit's all-gather in
    flight; a unit's weights are waited for just before their first reader: the chunk's
    forward (the embedding lookup), each block's forward, the final norm (the head, and a
    tied embedding used as the output layer)."""
    start = [units[n] for n in START_UNITS if n in units] if chunk.pre_process else []
    end = [units[n] for n in ("head", "embedding") if n in units and n not in [u.name for u in start]]

    def wait(now: list[FlatUnit]) -> None:
        for u in now:
            u.wait_gather()

    chunk.register_forward_pre_hook(lambda m, a, kw: wait(start), with_kwargs=True)
    for unit in units.values():
        if unit.module is not None:
            unit.module.register_forward_pre_hook(lambda m, a, unit=unit: unit.wait_gather())
    if end:
        chunk.final_norm.register_forward_pre_hook(lambda m, a: wait(end))


def gather_and_prefetch(now: list[FlatUnit], order: list, after: FlatUnit | None = None) -> None:
    """Gather `now`; start the gather of what comes after it in `order` (the first item
    when `after` is None), which then runs while `now` computes."""
    gather_all(now)
    i = order.index(after) + 1 if after is not None else len(now)
    if i < len(order):
        for u in order[i] if isinstance(order[i], list) else [order[i]]:
            u.start_gather(backward=False)


def release_after_forward(unit: FlatUnit):
    """ZeRO-3: a block's forward hook that frees its full weights (its backward gathers them again)."""

    def hook(module, args, output):
        if not recomputing():  # a rerun runs inside the backward, which still needs the weights
            unit.release()

    return hook
