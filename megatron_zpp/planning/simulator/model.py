"""Step time of a training step: compute, the collectives of collectives.py on the
cluster's alpha-beta links, and an overlap model per schedule.

Cost of one collective: steps x alpha + bytes / bandwidth (+ quantization work), with
bytes = comm.model_bytes (the ledger's), steps the ring's message steps (n-1; 2(n-1) for
all-reduce; 1 for a send), the link of its class (hardware.Cluster.link; a "node" link's
bandwidth split over the node's ranks, which all send at once).

Compute: perf.flops_per_token split per layer (the count with one layer less), divided by
TP (and the tokens by CP), at the cluster's sustained rate; backward = 2 x forward, plus
the forward again for fully recomputed layers.

Overlap, per rank, with one compute stream and one communication stream per link class
(transfers on one link queue on it; an intra-node and an inter-node one run at once):

* TP collectives and the softmax K|V gather under CP are synchronous: fully exposed, but for
  the column-parallel backward under SP (tensor_parallel/layers.py): its re-gather of the
  input runs behind the input-gradient matmul and the gradient's reduce-scatter behind the
  weight-gradient one, so each is exposed by what exceeds that matmul (2 b s h w/TP FLOPs at
  the sustained rate; times the overlap efficiency, as the scan);
* the GLA state scan runs while the layer computes its local output (context_parallel/
  gla.py): exposed is what exceeds the GLA operator's share of the layer; its time is the
  chain on the group's hops (context_parallel/chain.py: All-Scan in the K blocks the runtime
  picks, the ring in one) or LASP-2's all-gather; GDN's scan (context_parallel/delta_rule.py) waits
  for the local pass: all exposed,
  as is GDN's convolution halo (one p2p of 3 tokens each way);
* ZeRO-3: a unit's gather is issued when the previous unit starts computing (prefetch of
  one) and the unit waits for it; a unit's gradient reduction starts after its backward,
  at most --zero-reduce-in-flight in flight (default max(2, hops), reduce_schedule's
  max_in_flight; the compute stream waits for the oldest beyond it), the rest drains at
  the step's end; ZeRO-1/2 and plain DP reduce during the last backward
  (--overlap-grad-reduce) or after it; stages 1-2's parameter all-gather is exposed
  unless --overlap-param-gather hides it behind the next forward;
* the quantizer (qwZ, qgZ), on an accelerator (Cluster.device != "cpu"): on the
  communication streams, as zero_engine runs it: a gather's quantize -> all-gather ->
  decode on its link's stream, a reduction's whole hop chain (quantize -> all-to-all ->
  dequantize-sum per hop, each on its tier's stream) enqueued when the unit's gradients
  are ready; the compute stream only waits on their events. On the emulated CPU cluster
  streams are no-ops and gloo's waits block the host, so as the engine there: the
  quantizer on the compute stream (quantize before the issue, dequantize(-sum) after the
  wait, quant_parts) and a hierarchical reduction moving one hop per later unit, its wait
  at that program point (grad_reduce.HierarchicalReduceScatter.advance);
* MoE token exchanges (moe/dispatch.py: counts, tokens over EP, expert TP's gather and scatter, or the
  allgather dispatcher's) block the compute stream: fully exposed ("moe dispatch"); with a
  `moe_imbalance` the busiest rank's exchanges and experts take that factor longer (simulator/moe.py);
* pipeline: the real schedule's order (schedule.stage_ops), p2p on the dependency edges,
  so the bubble comes out of the event times;
* overlap efficiency (Cluster.overlap_efficiency): of the stream time the schedule above
  hides, only that fraction is really hidden, the rest is added to the step ("comm not
  overlapped"; the GLA scan's hidden part likewise). 1.0 on the GPU presets (separate
  comm streams); on the emulated cluster gloo's threads take the same 2 cores as compute, so
  it is fitted from calibration runs at two link rates.

Per layer and micro-batch, a fixed overhead (Cluster.per_layer_s, + gla_layer_s for a GLA or
GDN layer, GDN not calibrated apart: the CPU's per-op cost; 0 on the GPU presets). Step-end terms besides the optimizer:
Cluster.fixed_step_s (per step) and unit_step_s per ZeRO unit (Python hooks, the optimizer
over many shard segments: ~0 on GPUs, fitted on the emulated cluster); the quantizer's
per-element and per-call cost per (bits, block) (quant_time); the CP chain's per-message cost
scan_msg_s on top of the link alpha.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ...config import Config
from ...context_parallel import auto_blocks
from ...context_parallel.chain import Hop, chain_time, hop_classes
from ...data.tokenizer import pad_vocab_size
from ...perf import flops_per_token
from ...topology import Group, topology_from_config
from ...zero.reduce_schedule import reductions_in_flight
from ...zero.sharded_params import START_UNITS
from .collectives import Coll, RankStep, rank_groups, rank_step, representative_ranks, stage_chunks, transition_bytes
from .hardware import Cluster
from .moe import expert_flops_per_token
from .schedule import pipeline_time


def _steps(op: str, n: int) -> int:
    return {"all_reduce": 2 * (n - 1), "send": 1}.get(op, n - 1)


RING_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def node_egress(c: Coll, ranks_per_node: int, gloo: bool) -> float:
    """Bytes leaving one node for collective `c` when every group of its kind runs at once
    (all ranks run the same program): a ring leaves each node once per group, so a node
    carries (ranks per node / members per node) x the per-rank bytes; an all-to-all sends
    every member's cross-node share; a p2p send leaves from every rank. gloo's SUM
    reduce-scatter is an all-to-all (comm.py)."""
    if c.op == "send":
        return ranks_per_node * c.bytes()
    k = max(Counter(r // ranks_per_node for r in c.ranks).values()) if c.ranks else 1
    groups = ranks_per_node / k
    if c.op == "all_to_all" or (gloo and c.op == "reduce_scatter"):
        return groups * k * c.bytes() * (c.n - k) / max(c.n - 1, 1)
    return groups * c.bytes()


def wire_time(c: Coll, cl: Cluster, ranks_per_node: int | None = None) -> float:
    """The transfer of `c` on its link: message steps x alpha + bytes / bandwidth."""
    if c.n <= 1:
        return 0.0
    link = cl.link(c.link)
    if link.shared == "node":
        wire = node_egress(c, ranks_per_node or cl.ranks_per_node, cl.device == "cpu") / link.bandwidth
    else:
        wire = c.bytes() / link.bandwidth
    return _steps(c.op, c.n) * link.alpha + wire * c.imbalance  # an MoE exchange: the busiest rank's rows


def coll_time(c: Coll, cl: Cluster, ranks_per_node: int | None = None) -> float:
    """The transfer and the quantizer work of `c`, back to back (a synchronous call)."""
    return wire_time(c, cl, ranks_per_node) + quant_time(c, cl) if c.n > 1 else 0.0


def quant_time(c: Coll, cl: Cluster) -> float:
    """The quantizer work of `c`: per element + per call at its (bits, block) where the preset
    has them (Cluster.quant), else elements at the preset's one throughput."""
    if not c.quant_elems:
        return 0.0
    if c.quant_key in cl.quant:
        per_elem, per_call = cl.quant[c.quant_key]
        return c.quant_elems * per_elem + c.quant_calls * per_call
    return c.quant_elems / cl.quant_elems_per_s


