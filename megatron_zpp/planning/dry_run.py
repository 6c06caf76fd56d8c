"""A dry run: the real set-up and training step of chosen ranks of an N-rank layout, one rank after
another in a process (`dry_run(jobs=J)` spreads them over J worker processes), on torch's fake
process group and fake tensors (FakeTensorMode).

Each rank initializes torch.distributed with the `fake` backend at its rank and the world size
(collectives return at once, moving nothing), builds its model, engine and optimizer as
training.setup does (the model on the meta device, the engine filling what the rank holds, here
as fake tensors: shapes, dtypes and storage sizes, no memory), and runs training.step.train_step
on --mock-data batches turned into fake tensors. What needs a value reads a stand-in where the
tensor is fake (optim/nonfinite.agree_finite: a finite step; the gradient norm and the loss: 0),
so the step is the real one, not a copy.

Per rank it records, through comm.py: every group's ordered collectives (comm.ORDER.keep) and
point-to-point messages, the ledger's bytes per link class; and the peak of live fake storage
(live_bytes.FakeLiveBytes) during start-up and during the step. `check(results)` then compares the
ranks that ran: each group's members issue the same sequence (the first divergence named), each
send has its receive on the peer, in order, and each rank's bytes per link class are the step
simulator's (simulator/collectives.py: the same byte model); each peak stands beside memory.py's
estimate (RankResult.ratio)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import multiprocessing
import os
import time
import warnings
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from .. import comm, training
from ..config import Config
from ..topology import topology_from_config
from ..training.step import count_step, train_step
from . import live_bytes, memory
from .simulator.collectives import rank_step

GROUP = tuple[str, tuple[int, ...]]  # (role, global ranks), comm.ORDER's key


@dataclass
class RankResult:
    rank: int
    coords: dict[str, int]
    collectives: dict[GROUP, list[str]]  # "op phase elements x dtype", in issue order
    p2p: dict[GROUP, list[tuple]]  # ("send"|"recv", group peer, elements, dtype, tag), in issue order
    link_bytes: dict[str, float]  # the ledger's bytes (real-fabric model) per link class, this step
    startup_peak: int  # live bytes, set-up (model, engine, optimizer)
    step_peaks: list[int]  # live bytes, each training step (what was held before it included)
    seconds: float
    estimate: int = 0  # memory.estimate_rank's peak for this rank's stage and CP slice
    # its start-up: what set-up leaves (held), and the init's largest full fp32 parameter (a launch
    # draws each on the host, one at a time; here they land on the one fake device, so the measured
    # start-up lies between held and held + draw)
    startup_held: int = 0
    startup_draw: int = 0
    simulated: dict[str, float] = field(default_factory=dict)  # simulator.collectives' bytes per link class

    @property
    def step_peak(self) -> int:
        """The last step's: with two or more, AdamW's moments are held through it (the steady state)."""
        return self.step_peaks[-1]

    @property
    def ratio(self) -> float:
        return self.step_peak / self.estimate if self.estimate else float("nan")

    @property
    def startup_ratio(self) -> float:
        """The start-up peak over what the estimator says set-up holds (1 to 1 + draw / held)."""
        return self.startup_peak / self.startup_held if self.startup_held else float("nan")


@dataclass
class Mismatch:
    what: str  # "order" or "p2p"
    message: str


@dataclass
class Report:
    results: list[RankResult]
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def auto_ranks(cfg: Config, world_size: int) -> list[int]:
    """One rank per role (first/middle/last pipeline stage x first/last TP x CP x DP rank), plus every
    member of one group of each kind (rank 0's), so that every kind of group is compared whole."""
    topo = topology_from_config(cfg, world_size)
    s = topo.sizes
    picks = {a: sorted({0, s[a] - 1}) for a in ("tp", "cp", "dp")}
    picks["pp"] = sorted({0, (s["pp"] - 1) // 2, s["pp"] - 1})
    ranks = {
        topo.rank_of(tp=t, cp=c, dp=d, pp=p)
        for t in picks["tp"]
        for c in picks["cp"]
        for d in picks["dp"]
        for p in picks["pp"]
    }
    for kind in ("tp", "cp", "dp", "pp"):  # rank 0's group: the others' coordinates 0 (O(group), not O(world))
        ranks.update(topo.rank_of(**{kind: i}) for i in range(s[kind]))
    if cfg.model.num_experts:  # and rank 0's expert groups: ep (the token all-to-all), expert TP, expert DP
        ranks.update(r for group in rank0_expert_groups(topo).values() for r in group)
    return sorted(ranks)


def rank0_expert_groups(topo) -> dict[str, list[int]]:
    """Rank 0's ep, etp and edp groups (topology.py's expert grid: the first stage's ranks in global order,
    etp fastest, then ep, then edp), from the stage's O(stage) ranks, not the world's groups."""
    s, e = topo.sizes, topo.expert_sizes
    stage = sorted(
        topo.rank_of(tp=t, cp=c, dp=d) for t in range(s["tp"]) for c in range(s["cp"]) for d in range(s["dp"])
    )
    etp, ep = e["etp"], e["ep"]
    return {
        "etp": stage[:etp],
        "ep": [stage[i * etp] for i in range(ep)],
        "edp": [stage[i * etp * ep] for i in range(e["edp"])],
    }


def auto_ranks_at_least(cfg: Config, world_size: int) -> int:
    """A lower bound of len(auto_ranks(...)) in O(1): it holds a whole group of each kind."""
    topo = topology_from_config(cfg, world_size)
    experts = (topo.expert_sizes["ep"], topo.expert_sizes["edp"]) if cfg.model.num_experts else ()
    return max(*topo.sizes.values(), *experts)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, ranks_per_node: int):
    """torch.distributed on the fake backend as `rank` of `world_size`, with the environment a launcher
    gives (training.distributed.init_distributed reads it)."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class FakeBatches:
    """The run's micro-batches as fake tensors: the loader (and its numpy) runs, its values stay behind."""

    def __init__(self, batches, mode: FakeTensorMode):
        self.batches, self.mode = batches, mode

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.batches)
        return {k: self.mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _link_bytes() -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for row in comm.LEDGER.local_rows():
        out[row["link"]] += row["bytes"]
    return dict(out)


def run_rank(cfg: Config, rank: int, world_size: int, skip: dict[int, str] | None = None, steps: int = 1) -> RankResult:
    """Set up and train `steps` steps as `rank` of `world_size`, on fake tensors; what it issued and
    held. `skip` (a test's hook): {rank: phase}, that rank leaves out its first collective of the phase."""
    t0 = time.time()
    topo = topology_from_config(cfg, world_size)
    comm.LEDGER.reset()
    comm.ORDER.seq.clear()
    comm.ORDER.p2p.clear()
    comm.ORDER.keep = True
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),  # rank 0's start-up lines, once per rank run
            warnings.catch_warnings(),
            fake_world(rank, world_size, topo.ranks_per_node),
            _skipping((skip or {}).get(rank)),
            fused_attention(),
            mode,
            live_bytes.FakeLiveBytes() as live,
        ):
            # a fake tensor's data_ptr is 0: the quantizer's alignment test passes, as it would on the device
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            run = training.setup(cfg)
            startup = live.peak
            run = dataclasses.replace(run, train_data=FakeBatches(run.train_data, mode))  # Run is frozen
            peaks = []
            for _ in range(steps):
                live.reset_peak()
                samples = cfg.train.global_batch_at(run.state.consumed_samples)
                train_step(run)
                count_step(run, samples)
                peaks.append(live.peak)
            if run.exit_signal is not None:
                run.exit_signal.close()
        result = RankResult(
            rank,
            topo.coords(rank),
            dict(comm.ORDER.seq),
            dict(comm.ORDER.p2p),
            _link_bytes(),
            startup,
            peaks,
            time.time() - t0,
        )
    finally:
        comm.ORDER.keep = False
        comm.ORDER.seq.clear()
        comm.ORDER.p2p.clear()
        comm.LEDGER.reset()
    estimate = memory.estimate_rank(cfg, result.coords["pp"], cp_rank=result.coords["cp"])
    result.estimate = estimate.peak
    result.startup_held, result.startup_draw = estimate.startup_peak, estimate.startup_transient
    result.simulated = simulated_link_bytes(cfg, rank)
    return result


