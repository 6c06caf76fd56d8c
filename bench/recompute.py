"""Activation memory of one micro-batch with and without activation recompute, per layout and mode.

A medium GPT (default: hidden 512, 8 layers, 8 heads, seq 1024, micro-batch 1, vocab 4096, fp32) on
CPU, for each layout (single rank: softmax, softmax with attention dropout 0.1 (SDPA's math path, which
keeps the T x T probabilities), GLA, hybrid GLA/softmax; 2 ranks: hybrid at TP2 + SP and at CP2
All-Scan) and mode (none; selective; full uniform 1 = every layer recomputed; full block 4 = the first 4
of 8 layers recomputed). Each layout runs in its own process(es) (torchrun for 2 ranks), built by
training.setup from pretrain_gpt.py's flags; after one warm-up forward+backward (lazy imports done;
the engine's fp32 gradient buffer exists from the start) each mode is switched on in turn on the same
model (set_mode: what GPT and its mixers read from the config) and one forward+backward measured, per
rank:

  saved   bytes the forward keeps for the backward: every tensor autograd saves (the checkpointed
          regions' inputs included) but the weights, unique storages, through
          torch.autograd.graph.saved_tensors_hooks; exact, independent of the allocator
  peak    peak resident memory during the forward+backward above the resident memory just before it
          (Linux: VmHWM after resetting it with /proc/self/clear_refs; glibc's mmap threshold is fixed
          at 64 KiB so freed tensors leave the resident set at once); includes the backward's transients
          (gradients of activations, a rerun's activations), so it is the number a memory budget needs
  time    the measured forward+backward, wall seconds (a shared CPU: noisy), and the process's CPU seconds

Reported: the busiest rank. The last stdout line is one JSON object.

Run:  .venv/bin/python bench/recompute.py                          (CPU; ~10 min on 2 idle cores)
      .venv/bin/python bench/recompute.py --layouts gla hybrid --modes none full_uniform_1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = (
    "--mock-data --hidden-size {hidden} --num-layers {layers} --num-attention-heads 8 --seq-length {seq} "
    "--vocab-size 4096 --micro-batch-size 1 --train-iters 1 --gla-chunk-size 64 --seed 1 "
    "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
    "--hidden-dropout 0 --attention-dropout 0"  # the figures' block
)
LAYOUTS = {  # name: (ranks, flags)
    "softmax": (1, "--attention-type softmax"),
    "softmax_attn_dropout": (1, "--attention-type softmax --attention-dropout 0.1"),
    "gla": (1, "--attention-type gla"),
    "hybrid": (1, "--attention-type gla --softmax-attention-every 4"),
    "hybrid_tp2_sp": (
        2,
        "--attention-type gla --softmax-attention-every 4 --tensor-model-parallel-size 2 --sequence-parallel",
    ),
    "hybrid_cp2": (2, "--attention-type gla --softmax-attention-every 4 --context-parallel-size 2"),
}
MODES = {
    "none": "",
    "selective": "--recompute-granularity selective",
    "full_uniform_1": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "full_block_4": "--recompute-granularity full --recompute-method block --recompute-num-layers 4",
}


# ---- the measurement, in the worker process(es) -----------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _fwd_bwd(chunk, tokens, saved=None):
    import torch

    if saved is None:
        loss = chunk(tokens=tokens, labels=tokens).mean()
    else:
        params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:  # weights are not activations
                saved[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = chunk(tokens=tokens, labels=tokens).mean()
    loss.backward()


def set_mode(chunk, model_cfg) -> None:
    """Switch a built model to another recompute mode: what GPT and the mixers read from the
    config at construction (the same weights measured in every mode)."""
    from megatron_zpp import recompute

    chunk.block_groups = recompute.layer_groups(model_cfg, len(chunk.layers))
    for block in chunk.layers.values():
        block.mixer.selective = model_cfg.recompute_granularity == "selective"


def worker(argv: list[str], modes: list[str], out: str) -> None:
    import torch

    from megatron_zpp import training
    from megatron_zpp.config.arguments import parse_config
    from megatron_zpp.context_parallel.slices import sequence_slice

    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cfg = parse_config(argv, world)
    run = training.setup(cfg)
    g = run.groups
    chunk = run.chunks[0]
    chunk.train()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length), generator=gen)
    tokens = tokens[:, sequence_slice(cfg.model.seq_length, g.cp_rank, g.cp.size)].contiguous()
    set_mode(chunk, _mode_cfg(cfg.model, "selective"))  # warm-up: lazy imports (checkpoint's), thread pools
    _fwd_bwd(chunk, tokens)
    rows = {}
    for mode in modes:
        set_mode(chunk, _mode_cfg(cfg.model, mode))
        saved: dict[int, int] = {}
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS
        base = _status_kib("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        _fwd_bwd(chunk, tokens, saved)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = _status_kib("VmHWM") - base
        rows[mode] = {"saved_mib": sum(saved.values()) / 2**20, "peak_mib": peak / 1024}
        rows[mode].update(seconds=seconds, cpu_s=cpu)
    with open(f"{out}.{g.rank}", "w") as fh:
        json.dump(rows, fh)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _mode_cfg(model_cfg, mode: str):
    import dataclasses

    flags = MODES[mode].split()
    values = dict(zip(flags[::2], flags[1::2]))
    return dataclasses.replace(
        model_cfg,
        recompute_granularity=values.get("--recompute-granularity"),
        recompute_method=values.get("--recompute-method"),
        recompute_num_layers=int(values["--recompute-num-layers"]) if "--recompute-num-layers" in values else None,
    )


# ---- the driver ------------------------------------------------------------------------------


def measure(layout: str, modes: list[str], model_flags: str) -> dict:
    """{mode: the busiest rank's figures} for one layout (one process per rank, every mode in it)."""
    ranks, flags = LAYOUTS[layout]
    argv = f"{model_flags} {flags}".split()
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row")
        me = [os.path.abspath(__file__), "--worker", out, ",".join(modes), "--"] + argv
        if ranks == 1:
            cmd = [sys.executable] + me
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] + me
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{layout} failed:\n{proc.stderr[-3000:]}")
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(ranks)]
    return {m: {k: max(r[m][k] for r in per_rank) for k in per_rank[0][m]} for m in modes}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=1024)
    args = ap.parse_args(argv)
    model_flags = MODEL.format(hidden=args.hidden_size, layers=args.num_layers, seq=args.seq_length)
    print(f"model: {model_flags}; load average {os.getloadavg()[0]:.1f}", flush=True)
    head = [("layout", 22), ("mode", 16), ("saved MiB", 10), ("vs none", 9), ("peak MiB", 10), ("vs none", 9)]
    print("".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (h, w) in enumerate(head)) + "  time s   cpu s")
    results = {}
    modes = ["none"] + [m for m in args.modes if m != "none"]
    for layout in args.layouts:
        results[layout] = measure(layout, modes, model_flags)
        ref = results[layout]["none"]
        for mode in modes:
            r = results[layout][mode]
            ratio = lambda k: f"{r[k] / ref[k]:.2f}x" if ref else "-"  # noqa: E731
            print(
                f"{layout:<22}{mode:<16}{r['saved_mib']:>10.1f}{ratio('saved_mib'):>9}"
                f"{r['peak_mib']:>10.1f}{ratio('peak_mib'):>9}{r['seconds']:>8.2f}{r['cpu_s']:>8.2f}",
                flush=True,
            )
    print(json.dumps({"model": model_flags, "load_average": os.getloadavg()[0], "results": results}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[5:], sys.argv[3].split(","), sys.argv[2])
    else:
        main()