def quant_parts(c: Coll, cl: Cluster) -> tuple[float, float]:
    """quant_time(c) split into (before the issue: quantize what this rank sends, after the
    wait: dequantize what arrived). Both run on the compute stream (zero/gather.py,
    zero/grad_reduce.py call the quantizer from the hooks). A qwZ gather quantizes its shard
    and dequantizes n of them; a qgZ hop quantizes and dequantize-sums the same elements."""
    q = quant_time(c, cl) if c.n > 1 else 0.0
    sent = 1 / (c.n + 1) if c.kind == "zero_gather" else 0.5
    return q * sent, q * (1 - sent)


def layer_flops(cfg: Config) -> tuple[list[float], float]:
    """(model FLOPs per token of each layer, of the output layer), forward + backward."""
    m = cfg.model
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    total = [flops_per_token(dataclasses.replace(m, num_layers=n), vocab) for n in range(m.num_layers + 1)]
    return [b - a for a, b in zip(total, total[1:])], total[0]


def linear_mixer(m):
    """The shape of the model's linear mixer (the layers a CP state scan runs for)."""
    return next(shape for shape in map(m.mixer, range(m.num_layers)) if shape.linear)


def scan_time(cfg: Config, cl: Cluster, cp: Group, ranks_per_node: int) -> float:
    """The state scan's chain time for one linear-mixer layer (GLA, GDN), one direction: the all-gather's
    P - 1 ring steps on the group's slowest link; All-Scan's and the ring's chain (context_parallel/chain.py,
    the ring being one block) on the group's own hops, with the block count the runtime picks."""
    m, p = cfg.model, cfg.parallel
    P = cp.size
    if P <= 1:
        return 0.0
    mixer = linear_mixer(m)
    heads = mixer.heads // p.tensor_model_parallel_size
    state = cfg.train.micro_batch_size * heads * mixer.state_per_head * 4
    per_node = max(Counter(r // ranks_per_node for r in cp.ranks).values())

    def hop(link_class: str) -> Hop:  # per message: the link's alpha + the CPU cost of one send (emulated)
        link = cl.link(link_class)
        bw = link.bandwidth / (ranks_per_node / per_node if link.shared == "node" else 1)  # all replicas' chains
        return Hop(link.alpha + cl.scan_msg_s, bw)

    if p.cp_algo == "all-gather":
        slowest = hop(cp.link)
        return (P - 1) * (slowest.alpha + (state + transition_bytes(cfg, mixer)) / slowest.bandwidth)
    hops = [hop(c) for c in hop_classes(cp)]
    return chain_time(hops, state, 1 if p.cp_algo == "ring" else all_scan_blocks(cfg, cl, cp, state))


def all_scan_blocks(cfg: Config, cl: Cluster, cp: Group, state_bytes: int) -> int:
    """The block count All-Scan runs: --all-scan-blocks, else the runtime's choice (context_parallel.auto_blocks,
    from the link facts of the cluster's device type) over the dimension the blocks cut (GLA: K, GDN: V)."""

    class _Dev:  # auto_blocks reads only the device type
        type = cl.device

    mixer = linear_mixer(cfg.model)
    return cfg.parallel.all_scan_blocks or auto_blocks(state_bytes, cp, _Dev, mixer.scan_extent)


@dataclass
class Breakdown:
    step_time_s: float
    compute_s: float
    bubble_s: float
    exposed_s: dict[str, float] = field(default_factory=dict)
    other_s: dict[str, float] = field(default_factory=dict)
    bytes_per_rank: dict[str, float] = field(default_factory=dict)  # by link class, mean over the ranks timed


@dataclass
class _Reduction:
    """One unit's gradient reduction in flight: its hops (one for a flat reduce-scatter)."""

    hops: list[Coll]
    hop: int = 0  # the hop on the wire
    end: float = 0.0  # when that hop's transfer ends

    @property
    def hierarchical(self) -> bool:
        return self.hops[0].op == "all_to_all"


class _RankTimer:
    """One rank's compute and communication streams through its schedule."""

    def __init__(self, cfg: Config, cl: Cluster, step: RankStep, cp: Group, moe_imbalance: float = 1.0):
        self.cfg, self.cl, self.step, self.cp = cfg, cl, step, cp
        self.rpn = topology_from_config(cfg).ranks_per_node
        self.comm_free: dict[str, float] = defaultdict(float)  # per link class: when its stream is free
        self.comm_busy = 0.0  # seconds issued on the communication streams (for the overlap efficiency)
        self.stream_quantizer = 0.0  # quantizer seconds run on the communication streams (hidden or waited for)
        self.pending: list[_Reduction] = []  # gradient reductions in flight, oldest first
        self.side_streams = cl.device != "cpu"  # quantizer and waits on the communication streams
        self.in_flight = reductions_in_flight(cfg)
        self.exposed: dict[str, float] = defaultdict(float)
        self.book = self.exposed  # where waits and quantizer passes are booked (finish: the step-end terms)
        self.compute = 0.0
        chunks = stage_chunks(cfg, step.pp_rank)
        per_layer, head = layer_flops(cfg)
        # an MoE layer's experts run the busiest rank's rows (the expert-TP split and its gathered rows cancel)
        per_layer = [f + (moe_imbalance - 1) * expert_flops_per_token(cfg, i) for i, f in enumerate(per_layer)]
        m, p, t = cfg.model, cfg.parallel, cfg.train
        tokens = t.micro_batch_size * m.seq_length / p.context_parallel_size
        rate = cl.sustained_tflops * 1e12 * p.tensor_model_parallel_size / tokens  # tokens x FLOPs at TP-split rate
        self.fwd_unit: list[dict[str, float]] = []  # per chunk: unit name -> forward seconds
        self.rerun: list[set[str]] = []
        for chunk in chunks:
            ids = [int(k) for k in chunk.layers.keys()]
            units = {f"layer{i}": per_layer[i] / 3 / rate + self._layer_overhead(m.mixer(i).linear) / 3 for i in ids}
            if chunk.post_process:
                units["head"] = head / 3 / rate
            self.fwd_unit.append(units)
            again = {f"layer{ids[j]}" for a, b, r in chunk.block_groups if r for j in range(a, b)}
            self.rerun.append(again)
        heads_width = m.num_attention_heads * m.head_dim
        self.gla_core = 2 * heads_width * (m.linear_chunk_size + 2 * m.head_dim) / rate  # perf.py's GLA term, per token

    def _layer_overhead(self, linear: bool) -> float:
        return self.cl.per_layer_s + (self.cl.gla_layer_s if linear else 0.0)

    def _t(self, c: Coll) -> float:
        return coll_time(c, self.cl, self.rpn)

    # the communication streams: one per link class (transfers on one link share it and queue;
    # different links run at once, as their process groups do)
    def _issue(self, start: float, c: Coll) -> float:
        """Start `c`'s transfer at `start` (or when its link is free); its end."""
        cost = wire_time(c, self.cl, self.rpn)
        begin = max(start, self.comm_free[c.link])
        self.comm_free[c.link] = begin + cost
        self.comm_busy += cost
        return begin + cost

    def _issue_chain(self, start: float, c: Coll) -> float:
        """On a side stream: quantize, transfer, decode back to back on `c`'s link stream
        after `start`; the end (the compute stream is not delayed)."""
        pre, post = quant_parts(c, self.cl)
        self.stream_quantizer += pre + post
        begin = max(start, self.comm_free[c.link])
        end = begin + pre + wire_time(c, self.cl, self.rpn) + post
        self.comm_busy += end - begin
        self.comm_free[c.link] = end
        return end

    def _quantizer(self, t: float, seconds: float) -> float:
        self.book["quantizer"] += seconds
        return t + seconds

    # gradient reductions (zero/grad_reduce.py): a flat reduce-scatter is waited on only when the
    # engine holds too many; a hierarchical one moves one hop each time a later unit's gradients
    # are ready (the hop's wait, its dequantize-sum, the next hop's quantize and issue)
    def _start_hop(self, r: _Reduction, t: float) -> float:
        c = r.hops[r.hop]
        t = self._quantizer(t, quant_parts(c, self.cl)[0])
        r.end = self._issue(t, c)
        return t

    def _finish_hop(self, r: _Reduction, t: float, kind: str) -> float:
        self.book[kind] += max(0.0, r.end - t)
        t = self._quantizer(max(t, r.end), quant_parts(r.hops[r.hop], self.cl)[1])
        r.hop += 1
        return self._start_hop(r, t) if r.hop < len(r.hops) else t

    def _finish_reduction(self, r: _Reduction, t: float, kind: str) -> float:
        while r.hop < len(r.hops):
            t = self._finish_hop(r, t, kind)
        return t

    def _reduce(self, colls: list[Coll], t: float) -> float:
        """ReduceSchedule._reduce (zero/reduce_schedule.py): start this unit's reduction, advance those in
        flight, finish the oldest beyond the in-flight limit; the compute stream's time after it."""
        r = _Reduction(colls)
        if self.side_streams:  # the whole chain enqueued now; backpressure: wait for the oldest's event
            end = t
            for c in colls:
                end = self._issue_chain(end, c)
            r.hop, r.end = len(colls), end
            self.pending.append(r)
            while len(self.pending) > self.in_flight:
                oldest = self.pending.pop(0)
                self.book["gradient reduce"] += max(0.0, oldest.end - t)
                t = max(t, oldest.end)
            return t
        t = self._start_hop(r, t)
        for p in self.pending:
            if p.hierarchical and p.hop < len(p.hops):
                t = self._finish_hop(p, t, "gradient reduce")
        self.pending.append(r)
        while len(self.pending) > self.in_flight:
            t = self._finish_reduction(self.pending.pop(0), t, "gradient reduce")
        return t

    def run(self, index: int, start: float) -> float:
        op, colls = self.step.per_op[index]
        units = self.fwd_unit[op.chunk]
        zero, grads, tail, per_layer = _sort_collectives(colls)
        total_sync, scan_exposed, moe = self._per_layer_exposed(per_layer, op.kind)
        self.exposed["tp+cp (synchronous)"] += total_sync
        self.exposed["cp state scan"] += scan_exposed
        self.exposed["moe dispatch (synchronous)"] += moe
        layers = sum(1 for n in units if n.startswith("layer"))
        extra = (total_sync + scan_exposed + moe) / max(layers, 1)  # spread over the layers that issue them
        t = self._walk_units(op, _unit_order(units, op.kind, zero, grads), zero, grads, start, extra)
        for c in tail:
            t_p2p = self._t(c)
            self.exposed["pp p2p"] += t_p2p
            t += t_p2p
        return t

    def _per_layer_exposed(self, per_layer: list[Coll], kind: str) -> tuple[float, float, float]:
        """(exposed seconds of the synchronous TP/CP calls, of the CP state scans, of the MoE token exchanges:
        blocking, as moe/dispatch.py issues them) of one forward or backward."""
        cl, cfg = self.cl, self.cfg
        total_sync = scan_exposed = moe = 0.0
        for c in per_layer:
            if c.kind == "moe":
                moe += self._t(c)
            elif c.kind == "cp_scan":
                t_scan = (
                    scan_time(cfg, cl, self.cp, self.rpn)
                    if c.op == "send"
                    else self._t(c) + _steps(c.op, c.n) * cl.scan_msg_s
                )
                # GLA hides the scan behind its local pass (context_parallel/gla.py); GDN's waits for it (gdn.py)
                waits = linear_mixer(cfg.model).scan_waits_for_local_pass
                window = 0.0 if waits else self.gla_core * (1 if kind == "F" else 2)
                tokens = cfg.train.micro_batch_size * cfg.model.seq_length / cfg.parallel.context_parallel_size
                scan_exposed += t_scan - cl.overlap_efficiency * min(t_scan, window * tokens)
            else:  # an SP backward call hides behind its matmul (tensor_parallel/layers.py), others are exposed
                t_c = self._t(c)
                total_sync += t_c - cl.overlap_efficiency * min(t_c, c.behind_flops / (cl.sustained_tflops * 1e12))
        return total_sync, scan_exposed, moe

    def _walk_units(self, op, order: list[str], zero, grads, start: float, extra: float) -> float:
        """Run `order`'s units on the compute stream, each waiting for its gathers (the next unit's issued as it
        starts) and handing its gradients to the reduction; the time after the last."""
        cl, units, again = self.cl, self.fwd_unit[op.chunk], self.rerun[op.chunk]
        factor = 1.0 if op.kind == "F" else 2.0
        gather_done: dict[str, float] = {}

        def prefetch(name: str, at: float) -> float:
            """Quantize (qwZ) and issue `name`'s gathers at `at`; the compute stream's time after."""
            for c in zero.get(name, []):
                if self.side_streams:  # quantize -> all-gather -> decode on the gather stream
                    gather_done[name] = max(gather_done.get(name, at), self._issue_chain(at, c))
                    continue
                at = self._quantizer(at, quant_parts(c, cl)[0])
                gather_done[name] = max(gather_done.get(name, at), self._issue(at, c))
            return at

        t = prefetch(order[0], start) if order else start
        for k, name in enumerate(order):
            ready = max(t, gather_done.get(name, t))
            self.exposed["zero-3 gathers"] += ready - t
            if not self.side_streams:  # the decode after the wait, on the compute stream
                ready = self._quantizer(ready, sum(quant_parts(c, cl)[1] for c in zero.get(name, [])))
            if k + 1 < len(order):  # the next unit's gather is issued as this one starts computing
                ready = prefetch(order[k + 1], ready)
            work = units.get(name, 0.0) * factor + (units.get(name, 0.0) if op.kind == "B" and name in again else 0.0)
            t = ready + work + (extra if name.startswith("layer") else 0.0)
            self.compute += work
            if grads.get(name):
                t = self._reduce(grads[name], t)
        return t

    def finish(self, t: float) -> tuple[float, dict[str, float]]:
        """The step's end after the last backward at `t`: drain, finalize, optimizer, gathers."""
        cfg, cl, other = self.cfg, self.cl, defaultdict(float)
        self.book = other  # the drain's waits and quantizer passes are step-end terms
        while self.pending:
            t = self._finish_reduction(self.pending.pop(0), t, "gradient reduce (drain)")
        drained = max([t, *self.comm_free.values()])
        other["gradient reduce (drain)"] += drained - t
        t = drained
        for c in self.step.step_end:
            dt = self._t(c)
            if c.kind == "grad":
                other["gradient reduce (after backward)"] += dt
            elif c.kind == "param_gather":
                first_fwd = sum(self.fwd_unit[0].values())
                dt = max(0.0, dt - first_fwd) if cfg.zero.overlap_param_gather else dt
                other["parameter all-gather"] += dt
            else:
                other["small syncs"] += dt
            t += dt
        shard = (
            sum(u.shard for u in self.step.units)
            if self.step.units
            else sum(q.numel() for c in stage_chunks(cfg, self.step.pp_rank) for q in c.parameters())
        )
        other["optimizer"] = shard * cl.optimizer_s_per_param
        other["fixed overhead"] = cl.fixed_step_s
        other["per-unit overhead"] = cl.unit_step_s * len(self.step.units)
        # what the stream "hid" but did not: (1 - overlap efficiency) of the hidden stream time
        hidden = self.comm_busy - self.exposed["zero-3 gathers"] - self.exposed["gradient reduce"]
        hidden -= other["gradient reduce (drain)"]
        other["comm not overlapped"] = (1 - cl.overlap_efficiency) * max(0.0, hidden)
        terms = ("optimizer", "fixed overhead", "per-unit overhead", "comm not overlapped")
        extra = sum(other[k] for k in terms)
        return t + extra, dict(other)


def simulate(cfg: Config, cl: Cluster, moe_imbalance: float = 1.0) -> Breakdown:
    """Step time of `cfg` (a validated config) on cluster `cl`: each CP rank's pipeline is
    timed from representative ranks (TP 0, DP 0); the slowest sets the step. `moe_imbalance` (>= 1): an
    MoE layer's busiest rank runs and exchanges this x an even share of the routed rows, and sets the step."""
    topo = topology_from_config(cfg)
    pipelines: dict[int, list[int]] = defaultdict(list)
    cp = topo.sizes["cp"]
    edges = {0, 1, cp - 2, cp - 1}  # the chain's ends and one inner rank: the others repeat the inner one
    for r in representative_ranks(cfg):
        if topo.coords(r)["cp"] in edges:
            pipelines[topo.coords(r)["cp"]].append(r)
    best: Breakdown | None = None
    for members in pipelines.values():
        timers = [
            _RankTimer(cfg, cl, rank_step(cfg, r, moe_imbalance), rank_groups(cfg, r).cp, moe_imbalance)
            for r in sorted(members, key=lambda r: topo.coords(r)["pp"])
        ]
        index = [{op: i for i, (op, _) in enumerate(tm.step.per_op)} for tm in timers]
        ends = pipeline_time(
            [tm.step.schedule for tm in timers], lambda s, op, start: timers[s].run(index[s][op], start)
        )
        finished = [tm.finish(end) for tm, end in zip(timers, ends)]
        slowest = max(range(len(timers)), key=lambda i: finished[i][0])
        tm, (_, other) = timers[slowest], finished[slowest]
        exposed = {k: v for k, v in tm.exposed.items() if v > 1e-12}
        bubble = max(0.0, ends[slowest] - tm.compute - sum(exposed.values()))
        bd = Breakdown(
            max(f[0] for f in finished), tm.compute, bubble, exposed, {k: v for k, v in other.items() if v > 1e-12}
        )
        bd.bytes_per_rank = _bytes_by_link([tm.step for tm in timers])
        if best is None or bd.step_time_s > best.step_time_s:
            best = bd
    return best


def _bytes_by_link(steps: list[RankStep]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for st in steps:
        for c in st.all():
            out[c.link] += c.bytes() / len(steps)
    return dict(out)


def throughput(cfg: Config, bd: Breakdown) -> dict[str, float]:
    """tokens/s and model TFLOP/s per rank of a simulated step."""
    m, t = cfg.model, cfg.train
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    tokens = t.global_batch_size * m.seq_length
    flops = flops_per_token(m, vocab) * tokens
    return {
        "tokens_per_s": tokens / bd.step_time_s,
        "tflops_per_gpu": flops / bd.step_time_s / cfg.parallel.world_size / 1e12,
    }


def _sort_collectives(colls) -> tuple[dict, dict, list[Coll], list[Coll]]:
    """One op's collectives by role: ZeRO gathers and gradient reductions per unit, the PP p2p after it, and
    the unit-less TP/CP calls of its layers (in issue order)."""
    zero: dict[str, list[Coll]] = defaultdict(list)
    grads: dict[str, list[Coll]] = defaultdict(list)
    tail: list[Coll] = []
    per_layer = [c for u, c in colls if u is None and c.kind in ("tp", "cp_attn", "cp_scan", "cp_halo", "moe")]
    for u, c in colls:
        if u is not None:
            (grads if c.kind == "grad" else zero)[u].append(c)
        elif c.kind == "pp":
            tail.append(c)
    return zero, grads, tail, per_layer


def _unit_order(units: dict, kind: str, zero: dict, grads: dict) -> list[str]:
    """The units in compute order: forward, or reversed with the head first in a backward; the start units
    (embedding) before a forward and after a backward."""
    order = list(units) if kind == "F" else list(reversed(list(units)))
    starts = [n for n in START_UNITS if n in zero or (kind == "B" and n in grads)]
    if kind == "F":
        return starts + order
    if kind == "B":
        return (["head"] if "head" in units else []) + [u for u in order if u != "head"] + starts
    return order
