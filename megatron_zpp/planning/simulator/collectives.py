"""Every collective one rank issues in a training step, from a validated config.

Enumerated the way the engines issue them (read alongside the code they mirror):

* tensor_parallel/layers.py: per micro-batch and block, two column-parallel inputs (SP:
  all-gather forward, and in the backward an all-gather again (only the shard was kept)
  behind the input-gradient matmul, then the gradient's reduce-scatter behind the
  weight-gradient one; else an all-reduce of the input gradient)
  and two row-parallel outputs (SP: reduce-scatter / all-gather; else a forward
  all-reduce); the embedding's output and the output layer's input likewise; the
  vocab-parallel cross-entropy's two fp32 all-reduces (tensor_parallel/cross_entropy.py);
* context_parallel/: softmax layers all-gather K|V and reduce-scatter their gradient;
  GLA and GDN layers pass one fp32 state [b, heads, d, d] down the chain (all-scan, ring)
  or all-gather every state with its transition (GLA's decay [b, heads, d], GDN's M [b, heads,
  d, d]), forward and backward; GDN's convolution sends its last 3 q|k|v tokens to the next
  rank (context_parallel/delta_rule.py) and gets their gradient back;
* moe/ (simulator/moe.py): an MoE layer's router counts and token exchanges per micro-batch;
  its routed experts' gradients over the expert-data-parallel group (their own DDP buffer, or
  each block's expert unit under ZeRO: gathered before the block, reduced before it, flat);
* recompute.py: a region's rerun in the backward repeats its forward collectives (a full-recompute group's TP,
  softmax K|V gathers and MoE exchanges; an MoE layer's under --moe-layer-recompute) but the CP state and halo it
  recalls, and stops once the last tensor the backward keeps is recomputed (torch.utils.checkpoint's early
  stop): the collective that ends a region with nothing kept after it (its last FFN's reduce-scatter without
  hidden dropout) is not repeated;
* pipeline_parallel/: the sends of the real schedule (schedule.stage_ops);
* zero/: plain DP's fp32 gradient all-reduce; ZeRO units (the engine's own padding,
  zero/sharded_params.flat_geometry) gathered and released by the hooks' rules (a block
  before each forward and backward, the end units once until their gradient is reduced;
  hpZ: the step's first gather from the primary, qwZ-quantized, every later one from the
  secondary), gradients reduce-scattered flat or hop by hop (qgZ int4 wire bytes,
  ops/quantize.wire_bytes), stages 1-2's parameter all-gather after the step;
* optim/finalize.py, clipping.py and training/step.py: the SP norm-gradient and tied
  embedding all-reduces, the fp64 grad-norm all-reduces (dense, then the experts' part), the
  loss report, model/moe_mlp.moe_step's.

Each collective's bytes are `comm.model_bytes` of its (op, group size, buffer) and its
link is the ledger's (topology.Topology.link_class of the group, or of the pair for p2p),
so the simulator and a --comm-report ledger agree exactly (tests/planning/test_simulator.py).
Not modelled: a full-recompute rerun's ZeRO-3 gathers are counted as backward gathers
(the ledger may file some of them under "zero_bwd_allgather:recompute").
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from ...config import Config
from ...config.shapes import MixerShape
from ...data.tokenizer import pad_vocab_size
from ...ops.quantize import wire_bytes
from ...tensor_parallel.layers import is_expert
from ...topology import Group, ProcessGroups, topology_from_config, zero_reduce_tiers
from ...zero.ddp_engine import default_bucket_numel
from ...zero.gather import QWZ_BITS
from ...zero.grad_buffer import bucket_bounds
from ...zero.grad_reduce import QGZ_BITS
from ...zero.sharded_params import START_UNITS, flat_geometry, is_expert_unit, model_units, pad_block, shard_segments
from ..memory import stage_model
from .calls import Coll, _coll
from .moe import moe_colls, moe_step_colls
from .schedule import Op, StageSchedule, stage_ops


@dataclass
class UnitInfo:
    name: str
    chunk: int
    numels: list[int]
    padded: int
    shard: int
    is_block: bool
    tp_partial: list[bool]
    tied: bool
    expert: bool = False  # a block's routed experts (`layer{i}.experts`): sharded over the expert-data-parallel group
    companions: list[UnitInfo] = field(default_factory=list)  # a block's: its experts' unit, gathered before it


@dataclass
class RankStep:
    """One rank's step: its schedule, the collectives of each forward/backward (in
    issue order, each with the unit it belongs to for ZeRO) and those at the step's end."""

    rank: int
    pp_rank: int
    schedule: StageSchedule
    per_op: list[tuple[Op, list[tuple[str | None, Coll]]]] = field(default_factory=list)
    step_end: list[Coll] = field(default_factory=list)
    units: list[UnitInfo] = field(default_factory=list)

    def all(self) -> list[Coll]:
        return [c for _, cs in self.per_op for _, c in cs] + self.step_end


