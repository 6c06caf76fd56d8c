"""Checkpoint save and load: our sharded checkpoints vs PyTorch Distributed Checkpoint, and the disk.

    .venv/bin/python bench/checkpoint.py            (~80 s on 2 CPU cores; writes ~1.5 GB under runs/)
    .venv/bin/python bench/checkpoint.py --quick    (smoke run: smaller model, 2 repeats)

A real run at each layout (training.setup on --mock-data, fp32, CPU, gloo ranks through
megatron_zpp/testing/dist.py), one training step so the AdamW state exists, then, per layout, timed with a
barrier before and after (the slowest rank's time), median of the repeats (5); each repeat
runs every kind in turn (ours, DCP, ...: drift and the page cache's state hit them alike),
after one untimed round; every save goes to a fresh directory:

  save     ours: checkpoint.save_checkpoint(run, dir) (each rank: clone its state, write it as
           safetensors, fsync, rename, read the file back for its sha256; the digests are
           all-gathered; rank 0 writes meta.json and renames the directory)
           DCP:  torch.distributed.checkpoint.save(state, checkpoint_id=dir) with its default
           FileSystemWriter (one file per rank, sync_files=True: fsync) and DefaultSavePlanner
  load     ours: checkpoint.load_checkpoint(target, dir) (sha256 check, safetensors read, copy into
           the model, optimizer.load_state_dict, RNG)
           DCP:  dcp.load(state, checkpoint_id=dir) in place into the live tensors, then
           optimizer.load_state_dict and the RNG states, as ours
  reshard  ours only: the ZeRO-3 DP2 checkpoint loaded by the TP2 x DP2 plain-DP run (TP, DP
           engine and ZeRO stage all change); DCP cannot reshard plain tensors. Its ratio is to
           our same-layout load at the target layout.

Loads are timed twice: "warm" (the files are in the page cache, as right after the save) and
"cold" (rank 0 drops the checkpoint's pages with posix_fadvise(DONTNEED) before the barrier:
the load reads the disk; ours reads its file twice, the sha256 pass reading it from disk).
Before every load the model weights and AdamW moments are zeroed (untimed), and after it
they are checked against the state that was saved, so a load that restores nothing fails.

The same state for both: each rank's own tensors, exactly the entries our rank file holds:
"model" (ZeRO: every unit's fp32 master shard; plain DP: the chunk parameters), "optimizer" (the
AdamW state_dict) and "rng". DCP gets the live tensors (our save clones them first: that copy is
ours to pay). Keys are prefixed by the global rank: with the default planners DCP treats a plain
(non-DTensor) tensor as replicated: every rank plans a write of its key and DCP's
dedup_save_plans keeps one rank's copy per key (and on load every rank reads that copy), so TP
shards or ZeRO shards under one name would silently be saved as one rank's. Rank-unique keys
make each rank write and read its own, as ours does. At plain DP the DP replicas hold identical
weights and AdamW state; "DCP dedup" keys the model and optimizer by (TP, PP) rank instead, so
DCP writes each replica once (spread over the replicas by its planner) and every replica reads
it back: bytes ours writes redundantly (the RNG stays per rank).

Disk limit: one more kind in the same rounds (so under the same conditions: the virtual
disk's write rate drops while it absorbs earlier writes): rank 0 alone writes as many bytes
as our checkpoint holds with os.write (16 MiB blocks) and one fsync, into a file on the same
filesystem, while the other ranks wait at the barrier; for loads, one sequential read of that
file, warm or cold. Other byte counts (DCP's, the reshard source's) scale its time by their
bytes. "/lim" = time / limit time.
"Where the time goes": this process's time inside save._rank_state (clone), safetensors'
save_file, os.fsync, files.sha256_of, RankFile.state (safetensors load), load._restore
and reshard.rank_state_for (wrapped with timers, rank 0, the median repeat); DCP calls
torch.save/torch.load/fsync.
GB/s = bytes of the checkpoint directory (every file) / time. 4 ranks time-share 2 cores:
absolute times are this machine's; the ratios are the figure. The last stdout line is one
JSON object with everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_zpp.testing.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORK = os.path.join(ROOT, "runs", "bench_checkpoint")  # /runs/ is gitignored; / is disk-backed (/tmp may be tmpfs)
LAYOUTS = {  # name -> (label, world size, flags)
    "zero3_dp2": ("ZeRO-3 over DP2", 2, ["--zero-stage", "3"]),
    "tp2_dp2": ("TP2 x DP2 plain DP", 4, ["--tensor-model-parallel-size", "2"]),
}
RESHARD = ("zero3_dp2", "tp2_dp2")  # source layout's checkpoint, loaded by the target layout's run


# ------------------------------------------------------------------ this rank's state


def tensors_of(run) -> list[torch.Tensor]:
    """What a load must restore: the engine's live model tensors (what our save clones) and the AdamW moments."""
    state = run.dp.state_dict()
    moments = [s[k] for s in state["optimizer"]["state"].values() for k in ("exp_avg", "exp_avg_sq")]
    return list(state["model"].values()) + moments


