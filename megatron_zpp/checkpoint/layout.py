"""What a rank file holds, in terms of the single-rank model: the map behind resharding
and consolidation.

A rank file's tensors are described by *slots*. A slot is a flat span of one tensor of
the file that holds a flat range of one parameter's TP piece:

* plain DP: a whole piece, `chunk{c}.{name}` (with bf16, `master.{i}` is its fp32 master);
* ZeRO: the part of a parameter inside this rank's shard of a unit, `unit{u}.{unit}.master`
  (fp32).

Each slot also says which optimizer parameter holds its AdamW moments and where. The
slots of any rank follow from the run's config alone: the rank's model chunks are rebuilt
on the meta device (shapes and names, no memory, no process groups) exactly as
training places layers on pipeline stages (`build_stage_model`), the ZeRO units are cut as
the ZeRO engine cuts them (`model_units`, `flat_geometry`) and AdamW numbers its
parameters by the one rule of `adamw_order`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import Config
from ..model import GPT, ParallelContext
from ..model.init import full_shape
from ..optim import adamw_order
from ..pipeline_parallel import build_stage_model
from ..topology import Topology, topology_from_config
from ..zero.sharded_params import flat_geometry, model_units, pad_block, shard_segments
from .files import CheckpointError


@dataclass(frozen=True)
class FakeGroup:
    """Stands in for a process group where only .rank and .size are read (construction)."""

    rank: int
    size: int


@dataclass(frozen=True)
class Slot:
    key: str  # tensor of the rank file's "model" dict (ZeRO: without .master)
    lo: int  # its flat span [lo, hi)
    hi: int
    opt: int  # the optimizer parameter whose AdamW state is the span's (same length)
    name: str  # the single-rank parameter name
    tp_split: tuple | None  # how the full parameter is cut over TP (tensor_parallel.layers.shard)
    tp_rank: int
    tp_size: int
    full_shape: tuple  # the single-rank parameter's shape
    shape: tuple  # this TP rank's piece of it
    start: int  # flat offset of the span in this rank's TP piece
    master_key: str | None  # plain DP with bf16: the fp32 master's key


@dataclass
class RankLayout:
    """Every tensor of one rank's file: shapes of the "model" dict, optimizer state shapes, slots."""

    zero: bool
    tensors: dict[str, tuple[tuple, bool]] = field(default_factory=dict)  # key -> (shape, fp32 master?)
    opt_shapes: list[tuple] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)


def config_from_dict(d: dict) -> Config:
    """The Config a checkpoint's meta["config"] (Config.to_dict()) describes."""
    cfg = Config()
    for section, values in d.items():
        obj = getattr(cfg, section, None)
        if obj is None:
            raise CheckpointError(f"checkpoint config has an unknown section {section!r}")
        for name, value in values.items():
            if not hasattr(obj, name):
                raise CheckpointError(f"checkpoint config has an unknown setting {section}.{name}")
            setattr(obj, name, value)
    _upgrade_old_config(d, cfg)
    return cfg


