"""ZeRO parameter units: groups of parameters stored as one flat buffer, sharded over
the ZeRO group (data parallel x context parallel).

A unit is a transformer block, the embedding, or the head (final norm and untied output
layer). Its flat buffer is padded to a multiple of group size x quantization block, so
every shard and every quantization block is whole. Rank r owns slice r of the flat
buffer: its fp32 master weights, optimizer state and (stages 2-3) gradients.

Stage 3 keeps only the shard between uses: the full buffer's storage is freed after a
unit's forward and re-gathered before its backward (saved activations keep pointing into
the same storage, so they are valid again once it is refilled).

* qwZ: the forward gather sends int8 blocks with one fp32 scale each.
* hpZ: the first forward gather after a step (or a load) also leaves each rank a secondary
  shard, its slice of the full weights within its hpZ group (inside one node); every later
  gather until the next step (the backward's, and with gradient accumulation the next
  micro-batches' forward) reads only those, so it never leaves the node. The weights
  change only at the step, so the secondary is never older than what the forward used,
  and it is written before any of its readers can start.
"""

from __future__ import annotations

import math

import torch

from ..model.init import swap_in
from ..tensor_parallel.layers import is_expert
from ..topology import Group
from .engine import RankLayout, numbered_layout, param_slot
from .gather import PendingGather, SecondaryShard, all_gather_weights


def flat_geometry(numels: list[int], group_size: int, pad_block: int) -> tuple[list[int], int, int]:
    """(offsets of the parameters in the flat buffer, padded length, shard length): the
    buffer is padded to a multiple of group size x block, so shards and blocks are whole."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    padded = math.ceil(offsets[-1] / (group_size * pad_block)) * group_size * pad_block
    return offsets, padded, padded // group_size


def pad_block(zero_cfg) -> int:
    """What a unit's flat buffer is padded to per rank: whole qwZ and qgZ blocks."""
    return math.lcm(zero_cfg.zero_quantization_block_size, zero_cfg.zero_gradient_quantization_block_size)


def shard_segments(offsets: list[int], lo: int, hi: int):
    """(parameter index, start in shard, end in shard, start in parameter) for each piece
    of a parameter that falls into the shard [lo, hi) of the flat buffer."""
    for i, (off, end) in enumerate(zip(offsets, offsets[1:])):
        a, b = max(off, lo), min(end, hi)
        if a < b:
            yield i, a - lo, b - lo, a - off


# the units the first stage's forward reads before its blocks (the word embedding and learned positions)
START_UNITS = ("embedding", "position_embeddings")


def model_units(chunk) -> list[tuple[str, list, torch.nn.Module | None]]:
    """(name, params, module) per unit of a model chunk (a GPT, walked by its `parts()`): the
    embedding (and the learned positions, see START_UNITS), each block, the head (final norm,
    untied output layer). Blocks carry their module (stage 3 hooks it). A block with routed experts
    also gives a unit of its expert weights, `layer{i}.experts` (is_expert_unit; sharded over the
    expert-data-parallel group, gathered and freed with its block), right after the block's."""
    parts = chunk.parts()
    units = []
    if parts.embedding is not None:
        units.append(("embedding", list(parts.embedding.parameters()), None))
    if parts.position_embeddings is not None:  # a unit of its own: the tied twin has none
        units.append(("position_embeddings", list(parts.position_embeddings.parameters()), None))
    for idx, block in parts.layers:
        params = list(block.parameters())
        units.append((f"layer{idx}", [p for p in params if not is_expert(p)], block))
        experts = [p for p in params if is_expert(p)]
        if experts:
            units.append((f"layer{idx}{EXPERTS_SUFFIX}", experts, None))
    head = [p for m in (parts.final_norm, parts.output) if m is not None for p in m.parameters()]
    if head:
        units.append(("head", head, None))
    return units


EXPERTS_SUFFIX = ".experts"


def is_expert_unit(name: str) -> bool:
    return name.endswith(EXPERTS_SUFFIX)