def fingerprint(run) -> list[float]:
    return [t.double().sum().item() + t.double().abs().sum().item() for t in tensors_of(run)]


@torch.no_grad()
def wipe(run) -> None:
    for t in tensors_of(run):
        t.zero_()


def dcp_state(run, dedup: bool) -> dict:
    """The state DCP saves and loads in place; see the module docstring for the keys."""
    from megatron_zpp.checkpoint.rng import get_rng_state

    shared, mine = dcp_keys(run, dedup)
    return {
        shared: run.dp.state_dict(),
        mine: {
            "rng": get_rng_state(),
            "iteration": run.state.iteration,
            "consumed_samples": run.state.consumed_samples,
        },
    }


def dcp_keys(run, dedup: bool) -> tuple[str, str]:
    """(key of model + optimizer, key of the RNG and position): rank-unique, or by (TP, PP) rank for dedup."""
    g = run.groups
    return (f"tp{g.tp_rank}_pp{g.pp_rank}" if dedup else f"rank{run.rank}"), f"rank{run.rank}.run"


def dcp_apply(run, state: dict, dedup: bool) -> None:
    """After dcp.load: what load_checkpoint does after reading (tensors are already in place)."""
    from megatron_zpp.checkpoint.rng import set_rng_state

    shared, mine = dcp_keys(run, dedup)
    run.dp.load_state_dict(state[shared])  # its tensors are in place: ZeRO re-derives its shards, as ours
    set_rng_state(state[mine]["rng"])
    run.state.iteration, run.state.consumed_samples = (
        int(state[mine]["iteration"]),
        int(state[mine]["consumed_samples"]),
    )


# ------------------------------------------------------------------ timing


@contextlib.contextmanager
def phase_timers():
    """Times the parts of our save/load in this process: yields {phase: seconds}, accumulated."""
    from megatron_zpp.checkpoint import files, load, save

    acc: dict[str, float] = {}
    patched = [
        (save, "_rank_state", "clone state"),
        (files, "save_file", "safetensors save"),
        (torch, "save", "torch.save"),
        (os, "fsync", "fsync"),
        (files, "sha256_of", "sha256"),
        (files.RankFile, "state", "safetensors load"),
        (torch, "load", "torch.load"),
        (load, "_restore", "copy into model"),
        (load, "rank_state_for", "reshard"),
    ]
    originals = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]

    stack: list[str] = []  # a phase inside another is recorded as "outer>inner"

    def wrap(fn, phase):
        def wrapper(*args, **kw):
            key = f"{stack[-1]}>{phase}" if stack else phase
            stack.append(phase)
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
                stack.pop()

        return wrapper

    for mod, name, phase in patched:
        setattr(mod, name, wrap(getattr(mod, name), phase))
    try:
        yield acc
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)


def drop_cache(path: str) -> None:
    """Evict the file's, or the directory's files', (clean, fsynced) pages from the page cache:
    the next read goes to disk."""
    walk = [(os.path.dirname(path), None, [os.path.basename(path)])] if os.path.isfile(path) else os.walk(path)
    for d, _, files in walk:
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dir_bytes(path: str) -> tuple[int, int]:
    """(bytes, files) of every file under path."""
    n = files = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            n += os.path.getsize(os.path.join(d, f))
            files += 1
    return n, files