def simulated_link_bytes(cfg: Config, rank: int) -> dict[str, float]:
    """The step simulator's bytes of `rank` per link class (the ledger's byte model: they should be equal)."""
    out: dict[str, float] = defaultdict(float)
    for c in rank_step(cfg, rank).all():
        out[c.link] += c.bytes()
    return dict(out)


# What the dry run measures in place of the device's kernels, for the report
CODE_PATHS = (
    "fake CPU tensors (fake CUDA ones abort this CPU-only torch in SDPA); softmax attention as the fused "
    "kernel a GPU runs (flash/efficient: output + fp32 logsumexp kept, not SDPA's CPU math path; attention "
    "dropout with layout-invariant masks: explicit, rerun in the backward, as on a GPU); ZeRO++'s quantizers "
    "and the MoE grouped GEMM as their kernel launches (fake: output "
    "buffers only; MoE token counts: an even share per rank and expert, moe/dispatch.py); "
    "norms, RoPE, SwiGLU, cross-entropy and GLA on their PyTorch reference ops (memory.py models the same)"
)


@contextlib.contextmanager
def fused_attention():
    """SDPA as a GPU run computes it. On CPU, SDPA with dropout takes its math path, which keeps the
    [b, heads, s, s] probabilities and dropout mask; CUDA's flash and memory-efficient kernels take
    dropout (and the CP mask) inside the kernel and keep only the output and a logsumexp. The CPU
    flash operator keeps exactly that, so under FakeTensorMode it stands in for them (its fake kernel
    accepts dropout and grouped KV heads; the CPU dispatch would refuse dropout). Nothing else of the
    step changes: the model's own call reaches it."""
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