# ---------------------------------------------------------------- groups of a rank


def rank_groups(cfg: Config, rank: int) -> ProcessGroups:
    """This rank's groups as topology.build_groups_from_config makes them, without processes:
    the same kinds, members and link classes (Topology.link_class), no torch handles."""
    z = cfg.zero
    topo = topology_from_config(cfg)
    tiers = zero_reduce_tiers(cfg, topo) if (z.zero_quantized_gradients or z.zero_hierarchy) else None
    mine: dict[str, Group] = {}
    for kind, groups in topo.all_group_kinds(tiers, z.zero_hpz_partition_size).items():
        for members in groups:
            if rank in members:
                key = tuple(members)
                peers = tuple(topo.link_class([rank, r]) for r in key)
                mine[kind] = Group(kind, key, key.index(rank), topo.link_class(key), peers, topo.hop_links(key))
    return ProcessGroups.from_kinds(topo, rank, mine)


_CHUNKS: dict[tuple[str, int], list] = {}


def stage_chunks(cfg: Config, pp_rank: int) -> list:
    """This stage's model chunks on the meta device (memory.stage_model), cached per config."""
    key = (repr(cfg), pp_rank)
    if key not in _CHUNKS:
        if len(_CHUNKS) > 64:
            _CHUNKS.clear()
        _CHUNKS[key] = stage_model(cfg, pp_rank)
    return _CHUNKS[key]


# ---------------------------------------------------------------- per micro-batch