def _upgrade_old_config(d: dict, cfg: Config) -> None:
    """Checkpoints saved before the Megatron defaults have no model.group_query_attention:
    there --num-query-groups alone meant GQA and a SwiGLU MLP width rounded up to 64; those saved before
    Megatron's gelu rule have no model.openai_gelu: their gelu was the tanh form."""
    m, saved = cfg.model, d.get("model", {})
    if "openai_gelu" not in saved:  # saved before Megatron's gelu rule: gelu was always the tanh form
        m.openai_gelu = True
    if "group_query_attention" in saved:
        return
    m.group_query_attention = m.num_query_groups is not None
    if m.ffn_hidden_size is None and m.activation == "swiglu":
        m.ffn_hidden_size = 64 * ((int(8 * m.hidden_size / 3) + 63) // 64)


def topology_of(cfg: Config) -> Topology:
    """The rank grid of a config (nodes do not matter for what a rank holds)."""
    return topology_from_config(cfg, ranks_per_node=cfg.parallel.world_size)


def build_chunks(cfg: Config, vocab: int, tp_rank: int, pp_rank: int) -> list[GPT]:
    """This (TP rank, PP stage)'s model chunks on the meta device (shapes and names only)."""
    ctx = ParallelContext(
        tp=FakeGroup(tp_rank, cfg.parallel.tensor_model_parallel_size), sequence_parallel=cfg.parallel.sequence_parallel
    )
    with torch.device("meta"):
        return build_stage_model(cfg, vocab, ctx, pp_rank)


def model_shapes(cfg: Config, vocab: int) -> dict[str, tuple]:
    """{single-rank parameter name: full shape} of the model `cfg` describes."""
    tp = cfg.parallel.tensor_model_parallel_size
    return {
        n: tuple(full_shape(p, tp))
        for stage in range(cfg.parallel.pipeline_model_parallel_size)
        for chunk in build_chunks(cfg, vocab, 0, stage)
        for n, p in chunk.named_parameters()
    }


def _optimizer_index(ndims: list[int]) -> list[int]:
    """Each parameter's index in AdamW's state (its numbering, `adamw_order`)."""
    index = [0] * len(ndims)
    for j, i in enumerate(adamw_order(ndims)):
        index[i] = j
    return index


def rank_layout(
    cfg: Config, vocab: int, rank: int, topo: Topology | None = None, chunk_cache: dict | None = None
) -> RankLayout:
    """The slots of `rank`'s file in a run of `cfg` (padded vocabulary `vocab`). A caller
    describing many ranks of one run passes a `chunk_cache` dict: the meta-device chunks
    depend only on the (TP, PP) coordinates, so DP x CP replicas share them."""
    topo = topo or topology_of(cfg)
    c = topo.coords(rank)
    tp_size = cfg.parallel.tensor_model_parallel_size
    cache = chunk_cache if chunk_cache is not None else {}
    if (c["tp"], c["pp"]) not in cache:
        cache[c["tp"], c["pp"]] = build_chunks(cfg, vocab, c["tp"], c["pp"])
    chunks = cache[c["tp"], c["pp"]]
    zero, bf16 = cfg.zero.zero_stage > 0, cfg.train.bf16 or cfg.train.fp16  # 16-bit weights: fp32 masters
    out = RankLayout(zero=zero)

    def slot(key, lo, hi, name, p, start, master_key=None):
        return dict(
            key=key,
            lo=lo,
            hi=hi,
            name=name,
            tp_split=p.tp_split,
            tp_rank=c["tp"],
            tp_size=tp_size,
            full_shape=tuple(full_shape(p, tp_size)),
            shape=tuple(p.shape),
            start=start,
            master_key=master_key,
        )

    pending, ndims = [], []  # (slot fields, optimizer state shape) in the engine's parameter order
    if not zero:  # PlainDP: every parameter whole, optimizer over chunks' parameters in order
        params = [(ci, n, p) for ci, chunk in enumerate(chunks) for n, p in chunk.named_parameters()]
        for i, (ci, name, p) in enumerate(params):
            key, master = f"chunk{ci}.{name}", (f"master.{i}" if bf16 else None)
            out.tensors[key] = (tuple(p.shape), False)
            if master:
                out.tensors[master] = (tuple(p.shape), True)
            pending.append((slot(key, 0, p.numel(), name, p, 0, master), tuple(p.shape)))
            ndims.append(p.ndim)
    else:  # ZeroDP: units of each chunk, sharded over the DP x CP group
        members = next(g for g in topo.groups(["dp", "cp"]) if rank in g)
        size, grank, block = len(members), members.index(rank), pad_block(cfg.zero)
        u = 0
        for chunk in chunks:
            names = {id(p): n for n, p in chunk.named_parameters()}
            for uname, uparams, _ in model_units(chunk):
                key = f"unit{u}.{uname}"
                offsets, _, shard = flat_geometry([p.numel() for p in uparams], size, block)
                out.tensors[key + ".master"] = ((shard,), True)
                for i, a, b, start in shard_segments(offsets, grank * shard, (grank + 1) * shard):
                    p = uparams[i]
                    pending.append((slot(key, a, b, names[id(p)], p, start), (b - a,)))
                    ndims.append(p.ndim)
                u += 1
    index = _optimizer_index(ndims)
    out.opt_shapes = [None] * len(pending)
    for (fields, shape), j in zip(pending, index):
        out.slots.append(Slot(opt=j, **fields))
        out.opt_shapes[j] = shape
    return out