@contextlib.contextmanager
def _skipping(phase: str | None):
    """The first collective of `phase` on this rank does not happen (nor is it recorded): a rank that
    skipped a unit's reduction, as a bug would, for the check to catch."""
    if phase is None:
        yield
        return
    names = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
    real = {n: getattr(comm, n) for n in names}
    done = []

    def wrap(fn):
        def call(*args, **kwargs):
            ph = kwargs.get("phase", args[3] if fn is not real["all_reduce"] else args[2])
            if not done and ph == phase:
                done.append(ph)
                return comm._Done() if kwargs.get("async_op") else None
            return fn(*args, **kwargs)

        return call

    for n in names:
        setattr(comm, n, wrap(real[n]))
    try:
        yield
    finally:
        for n, fn in real.items():
            setattr(comm, n, fn)


def check(results: list[RankResult]) -> list[Mismatch]:
    """Every group's members that ran issue the same collectives; every send meets its receive; each
    rank's ledger bytes per link class are the simulator's."""
    return _check_order(results) + _check_p2p(results) + _check_bytes(results)


def _check_bytes(results: list[RankResult]) -> list[Mismatch]:
    out = []
    for r in results:
        links = sorted(set(r.link_bytes) | set(r.simulated))
        diff = [k for k in links if abs(r.link_bytes.get(k, 0.0) - r.simulated.get(k, 0.0)) > 1e-6 * _top(r, k)]
        if diff:
            what = ", ".join(
                f"{k}: ran {r.link_bytes.get(k, 0.0):.0f}, simulated {r.simulated.get(k, 0.0):.0f}" for k in diff
            )
            out.append(Mismatch("bytes", f"rank {r.rank}: bytes sent per link differ from the simulator's ({what})"))
    return out


def _top(r: RankResult, link: str) -> float:
    return max(r.link_bytes.get(link, 0.0), r.simulated.get(link, 0.0), 1.0)


def _check_order(results: list[RankResult]) -> list[Mismatch]:
    by_group: dict[GROUP, dict[int, list[str]]] = defaultdict(dict)
    ran = {r.rank for r in results}
    for r in results:
        for key in {k for k in r.collectives} | _groups_of(r):
            by_group[key][r.rank] = r.collectives.get(key, [])
    out = []
    for (role, ranks), seqs in sorted(by_group.items()):
        members = [m for m in ranks if m in ran]
        if len(members) < 2 or len({tuple(seqs.get(m, [])) for m in members}) == 1:
            continue
        lists = [seqs.get(m, []) for m in members]
        i = 0
        while all(i < len(s) for s in lists) and len({s[i] for s in lists}) == 1:
            i += 1
        what = "; ".join(f"rank {m}: {s[i] if i < len(s) else '(nothing)'}" for m, s in zip(members, lists))
        out.append(Mismatch("order", f"group {role} {_short(ranks)} diverged at collective #{i}: {what}"))
    return out