def _act_bytes(cfg: Config) -> tuple[int, int]:
    """(bytes per element of the training dtype, elements of one [b, s/cp, h] activation)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    return (2 if t.bf16 else 4), t.micro_batch_size * (m.seq_length // p.context_parallel_size) * m.hidden_size


def _tp_enter(g: ProcessGroups, sp: bool, nbytes: float, fwd: bool, matmul_flops: float = 0.0) -> list[Coll]:
    """A column-parallel product's input: under SP gathered in the forward, gathered again in the
    backward (only the shard is kept, tensor_parallel/layers.py) behind the input-gradient matmul
    and its gradient reduce-scattered behind the weight-gradient one (each `matmul_flops`)."""
    if sp:
        if fwd:
            return [_coll(g.tp, "sp_fwd_allgather", "all_gather", nbytes, "tp")]
        again = _coll(g.tp, "sp_bwd_regather", "all_gather", nbytes, "tp")
        scatter = _coll(g.tp, "sp_bwd_reducescatter", "reduce_scatter", nbytes, "tp")
        return [dataclasses.replace(c, behind_flops=matmul_flops) for c in (again, scatter)]
    return [] if fwd else [_coll(g.tp, "tp_bwd_allreduce", "all_reduce", nbytes, "tp")]


def _tp_exit(g: ProcessGroups, sp: bool, nbytes: float, fwd: bool) -> list[Coll]:
    if sp:
        return (
            [_coll(g.tp, "sp_fwd_reducescatter", "reduce_scatter", nbytes, "tp")]
            if fwd
            else [_coll(g.tp, "sp_bwd_allgather", "all_gather", nbytes, "tp")]
        )
    return [_coll(g.tp, "tp_fwd_allreduce", "all_reduce", nbytes, "tp")] if fwd else []


def _block_colls(
    cfg: Config,
    g: ProcessGroups,
    layer: int,
    fwd: bool,
    rerun: bool = False,
    imbalance: float = 1.0,
    ends_group: bool = False,
    in_group: bool = False,
) -> list[Coll]:
    """TP, CP and MoE collectives of one block's forward (fwd) or backward. `rerun`: the forward collectives the
    rerun of a full-recompute group repeats (TP, softmax K|V gather, MoE dispatch; not the linear mixers' scan and
    halo, which it recalls); `ends_group`: the block ends that group, whose rerun stops once the last tensor the
    backward keeps is recomputed (torch.utils.checkpoint's early stop, recompute.py), before the FFN branch's last
    collective when nothing after it keeps one (`_ffn_colls`; in the block: no hidden dropout mask, no norm of the
    branch's output). An MoE layer's backward with --moe-layer-recompute: its own forward's again first (stopping
    likewise), unless the block is `in_group` (a recompute region inside another just runs)."""
    m, p = cfg.model, cfg.parallel
    e = _act_bytes(cfg)[0]
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    out = _tp_product(cfg, g, _product_widths(cfg, layer)[0], fwd) if tp > 1 else []  # the mixer's projections
    if tp > 1 and m.qk_layernorm_full_width and m.layer_kind(layer) == "softmax":  # q's, k's fp32 sums of squares
        rows = cfg.train.micro_batch_size * (m.seq_length // cp) * 4
        out += [_coll(g.tp, "tp_fwd_allreduce" if fwd else "tp_bwd_allreduce", "all_reduce", rows, "tp")] * 2
    if cp > 1:
        b, s_cp, mixer = cfg.train.micro_batch_size, m.seq_length // cp, m.mixer(layer)
        if not mixer.linear:
            kv = cp * b * (mixer.kv_heads // tp) * s_cp * 2 * mixer.key_dim * e
            out.append(
                _coll(g.cp, "cp_attn_fwd", "all_gather", kv, "cp_attn")
                if fwd
                else _coll(g.cp, "cp_attn_bwd", "reduce_scatter", kv, "cp_attn")
            )
        elif not rerun:  # the halo before the operator's scan; its gradient after the scan's
            scan, halo = _scan_colls(cfg, g, fwd, mixer), _halo_colls(cfg, g, fwd, mixer, e)
            out += halo + scan if fwd else scan + halo
    ffn, ends_with_last = _ffn_colls(cfg, g, layer, fwd, imbalance)
    if rerun:
        kept_after = m.hidden_dropout > 0 or m.reordered_norm(layer)  # the dropout's mask, the norm's input
        stops = ends_group and ends_with_last and not kept_after
        return [_recomputed(c) for c in out + (ffn[:-1] if stops else ffn)]
    if not fwd and m.ffn(layer).kind == "moe" and m.moe_layer_recompute and not in_group:
        again, ends_with_last = _ffn_colls(cfg, g, layer, True, imbalance)
        out += [_recomputed(c) for c in (again[:-1] if ends_with_last else again)]
    return out + ffn


def _ffn_colls(cfg: Config, g: ProcessGroups, layer: int, fwd: bool, imbalance: float = 1.0) -> tuple[list, bool]:
    """(the FFN branch's collectives of a forward or backward, whether its forward keeps no tensor for the backward
    after the last of them): a dense MLP ends with its TP exit; an MoE layer with its shared expert's TP exit unless
    that is gated (the gate multiplies its output), without one with the allgather dispatcher's scatter (the
    alltoall dispatcher's unpermute scales the combined rows by the probabilities)."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    widths = _product_widths(cfg, layer)[1:]  # the dense MLP's fc1, or an MoE layer's shared expert's if any
    out: list[Coll] = []
    ends = True
    if m.ffn(layer).kind == "moe":
        out += moe_colls(cfg, g, fwd, imbalance)
        if widths:  # the shared expert runs after the dispatcher
            ends = tp > 1 and not m.moe_shared_expert_gate
        else:
            ends = m.moe_token_dispatcher_type != "alltoall" and g.etp_ep.size > 1
    if tp > 1 and widths:
        out += _tp_product(cfg, g, widths[0], fwd)
    return out, ends and bool(out)


def _tp_product(cfg: Config, g: ProcessGroups, width: int, fwd: bool) -> list[Coll]:
    """A column-parallel product of full output `width` and the row-parallel one after it: enter the TP region,
    leave it."""
    e, act = _act_bytes(cfg)
    flops = 2 * act * width / cfg.parallel.tensor_model_parallel_size  # a backward matmul: [b s, h] x [h, width/TP]
    sp = cfg.parallel.sequence_parallel
    return _tp_enter(g, sp, act * e, fwd, flops) + _tp_exit(g, sp, act * e, fwd)


def _recomputed(c: Coll) -> Coll:
    return c if c.phase.endswith(":recompute") else dataclasses.replace(c, phase=c.phase + ":recompute")


def _product_widths(cfg: Config, layer: int) -> tuple[int, ...]:
    """Full output widths of a block's column-parallel products: its mixer's input projection (with a
    replicated section TP times: it is not split) and fc1, or in an MoE layer the shared expert's fc1 if any
    (the routed experts are not TP-split: their own exchanges, moe.py)."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    ffn = m.ffn(layer)
    if ffn.kind == "moe":
        shared = ffn.shared_hidden * len(ffn.sections)
        return (m.mixer(layer).projection_width(tp),) + ((shared,) if shared else ())
    return m.mixer(layer).projection_width(tp), sum(ffn.sections)


def _scan_colls(cfg: Config, g: ProcessGroups, fwd: bool, mixer: MixerShape) -> list[Coll]:
    """The state scan of one linear mixer (context_parallel/: fp32 state [b, H, K, V])."""
    p = cfg.parallel
    heads = mixer.heads // p.tensor_model_parallel_size
    state = cfg.train.micro_batch_size * heads * mixer.state_per_head * 4
    cp, algo = g.cp, p.cp_algo
    if algo == "all-gather":  # the states (and their transitions, forward) of every rank
        nbytes = cp.size * (state + transition_bytes(cfg, mixer)) if fwd else cp.size * state
        return [_coll(cp, "cp_lasp2_fwd" if fwd else "cp_lasp2_bwd", "all_gather", nbytes, "cp_scan")]
    dst = cp.rank + (1 if fwd else -1)
    if not 0 <= dst < cp.size:
        return []
    name = "cp_allscan" if algo == "all-scan" else "cp_ring"
    return [_coll(cp, f"{name}_{'fwd' if fwd else 'bwd'}", "send", state, "cp_scan", link=cp.peer_links[dst])]


def transition_bytes(cfg: Config, mixer: MixerShape) -> int:
    """What the all-gather sends of a transition with its state (GLA's decay [b, H, K], GDN's M [b, H, K, K])."""
    heads = mixer.heads // cfg.parallel.tensor_model_parallel_size
    return cfg.train.micro_batch_size * heads * mixer.transition_per_head * 4


def _halo_colls(cfg: Config, g: ProcessGroups, fwd: bool, mixer: MixerShape, e: int) -> list[Coll]:
    """A convolution's halo: its last kernel-1 tokens of the conv channels [b, k-1, channels/TP] (e) to rank p+1,
    their gradient back."""
    cp = g.cp
    dst = cp.rank + (1 if fwd else -1)
    if not mixer.halo_tokens or not 0 <= dst < cp.size:
        return []
    channels = mixer.conv_channels // cfg.parallel.tensor_model_parallel_size
    nbytes = cfg.train.micro_batch_size * mixer.halo_tokens * channels * e
    return [_coll(cp, "cp_halo_fwd" if fwd else "cp_halo_bwd", "send", nbytes, "cp_halo", link=cp.peer_links[dst])]


def _end_colls(cfg: Config, g: ProcessGroups, chunk, fwd: bool) -> list[Coll]:
    """The embedding's output (first stage) and the output layer + cross-entropy (last)."""
    p = cfg.parallel
    if p.tensor_model_parallel_size == 1:
        return []
    e, act = _act_bytes(cfg)
    sp, out = p.sequence_parallel, []
    if chunk.pre_process:
        out += _tp_exit(g, sp, act * e, fwd)
    if chunk.post_process:
        tp, m = p.tensor_model_parallel_size, cfg.model
        vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
        out += _tp_enter(g, sp, act * e, fwd, 2 * act * vocab / tp)
        if fwd:
            rows = act // cfg.model.hidden_size
            out += [
                _coll(g.tp, "tp_fwd_ce", "all_reduce", rows * 4, "tp"),
                _coll(g.tp, "tp_fwd_ce", "all_reduce", 2 * rows * 4, "tp"),
            ]
    return out


# ---------------------------------------------------------------- ZeRO


def _units(cfg: Config, chunks) -> list[UnitInfo]:
    """The engine's units (zero/sharded_params.model_units): a block's routed experts a unit of their own over
    the expert-data-parallel group, its block's companion."""
    n = cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size
    edp = topology_from_config(cfg).expert_sizes["edp"]
    out: list[UnitInfo] = []
    for c, chunk in enumerate(chunks):
        for name, params, module in model_units(chunk):
            numels = [q.numel() for q in params]
            expert = is_expert_unit(name)
            _, padded, shard = flat_geometry(numels, edp if expert else n, pad_block(cfg.zero))
            partial = [bool(getattr(q, "tp_partial_grad", False)) for q in params]
            tied = name == "embedding" and chunk.tied
            out.append(UnitInfo(name, c, numels, padded, shard, module is not None, partial, tied, expert))
            if expert:  # right after its block (model_units' order)
                out[-2].companions.append(out[-1])
    return out


class _ZeroState:
    """Gathered / released state of each unit, by zero/gather_schedule.py's hook rules."""

    def __init__(self, cfg: Config, g: ProcessGroups, units: list[UnitInfo]):
        z = cfg.zero
        self.cfg, self.g, self.units = cfg, g, units
        self.e = 2 if cfg.train.bf16 else 4
        self.per_step = z.zero_param_persistence == "step"
        self.hpz = g.dp_hpz if z.zero_hpz_partition_size > 1 else None
        self.qwz = z.zero_quantization_block_size if z.zero_quantized_weights else None
        self.gathered = {id(u): False for u in units}
        self.secondary = {id(u): False for u in units}

    def gather(self, u: UnitInfo, backward: bool) -> list[tuple[str, Coll]]:
        if self.gathered[id(u)]:
            return []
        self.gathered[id(u)] = True
        phase = "zero_bwd_allgather" if backward else "zero_fwd_allgather"
        group = self.g.edp if u.expert else self.g.dp_cp
        if u.expert:  # over the expert-data-parallel group, from the primary shard (no hpZ), qwZ as any unit
            return self._primary(u, group, phase)
        if self.hpz is not None and (backward or self.secondary[id(u)]):
            return (
                [(u.name, _coll(self.hpz, phase, "all_gather", u.padded * self.e, "zero_gather"))]
                if (self.hpz.size > 1)
                else []
            )
        if self.hpz is not None:
            self.secondary[id(u)] = True
        return self._primary(u, group, phase)

    def _primary(self, u: UnitInfo, group: Group, phase: str) -> list[tuple[str, Coll]]:
        """`u`'s gather from its primary shards over `group` (qwZ: int8 with block scales)."""
        if group.size == 1:
            return []
        if self.qwz is None:
            return [(u.name, _coll(group, phase, "all_gather", u.padded * self.e, "zero_gather"))]
        wire = group.size * wire_bytes(u.shard, self.qwz, QWZ_BITS)
        key = f"{QWZ_BITS}/{self.qwz}"
        return [(u.name, _coll(group, phase, "all_gather", wire, "zero_gather", quant=u.padded + u.shard, qkey=key))]

    def release(self, u: UnitInfo) -> None:
        if not self.per_step:
            self.gathered[id(u)] = False


def grad_wire_bytes(cfg: Config) -> int:
    """Bytes per element of an unquantized gradient reduction: 2 with --grad-reduce-in-bf16."""
    return 2 if cfg.zero.grad_reduce_in_bf16 else 4


def _reduction(cfg: Config, g: ProcessGroups, u: UnitInfo) -> list[Coll]:
    """One unit's gradient reduction (zero/grad_reduce.py): flat, or hop by hop (not a unit of routed experts:
    flat over the expert-data-parallel group, reduce_schedule.py)."""
    z = cfg.zero
    if u.expert:
        if g.edp.size == 1:
            return []
        return [_coll(g.edp, "zero_grad_reducescatter", "reduce_scatter", grad_wire_bytes(cfg) * u.padded, "grad")]
    if z.zero_quantized_gradients or z.zero_hierarchy:
        bits = QGZ_BITS if z.zero_quantized_gradients else None
        block = z.zero_gradient_quantization_block_size
        phase = "qgz_grad" if bits else "zero_grad_hierarchical"
        out, numel = [], u.padded
        for hop in g.dp_tier_hops():
            if hop.size > 1:
                nbytes = wire_bytes(numel, block, bits) if bits else grad_wire_bytes(cfg) * numel
                qkey = f"{bits}/{block}" if bits else ""
                out.append(_coll(hop, phase, "all_to_all", nbytes, "grad", quant=2 * numel if bits else 0.0, qkey=qkey))
            numel //= hop.size
        return out
    if g.dp_cp.size == 1:
        return []
    return [_coll(g.dp_cp, "zero_grad_reducescatter", "reduce_scatter", grad_wire_bytes(cfg) * u.padded, "grad")]


def _zero_forward(st: _ZeroState, chunk, units: list[UnitInfo]) -> list[tuple[str, Coll]]:
    blocks = [u for u in units if u.is_block]
    start = [u for u in units if u.name in START_UNITS] if chunk.pre_process else []
    end = [u for u in units if u.name in ("head", "embedding")] if chunk.post_process else []
    out = []
    for u in start:
        out += st.gather(u, False)
    for u in blocks:
        for x in u.companions + [u]:  # FlatUnit.start_gather: its experts' first
            out += st.gather(x, False)
        for x in u.companions + [u]:
            st.release(x)  # after its forward
    for u in end:
        out += st.gather(u, False)
    return out


def _zero_backward(st: _ZeroState, cfg: Config, g: ProcessGroups, chunk, units) -> list[tuple[str, Coll]]:
    blocks = [u for u in units if u.is_block]
    start = [u for u in units if u.name in START_UNITS] if chunk.pre_process else []
    end = [u for u in units if u.name in ("head", "embedding")] if chunk.post_process else []
    out = []
    for u in start + [u for u in end if u not in start]:  # chunk_backward: 1F1B may have freed them
        out += st.gather(u, True)
    # gradients complete in backward order: the head, the blocks last to first, the embedding
    # (a block's experts' reduction before its own: reduce_schedule.backward_order)
    order = [u for u in end if u.name == "head"] + list(reversed(blocks)) + [u for u in units if u.name in START_UNITS]
    for u in order:
        if u.is_block:
            for x in u.companions + [u]:
                out += st.gather(x, True)
        for x in u.companions + [u]:
            out += [(x.name, c) for c in _reduction(cfg, g, x)]
            st.release(x)
    return out


# ---------------------------------------------------------------- a rank's step


def rank_step(cfg: Config, rank: int, moe_imbalance: float = 1.0) -> RankStep:
    """`rank`'s step (`moe_imbalance`: MoE token exchanges timed at this x the mean rows, moe.py)."""
    p, z = cfg.parallel, cfg.zero
    g = rank_groups(cfg, rank)
    chunks = stage_chunks(cfg, g.pp_rank)
    pp, V = p.pipeline_model_parallel_size, len(chunks)
    m = cfg.num_micro_batches
    sched = stage_ops(pp, g.pp_rank, V, m)
    step = RankStep(rank, g.pp_rank, sched)
    e, act = _act_bytes(cfg)
    p2p_bytes = act * e // (p.tensor_model_parallel_size if p.sequence_parallel else 1)
    units = _units(cfg, chunks) if z.zero_stage >= 1 else []
    step.units = units
    by_chunk = defaultdict(list)
    for u in units:
        by_chunk[u.chunk].append(u)
    st = _ZeroState(cfg, g, units) if z.zero_stage == 3 else None
    last_b = {c: max(i for i, op in enumerate(sched.ops) if op.kind == "B" and op.chunk == c) for c in range(V)}
    for i, op in enumerate(sched.ops):
        chunk, fwd = chunks[op.chunk], op.kind == "F"
        layer_ids = [int(k) for k in chunk.layers.keys()]
        colls: list[tuple[str | None, Coll]] = []
        if st is not None and fwd:
            colls += _zero_forward(st, chunk, by_chunk[op.chunk])
        if st is not None and not fwd:
            colls += _zero_backward(st, cfg, g, chunk, by_chunk[op.chunk])
        elif z.zero_stage == 2 and not fwd:
            colls += [(u.name, c) for u in reversed(by_chunk[op.chunk]) for c in _reduction(cfg, g, u)]
        elif z.zero_stage == 1 and not fwd and z.overlap_grad_reduce and i == last_b[op.chunk]:
            colls += [(u.name, c) for u in reversed(by_chunk[op.chunk]) for c in _reduction(cfg, g, u)]
        tp_cp = _end_colls(cfg, g, chunk, fwd)
        rerun = {layer_ids[j] for a, b, again in chunk.block_groups if again for j in range(a, b)}
        ends = {layer_ids[b - 1] for a, b, again in chunk.block_groups if again}  # each group's last block
        for layer in layer_ids if fwd else reversed(layer_ids):
            if not fwd and layer in rerun:
                tp_cp += _block_colls(cfg, g, layer, True, True, moe_imbalance, ends_group=layer in ends)
            tp_cp += _block_colls(cfg, g, layer, fwd, imbalance=moe_imbalance, in_group=layer in rerun)
        colls += [(None, c) for c in tp_cp]
        v = op.chunk * pp + g.pp_rank
        if pp > 1 and fwd and v < pp * V - 1:
            colls.append(
                (None, _coll(g.pp, "pp_fwd_p2p", "send", p2p_bytes, "pp", link=g.pp.peer_links[(g.pp.rank + 1) % pp]))
            )
        if pp > 1 and not fwd and v > 0:
            colls.append(
                (None, _coll(g.pp, "pp_bwd_p2p", "send", p2p_bytes, "pp", link=g.pp.peer_links[(g.pp.rank - 1) % pp]))
            )
        step.per_op.append((op, colls))
    step.step_end = _step_end(cfg, g, chunks, units)
    return step


def ddp_buckets(cfg: Config, chunks, experts: bool = False) -> list[int]:
    """Elements of each plain-DP gradient bucket (zero/grad_buffer.py's layout): of the dense parameters, or
    (`experts`) of the routed experts' buffer (zero/ddp_engine.py: its own, over the expert-data-parallel group)."""
    z, n = cfg.zero, cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size
    overlap = z.overlap_grad_reduce and n > 1
    bucket = (z.ddp_bucket_size or default_bucket_numel(n)) if overlap else None
    sizes = []
    for c in reversed(range(len(chunks))):
        params = [q for q in chunks[c].parameters() if q.requires_grad and is_expert(q) == experts]
        numels = [q.numel() for q in reversed(params)]
        sizes += [sum(numels[a:b]) for a, b in bucket_bounds(numels, bucket)]
    return sizes


def _step_end(cfg: Config, g: ProcessGroups, chunks, units: list[UnitInfo]) -> list[Coll]:
    z = cfg.zero
    e = 2 if cfg.train.bf16 else 4
    out: list[Coll] = []
    if z.zero_stage == 0:
        for group, experts in ((g.dp_cp, False), (g.edp, True)):
            if group.size > 1:
                out += [
                    _coll(group, "grad_allreduce", "all_reduce", grad_wire_bytes(cfg) * n, "grad")
                    for n in ddp_buckets(cfg, chunks, experts)
                    if n
                ]
        partial = sum(q.numel() for c in chunks for q in c.parameters() if getattr(q, "tp_partial_grad", False))
        tied = [e.weight.numel() for e in (c.parts().tied_embedding for c in chunks) if e is not None]
    else:
        if z.zero_stage == 1 and not z.overlap_grad_reduce:
            for u in reversed(units):
                out += _reduction(cfg, g, u)
        partial = 0
        for u in units:
            offsets = [0]
            for n in u.numels:
                offsets.append(offsets[-1] + n)
            lo = (g.edp if u.expert else g.dp_cp).rank * u.shard
            partial += sum(b - a for i, a, b, _ in shard_segments(offsets, lo, lo + u.shard) if u.tp_partial[i])
        tied = [u.shard for u in units if u.tied]
    if partial and g.tp.size > 1:
        out.append(_coll(g.tp, "sp_norm_grad_allreduce", "all_reduce", 4 * partial, "misc"))
    if "embedding" in g and g.embedding.size > 1:
        out += [_coll(g.embedding, "embedding_grad_allreduce", "all_reduce", 4 * n, "misc") for n in tied]
    # the gradient norm's parts (optim/clipping.py): dense, then the routed experts' in a model with experts
    parts = [[g.dp_cp, g.mp]] + ([[g.edp, g.expert_mp]] if cfg.model.num_experts else [])
    for part in parts:
        for group in part[z.zero_stage == 0 :]:  # without ZeRO, gradients are whole on each replica
            if group.size > 1:
                out.append(_coll(group, "grad_norm", "all_reduce", 8, "misc"))
    if g.world.size > 1:  # optim/nonfinite.agree_finite: the loss's and the gradients' flags, every step
        out.append(_coll(g.world, "step_check", "all_reduce", 8, "misc"))
    if z.zero_stage in (1, 2):
        for u in units:
            group = g.edp if u.expert else g.dp_cp
            if group.size > 1:
                out.append(_coll(group, "zero_param_allgather", "all_gather", u.padded * e, "param_gather"))
    out += moe_step_colls(cfg, g, sum(cfg.model.ffn(int(i)).kind == "moe" for c in chunks for i in c.layers.keys()))
    if g.pp.size > 1:
        out.append(_coll(g.pp, "loss_report", "broadcast", 4, "misc"))
    if g.dp_cp.size > 1:
        out.append(_coll(g.dp_cp, "loss_report", "all_reduce", 4, "misc"))
    return out


# ---------------------------------------------------------------- the ledger's view


def ledger_rows(cfg: Config, ranks: list[int] | None = None) -> dict[tuple[str, str, str, str], float]:
    """Mean bytes per rank per step by (role, phase, op, link), as comm.gather_report's
    bytes_per_rank_per_step (mean over `ranks`: all of them by default)."""
    ranks = list(range(cfg.parallel.world_size)) if ranks is None else ranks
    out: dict[tuple[str, str, str, str], float] = defaultdict(float)
    for r in ranks:
        for c in rank_step(cfg, r).all():
            out[(c.role, c.phase, c.op, c.link)] += c.bytes() / len(ranks)
    return dict(out)


def representative_ranks(cfg: Config) -> list[int]:
    """One rank per (PP stage, CP rank) at TP rank 0 and DP rank 0: the others repeat them."""
    topo = topology_from_config(cfg)
    return sorted({topo.rank_of(pp=s, cp=c) for s in range(topo.sizes["pp"]) for c in range(topo.sizes["cp"])})
