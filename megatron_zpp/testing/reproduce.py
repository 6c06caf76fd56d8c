"""The driver of the sweep scripts in examples/reproduce/ (shared by them, so in the package): real pretrain_gpt.py runs
on the emulated 2-node cluster of megatron_zpp/testing/cluster.py (two network namespaces joined by a veth
pair shaped with tc tbf; root needed, else every rank runs on loopback, unshaped, and the
rows say so), each with --metrics-file and --comm-report, summarized as JSONL rows

    {experiment, system, ranks, link_gbps, seq_length, step_time_s, tokens_per_s,
     tflops_per_gpu, source: "measured", ...extra: spread, cross_node_mb_per_rank, loss, load}

One launch covers several link rates: the ranks run pretrain_gpt.py unchanged under
megatron_zpp/testing/peers/ours.py's probe, which stops every rank at a gate before the first step of
each later rate; the driver reshapes the link with no traffic in flight and opens the gate.
Per rate the first step (which holds the gate wait in its step_time) is dropped, and before
the first rate --warmup steps; the figure is the median of the rest (`step_time` of rank 0's
metrics file, which ends with the loss all-reduced over the ranks). Every rank runs at one
thread (OMP_NUM_THREADS=1). The cluster's lock admits one cluster at a time: the driver waits
for it (--lock-wait).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_zpp.testing.cluster import wait_for_lock
from megatron_zpp.testing.peers import RUNNERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "examples", "reproduce", "results")


PROBE = os.path.join(RUNNERS, "ours.py")  # pretrain_gpt.py under the probe
LOOPBACK = "127.0.0.1"
TAIL_STEPS = 3  # untimed steps after the concurrent copies' timed block


def log(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Job:
    """One launch: `ranks` ranks, `per_node` per emulated node (1 or 2 nodes), over `rates`."""

    experiment: str
    system: str
    flags: list[str]  # pretrain_gpt.py flags of this system (model flags come from the Sweep)
    ranks: int
    per_node: int
    rates: list[str]
    seq_length: int
    extra: dict = dataclasses.field(default_factory=dict)  # copied into every row

    @property
    def nodes(self) -> int:
        return self.ranks // self.per_node


def gbps(rate: str) -> float | None:
    from megatron_zpp.testing.cluster import parse_rate

    bits = parse_rate(rate)
    return None if bits is None else bits / 1e9


def add_common_args(p: argparse.ArgumentParser, out_name: str) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument("--steps", type=int, default=3, help="timed steps per setting (default 3)")
    g.add_argument("--repeats", type=int, default=1, help="rounds over all settings, order reversed every other")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each launch (default 2)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="training dtype (default fp32: see docs)")
    g.add_argument("--out", default=os.path.join(RESULTS, out_name), help="JSONL of the rows (the PNG beside it)")
    g.add_argument("--no-netns", action="store_true", help="loopback, unshaped (no root needed; rows say so)")
    g.add_argument("--lock-wait", type=float, default=3600, help="seconds to wait for the cluster lock")
    g.add_argument("--run-timeout", type=float, default=900, help="seconds before a launch is stopped")
    g.add_argument("--keep", action="store_true", help="keep the runs' logs and metrics (printed path)")


def model_flags(a, seq_length: int, micro_batch: int, dp: int) -> list[str]:
    """The model of a script (a.hidden_size ...) as pretrain_gpt.py flags, mock data, global batch = mbs x DP."""
    return (
        f"--mock-data --{a.dtype} --num-layers {a.num_layers} --hidden-size {a.hidden_size} "
        f"--num-attention-heads {a.num_attention_heads} --seq-length {seq_length} --vocab-size {a.vocab_size} "
        f"--micro-batch-size {micro_batch} --global-batch-size {micro_batch * dp} --seed 1234 --lr 3e-4 "
        f"--lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --log-interval 1 --peak-tflops 1"
    ).split()


def summarize(job: Job, metrics: list[dict], comm_report: dict | None, steps: int, warmup: int) -> list[dict]:
    """One row per rate of a finished launch: medians of each rate's timed steps (rank 0's metrics)."""
    per_rate = steps + 1
    need = warmup + per_rate * len(job.rates)
    if len(metrics) != need:
        raise RuntimeError(f"{job.system}: {len(metrics)} steps in the metrics file, expected {need}")
    rows = []
    for k, rate in enumerate(job.rates):
        timed = metrics[warmup + k * per_rate + 1 : warmup + (k + 1) * per_rate]
        t = statistics.median(m["step_time"] for m in timed)
        rows.append(
            {
                "experiment": job.experiment,
                "system": job.system,
                "ranks": job.ranks,
                "link_gbps": gbps(rate),
                "seq_length": job.seq_length,
                "step_time_s": t,
                "tokens_per_s": statistics.median(m["tokens_per_sec"] for m in timed),
                "tflops_per_gpu": statistics.median(m["tflops_per_rank"] for m in timed),
                "source": "measured",
                "rate": rate,
                "nodes": job.nodes,
                "spread": (max(m["step_time"] for m in timed) - min(m["step_time"] for m in timed)) / t,
                "loss": timed[-1]["loss"],
                **cross_node(comm_report, job.ranks),
                **job.extra,
            }
        )
    return rows


def cross_node(report: dict | None, ranks: int) -> dict:
    """Ledger bytes per rank per step that cross nodes, and those of the context-parallel state (MB)."""
    if not report:
        return {}
    recs = report["records"]
    inter = sum(r["bytes_per_rank_per_step"] for r in recs if r["link"] == "inter_node")
    cp = sum(r["bytes_per_rank_per_step"] for r in recs if r["role"] == "cp")
    return {"cross_node_mb_per_rank": inter / 1e6, "cp_mb_per_rank": cp / 1e6}


def combine(rounds: list[list[dict]]) -> list[dict]:
    """One row per setting from several rounds: the median over the rounds of each round's median
    (a failed round is dropped; all failed: its failed row), each round's step time and their spread."""
    key = lambda r: (r["experiment"], r["system"], r["ranks"], r.get("rate"), r["seq_length"])  # noqa: E731
    groups: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault(key(r), []).append(r)
    out = []
    for rs in groups.values():
        ok = [r for r in rs if r["step_time_s"]]
        if not ok:
            out.append(rs[0])
            continue
        t = statistics.median(r["step_time_s"] for r in ok)
        row = dict(ok[0], step_time_s=t, rounds=len(ok), round_step_time_s=[r["step_time_s"] for r in ok])
        for k in ("tokens_per_s", "tflops_per_gpu", "load"):
            row[k] = statistics.median(r[k] for r in ok)
        row["round_spread"] = (max(row["round_step_time_s"]) - min(row["round_step_time_s"])) / t
        out.append(row)
    return out