def _groups_of(r: RankResult) -> set[GROUP]:
    return set(r.collectives) | set(r.p2p)


def _check_p2p(results: list[RankResult]) -> list[Mismatch]:
    """Per group and ordered pair (a -> b): a's sends to b equal b's receives from a, in order."""
    by_rank = {r.rank: r for r in results}
    out = []
    for r in results:
        for (role, ranks), msgs in sorted(r.p2p.items()):
            me = ranks.index(r.rank)
            for peer in sorted({m[1] for m in msgs if m[0] == "send"}):
                other = by_rank.get(ranks[peer])
                if other is None:
                    continue
                sent = [m[2:] for m in msgs if m[0] == "send" and m[1] == peer]
                got = [m[2:] for m in other.p2p.get((role, ranks), []) if m[0] == "recv" and m[1] == me]
                if sent != got:
                    i = next((j for j, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
                    out.append(
                        Mismatch(
                            "p2p",
                            f"group {role} {_short(ranks)}: rank {r.rank} -> rank {ranks[peer]} message #{i}: "
                            f"sent {sent[i] if i < len(sent) else '(nothing)'}, "
                            f"received {got[i] if i < len(got) else '(nothing)'}",
                        )
                    )
    return out


def _short(ranks: tuple[int, ...]) -> str:
    return str(list(ranks)) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ... {ranks[-1]}] ({len(ranks)} ranks)"


def dry_run(
    cfg: Config,
    world_size: int,
    ranks: list[int],
    skip: dict[int, str] | None = None,
    log=None,
    jobs: int = 1,
    steps: int = 1,
) -> Report:
    """Run `ranks` of the layout, then compare them: one after another in this process (jobs=1),
    or spread over `jobs` worker processes, each running its ranks one after another (a rank's
    run shares nothing with another's: its own fake world, model and ledger). Results come back,
    and are logged, in the order of `ranks`."""
    results = []
    for result in _rank_results(cfg, world_size, ranks, skip, jobs, steps):
        results.append(result)
        if log is not None:
            log(summary_line(result))
    return Report(results, check(results))


def _rank_results(cfg: Config, world_size: int, ranks: list[int], skip, jobs: int, steps: int):
    if jobs <= 1 or len(ranks) < 2:
        for rank in ranks:
            yield run_rank(cfg, rank, world_size, skip, steps)
        return
    # spawn, not fork: the parent may hold OpenMP threads a forked child would deadlock on
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(jobs, len(ranks)), mp_context=context, initializer=_worker_start) as pool:
        yield from pool.map(run_rank, repeat(cfg), ranks, repeat(world_size), repeat(skip), repeat(steps))


def _worker_start() -> None:
    torch.set_num_threads(1)  # fake tensors compute nothing: one thread per worker, workers per core


def summary_line(r: RankResult) -> str:
    c = r.coords
    calls = sum(len(s) for s in r.collectives.values())
    sends = sum(1 for msgs in r.p2p.values() for m in msgs if m[0] == "send")
    links = ", ".join(f"{k} {v / memory.GiB:.3f}" for k, v in sorted(r.link_bytes.items()))
    return (
        f"rank {r.rank:>5} (tp {c['tp']} cp {c['cp']} dp {c['dp']} pp {c['pp']}): "
        f"start-up {r.startup_peak / memory.GiB:.3f} GiB (estimate {r.startup_held / memory.GiB:.3f} held "
        f"+ at most {r.startup_draw / memory.GiB:.3f} drawn), step{'s' if len(r.step_peaks) > 1 else ''} "
        f"{' / '.join(f'{p / memory.GiB:.3f}' for p in r.step_peaks)} GiB "
        f"(estimate {r.estimate / memory.GiB:.3f}, ratio {r.ratio:.3f}); {calls} collectives, {sends} sends; "
        f"GiB sent by link: {links or 'none'}{_sim_note(r)}; {r.seconds:.1f} s"
    )


def _sim_note(r: RankResult) -> str:
    same = all(abs(r.link_bytes.get(k, 0.0) - r.simulated.get(k, 0.0)) <= 1e-6 * _top(r, k) for k in r.simulated)
    return " (= simulator)" if same and set(r.link_bytes) <= set(r.simulated) else " (simulator differs)"
