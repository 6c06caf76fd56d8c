"""Dry-run a layout before launching it: the real set-up and training step(s) of chosen ranks of an
N-rank job, one after another in this process (or in --jobs worker processes), on torch's fake
process group and fake tensors (megatron_zpp/planning/dry_run.py). The same flags as
pretrain_gpt.py (with --mock-data), plus

    --world-size N       ranks of the launch (default: $WORLD_SIZE or 1)
    --ranks R ... | auto the ranks to run (default auto: one per role, and every member of one group
                         of each kind)
    --gpu-memory-gb G    also check each rank's peaks (start-up and step) against G GiB
    --json PATH          write the per-rank results and the mismatches as JSON ('-': stdout)
    --jobs J             worker processes the ranks are spread over (default: the CPUs this
                         process may use; 1: every rank in this process)
    --steps S            training steps per rank (default 1; from 2 on, the last one's peak is
                         the steady state's: AdamW's moments held through it)
    --max-ranks M        refuse a run of more than M ranks (default 512; --ranks auto picks every
                         member of one group of each kind, all N ranks when DP spans the world)

After the first rank it prints an estimate of the whole run's time (that rank's seconds times
the rounds of --jobs workers), and at the end the time it took.

    python tools/dry_run.py --world-size 512 --ranks auto --mock-data --num-layers 4 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --micro-batch-size 1 --global-batch-size 256 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --zero-stage 1 --vocab-size 512 \\
        --tokenizer-type NullTokenizer --train-iters 1

Prints one line per rank (peak GiB at start-up and in the step, each beside memory.py's estimate,
collectives and sends issued, GiB sent per link class), every mismatch (a group whose members
issue different collectives, named by group, index, op and rank; a send without its receive;
bytes per link class other than the step simulator's), and OK or FAIL; exits 1 on any mismatch
or a peak over --gpu-memory-gb.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_config
from megatron_zpp.planning import memory
from megatron_zpp.planning.dry_run import CODE_PATHS, auto_ranks, auto_ranks_at_least, dry_run


def _usable_cpus() -> int:
    # the CPUs this process may run on (its affinity where the OS has one: Linux), else all
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ToolArgError(Exception):
    """One of this tool's own arguments is malformed: its one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise ToolArgError(message)