def shard_layout(chunks, group: tuple[int, int], edp: tuple[int, int] | None, block: int, key_of) -> RankLayout:
    """What rank `group` = (rank, size) of a ZeRO group holds of `chunks` (ZeroEngine.slots): each unit's
    fp32 master shard (`key_of(unit index, unit name)`), cut as FlatUnit cuts it; a parameter's AdamW
    segment is its part inside the shard. A block's routed experts are cut over the expert-data-parallel
    group, `edp` = (rank, size) (None: the same as `group`), as ZeroEngine builds their units."""
    tensors, spans, u = {}, [], 0
    for chunk in chunks:
        names = {id(p): n for n, p in chunk.named_parameters()}
        for name, params, _ in model_units(chunk):
            key = key_of(u, name)
            rank, size = (edp or group) if is_expert_unit(name) else group
            offsets, _, shard = flat_geometry([p.numel() for p in params], size, block)
            tensors[key] = ((shard,), True)
            for i, a, b, start in shard_segments(offsets, rank * shard, (rank + 1) * shard):
                p = params[i]
                spans.append((param_slot(chunk, key, a, b, names[id(p)], p, start), (b - a,), p.ndim))
            u += 1
    return numbered_layout(tensors, spans)


class FlatUnit:
    def __init__(
        self,
        name: str,
        params: list[torch.nn.Parameter],
        group: Group,
        sharded_weights: bool,
        pad_block: int,
        hpz: Group | None = None,
        qwz_block: int | None = None,
        init=None,
        module: torch.nn.Module | None = None,
        chunk: int = 0,
        tied: bool = False,
        gather_stream=None,
    ):
        """`params` are real tensors (copied into the flat buffer), or on the meta device with `init`
        (model/init.RankInit): a sharded start-up, which allocates and fills only what this rank
        keeps, parameter by parameter: ZeRO-3 (`sharded_weights`) its shard (the full buffer is first
        allocated by the first gather), stages 1-2 the full buffer. The values are the same either way.
        `module`: a block's module (ZeRO-3 hooks it); `chunk`: the model chunk it belongs to; `tied`: the
        embedding whose twin is the output layer on the other end stage; `gather_stream`: the engine's
        all-gather stream (None: the current one)."""
        self.name, self.params, self.group, self.sharded_weights = name, params, group, sharded_weights
        self.companions: list[FlatUnit] = []  # units gathered and freed with this one (a block's experts)
        self.qwz_block = qwz_block
        self.module, self.chunk, self.tied, self.gather_stream = module, chunk, tied, gather_stream
        p0 = params[0]
        on_meta = p0.is_meta
        if on_meta and init is None:
            raise ValueError(f"ZeRO unit {name}: its parameters are on the meta device and no init was given")
        self.dtype, self.device = p0.dtype, (init.device if on_meta else p0.device)
        self.numels = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.ndims = {id(p): p.ndim for p in params}  # stage 3 empties p.data; weight decay needs the real rank
        self.offsets, self.padded, self.shard_numel = flat_geometry(self.numels, group.size, pad_block)
        self.numel = self.offsets[-1]
        self.lo = group.rank * self.shard_numel  # my slice [lo, hi) of the flat buffer
        self.hi = self.lo + self.shard_numel
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        if on_meta:
            for p in params:  # the same objects, now on the device, empty until attached
                swap_in(p, self._empty)
        self.gathered = True
        self._gather: PendingGather | None = None
        self._views: list[torch.Tensor] | None = None  # the parameters' views of the full buffer, once it exists
        self._fill(init if on_meta else None)
        self.hpz = (
            None if hpz is None else SecondaryShard(hpz, self.padded, self._full_or_none(), self.dtype, self.device)
        )
        if sharded_weights:
            self.release()
        # fp32 master shard (ZeRO-3 in fp32: the shard itself) and fp32 gradient shard
        self.master = self.shard if self.dtype == torch.float32 and sharded_weights else self.shard.float().clone()
        self.grad_shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)

    def _fill(self, init) -> None:
        """Allocate and fill the weights: from the parameters, or (`init`: a sharded start-up) ZeRO-3's
        shard alone (the full buffer and its views come with the first gather), stages 1-2 the full buffer."""
        if init is not None and self.sharded_weights:
            self.full, self._views, self.gathered = torch.empty(0, dtype=self.dtype, device=self.device), None, False
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
            for i, a, b, start in shard_segments(self.offsets, self.lo, self.hi):
                init.fill(self.params[i], self.shard[a:b], start)
            return
        self.full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self._views = self._views_of_full()
        for p, view in zip(self.params, self._views):
            if init is not None:
                init.fill(p, view.view(-1))
            else:
                view.copy_(p.detach())
        self._attach()
        self.shard = self.full[self.lo : self.hi].clone()  # training-dtype copy of my slice (what I send)

    def _full_or_none(self) -> torch.Tensor | None:
        return None if self._views is None else self.full

    def _views_of_full(self) -> list[torch.Tensor]:
        return [self.full[off : off + n].view(shape) for shape, off, n in zip(self.shapes, self.offsets, self.numels)]

    # ---- parameter gathering (stage 3) -----------------------------------------------
    def start_gather(self, backward: bool) -> None:
        """Issue the all-gather of this unit's full weights (async; `wait_gather` ends it), its companions'
        first."""
        for unit in self.companions:
            unit.start_gather(backward)
        if self.gathered or self._gather is not None:
            return
        if self._views is None:  # a sharded start-up: the first gather allocates the full buffer
            self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            self._views = self._views_of_full()
        else:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        phase = "zero_bwd_allgather" if backward else "zero_fwd_allgather"
        # hpZ: the backward, and every forward after the step's first (the weights change only
        # at the step), gather inside the node from the secondary shards
        stream = self.gather_stream
        if self.hpz is not None and self.hpz.serves(backward):
            self._gather = all_gather_weights(self.full, self.hpz.shard, self.hpz.group, phase, stream=stream)
        else:
            self._gather = all_gather_weights(self.full, self.shard, self.group, phase, self.qwz_block, stream)

    def wait_gather(self) -> None:
        for unit in self.companions:
            unit.wait_gather()
        if self.gathered:
            return
        if self._gather is None:
            raise RuntimeError(f"ZeRO unit {self.name}: waited for a gather that was never started")
        if self.hpz is not None:  # the step's first forward: keep its weights (copied on the gather stream)
            self._gather.then = self.hpz.keep(self.full)
        self._gather.wait()
        self._gather, self.gathered = None, True
        self._attach()

    def gather(self, backward: bool = False) -> None:
        self.start_gather(backward)
        self.wait_gather()

    def release(self) -> None:
        """Free the full weights (stage 3); the shard stays. A prefetch in flight is
        finished first (its buffer is the storage being freed) and dropped. Its companions too."""
        for unit in self.companions:
            unit.release()
        self._drop_gather()
        if self.sharded_weights and self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False
            for p in self.params:  # reading a released weight gives an empty tensor, not freed memory
                p.data = self._empty

    def _drop_gather(self) -> None:
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self.gathered = True  # the buffer is full (of now unwanted weights): release frees it

    def _attach(self) -> None:
        assert self._views is not None  # attached only once the full buffer exists
        for p, view in zip(self.params, self._views):
            p.data = view

    # ---- after the optimizer step ------------------------------------------------------
    def set_shard(self, new_shard: torch.Tensor, wait: bool = True) -> None:
        """Take the updated shard; stages 1-2 gather the full weights again (at once, or
        with wait=False left in flight: wait_gather, gather or release ends it before
        the weights are read). A gather in flight (a prefetch of the old weights) is
        dropped; the hpZ secondary is stale until the next forward gather refreshes it."""
        self._drop_gather()
        if self.hpz is not None:
            self.hpz.stale()
        self.shard.copy_(new_shard)
        if not self.sharded_weights:
            self._gather = all_gather_weights(
                self.full, self.shard, self.group, "zero_param_allgather", stream=self.gather_stream
            )
            self.gathered = False
            if wait:
                self.wait_gather()
        else:
            self.release()

    # ---- shard geometry ----------------------------------------------------------------
    def segments(self):
        """(param, start in shard, end in shard, start in param) for each parameter piece
        that falls into this rank's shard."""
        for i, a, b, start in shard_segments(self.offsets, self.lo, self.hi):
            yield self.params[i], a, b, start