def timed(fn, before=None) -> tuple[float, dict]:
    """(seconds between a barrier before and one after `fn`, this rank's phase times)."""
    if before is not None:
        before()
    dist.barrier()
    with phase_timers() as acc:
        t = time.perf_counter()
        fn()
        dist.barrier()
        dt = time.perf_counter() - t
    return dt, dict(acc)


def summarize(samples: list[tuple[float, dict]]) -> dict:
    times = [s for s, _ in samples]
    i = times.index(statistics.median_low(times))
    return {"s": statistics.median(times), "all_s": times, "phases": samples[i][1]}


# ------------------------------------------------------------------ one layout (every rank runs this)


def bench_layout(rank: int, world: int, a: dict, name: str, reshard_src: str | None) -> dict:
    sys.stdout = open(os.devnull, "w")  # setup() logs on rank 0; the parent prints the table
    import torch.distributed.checkpoint as dcp

    from megatron_zpp import training
    from megatron_zpp.checkpoint import LoadTarget, load_checkpoint, save_checkpoint
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.validation import validate
    from megatron_zpp.zero import DDPEngine

    label, _, extra = LAYOUTS[name]
    OLD_BLOCK = (  # the figures' block
        "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
        "--hidden-dropout 0 --attention-dropout 0"
    )
    argv = (
        f"--mock-data --device cpu --num-layers {a['layers']} --hidden-size {a['hidden']} "
        f"--num-attention-heads {a['heads']} --seq-length {a['seq']} --vocab-size {a['vocab']} "
        f"--micro-batch-size 1 --global-batch-size 2 --train-iters 10 --lr 1e-3 --lr-warmup-iters "
        f"0 --log-interval 1000000 {OLD_BLOCK}"
    ).split() + extra
    run = training.setup(validate(parse_args(argv), world))
    training.train_step(run)
    run.state.iteration, run.state.consumed_samples = 1, 2
    want = fingerprint(run)
    base = os.path.join(WORK, name)
    R = a["repeats"]
    out: dict = {"label": label, "world": world, "rank": rank}

    def check(what: str) -> None:
        got = fingerprint(run)
        bad = [i for i, (x, y) in enumerate(zip(got, want)) if x != y]
        if bad:
            raise AssertionError(f"{name}: {what} did not restore the saved state ({len(bad)} tensors differ)")

    # every kind in turn within a repeat (drift and the page cache's state hit all alike), after one untimed round
    plain_dp = isinstance(run.dp, DDPEngine) and run.groups.topo.sizes["dp"] > 1
    savers = {
        "ours": lambda d: save_checkpoint(run, d),
        "dcp": lambda d: dcp.save(dcp_state(run, False), checkpoint_id=d),
    }
    if plain_dp:
        savers["dcp_dedup"] = lambda d: dcp.save(dcp_state(run, True), checkpoint_id=d)
    # the disk limit is one more kind: rank 0 writes as many bytes as our checkpoint holds (known after round 0)
    limit_file = os.path.join(base, "disk_limit.bin")
    nbytes = [0]
    savers["limit"] = lambda d: write_fsync(limit_file, nbytes[0]) if rank == 0 and nbytes[0] else None
    samples: dict[str, list] = {k: [] for k in savers}
    last: dict[str, str] = {}
    for i in range(1 + R):
        for kind, fn in savers.items():
            d = os.path.join(base, f"{kind}_{i}")
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            sample = timed(lambda: fn(d))
            if i:
                samples[kind].append(sample)
            if rank == 0 and kind in last and os.path.exists(last[kind]):
                shutil.rmtree(last[kind])  # untimed; one copy of each kind stays on disk
            last[kind] = d
        if i == 0 and rank == 0:
            nbytes[0] = dir_bytes(last["ours"])[0]
    del savers["limit"], last["limit"]
    for kind in list(savers) + ["limit"]:
        out[f"save_{kind}"] = summarize(samples[kind])
    if rank == 0:
        for kind in savers:
            out[f"bytes_{kind}"], out[f"files_{kind}"] = dir_bytes(last[kind])
        out["bytes_limit"] = nbytes[0]

    def dcp_loader(d: str, dedup: bool):
        def load():
            state = dcp_state(run, dedup)
            dcp.load(state, checkpoint_id=d)
            dcp_apply(run, state, dedup)

        return load

    target, restored = LoadTarget(run.cfg, run.groups, run.device, run.dp, run.tokenizer.padded_vocab_size), {}
    loaders = {"ours": (last["ours"], lambda: load_checkpoint(target, last["ours"]))}
    loaders.update({k: (last[k], dcp_loader(last[k], k == "dcp_dedup")) for k in savers if k != "ours"})
    if reshard_src:
        src = os.path.join(WORK, reshard_src, "ours_keep")
        out["reshard_from"] = reshard_src
        if rank == 0:
            out["bytes_reshard_src"], out["files_reshard_src"] = dir_bytes(src)
        loaders["reshard"] = (src, lambda: restored.update(reshard=load_checkpoint(target, src)))
    loaders["limit"] = (limit_file, lambda: read_all(limit_file) if rank == 0 else None)
    if rank == 0:
        write_fsync(limit_file, nbytes[0])
    for cache in ("warm", "cold"):
        samples = {k: [] for k in loaders}
        for i in range(1 + R):
            for kind, (d, fn) in loaders.items():

                def prep(d=d, kind=kind):
                    if kind != "limit":
                        wipe(run)
                    if cache == "cold" and rank == 0:
                        drop_cache(d)

                sample = timed(fn, prep)
                if i:
                    samples[kind].append(sample)
                if kind == "reshard":
                    resharded = restored.pop("reshard").resharded_from
                    assert resharded, "the source checkpoint was not resharded"
                    # the source trained the same step on the same global batch at another layout: equal to
                    # fp32 round-off (this layout's own state is restored by the next "ours" load)
                    got = fingerprint(run)
                    out["resharded"] = resharded
                    out["reshard_max_rel_diff"] = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(got, want))
                elif kind != "limit":
                    check(f"{kind} load")
        for kind in loaders:
            out[f"load_{kind}_{cache}"] = summarize(samples[kind])
    ours, dcp_dirs = last["ours"], {k: v for k, v in last.items() if k != "ours"}
    if rank == 0:
        os.unlink(limit_file)

    dist.barrier()
    if rank == 0:  # keep our checkpoint for the next layout's reshard; drop the rest
        for d in dcp_dirs.values():
            shutil.rmtree(d)
        shutil.rmtree(os.path.join(base, "ours_keep"), ignore_errors=True)
        os.rename(ours, os.path.join(base, "ours_keep"))
    return out