def tool_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = _Parser(add_help=False)
    ap.add_argument("--world-size", type=int, default=os.environ.get("WORLD_SIZE", "1"))
    ap.add_argument("--ranks", nargs="+", default=["auto"])
    ap.add_argument("--gpu-memory-gb", type=float, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--jobs", type=int, default=_usable_cpus())
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--max-ranks", type=int, default=512)
    return ap.parse_known_args(argv)


def check_tool_args(ours: argparse.Namespace) -> None:
    """Refuse bad values of this tool's own arguments before any work (ToolArgError: one line)."""
    for flag, value in (("--world-size", ours.world_size), ("--jobs", ours.jobs), ("--steps", ours.steps)):
        if value < 1:
            raise ToolArgError(f"{flag} {value}: give at least 1")
    if ours.max_ranks < 1:
        raise ToolArgError(f"--max-ranks {ours.max_ranks}: give at least 1")
    if ours.gpu_memory_gb is not None and not 0 < ours.gpu_memory_gb < float("inf"):
        raise ToolArgError(f"--gpu-memory-gb {ours.gpu_memory_gb}: give a positive number of GiB")
    if ours.ranks != ["auto"]:
        for r in ours.ranks:
            if not r.isdigit():
                raise ToolArgError(f"--ranks {r}: give rank numbers (0 to {ours.world_size - 1}) or auto alone")
            if int(r) >= ours.world_size:
                raise ToolArgError(
                    f"--ranks {r}: not a rank of --world-size {ours.world_size} (0 to {ours.world_size - 1})"
                )
    if ours.json not in (None, "-"):  # found now, not after minutes of work
        folder = os.path.dirname(os.path.abspath(ours.json))
        if os.path.isdir(ours.json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ToolArgError(f"--json {ours.json}: cannot write a file there (a missing or read-only folder?)")


def _estimate_line(first_seconds: float, ranks: int, jobs: int) -> str:
    rounds = -(-ranks // jobs)
    return (
        f"estimate: about {first_seconds * rounds:.0f} s for {ranks} ranks "
        f"(the first took {first_seconds:.1f} s; {rounds} round(s) of {jobs} worker(s))"
    )


def to_json(report, seconds: float) -> dict:
    return {
        "ok": report.ok,
        "seconds": seconds,
        "code_paths": CODE_PATHS,
        "ranks": [
            {
                "rank": r.rank,
                "coords": r.coords,
                "startup_peak_bytes": r.startup_peak,
                "step_peak_bytes": r.step_peak,
                "step_peaks_bytes": r.step_peaks,
                "startup_held_bytes": r.startup_held,
                "startup_draw_bytes": r.startup_draw,
                "startup_ratio": r.startup_ratio,
                "estimate_bytes": r.estimate,
                "ratio": r.ratio,
                "collectives": {f"{role} {list(ranks)}": seq for (role, ranks), seq in r.collectives.items()},
                "p2p": {f"{role} {list(ranks)}": [list(m) for m in msgs] for (role, ranks), msgs in r.p2p.items()},
                "link_bytes": r.link_bytes,
                "simulated_link_bytes": r.simulated,
                "seconds": r.seconds,
            }
            for r in report.results
        ],
        "mismatches": [{"what": m.what, "message": m.message} for m in report.mismatches],
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
    try:
        ours, rest = tool_args(argv)
        check_tool_args(ours)
    except ToolArgError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = parse_config(rest, ours.world_size, run=False)
    except ConfigError as e:
        print("error: " + str(e).replace("\n", "\nerror: "), file=sys.stderr)
        return 2
    if ours.steps > (cfg.train.train_iters or 0):  # --mock-data holds --train-iters steps of samples
        print(f"error: --steps {ours.steps} is more than --train-iters {cfg.train.train_iters}", file=sys.stderr)
        return 2
    auto = ours.ranks == ["auto"]
    least = auto_ranks_at_least(cfg, ours.world_size) if auto else len(ours.ranks)  # O(1), before O(world) work
    ranks: list[int] = []
    if least <= ours.max_ranks:
        ranks = auto_ranks(cfg, ours.world_size) if auto else [int(r) for r in ours.ranks]
    if not ranks or len(ranks) > ours.max_ranks:
        how = "--ranks auto picks" if auto else "--ranks names"
        count = len(ranks) if ranks else f"at least {least}"
        print(
            f"error: {how} {count} ranks, more than --max-ranks {ours.max_ranks} "
            f"(about 2 s each on one core): raise --max-ranks or name fewer with --ranks",
            file=sys.stderr,
        )
        return 2
    out = sys.stderr if ours.json == "-" else sys.stdout
    jobs = max(1, min(ours.jobs, len(ranks)))
    print(f"dry run: {len(ranks)} of {ours.world_size} ranks, {jobs} worker(s); {CODE_PATHS}", file=out, flush=True)
    t0 = time.time()

    def log(line: str) -> None:
        print(line, file=out, flush=True)
        if log.first:  # the first rank's time: the estimate of the whole run
            log.first = False
            print(_estimate_line(time.time() - t0, len(ranks), jobs), file=out, flush=True)

    log.first = len(ranks) > 1
    report = dry_run(cfg, ours.world_size, ranks, log=log, jobs=jobs, steps=ours.steps)
    seconds = time.time() - t0
    for m in report.mismatches:
        print(f"MISMATCH ({m.what}): {m.message}", file=out)
    over = []
    if ours.gpu_memory_gb is not None:
        over = [r for r in report.results if max(r.startup_peak, r.step_peak) > ours.gpu_memory_gb * memory.GiB]
        for r in over:
            peak = max(r.startup_peak, r.step_peak) / memory.GiB
            print(f"OVER: rank {r.rank} peaks at {peak:.2f} GiB > {ours.gpu_memory_gb:g}", file=out)
    ok = report.ok and not over
    print(f"{'OK' if ok else 'FAIL'}: {len(ranks)} ranks in {seconds:.1f} s", file=out)
    if ours.json:
        text = json.dumps(to_json(report, seconds), indent=1)
        if ours.json == "-":
            print(text)
        else:
            with open(ours.json, "w") as fh:
                fh.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