def write_rows(path: str, rows: list[dict], append: bool) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Sweep:
    """Holds the cluster (and its lock) for a script's launches."""

    def __init__(self, a):
        from megatron_zpp.testing.cluster import Cluster

        self.a = a
        self.lock_fd = None if a.no_netns else wait_for_lock(a.lock_wait)
        self.cluster = Cluster(want_netns=not a.no_netns, lock_fd=self.lock_fd)
        self.work = tempfile.mkdtemp(prefix="zpp_sweep_")
        self.port = 29700 + os.getpid() % 200
        self.first_row = True

    def __enter__(self) -> Sweep:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.cluster.cleanup()
        if self.a.keep:
            log(f"runs kept in {self.work}")
        else:
            subprocess.run(["rm", "-rf", self.work], check=False)

    def run(self, job: Job, flags: list[str]) -> list[dict]:
        """Launch `job` (flags: model + system), return its rows (written to --out as they come)."""
        out = os.path.join(self.work, f"{len(os.listdir(self.work)):03d}")
        os.makedirs(out)
        files = ["--metrics-file", os.path.join(out, "metrics.jsonl"), "--comm-report", os.path.join(out, "comm.json")]
        iters = self.a.warmup + (self.a.steps + 1) * len(job.rates)
        args = [*flags, *job.flags, "--train-iters", str(iters), "--ranks-per-node", str(job.per_node), *files]
        log(f"{job.experiment}: {job.system}, {job.ranks} ranks ({job.nodes} x {job.per_node}), {', '.join(job.rates)}")
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        error = refusal(args, job.ranks) or self._launch(job, args, out)
        if error:
            log(f"  FAILED: {error}")
            rows = [self._failed_row(job, rate, error) for rate in job.rates]
        else:
            metrics = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]
            report = json.load(open(os.path.join(out, "comm.json")))
            rows = summarize(job, metrics, report, self.a.steps, self.a.warmup)
            for r in rows:
                r.update(load=load, netns=self.cluster.netns, dtype=self.a.dtype)
                log(f"  {r['rate']:>9}: {r['step_time_s']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s")
        log(f"  {time.perf_counter() - t0:.0f} s")
        write_rows(self.a.out, rows, append=not self.first_row)
        self.first_row = False
        return rows

    def run_concurrent(self, job: Job, flags: list[str], copies: int, local_world: int, steps: int) -> dict:
        """`copies` independent single-rank runs of `job` at once (the nodes alternating): what the CPU
        sharing alone costs. Each copy sees LOCAL_WORLD_SIZE = `local_world` (pretrain_gpt.py gives a rank
        cores / LOCAL_WORLD_SIZE threads, so pass the training ranks' ranks per node for the same threads)
        and runs under the probe: --warmup steps, an untimed block of steps + 1 that absorbs the other
        copies' start-up, a file gate that opens once every copy waits at it (`open_gates`), `steps` + 1
        steps timed together (the first, holding the gate wait, dropped), then a few untimed steps so a
        copy lagging behind still shares the cores to its last timed step. A row with the copies' summed
        tokens/s (each one's median) and their median step time."""
        from megatron_zpp.testing.cluster import stop_process

        assert len(job.rates) == 1 and job.ranks == 1
        gated = dataclasses.replace(job, rates=job.rates * 2)  # block 0: start-up; block 1: timed together
        need = self.a.warmup + 2 * (steps + 1)
        log(f"{job.experiment}: {copies} concurrent single-rank runs of {job.system}, {steps} steps timed together")
        procs, outs, load = [], [], os.getloadavg()[0]
        for i in range(copies):
            out = os.path.join(self.work, f"{len(os.listdir(self.work)):03d}")
            os.makedirs(out)
            outs.append(out)
            open(os.path.join(out, "gate2.open"), "w").close()  # the tail steps never wait
            args = [*flags, *job.flags, "--train-iters", str(need + TAIL_STEPS)]
            args += ["--metrics-file", os.path.join(out, "m.jsonl"), "--ranks-per-node", "1"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore::FutureWarning",
                   "LOCAL_WORLD_SIZE": str(local_world), "ZPP_PROBE_DIR": out}  # fmt: skip
            probe = [PROBE, "--warmup", str(self.a.warmup), "--gate-every", str(steps + 1), "--", *args]
            log_f = open(os.path.join(out, "node0.log"), "w")
            cmd = self.cluster.prefix(i % 2) + [sys.executable, *probe]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT, cwd=ROOT,
                                           start_new_session=True), log_f))  # fmt: skip
        deadline = time.perf_counter() + self.a.run_timeout
        error = open_gates(outs, 1, [p for p, _ in procs], deadline)
        while not error and any(p.poll() is None for p, _ in procs) and time.perf_counter() < deadline:
            time.sleep(0.2)
        for p, f in procs:
            stop_process(p)
            f.close()
        if error or any(p.returncode for p, _ in procs):
            raise RuntimeError(f"a concurrent run failed: {error or last_error(outs[0], 1)}")
        rows = []
        for o in outs:
            metrics = [json.loads(x) for x in open(os.path.join(o, "m.jsonl")) if x.strip()]
            rows.append(summarize(gated, metrics[:need], None, steps, self.a.warmup)[1])
        row = {**rows[0], "copies": copies, "threads": max(1, (os.cpu_count() or 1) // local_world), "load": load}
        row["tokens_per_s"] = sum(r["tokens_per_s"] for r in rows)
        row["step_time_s"] = statistics.median(r["step_time_s"] for r in rows)
        row["copy_step_time_s"] = [r["step_time_s"] for r in rows]
        log(f"  {row['step_time_s']:.3f} s/step each, {row['tokens_per_s']:.0f} tok/s together")
        return row

    def run_jobs(self, jobs: list[tuple[Job, list[str]]]) -> list[dict]:
        """Every (job, flags) for --repeats rounds, the order reversed every other round (a drift of the
        machine's load hits every setting alike); the combined rows replace the progress rows in --out."""
        rounds = []
        for k in range(self.a.repeats):
            order = jobs if k % 2 == 0 else jobs[::-1]
            rounds.append([row for job, flags in order for row in self.run(job, flags)])
        rows = combine(rounds)
        write_rows(self.a.out, rows, append=False)
        return rows

    def _failed_row(self, job: Job, rate: str, error: str) -> dict:
        return {"experiment": job.experiment, "system": job.system, "ranks": job.ranks, "link_gbps": gbps(rate),
                "seq_length": job.seq_length, "step_time_s": None, "tokens_per_s": None, "tflops_per_gpu": None,
                "source": "measured", "rate": rate, "error": error, **job.extra}  # fmt: skip

    def _launch(self, job: Job, args: list[str], out: str) -> str | None:
        from megatron_zpp.testing.cluster import ADDRS, VETHS, parse_rate, stop_process

        c = self.cluster
        if job.nodes > 2 or job.ranks % job.per_node:
            return f"{job.ranks} ranks at {job.per_node} per node need more than the cluster's 2 nodes"
        c.shape(parse_rate(job.rates[0]))
        open(os.path.join(out, "gate0.open"), "w").close()
        self.port += 1
        master = ADDRS[0] if c.netns and job.nodes > 1 else LOOPBACK
        procs, logs = [], []
        for node in range(job.nodes):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "ZPP_PROBE_DIR": out, "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore::FutureWarning"}  # fmt: skip
            if c.netns:
                iface = VETHS[node] if job.nodes > 1 else "lo"
                env.update(GLOO_SOCKET_IFNAME=iface, ZPP_VETH=VETHS[node], ZPP_NODE=str(node))
            where = f"--nnodes {job.nodes} --nproc-per-node {job.per_node} --node-rank {node} --master-addr {master}"
            cmd = [sys.executable, "-m", "torch.distributed.run", *where.split(), "--master-port", str(self.port)]
            cmd += [PROBE, "--warmup", str(self.a.warmup), "--gate-every", str(self.a.steps + 1), "--", *args]
            logs.append(open(os.path.join(out, f"node{node}.log"), "w"))
            p = subprocess.Popen(
                c.prefix(node) + cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
            procs.append(p)
            c.children.append(p)
        try:
            return self._drive(job, procs, out, time.perf_counter() + self.a.run_timeout)
        finally:
            for p in procs:
                stop_process(p)
                c.children.remove(p)
            for f in logs:
                f.close()

    def _drive(self, job: Job, procs: list, out: str, deadline: float) -> str | None:
        """Open each later rate's gate once every rank waits at it (after reshaping); wait for the end."""
        from megatron_zpp.testing.cluster import parse_rate

        for k in range(1, len(job.rates) + 1):
            while True:
                codes = [p.poll() for p in procs]
                if any(code not in (None, 0) for code in codes) or (k == len(job.rates) and None not in codes):
                    break
                if k < len(job.rates) and all(
                    os.path.exists(os.path.join(out, f"gate{k}.rank{r}")) for r in range(job.ranks)
                ):
                    self.cluster.shape(parse_rate(job.rates[k]))
                    open(os.path.join(out, f"gate{k}.open"), "w").close()
                    break
                if time.perf_counter() > deadline:
                    return f"timed out after {self.a.run_timeout:.0f} s (--run-timeout)"
                time.sleep(0.05)
        while any(p.poll() is None for p in procs):  # one node failed: the other may hang in gloo
            if time.perf_counter() > deadline or any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            return f"exit codes {codes}: {last_error(out, job.nodes)}"
        return None


def open_gates(dirs: list[str], k: int, procs: list, deadline: float) -> str | None:
    """Open gate k of every probe dir at once, when every single-rank copy waits at it (gate<k>.rank0
    in each dir); an error if a copy ended first or the deadline passed."""
    while not all(os.path.exists(os.path.join(d, f"gate{k}.rank0")) for d in dirs):
        if any(p.poll() is not None for p in procs):
            return f"a copy ended before gate {k}"
        if time.perf_counter() > deadline:
            return "timed out at the gate (--run-timeout)"
        time.sleep(0.05)
    for d in dirs:
        open(os.path.join(d, f"gate{k}.open"), "w").close()
    return None


def refusal(args: list[str], world: int) -> str | None:
    """pretrain_gpt.py's own configuration check, before any process starts: its message if it refuses."""
    from megatron_zpp.config import ConfigError
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.validation import validate

    try:
        validate(parse_args(args), world)
    except ConfigError as e:
        return "refused by pretrain_gpt.py: " + str(e).strip().replace("\n", "; ")
    return None


def last_error(out: str, nodes: int) -> str:
    """The most telling line of the nodes' logs (an `error:` line, else the last non-empty one)."""
    lines = []
    for n in range(nodes):
        path = os.path.join(out, f"node{n}.log")
        if os.path.exists(path):
            lines += [x.strip() for x in open(path, errors="replace") if x.strip()]
    errors = [x for x in lines if "error:" in x.lower() or "Error" in x]
    return (errors or lines or ["no output"])[-1][:300]


def save_plot(rows: list[dict], png: str, decorate=None, **kw) -> None:
    """plot_scaling's figure of `rows`, `decorate(fig)` applied, saved as `png`."""
    from megatron_zpp.plotting import plot_scaling

    fig = plot_scaling(rows, **kw)
    if decorate:
        decorate(fig)
    fig.savefig(png, dpi=100)
    log(f"wrote {png}")


def png_of(jsonl: str) -> str:
    return os.path.splitext(jsonl)[0] + ".png"