# ------------------------------------------------------------------ the disk


BLOCK = 16 << 20


def write_fsync(path: str, nbytes: int) -> None:
    """The disk's write limit: nbytes in 16 MiB os.write calls, one fsync."""
    buf = bytes(range(256)) * (BLOCK // 256)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(BLOCK, left)])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_all(path: str) -> None:
    """The disk's (or page cache's) read limit: one sequential pass in 16 MiB os.read calls."""
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, BLOCK):
            pass
    finally:
        os.close(fd)


def filesystem_of(path: str) -> str:
    best = ("?", "?", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (path + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[2]):
                best = (dev, fstype, mnt)
    return f"{best[1]} ({best[0]} on {best[2]})"


# ------------------------------------------------------------------ report


def row_fmt(name, ours, peer, limit, peer_limit, nbytes, peer_bytes):
    """ours and the peer: seconds, GB/s; ours/peer; the disk limit for our bytes; each over its own bytes' limit."""
    return (
        f"  {name:<34} {ours:>7.3f} {nbytes / ours / 1e9:>5.2f} {peer:>7.3f} {peer_bytes / peer / 1e9:>5.2f} "
        f"{ours / peer:>8.2f}  {limit:>7.3f} {ours / limit:>8.2f} {peer / peer_limit:>8.2f}"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: smaller model, 2 repeats")
    ap.add_argument("--repeats", type=int, help="timed repeats per row (default 5, --quick 2)")
    ap.add_argument("--smoke", action="store_true", help="seconds: a toy model, ZeRO-3 DP2 only, 1 repeat")
    args = ap.parse_args(argv)
    a = (
        dict(layers=2, hidden=64, heads=2, seq=32, vocab=256, repeats=1)
        if args.smoke
        else dict(layers=4, hidden=256, heads=4, seq=128, vocab=4096, repeats=2)
        if args.quick
        else dict(layers=8, hidden=512, heads=8, seq=256, vocab=8192, repeats=5)
    )
    layouts = {RESHARD[0]: LAYOUTS[RESHARD[0]]} if args.smoke else LAYOUTS
    a["repeats"] = args.repeats or a["repeats"]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    fs = filesystem_of(WORK)
    results = {}
    for name, (_label, world, _) in layouts.items():
        src = RESHARD[0] if name == RESHARD[1] else None
        per_rank = run_distributed(bench_layout, world, a, name, src, timeout=900)
        results[name] = per_rank[0]
    limits = {}  # layout -> the disk limit measured in its run, at our checkpoint's bytes
    for name, r in results.items():
        limits[name] = {
            "bytes": r["bytes_limit"],
            "write_fsync_s": r["save_limit"]["s"],
            "read_warm_s": r["load_limit_warm"]["s"],
            "read_cold_s": r["load_limit_cold"]["s"],
        }
    shutil.rmtree(WORK, ignore_errors=True)

    ffn = 64 * ((int(8 * a["hidden"] / 3) + 63) // 64)
    params = (
        a["layers"] * (4 * a["hidden"] ** 2 + 3 * a["hidden"] * ffn + 2 * a["hidden"])
        + a["vocab"] * a["hidden"]
        + a["hidden"]
    )
    print(
        f"\nGPT fp32 {params / 1e6:.1f}M params ({a['layers']} layers, hidden {a['hidden']}, ffn {ffn}, vocab "
        f"{a['vocab']}, tied embedding), AdamW state after 1 step; gloo ranks on {os.cpu_count()} CPU cores"
    )
    print(f"checkpoints in {WORK}: {fs}" + ("  -- tmpfs: RAM, not a disk!" if "tmpfs" in fs else ""))
    print(
        f"median of {a['repeats']} per row; time = barrier .. barrier (slowest rank); GB/s = checkpoint bytes / "
        f"time; loads: warm = files in the page cache, cold = their pages dropped first"
    )
    print(
        "limit s = the disk limit for our bytes (saves: one os.write stream + fsync; loads: one sequential read, "
        "warm or cold); ours/lim and DCP/lim: each time over the limit for its own bytes\n"
    )
    head = (
        f"  {'':<34} {'ours s':>7} {'GB/s':>5} {'DCP s':>7} {'GB/s':>5} {'ours/DCP':>8}  {'limit s':>7} "
        f"{'ours/lim':>8} {'DCP/lim':>8}"
    )
    summary = {}
    for name, r in results.items():
        b = {k: r.get(f"bytes_{k}") for k in ("ours", "dcp", "dcp_dedup")}
        print(
            f"{r['label']} ({r['world']} ranks): ours {b['ours'] / 1e6:.0f} MB in {r['files_ours']} files, DCP "
            f"{b['dcp'] / 1e6:.0f} MB in {r['files_dcp']} files"
            + (f", DCP dedup {b['dcp_dedup'] / 1e6:.0f} MB" if b["dcp_dedup"] else "")
        )
        print(head)
        lim = limits[name]

        def limit_for(nbytes: int) -> dict:
            """The limit's times scaled to nbytes (its throughput held: within 10% from 240 to 720 MB here)."""
            return {k: v * nbytes / lim["bytes"] for k, v in lim.items() if k.endswith("_s")}

        rows = {}
        for peer in ("dcp", "dcp_dedup"):
            if f"save_{peer}" not in r:
                continue
            tag = "" if peer == "dcp" else " [vs DCP dedup]"
            pl = limit_for(b[peer])
            for op, what, lkey in (
                ("save", "save", "write_fsync_s"),
                ("load_%s_warm", "load warm", "read_warm_s"),
                ("load_%s_cold", "load cold", "read_cold_s"),
            ):
                ko, kp = (op % "ours", op % peer) if "%" in op else (f"{op}_ours", f"{op}_{peer}")
                o, p = r[ko]["s"], r[kp]["s"]
                label = what + tag
                print(row_fmt(label, o, p, lim[lkey], pl[lkey], b["ours"], b[peer]))
                rows[label] = {
                    "ours_s": o,
                    "peer_s": p,
                    "ratio_ours_over_peer": o / p,
                    "limit_s": lim[lkey],
                    "ours_over_limit": o / lim[lkey],
                    "peer_over_limit": p / pl[lkey],
                    "ours_gbps": b["ours"] / o / 1e9,
                    "peer_gbps": b[peer] / p / 1e9,
                }
        if "reshard_from" in r:
            src = results[r["reshard_from"]]
            sl = limit_for(r["bytes_reshard_src"])
            for cache, lkey in (("warm", "read_warm_s"), ("cold", "read_cold_s")):
                s, same = r[f"load_reshard_{cache}"]["s"], r[f"load_ours_{cache}"]["s"]
                print(
                    f"  {'reshard load ' + cache:<34} {s:>7.3f} {r['bytes_reshard_src'] / s / 1e9:>5.2f}  "
                    f"from {src['label']} ({r['bytes_reshard_src'] / 1e6:.0f} MB): {s / same:.2f} x our "
                    f"same-layout load, {s / sl[lkey]:.1f} x its read limit"
                )
                rows[f"reshard load {cache}"] = {
                    "ours_s": s,
                    "over_same_layout_load": s / same,
                    "limit_s": sl[lkey],
                    "ours_over_limit": s / sl[lkey],
                    "gbps": r["bytes_reshard_src"] / s / 1e9,
                }
            print(
                f"  (resharded: {', '.join(r['resharded'])}; state vs this layout's own after the same step: "
                f"max rel diff {r['reshard_max_rel_diff']:.1e})"
            )
        print(
            "  where the time goes (rank 0, seconds; a>b: b inside a; other: the rest, e.g. barriers, planning "
            "collectives, meta.json, renames, optimizer/RNG load):"
        )
        for key in (
            "save_ours",
            "load_ours_warm",
            "load_ours_cold",
            "load_reshard_warm",
            "load_reshard_cold",
            "save_dcp",
            "load_dcp_warm",
            "load_dcp_cold",
        ):
            if key in r:
                ph = r[key]["phases"]
                other = r[key]["s"] - sum(v for k, v in ph.items() if ">" not in k)
                print(
                    f"    {key:<18} {r[key]['s']:>6.3f} = "
                    + ", ".join(f"{k} {v:.3f}" for k, v in ph.items())
                    + f", other {other:.3f}"
                )
        sha = {
            k: r[k]["phases"].get("sha256", 0.0) / r[k]["s"] for k in ("save_ours", "load_ours_warm", "load_ours_cold")
        }
        print(
            "  sha256 (ours hashes every file once on save, reading it back, and once more on load): "
            + ", ".join(f"{100 * v:.0f}% of {k.replace('_ours', '')}" for k, v in sha.items())
        )
        print()
        summary[name] = {
            "sha256_share": sha,
            "label": r["label"],
            "world": r["world"],
            "bytes": b,
            "rows": rows,
            "raw": {k: v for k, v in r.items() if k.startswith(("save_", "load_"))},
            "reshard": {
                "from": r.get("reshard_from"),
                "changes": r.get("resharded"),
                "max_rel_diff": r.get("reshard_max_rel_diff"),
            },
        }
    load = round(load_before, 2)
    busy = " -- BUSY: other processes share these cores, figures are distorted" if load > 1.0 else ""
    print(
        "disk limit (rank 0 alone, os.write 16 MiB + fsync / cold / warm sequential read), GB/s: "
        + ", ".join(
            f"{results[k]['label']} run {v['bytes'] / v['write_fsync_s'] / 1e9:.2f} / "
            f"{v['bytes'] / v['read_cold_s'] / 1e9:.2f} / {v['bytes'] / v['read_warm_s'] / 1e9:.2f}"
            for k, v in limits.items()
        )
    )
    print(f"total bench time {time.perf_counter() - t0:.0f} s; 1-min load average at start {load}{busy}")
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "config": a,
                "cpu_cores": os.cpu_count(),
                "torch": torch.__version__,
                "filesystem": fs,
                "load_avg_at_start": load,
                "layouts": summary,
                "disk_limit": limits,
            }
        )
    )


if __name__ == "__main__":
    main()
