"""ZeRO-3 and ZeRO++ on an emulated 2-node cluster: ours vs PyTorch FSDP2 vs DeepSpeed, bf16 and fp32.

    sudo .venv/bin/python bench/zero.py                  (the reference run; prints its expected duration)
    sudo .venv/bin/python bench/zero.py --quick          (smoke test, < 3 min: tiny model, 1gbit, bf16, 4 systems once)
    sudo .venv/bin/python bench/zero.py --components     (+ ours qwZ, hpZ, qgZ alone, DeepSpeed regather/qwZ/qgZ)
    .venv/bin/python bench/zero.py --rates 1gbit --systems ours-z3 fsdp2 --dtype bf16 --steps 2 --warmup 1

The cluster: two network namespaces `zpp_n0`, `zpp_n1` joined by a veth pair (10.231.77.1/24
<-> 10.231.77.2/24), 2 ranks in each, launched by `ip netns exec zpp_nI torchrun --nnodes 2
--nproc-per-node 2 --node-rank I --master-addr 10.231.77.1`. GLOO_SOCKET_IFNAME is the
namespace's veth: two ranks of one node then talk through their own veth address, which the
kernel delivers over the namespace's loopback (unshaped, never on the veth: checked at start
by a socket transfer). The cross-node link is shaped on both veth ends with
`tc qdisc replace ... tbf rate R burst B latency 50ms`; "unshaped" removes the qdisc. The
namespaces are removed at the end whatever happens (finally, atexit, SIGTERM/SIGINT, and a
watchdog process for SIGKILL); stale ones from an earlier run are removed at start. Without
root, `ip` or `tc` the bench says so and runs all 4 ranks on loopback, unshaped.

Schedule: for each dtype (--dtype both: bf16 first, the headline, then fp32), --repeats (2)
rounds; each round launches every system in turn (the order reversed in every other round,
so a slow drift of the machine hits every system alike), and one launch covers every rate:
the ranks stop at a gate before the first step of each rate (the probe of
bench/zero_peers/common.py), the bench reshapes the link and opens the gate (the wait is not
timed). Each launch runs --warmup (3) untimed steps before the first rate and --steps (8)
timed steps per rate. The expected duration is printed at start (a rough model: start-up +
the compute of one forward + backward timed here + the cross-node bytes at the link rate).

The model (defaults): Llama-style GPT, hidden 512, 6 layers, 8 heads, seq 32, vocab 512
(19.5M parameters), micro-batch 1 per rank, global batch 4. A CPU without native bf16 math
(the 2-core AVX2 machine this was written on) runs a bf16 matmul ~25-70x slower than an fp32
one, so a bf16 step carries far more compute per byte sent than on a GPU (the header prints
both compute times) and the bf16 speedups of communication savings come out smaller than the
fp32 ones. seq 32 keeps a bf16 step at a few seconds there; at seq 256 a bf16 step of the
26M-parameter model took ~50 s and the default run 4+ hours (--seq-length to change it).

Mixed precision (bf16), the same for every system as far as each allows:
  ours: pretrain_gpt.py --bf16: bf16 weights, gathers and compute; fp32 masters, fp32 gradient
      accumulation and fp32 gradient reduce-scatter (qgZ: int4 on the wire, summed in fp32);
  FSDP2: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), its best setting
      for bf16 training and the one like ours: fp32 sharded masters, bf16 gathers and compute,
      fp32 gradient reduce-scatter;
  DeepSpeed: `bf16: {enabled: true}`, nothing else: bf16 weights, gathers and compute, fp32
      master partitions; its defaults reduce-scatter and accumulate the gradients in bf16
      (communication_data_type and grad_accum_dtype follow the model dtype): half the gradient
      bytes of ours and FSDP2's.
A system that cannot run a dtype says so in its row with its error; nothing falls back to
fp32. fp32 (--fp32 everywhere) is the second table.

Systems (same model, weights, token stream, global batch, AdamW, LR schedule, clipping):
  ours-z3, ours-zpp (qwZ+hpZ+qgZ), with --components ours-qwz, ours-hpz, ours-qgz alone
      (ours-z0, plain DP, only if named): pretrain_gpt.py through bench/zero_peers/ours.py
      (probe only); a configuration that pretrain_gpt.py refuses is listed as "not available";
  fsdp2, fsdp2-hpz: torch fully_shard per block + root, reshard_after_forward True / 2 (2: the
      backward all-gather stays in the node, FSDP2's analogue of hpZ);
  ds-z3: DeepSpeed 0.19.8 ZeRO-3 with its defaults, DS_ACCELERATOR=cpu, gloo, from
      .venv-bench-ds/ (created on first use; reuses .venv's CPU torch through a .pth file);
      its defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9) keep a model
      this small gathered from forward to backward: no backward all-gather, 2M per step;
  ds-hpz: ZeRO-3 that releases each layer after use (both settings 0), as in the paper, with
      zero_hpz_partition_size 2; with --components also ds-z3-regather (the same without hpZ)
      and ds-qwz, ds-qgz, listed as not run (their kernels need CUDA); ds-hpz-default (hpZ on
      the defaults, where it has nothing to do) only if named.
The peers' model is bench/single_rank.py's PeerGPT (Llama-style like ours) loaded with our
initialized weights, so every system's first loss is the same number (bf16: to rounding).

Figures per dtype, system and rate:
  step s: the median over all rounds' timed steps (timed by the probe around the whole
      optimizer step, which ends with the loss all-reduced; for ours the JSON also has
      pretrain_gpt.py's own step_time from --metrics-file); spread: (slowest - fastest) /
      fastest of the rounds' medians, with a warning above 10%;
  cross-node MB per step: our ledger's inter_node bytes (--comm-report's model: what each rank
      sends in a collective whose group spans nodes counts whole; each rank's own ledger,
      written by ours.py) per rank (mean) and per node (the sum over its 2 ranks), beside the
      wire: veth tx_bytes over the timed steps (IP/TCP headers included, mean over rounds)
      per node (one veth per node) and per rank (a node's bytes / its 2 ranks);
  peak MB: the peak RSS per rank over the timed steps (VmHWM reset after warmup; max over
      ranks and rounds; includes ~300 MB of libraries; every rank runs with
      MALLOC_MMAP_THRESHOLD_=1 MiB, else glibc's adaptive threshold keeps freed gather buffers
      resident and a sharded system's peak RSS measured 300-370 MB above its live memory);
  speedup = reference step time / this step time (> 1: faster than the reference), against
      the best peer (the fastest of fsdp2, fsdp2-hpz, ds-z3, ds-z3-regather, ds-hpz that ran,
      per dtype and rate, named), ours ZeRO-3 and each peer. Under each table: ours ZeRO++ /
      best peer, ours ZeRO-3 / best peer, ours ZeRO++ / ours ZeRO-3.
Targets, checked on the bf16 table and printed MET / NOT MET (nothing is tuned to them):
ours ZeRO++ >= 2.5x the best peer at 200 Mbit/s and >= 1.5x at 1 Gbit/s; unshaped, ours
ZeRO++ within 15% of our ZeRO-3's step time and our ZeRO-3 no slower than the best peer.
Every system's reduce-scatter moves the real-fabric volume on gloo: gloo runs torch's
reduce-scatter as an all-reduce, twice the bytes of the ring reduce-scatter NCCL sends, so ours
sends a SUM reduce-scatter as an all-to-all + local sum ((n-1)/n of its input per rank;
megatron_zpp/comm.py), and the peers' processes do the same: before the model is wrapped,
bench/zero_peers/common.py install_gloo_collectives() replaces torch.distributed's
reduce_scatter_single (FSDP2's), reduce_scatter_tensor (DeepSpeed's ZeRO-3, bound by
deepspeed.comm at init_distributed), _reduce_scatter_base and reduce_scatter (a list) with
all_to_all_single + a local sum (in fp32 for bf16 inputs, rounded once; SUM, AVG, premul_sum;
async handles) on a gloo group, the original elsewhere. It also traces every collective a peer
calls: under the ledger check the bench prints, per peer, its calls and bytes per rank and step,
the cross-node bytes per node those put on the veth (a ring all-gather / all-reduce crosses once
per node, an all-to-all sends 2 of its 3 parts across; fp32 FSDP2: 2 all-gathers of the params
+ 1 reduce-scatter of the grads = (0.75 + 0.75 + 1) x 4 B per param), beside the measured veth
bytes, and warns when they differ by more than 5%. On this 2 x 2 cluster an all-to-all sends
1.0x its input per node across, where a node-ordered ring would send 0.75x: the same bytes per
rank, but each system's reduce-scatter pays that alike. --gloo-native-reduce-scatter gives the
peers gloo's own back (comparison only: their gradient bytes double).
4 ranks share the CPU cores at 1 thread each (OMP_NUM_THREADS=1): absolute times are this
machine's; the ratios are the figure. The last stdout line is one JSON object with everything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.cluster import ADDRS, VETHS, Cluster, _kill, parse_rate, take_lock  # noqa: E402

PEERS = os.path.join(ROOT, "bench", "zero_peers")
DS_VENV = os.path.join(ROOT, ".venv-bench-ds")
DS_PY = os.path.join(DS_VENV, "bin", "python")
DS_VERSION = "0.19.8"

WORLD, PER_NODE = 4, 2
NODES = WORLD // PER_NODE

# DeepSpeed's defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9) keep a model
# of this size gathered from forward to backward: no backward all-gather (2M per step, not 3M),
# and hpZ has nothing to do. "regather" releases each layer after use, as ZeRO-3 in the paper.
REGATHER = json.dumps({"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0})
ZPP = "--zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients"

# name -> (label, kind, options)
SYSTEMS = {
    "ours-z0": ("ours ZeRO-0 (plain DP)", "ours", "--zero-stage 0".split()),
    "ours-z3": ("ours ZeRO-3", "ours", "--zero-stage 3".split()),
    "ours-qwz": ("ours ZeRO-3 + qwZ", "ours", "--zero-stage 3 --zero-quantized-weights".split()),
    "ours-hpz": ("ours ZeRO-3 + hpZ", "ours", "--zero-stage 3 --zero-hpz-partition-size 2".split()),
    "ours-qgz": ("ours ZeRO-3 + qgZ", "ours", "--zero-stage 3 --zero-quantized-gradients".split()),
    "ours-zpp": ("ours ZeRO++ (qwZ+hpZ+qgZ)", "ours", ZPP.split()),
    "fsdp2": ("FSDP2 fully_shard", "fsdp2", "--reshard-after-forward true".split()),
    "fsdp2-hpz": ("FSDP2 reshard_after_forward=2", "fsdp2", "--reshard-after-forward 2".split()),
    "ds-z3": (f"DeepSpeed {DS_VERSION} ZeRO-3", "ds", "--hpz 1".split()),
    "ds-z3-regather": (f"DeepSpeed {DS_VERSION} ZeRO-3 regather", "ds", ["--hpz", "1", "--zero-config", REGATHER]),
    "ds-hpz": (f"DeepSpeed {DS_VERSION} ZeRO-3+hpZ regather", "ds", ["--hpz", "2", "--zero-config", REGATHER]),
    "ds-hpz-default": (f"DeepSpeed {DS_VERSION} ZeRO-3 + hpZ", "ds", "--hpz 2".split()),
    "ds-qwz": (f"DeepSpeed {DS_VERSION} ZeRO-3 + qwZ", "skip", "needs CUDA kernels (its quantizer op)"),
    "ds-qgz": (f"DeepSpeed {DS_VERSION} ZeRO-3 + qgZ", "skip", "needs CUDA kernels (its quantizer op)"),
}
HEADLINE = ["ours-z3", "ours-zpp", "fsdp2", "fsdp2-hpz", "ds-z3", "ds-hpz"]
COMPONENTS = ["ours-qwz", "ours-hpz", "ours-qgz", "ds-z3-regather", "ds-qwz", "ds-qgz"]
QUICK = ["ours-z3", "ours-zpp", "fsdp2", "ds-hpz"]
BEST_PEER_POOL = ("fsdp2", "fsdp2-hpz", "ds-z3", "ds-z3-regather", "ds-hpz")  # the best peer: the fastest of these
COLUMNS = (("ours-z3", "ours Z3"), ("fsdp2", "FSDP2"), ("fsdp2-hpz", "FSDP2-2"), ("ds-z3", "DS Z3"))
COLUMNS += (("ds-z3-regather", "DS Z3rg"), ("ds-hpz", "DS hpZ"))
SPREAD_WARN = 0.10  # repeats' medians differing by more than this: the machine was not quiet

# The duration estimate only (it needs them rough): cross-node bytes per node per step per parameter (veth
# tx: rings cross once per node, every reduce-scatter is an all-to-all sending 2 of its 3 parts across), (fp32, bf16);
# start-up seconds per launch; a step's compute over the calibrated forward + backward (gathers' copies,
# optimizer, python); what an unshaped veth moves on 2 busy cores.
WIRE_BYTES_PER_PARAM = {
    "ours-z0": (6.0, 6.0),
    "ours-z3": (10.0, 7.0),
    "ours-qwz": (5.5, 5.5),
    "ours-hpz": (7.0, 5.5),
    "ours-qgz": (6.5, 3.5),
    "ours-zpp": (1.0, 1.0),
    "fsdp2": (10.0, 7.0),
    "fsdp2-hpz": (7.0, 5.5),
    "ds-z3": (7.0, 3.5),
    "ds-z3-regather": (10.0, 5.0),
    "ds-hpz": (7.0, 3.5),
    "ds-hpz-default": (7.0, 3.5),
}
START_S = {"ours": 25.0, "fsdp2": 25.0, "ds": 30.0}
COMPUTE_OVERHEAD = 1.3
UNSHAPED_BITS = 4e9


def log(msg: str) -> None:
    print(f"[zero-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- DeepSpeed's venv


def ensure_ds_venv() -> str | None:
    """Create .venv-bench-ds with deepspeed==0.19.8 on our CPU torch; None if ready, else why not."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    check = [DS_PY, "-c", f"import deepspeed; assert deepspeed.__version__ == '{DS_VERSION}', deepspeed.__version__"]
    try:
        if not (os.path.exists(DS_PY) and subprocess.run(check, capture_output=True, env=env).returncode == 0):
            log(f"creating {DS_VENV} with deepspeed=={DS_VERSION} (once; reuses .venv's CPU torch)")
            subprocess.run([sys.executable, "-m", "venv", DS_VENV], check=True, capture_output=True)
            site = subprocess.run(
                [DS_PY, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            with open(os.path.join(site, "_zpp_main_venv.pth"), "w") as f:
                f.write(sysconfig.get_paths()["purelib"] + "\n")  # torch, numpy, pydantic of .venv
            for args in (["wheel"], ["--no-build-isolation", f"deepspeed=={DS_VERSION}"]):
                res = subprocess.run(
                    [DS_PY, "-m", "pip", "install", "-q", *args], capture_output=True, text=True, env=env
                )
                if res.returncode:
                    return f"pip install {' '.join(args)} failed: {_last_error(res.stdout + res.stderr)}"
            res = subprocess.run(check, capture_output=True, text=True, env=env)
            if res.returncode:
                return f"import deepspeed failed: {_last_error(res.stderr)}"
        res = subprocess.run([DS_PY, "-c", BUILD_SHM_OP], capture_output=True, text=True, env=env, timeout=600)
        if res.returncode:
            return f"building DeepSpeed's CPU shm comm op failed: {_last_error(res.stdout + res.stderr)}"
    except Exception as e:  # noqa: BLE001
        return f"setting up {DS_VENV} failed: {e}"
    return None


# DeepSpeed's init_distributed builds its CPU shm comm op (a JIT C++ extension) on first use: build it here
# once, not in 4 ranks at once in a launch. A build killed midway (a launch that timed out) leaves torch's
# lock file behind, and every later build waits on it forever; under the bench lock no build of ours runs
# now, so a lock found here is stale.
BUILD_SHM_OP = """
import os, torch.utils.cpp_extension as ext
lock = os.path.join(ext._get_build_directory("deepspeed_shm_comm", False), "lock")
if os.path.exists(lock):
    print("removing the stale build lock", lock)
    os.remove(lock)
from deepspeed.comm.torch import build_shm_op
build_shm_op()
"""


def _last_error(text: str, exit_codes: list | None = None) -> str:
    lines = [
        ln.strip()
        for ln in text.strip().splitlines()
        if ln.strip() and not re.match(r"^\[[WI]\d", ln.strip()) and "Warning" not in ln and "return func(" not in ln
    ]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[len("error:") :].strip()
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", ln) or "Error:" in ln:
            return ln[:300]
    killed = [-c for c in exit_codes or [] if c and c < 0]
    if killed:
        return f"killed by signal {killed[0]}" + (f" (last output: {lines[-1][:200]})" if lines else "")
    return lines[-1][:300] if lines else "no output"


# ---------------------------------------------------------------- duration estimate


def compute_s(a, dtype: str) -> float:
    """Seconds of one forward + backward of the model on one micro-batch in `dtype`, one thread
    (the second of two): one rank's compute with a core to itself. A CPU without native bf16
    (no AVX512-BF16 / AMX) runs bf16 matmuls many times slower than fp32 ones."""
    import torch

    from megatron_zpp.model import GPT

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mcfg, vocab = model_config(a)
    model = GPT(mcfg, vocab).to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length))
    for _ in range(2):
        t0 = time.perf_counter()
        model(tokens, tokens).float().mean().backward()
    torch.set_num_threads(threads)
    return time.perf_counter() - t0


def step_estimate_s(name: str, dtype: str, rate: str, params: int, compute: dict) -> float:
    shared = compute[dtype] * max(1.0, WORLD / (os.cpu_count() or 1))  # 4 ranks share the cores
    wire = WIRE_BYTES_PER_PARAM[name][dtype == "bf16"] * params
    return COMPUTE_OVERHEAD * shared + wire * 8 / (parse_rate(rate) or UNSHAPED_BITS)


def launch_estimate_s(name: str, dtype: str, a, params: int, compute: dict) -> float:
    kind = SYSTEMS[name][1]
    if kind == "skip":
        return 0.0
    steps = {r: a.steps + (a.warmup if k == 0 else 0) for k, r in enumerate(a.rates)}
    return START_S[kind] + sum(n * step_estimate_s(name, dtype, r, params, compute) for r, n in steps.items())


def duration_estimate_s(a, params: int, compute: dict) -> float:
    return a.repeats * sum(launch_estimate_s(n, d, a, params, compute) for d in a.dtypes for n in a.names)


# ---------------------------------------------------------------- one system, every rate


def model_args(a, iters: int, dtype: str) -> list[str]:
    return (
        f"--mock-data --{dtype} --num-layers {a.num_layers} --hidden-size {a.hidden_size} "
        f"--num-attention-heads {a.num_attention_heads} --seq-length {a.seq_length} --vocab-size "
        f"{a.vocab_size} --micro-batch-size {a.micro_batch_size} --global-batch-size "
        f"{a.micro_batch_size * WORLD} --train-iters {iters} --seed {a.seed} --lr 3e-4 "
        f"--lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --ranks-per-node {PER_NODE} "
        "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear"  # the peers' block
    ).split()


def ours_refusal(args: list[str]) -> str | None:
    """pretrain_gpt.py's own config check (no processes): its message if it refuses."""
    sys.path.insert(0, ROOT)
    try:
        from megatron_zpp.arguments import parse_args
        from megatron_zpp.config import ConfigError
        from megatron_zpp.validation import validate
    except Exception as e:  # noqa: BLE001
        return f"cannot import megatron_zpp: {e}"
    try:
        validate(parse_args(args), WORLD)
    except ConfigError as e:
        return str(e).strip().replace("\n", "; ")
    except SystemExit:
        return "pretrain_gpt.py rejects these flags"
    return None


def runner_command(name: str, a, dtype: str, out_dir: str, ds_reason: str | None) -> tuple[list[str], str | None]:
    """(python, script and flags of one rank; None) or ([], why this system cannot run)."""
    _, kind, opts = SYSTEMS[name]
    margs = model_args(a, a.warmup + a.steps * len(a.rates), dtype)
    runner_flags = f"--warmup {a.warmup} --gate-every {a.steps}".split()
    if kind == "ours":
        files = ["--metrics-file", os.path.join(out_dir, "metrics.jsonl")]
        files += ["--comm-report", os.path.join(out_dir, "comm.json")]
        # --peak-tflops 1 skips the CPU peak measurement: MFU is not reported
        ours_args = margs + opts + files + "--log-interval 1 --peak-tflops 1".split()
        refused = ours_refusal(ours_args)
        if refused:
            return [], refused
        return [sys.executable, os.path.join(PEERS, "ours.py"), *runner_flags, "--", *ours_args], None
    if kind == "fsdp2":
        return [sys.executable, os.path.join(PEERS, "fsdp2.py"), *runner_flags, *opts, "--", *margs], None
    if ds_reason:
        return [], ds_reason
    return [DS_PY, os.path.join(PEERS, "deepspeed_zero.py"), *runner_flags, *opts, "--", *margs], None


def torchrun_args(cluster: Cluster, node: int, port: int) -> list[str]:
    if cluster.netns:
        where = f"--nnodes {NODES} --nproc-per-node {PER_NODE} --node-rank {node} --master-addr {ADDRS[0]}"
    else:
        where = f"--nnodes 1 --nproc-per-node {WORLD} --master-addr 127.0.0.1"
    return ["-m", "torch.distributed.run", *where.split(), "--master-port", str(port)]


def rank_env(a, out_dir: str) -> dict:
    return {
        **os.environ,
        **({"MALLOC_MMAP_THRESHOLD_": str(a.malloc_mmap_threshold)} if a.malloc_mmap_threshold else {}),
        "OMP_NUM_THREADS": "1",
        "ZPP_PROBE_DIR": out_dir,
        "PYTHONUNBUFFERED": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore::FutureWarning",
        **({"ZPP_GLOO_NATIVE_RS": "1"} if a.gloo_native_reduce_scatter else {}),
    }


def launch(cluster: Cluster, name: str, a, dtype: str, out_dir: str, ds_reason: str | None, timeout: float) -> dict:
    """Run one system over every rate (one torchrun per node): its figures, or why it failed."""
    cmd, why_not = runner_command(name, a, dtype, out_dir, ds_reason)
    if why_not:
        return {"status": "not available" if SYSTEMS[name][1] == "ours" else "failed", "reason": why_not}
    os.makedirs(out_dir)
    cluster.shape(parse_rate(a.rates[0]))
    open(os.path.join(out_dir, "gate0.open"), "w").close()
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    deadline = t_start + timeout
    nodes = range(NODES) if cluster.netns else range(1)
    procs, logs = start_nodes(cluster, cmd, rank_env(a, out_dir), out_dir, nodes)
    timed_out = open_gates(cluster, procs, a.rates, out_dir, deadline)
    failed_at = None if timed_out else wait_ranks(procs, deadline)
    timed_out = timed_out or failed_at == "timeout"
    for p in procs:
        _kill(p)
        cluster.children.remove(p)
    for f in logs:
        f.close()
    wall = time.perf_counter() - t_start
    if timed_out:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f} s (--run-timeout)", "wall_s": wall}
    text = "".join(open(os.path.join(out_dir, f"node{n}.log"), errors="replace").read() for n in nodes)
    ranks, codes = read_ranks(out_dir), [p.returncode for p in procs]
    if any(codes) or failed_at is not None or len(ranks) < WORLD:
        return {"status": "failed", "reason": _last_error(text, codes), "wall_s": wall, "exit_codes": codes}
    timed, iters = len(ranks[0]["step_times"]), a.warmup + a.steps * len(a.rates)
    if timed != iters:
        return {"status": "failed", "reason": f"the probe timed {timed} of {iters} steps", "wall_s": wall}
    loads = [load_start, os.getloadavg()[0]]
    return {"status": "ok", "wall_s": wall, "loadavg": loads, **collect(SYSTEMS[name][1], out_dir, ranks, a)}


def start_nodes(cluster: Cluster, cmd: list[str], env: dict, out_dir: str, nodes: range) -> tuple[list, list]:
    """One torchrun per node (in its namespace), each logging to node<i>.log: (processes, log files)."""
    port = 29600 + start_nodes.count  # a fresh rendezvous port per launch: the last one may linger
    start_nodes.count += 1
    procs, logs = [], []
    for node in nodes:
        node_env = env
        if cluster.netns:
            node_env = {**env, "GLOO_SOCKET_IFNAME": VETHS[node], "ZPP_VETH": VETHS[node], "ZPP_NODE": str(node)}
        logs.append(open(os.path.join(out_dir, f"node{node}.log"), "w"))
        run_cmd = cluster.prefix(node) + [cmd[0], *torchrun_args(cluster, node, port), *cmd[1:]]
        p = subprocess.Popen(
            run_cmd, env=node_env, stdout=logs[-1], stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        procs.append(p)
        cluster.children.append(p)
    return procs, logs


start_nodes.count = 0


def open_gates(cluster: Cluster, procs: list, rates: list[str], out_dir: str, deadline: float) -> bool:
    """Open the gate of rate k once all ranks wait at it (no traffic in flight), after
    reshaping the link; True if the launch timed out meanwhile."""
    for k in range(1, len(rates)):
        while all(p.poll() is None for p in procs):
            if all(os.path.exists(os.path.join(out_dir, f"gate{k}.rank{r}")) for r in range(WORLD)):
                break
            if time.perf_counter() > deadline:
                return True
            time.sleep(0.05)
        else:
            return False  # a node ended early: wait_ranks reports it
        cluster.shape(parse_rate(rates[k]))
        open(os.path.join(out_dir, f"gate{k}.open"), "w").close()
    return False


def wait_ranks(procs: list, deadline: float) -> float | str | None:
    """Wait for both nodes: None if both ended, "timeout", or the time one failed (the other
    then has 15 s to report before it is stopped: it may hang in gloo)."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.perf_counter()
        if now > deadline:
            return "timeout"
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > 15:
            break
        time.sleep(0.1)
    return failed_at


def read_ranks(out_dir: str) -> dict:
    ranks = {}
    for r in range(WORLD):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[r] = json.load(f)
    return ranks


def ledger_bytes(ranks: dict) -> dict | None:
    """Our ledger's bytes per step from each rank's own rows (ours.py writes them): inter-node per
    rank (mean) and per node (the sum over its ranks, mean over nodes), the rest per rank."""
    if not all("ledger_rows" in r for r in ranks.values()):
        return None

    def link_sum(r: int, inter: bool, key: str = "bytes") -> float:
        return sum(row[key] for row in ranks[r]["ledger_rows"] if (row["link"] == "inter_node") == inter)

    inter = [link_sum(r, True) for r in range(WORLD)]
    return {
        "inter_node_per_rank": sum(inter) / WORLD,
        "inter_node_per_node": sum(inter) / NODES,
        "inter_node_by_rank": inter,
        # rank r is on node r // PER_NODE (--ranks-per-node, and torchrun's order of the namespaces)
        "inter_node_by_node": [sum(inter[n * PER_NODE : (n + 1) * PER_NODE]) for n in range(NODES)],
        "gloo_inter_node_per_rank": sum(link_sum(r, True, "gloo_bytes") for r in range(WORLD)) / WORLD,
        "intra_node_per_rank": sum(link_sum(r, False) for r in range(WORLD)) / WORLD,
        "on_wire_per_node": ledger_on_wire(ranks),
    }


# The bench's groups that span the nodes, by ledger role: (ranks, ranks of it per node).
GROUP_SHAPES = {"dp_cp": (WORLD, PER_NODE), "dp": (WORLD, PER_NODE), "world": (WORLD, PER_NODE), "dp_tier1": (NODES, 1)}


def ledger_on_wire(ranks: dict) -> float | None:
    """The bytes per step and node that the ledger's inter-node rows put on the veth, if gloo runs an
    all-gather or all-reduce as a ring in group-rank order (one of a node's m ranks in the group sends
    its share across) and a pairwise all-to-all ((n - m) of each rank's n - 1 parts go across; a SUM
    reduce-scatter is one on gloo, see comm.py). None if a row's group shape is unknown."""
    total = 0.0
    for info in ranks.values():
        for row in info["ledger_rows"]:
            if row["link"] != "inter_node":
                continue
            if row["role"] not in GROUP_SHAPES:
                return None
            n, m = GROUP_SHAPES[row["role"]]
            ring = row["op"] in ("all_gather", "all_reduce")
            total += row["bytes"] / m if ring else row["bytes"] * (n - m) / (n - 1)
    return total / NODES


def wire_bytes_by_node(ranks: dict, first: int, last: int) -> list[float] | None:
    """veth tx bytes per step of each node over timed steps [first, last) (its first rank reads them)."""
    per_node = []
    for r in ranks.values():
        tb, te = r.get("tx_begin") or [], r.get("tx_end") or []
        if r.get("iface") and len(tb) >= last and len(te) >= last and tb[first] is not None:
            per_node.append((te[last - 1] - tb[first]) / (last - first))
    return per_node if len(per_node) == NODES else None


def peer_comm(ranks: dict, first: int, last: int) -> dict | None:
    """The peers' traced collectives (bench/zero_peers/common.py CommTrace) per step over timed steps
    [first, last): per torch.distributed entry point its calls and payload per rank, and the modelled
    cross-node bytes per node as run ("x_node") and with every reduce-scatter at the real-fabric volume
    ("x_node_real"); None for ours (its ledger) or a run without the trace."""
    if not all(r.get("comm_end") and len(r["comm_end"]) >= last for r in ranks.values()):
        return None
    steps, by_entry = last - first, {}
    for r in ranks.values():
        begin, end = r["comm_begin"][first], r["comm_end"][last - 1]
        for name, tot in end.items():
            d = [t - b for t, b in zip(tot, begin.get(name, [0] * len(tot)))]
            e = by_entry.setdefault(name, {"calls": 0.0, "payload": 0.0, "x_node": 0.0, "x_node_real": 0.0})
            for key, v in zip(e, d):
                e[key] += v / steps
    for e in by_entry.values():
        e["calls"] /= WORLD
        e["payload"] /= WORLD  # per rank
        e["x_node"] /= NODES  # per node: the sum over its ranks
        e["x_node_real"] /= NODES
    return {
        "by_entry": {n: e for n, e in by_entry.items() if e["calls"]},
        "x_node_per_node": sum(e["x_node"] for e in by_entry.values()),
        "x_node_real_per_node": sum(e["x_node_real"] for e in by_entry.values()),
        "native_rs": any(r.get("native_rs") for r in ranks.values()),
    }


def collect(kind: str, out_dir: str, ranks: dict, a) -> dict:
    metrics = []
    if kind == "ours":
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(ln) for ln in f if ln.strip()]
    out = {"rates": {}, "ledger": ledger_bytes(ranks), "losses": ranks[0]["losses"]}
    for k, rate in enumerate(a.rates):
        first, last = a.warmup + k * a.steps, a.warmup + (k + 1) * a.steps  # timed steps [first, last)
        # ours: pretrain_gpt's own step_time (--metrics-file) too; it includes the gate wait at a rate's first step
        own = [m["step_time"] for m in metrics if first + (k > 0) < m["iteration"] <= last]
        peaks = [p[k] for r in ranks.values() if len(p := r.get("peak_rss_by_rate") or []) > k and p[k]]
        out["rates"][rate] = {
            "step_times_s": ranks[0]["step_times"][first:last],  # the probe's, the same for every system
            "step_s_metrics_file": statistics.median(own) if own else None,
            "wire_bytes_by_node": wire_bytes_by_node(ranks, first, last),
            "peak_rss_mb_max": max(peaks) / 2**20 if peaks else None,
            "peer_comm": peer_comm(ranks, first, last),
            "loss_last": ranks[0]["losses"][last - 1] if len(ranks[0]["losses"]) >= last else None,
        }
    out["maxrss_lifetime_mb"] = max(r.get("maxrss_lifetime", 0) for r in ranks.values()) / 2**20
    out["peer_info"] = {k: v for k, v in ranks[0].items() if k in ("communication_data_type", "grad_accum_dtype")}
    return out


# ---------------------------------------------------------------- repeats -> one row


def mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def combine_rate(runs: list[dict], rate: str) -> dict:
    """One system at one rate over its successful repeats."""
    rs = [run["rates"][rate] for run in runs]
    medians = [statistics.median(r["step_times_s"]) for r in rs if r["step_times_s"]]
    pooled = [t for r in rs for t in r["step_times_s"]]
    wire_node = mean_or_none([sum(w) / NODES for r in rs if (w := r["wire_bytes_by_node"])])
    return {
        "step_s": statistics.median(pooled) if pooled else None,
        "repeat_step_s": medians,
        "spread": (max(medians) - min(medians)) / min(medians) if len(medians) > 1 else None,
        "step_times_s": [r["step_times_s"] for r in rs],
        "step_s_metrics_file": mean_or_none([r["step_s_metrics_file"] for r in rs]),
        "wire_bytes_per_node": wire_node,
        "wire_bytes_per_rank": wire_node / PER_NODE if wire_node is not None else None,
        "peak_rss_mb_max": max((r["peak_rss_mb_max"] for r in rs if r["peak_rss_mb_max"]), default=None),
        "loss_last": rs[0]["loss_last"],
        "peer_comm": rs[0].get("peer_comm"),  # the same calls in every round
        "loss_last_repeats": [r["loss_last"] for r in rs],
    }


def combine(runs: list[dict], rates: list[str]) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] != "ok"]
    if not ok:
        return {**failed[0], "repeats": runs}
    return {
        "status": "ok",
        "rates": {rate: combine_rate(ok, rate) for rate in rates},
        "ledger": ok[0]["ledger"],
        "peer_info": ok[0]["peer_info"],
        "failed_repeats": [r["reason"] for r in failed],
        "repeats": runs,
    }


# ---------------------------------------------------------------- ratios and targets


def step_s(results: dict, name: str, rate: str) -> float | None:
    res = results.get(name, {})
    return res["rates"][rate]["step_s"] if res.get("status") == "ok" else None


def best_peer(results: dict, rate: str) -> tuple[str | None, float | None]:
    """The fastest peer (FSDP2 or DeepSpeed, any variant that ran) at this rate: (name, step s)."""
    times = [(t, n) for n in BEST_PEER_POOL if (t := step_s(results, n, rate))]
    return (min(times)[1], min(times)[0]) if times else (None, None)


def speedup(ref_s: float | None, this_s: float | None) -> float | None:
    return ref_s / this_s if ref_s and this_s else None


def headline(results: dict, rate: str) -> dict:
    best, best_s = best_peer(results, rate)
    z3, zpp = step_s(results, "ours-z3", rate), step_s(results, "ours-zpp", rate)
    return {
        "best_peer": best,
        "zpp_vs_best": speedup(best_s, zpp),
        "z3_vs_best": speedup(best_s, z3),
        "zpp_vs_z3": speedup(z3, zpp),
    }


# (rate in bits/s, None: unshaped; what; headline key; the speedup it needs)
TARGETS = (
    (200e6, "200 Mbit/s: ours ZeRO++ >= 2.5x the best peer", "zpp_vs_best", 2.5),
    (1e9, "1 Gbit/s: ours ZeRO++ >= 1.5x the best peer", "zpp_vs_best", 1.5),
    (None, "unshaped: ours ZeRO++ step within 15% of ours ZeRO-3's", "zpp_vs_z3", 1 / 1.15),
    (None, "unshaped: ours ZeRO-3 no slower than the best peer", "z3_vs_best", 1.0),
)


def check_targets(heads: dict, rates: list[str], netns: bool) -> list[dict]:
    """Each target: MET / NOT MET / not measured, with the measured speedup."""
    out = []
    for bits, what, key, minimum in TARGETS:
        rate = next((r for r in rates if parse_rate(r) == bits), None)
        value = heads[rate][key] if rate else None
        if rate is None:
            verdict = "not measured (rate not run)"
        elif bits is not None and not netns:
            verdict, value = "not measured (link not shaped: no namespaces)", None
        elif value is None:
            verdict = "not measured (a system did not run)"
        else:
            verdict = "MET" if value >= minimum else "NOT MET"
        out.append({"target": what, "minimum": minimum, "measured": value, "verdict": verdict})
    return out


# ---------------------------------------------------------------- report


def fmt(v, spec: str, na: str = "n/a") -> str:
    return na if v is None else format(v, spec)


def mb(v) -> str:
    return fmt(v and v / 1e6, "7.1f", "      -")


def rate_title(rate: str, dtype: str, netns: bool) -> str:
    if not netns:
        return f"\n== {dtype}, {rate} (NOT shaped: loopback, no namespaces) =="
    return f"\n== {dtype}, {rate}{'' if parse_rate(rate) is None else ' (tbf on the cross-node veth)'} =="


def print_rate_table(results: dict, rate: str, names: list[str], columns: list) -> dict:
    """One dtype at one rate; the speedups of every row."""
    refs = " ".join(f"{lab:>7}" for _, lab in [("best", "best")] + columns)
    head = (
        f"{'system':37} {'step s':>6} {'spread':>6} | {'ledger x-node MB':>15} | {'wire x-node MB':>15} | "
        f"{'peak MB':>7} {'loss@end':>8} | {refs}"
    )
    print(head)
    print(
        f"{'':37} {'median':>6} {'rounds':>6} | {'rank':>7} {'node':>7} | {'rank':>7} {'node':>7} | "
        f"{'per rank':>16} | speedup vs"
    )
    print("-" * len(head))
    best, best_s = best_peer(results, rate)
    ratios = {}
    for name in names:
        res, label = results[name], SYSTEMS[name][0]
        if res["status"] != "ok":
            print(f"{label:37} {res['status']}: {res['reason']}")
            continue
        r, led = res["rates"][rate], res["ledger"] or {}
        row = {n: speedup(step_s(results, n, rate), r["step_s"]) for n, _ in columns}
        ratios[name] = row = {"best": speedup(best_s, r["step_s"]), **row}
        cells = " ".join(fmt(v, "7.2f") for v in row.values())
        spread = f"{100 * r['spread']:5.1f}%" if r["spread"] is not None else "n/a"
        print(
            f"{label:37} {fmt(r['step_s'], '6.2f')} {spread:>6} | {mb(led.get('inter_node_per_rank'))} "
            f"{mb(led.get('inter_node_per_node'))} | {mb(r['wire_bytes_per_rank'])} {mb(r['wire_bytes_per_node'])} | "
            f"{fmt(r['peak_rss_mb_max'], '7.0f')} {fmt(r['loss_last'], '8.4f')} | {cells}"
        )
    return ratios


def print_headline(h: dict) -> None:
    best = SYSTEMS[h["best_peer"]][0] if h["best_peer"] else "none ran"
    print(
        f"  best peer: {best}; speedups: ours ZeRO++ / best peer {fmt(h['zpp_vs_best'], '.2f')}x, ours ZeRO-3 / "
        f"best peer {fmt(h['z3_vs_best'], '.2f')}x, ours ZeRO++ / ours ZeRO-3 {fmt(h['zpp_vs_z3'], '.2f')}x"
    )


def print_dtype(results: dict, dtype: str, a, netns: bool) -> tuple[dict, dict]:
    """Every rate's table of one dtype: (speedups, headline ratios) by rate."""
    columns = [(n, lab) for n, lab in COLUMNS if n in a.names]
    ratios, heads = {}, {}
    for rate in a.rates:
        print(rate_title(rate, dtype, netns))
        ratios[rate] = print_rate_table(results, rate, a.names, columns)
        heads[rate] = headline(results, rate)
        print_headline(heads[rate])
    return ratios, heads


def print_targets(targets: list[dict]) -> None:
    print("\nTargets (bf16 table; reported, nothing is tuned to them):")
    for t in targets:
        need = f"need >= {t['minimum']:.2f}x"
        print(f"  {t['target']:56} measured {fmt(t['measured'], '.2f')}x ({need}): {t['verdict']}")


def print_ledger_check(results_by_dtype: dict, rates: list[str]) -> None:
    """Ours: the ledger's cross-node bytes, what they put on the veth, and what the veth carried."""
    lines = []
    for dtype, results in results_by_dtype.items():
        for name, res in results.items():
            led = res.get("ledger") or {}
            if res["status"] != "ok" or not led.get("on_wire_per_node"):
                continue
            for rate in rates:
                wire, expect = res["rates"][rate]["wire_bytes_per_node"], led["on_wire_per_node"]
                if not wire:
                    continue
                lines.append(
                    f"  {dtype} {rate:8} {SYSTEMS[name][0]:26} ledger {mb(led['inter_node_per_rank'])} MB/rank "
                    f"{mb(led['inter_node_per_node'])} MB/node, on the wire {mb(expect)} MB/node; measured "
                    f"{mb(wire)} MB/node (x {wire / expect:.3f})"
                )
    if lines:
        print(
            "\nours, ledger vs wire: the ledger counts all a rank sends in a node-spanning collective; the veth "
            "carries only the hops between the nodes: a 4-rank ring (gloo's all-gather, all-reduce) crosses once "
            "per node, a pairwise all-to-all (and comm.py's SUM reduce-scatter on gloo) sends 2 of its 3 parts "
            "across; measured / that = IP/TCP headers and ACKs (~1.03-1.05) if the ledger is right:"
        )
        print("\n".join(lines))


PEER_WIRE_TOLERANCE = 0.05  # measured / traced real-fabric volume beyond 1 +- this: the peers' figure is off


def print_peer_wire_check(results_by_dtype: dict, rates: list[str], params: int) -> list[str]:
    """The peers: their traced collectives (bench/zero_peers/common.py), the cross-node bytes those put on the
    veth, at the real-fabric reduce-scatter volume and as run, and what the veth carried; the lines whose
    measured bytes are off the real-fabric volume by more than PEER_WIRE_TOLERANCE (for warnings_of)."""
    lines, off = [], []
    for dtype, results in results_by_dtype.items():
        for name, res in results.items():
            if res["status"] != "ok" or SYSTEMS[name][1] not in ("fsdp2", "ds"):
                continue
            for rate in rates:
                r = res["rates"][rate]
                comm, wire = r.get("peer_comm"), r["wire_bytes_per_node"]
                if not comm or not wire:
                    continue
                calls = ", ".join(
                    f"{n} {e['calls']:.0f}x {mb(e['payload']).strip()} MB ({e['payload'] / params:.2f} B/param)"
                    for n, e in sorted(comm["by_entry"].items(), key=lambda kv: -kv[1]["payload"])
                    if e["payload"] >= 1e5
                )
                real, as_run = comm["x_node_real_per_node"], comm["x_node_per_node"]
                ratio = wire / real if real else float("nan")
                native = comm["native_rs"]
                lines.append(
                    f"  {dtype} {rate:8} {SYSTEMS[name][0]:36} per rank and step: {calls}\n"
                    f"  {'':50} x-node per node: real-fabric reduce-scatter {mb(real)} MB"
                    + (f", as run (gloo's own: an all-reduce) {mb(as_run)} MB" if native else "")
                    + f"; measured {mb(wire)} MB (x {ratio:.3f} of real-fabric"
                    + (f", x {wire / as_run:.3f} of as run)" if native and as_run else ")")
                )
                if not native and abs(ratio - 1) > PEER_WIRE_TOLERANCE:
                    off.append(
                        f"{dtype} {rate} {SYSTEMS[name][0]}: measured {mb(wire).strip()} MB/node, x {ratio:.3f} of the "
                        f"real-fabric {mb(real).strip()} MB/node (tolerance {100 * PEER_WIRE_TOLERANCE:.0f}%)"
                    )
    if lines:
        print(
            "\npeers, traced collectives vs wire (every torch.distributed collective a peer calls, counted in its "
            "ranks; a ring all-gather / all-reduce crosses once per node, the real-fabric reduce-scatter is an "
            "all-to-all of (n-1)/n of its input per rank, 2 of its 3 parts across; measured / real-fabric = IP/TCP "
            "headers and ACKs if the peers move the real-fabric volume):"
        )
        print("\n".join(lines))
    return off


def warnings_of(results_by_dtype: dict) -> list[str]:
    """Per dtype and system: failed rounds, rounds whose medians disagree, timed steps far apart."""
    out = []
    for dtype, results in results_by_dtype.items():
        for name, res in results.items():
            if res["status"] != "ok":
                continue
            label = f"{dtype} {SYSTEMS[name][0]}"
            out += [f"{label}: a round failed ({reason}); figures from the others" for reason in res["failed_repeats"]]
            apart, noisy = [], []
            for rate, v in res["rates"].items():
                steps = [t for ts in v["step_times_s"] for t in ts]
                if v["spread"] is not None and v["spread"] > SPREAD_WARN:
                    apart.append(f"{rate} {100 * v['spread']:.0f}%")
                if steps and max(steps) > 1.25 * min(steps):
                    noisy.append(f"{rate} {min(steps):.2f}..{max(steps):.2f} s")
            if apart:
                out.append(f"{label}: the rounds' medians differ by > {100 * SPREAD_WARN:.0f}%: {', '.join(apart)}")
            if noisy:
                out.append(f"{label}: timed steps more than 25% apart: {', '.join(noisy)}")
    return out


def print_notes(results_by_dtype: dict, names: list[str], native_rs: bool) -> None:
    if any(SYSTEMS[n][1] in ("fsdp2", "ds") for n in names):
        print(
            "\nOn gloo, torch's reduce-scatter runs as an all-reduce: twice the bytes of the ring reduce-scatter NCCL "
            "would send. Ours sends a SUM reduce-scatter as an all-to-all + local sum (megatron_zpp/comm.py), and "
            + (
                "the peers' (FSDP2's, DeepSpeed's) here ran gloo's own (--gloo-native-reduce-scatter): their "
                "gradient bytes are 2x the real-fabric ones, a handicap of gloo's, not of their algorithms."
                if native_rs
                else "so do the peers' (FSDP2's, DeepSpeed's: bench/zero_peers/common.py): every system's "
                "reduce-scatter moves the real-fabric volume."
            )
        )
    if any(SYSTEMS[n][1] == "ds" for n in names):
        info = {
            d: next((r["peer_info"] for r in res.values() if r.get("peer_info")), None)
            for d, res in results_by_dtype.items()
        }
        print(
            "DeepSpeed ZeRO-3 uses its defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9): "
            "a model this small stays gathered from forward to backward (no backward all-gather, more memory); "
            "'regather' sets both to 0, the paper's ZeRO-3 (3M per step), which hpZ needs to act. Its gradient "
            f"reduce-scatter and accumulation dtypes, as run: {({d: i for d, i in info.items() if i}) or 'n/a'}"
        )


# ---------------------------------------------------------------- main


def parse_cli() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="See the module docstring for details.")
    ap.add_argument("--rates", nargs="+", default=None, help="'unshaped' or like 1gbit / 200mbit (default: those 3)")
    ap.add_argument("--dtype", choices=["bf16", "fp32", "both"], default=None, help="default both (--quick: bf16)")
    ap.add_argument("--systems", nargs="+", default=None, choices=list(SYSTEMS), help="default: the headline six")
    ap.add_argument("--components", action="store_true", help="add ours qwZ/hpZ/qgZ alone and DeepSpeed's others")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 1gbit, bf16, 4 systems (< 3 min)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds over all systems per dtype (2; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per rate (default 8; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before the first rate (default 3; quick 1)")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--hidden-size", type=int, default=None)
    ap.add_argument("--num-attention-heads", type=int, default=None)
    ap.add_argument("--seq-length", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--run-timeout", type=float, default=None, help="seconds per launch (default 3x its estimate)")
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=2**20,
        help="MALLOC_MMAP_THRESHOLD_ of every rank, so that glibc returns freed buffers above it at once "
        "and peak RSS counts live memory (0: glibc's default, which keeps freed gather buffers)",
    )
    ap.add_argument(
        "--gloo-native-reduce-scatter",
        action="store_true",
        help="the peers use gloo's own reduce-scatter (an all-reduce: 2x the real-fabric gradient bytes), "
        "not the all-to-all + local sum every system uses by default (for comparison only)",
    )
    ap.add_argument("--no-netns", action="store_true", help="run on loopback without namespaces or shaping")
    ap.add_argument("--no-path-check", action="store_true", help="skip the socket check of the two paths")
    ap.add_argument("--work-dir", default=None, help="keep logs, metrics and probes here (default: a temp dir)")
    a = ap.parse_args()
    q = a.quick
    a.rates = a.rates or (["1gbit"] if q else ["unshaped", "1gbit", "200mbit"])
    a.dtypes = {"both": ["bf16", "fp32"], None: ["bf16"] if q else ["bf16", "fp32"]}.get(a.dtype, [a.dtype])
    a.steps = max(1, a.steps if a.steps is not None else (2 if q else 8))
    a.warmup = max(1, a.warmup if a.warmup is not None else (1 if q else 3))
    a.repeats = max(1, a.repeats if a.repeats is not None else (1 if q else 2))
    # seq 32 (it was 256): this CPU has no native bf16 (a bf16 step of the 26M model at seq 256 took ~50 s,
    # the default run 4+ hours); 6 layers (was 8) keep the default run near an hour
    a.num_layers = a.num_layers or (2 if q else 6)
    a.hidden_size = a.hidden_size or (128 if q else 512)
    a.num_attention_heads = a.num_attention_heads or (4 if q else 8)
    a.seq_length = a.seq_length or (64 if q else 32)
    a.names = a.systems or (QUICK if q else HEADLINE) + (COMPONENTS if a.components else [])
    for r in a.rates:
        parse_rate(r)
    return a


def model_config(a):
    """(our ModelConfig of the bench's model, its padded vocabulary)."""
    from megatron_zpp.config import ModelConfig
    from megatron_zpp.data.tokenizer import pad_vocab_size

    mcfg = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        seq_length=a.seq_length,
        vocab_size=a.vocab_size,
        normalization="RMSNorm",  # the peers' block (bench/single_rank.py's PeerGPT)
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
    )
    return mcfg, pad_vocab_size(a.vocab_size, mcfg.make_vocab_size_divisible_by, 1)


def count_params(a) -> int:
    from megatron_zpp.model import GPT, count_parameters

    return count_parameters(GPT(*model_config(a)))


def round_order(names: list[str], rep: int) -> list[str]:
    """Every other round runs the systems in reverse, so that a drift of the machine hits all alike."""
    return names if rep % 2 == 0 else names[::-1]


def summary(res: dict) -> str:
    if res["status"] != "ok":
        return f" ({res['reason']})"
    times = {r: statistics.median(v["step_times_s"]) for r, v in res["rates"].items() if v["step_times_s"]}
    return f" in {res['wall_s']:.0f} s: " + ", ".join(f"{r} {t:.2f} s/step" for r, t in times.items())


def run_all(cluster: Cluster, a, work: str, ds_reason: str | None, params: int, compute: dict) -> dict:
    """{dtype: {system: its rounds combined}}: per dtype, --repeats rounds over the systems."""
    runs = {d: {n: [] for n in a.names} for d in a.dtypes}
    for dtype in a.dtypes:
        for rep in range(a.repeats):
            for name in round_order(a.names, rep):
                label, kind, opts = SYSTEMS[name]
                if kind == "skip":
                    runs[dtype][name].append({"status": "not run", "reason": opts})
                    continue
                timeout = a.run_timeout or max(180.0, 3 * launch_estimate_s(name, dtype, a, params, compute))
                log(f"{dtype} round {rep + 1}/{a.repeats} {label}: {a.warmup} warmup + {len(a.rates)} x {a.steps}")
                out_dir = os.path.join(work, f"{dtype}-r{rep}", name)
                res = launch(cluster, name, a, dtype, out_dir, ds_reason, timeout)
                runs[dtype][name].append(res)
                log(f"{label}: {res['status']}{summary(res)}")
    return {d: {n: combine(rs, a.rates) for n, rs in by_name.items()} for d, by_name in runs.items()}


def print_header(a, cluster: Cluster, params: int, paths: dict, estimate: float, compute: dict) -> None:
    if cluster.netns:
        print(
            f"\nZeRO on an emulated 2-node cluster: {WORLD} ranks = 2 network namespaces x {PER_NODE}, veth + tc "
            f"tbf between the nodes, loopback inside each"
        )
    else:
        print(
            f"\nZeRO on ONE loopback host ({cluster.reason}): {WORLD} ranks, nothing shaped; ours still lays "
            f"out {PER_NODE} ranks per node for its ledger"
        )
    bf16 = " (bf16: fp32 masters; gradients reduced in fp32 by ours and FSDP2, in bf16 by DeepSpeed's defaults)"
    print(
        f"model: Llama-style GPT {params / 1e6:.2f}M params (hidden {a.hidden_size}, {a.num_layers} layers, "
        f"{a.num_attention_heads} heads, seq {a.seq_length}, vocab {a.vocab_size}), micro-batch "
        f"{a.micro_batch_size} x {WORLD} ranks = global batch {a.micro_batch_size * WORLD}; same weights and tokens "
        f"for every system; dtypes: {' then '.join(a.dtypes)}{bf16 if 'bf16' in a.dtypes else ''}"
    )
    print(
        f"per dtype {a.repeats} round(s) over the systems (every other one reversed), each launch {a.warmup} warmup "
        f"step(s) then {a.steps} timed steps per rate; step s = median of all rounds' timed steps, spread = "
        f"(max - min) / min of the rounds' medians; 4 ranks share {os.cpu_count()} CPU cores at 1 thread each: "
        f"absolute times are this machine's, the ratios are the figure; expected duration ~{estimate / 60:.0f} min"
    )
    print(
        "one forward + backward of one micro-batch on one thread (the compute of a rank's step; 4 ranks share the "
        f"cores): {', '.join(f'{d} {t:.2f} s' for d, t in compute.items())}"
        + (
            f" (bf16 {compute['bf16'] / compute['fp32']:.0f}x slower than fp32: no native bf16 on this CPU, so the "
            "bf16 steps carry far more compute per byte sent than on a GPU)"
            if len(compute) == 2 and compute["bf16"] > 2 * compute["fp32"]
            else ""
        )
    )
    print(
        "x-node MB per step: ledger = our comm ledger (all a rank sends in a node-spanning collective), per rank "
        "(mean) and per node (sum of its 2 ranks); wire = veth tx bytes per node (headers included) and per rank "
        "(node / 2); peak MB = max over ranks and rounds of the peak RSS in the timed steps; speedup = reference "
        "step time / this step time; best = the fastest of FSDP2 and DeepSpeed (every variant run)"
    )
    if paths:
        print(
            f"path check: cross-node {paths['cross_node']['mbit_per_s']:.0f} Mbit/s, intra-node "
            f"{paths['intra_node']['mbit_per_s']:.0f} Mbit/s with {paths['intra_node']['veth_tx_mb']:.2f} MB on "
            f"the veth (intra-node traffic stays off the shaped link)"
        )


def main() -> int:
    a = parse_cli()
    work = a.work_dir or tempfile.mkdtemp(prefix="zpp_zero_bench_")
    os.makedirs(work, exist_ok=True)
    t0, load0 = time.time(), os.getloadavg()[0]
    lock_fd = take_lock()
    ds_reason = None
    if any(SYSTEMS[n][1] == "ds" for n in a.names):
        ds_reason = ensure_ds_venv()
        if ds_reason:
            log(f"DeepSpeed unavailable: {ds_reason}")
    params = count_params(a)
    compute = {d: compute_s(a, d) for d in a.dtypes}
    estimate = duration_estimate_s(a, params, compute)
    log(
        f"expected duration ~{estimate / 60:.0f} min: {len(a.dtypes)} dtype(s) x {a.repeats} round(s) x "
        f"{len(a.names)} systems, {a.warmup} + {len(a.rates)} x {a.steps} steps each; one forward + backward "
        f"on one thread: {', '.join(f'{d} {t:.2f} s' for d, t in compute.items())}"
    )

    cluster = Cluster(not a.no_netns, lock_fd)
    paths, qdisc = {}, None
    try:
        if cluster.netns and not a.no_path_check:
            paths = cluster.check_paths(parse_rate(a.rates[0]) or 1e9)
            log(f"path check ({a.rates[0] if parse_rate(a.rates[0]) else '1gbit'} shaping): {paths}")
        results = run_all(cluster, a, work, ds_reason, params, compute)
        qdisc = cluster.qdisc()
    finally:
        cluster.cleanup()

    print_header(a, cluster, params, paths, estimate, compute)
    ratios, heads = {}, {}
    for dtype in a.dtypes:
        ratios[dtype], heads[dtype] = print_dtype(results[dtype], dtype, a, cluster.netns)
    targets = check_targets(heads["bf16"], a.rates, cluster.netns) if "bf16" in heads else []
    if targets:
        print_targets(targets)
    else:
        print("\nTargets: checked on the bf16 table, which this run did not make (--dtype fp32)")
    print_ledger_check(results, a.rates)
    peer_off = print_peer_wire_check(results, a.rates, params)
    print_notes(results, a.names, a.gloo_native_reduce_scatter)
    warnings = warnings_of(results)
    if warnings:
        print(f"\nWARNING: the machine was not quiet ({os.cpu_count()} cores shared with other processes?):")
        print("\n".join(f"  {ln}" for ln in warnings))
    if peer_off:
        print("\nWARNING: a peer's measured wire bytes are off its real-fabric volume (see above):")
        print("\n".join(f"  {ln}" for ln in peer_off))
    elapsed = time.time() - t0
    print(
        f"\nlogs: {work}; elapsed {elapsed / 60:.1f} min (expected ~{estimate / 60:.0f}); load average "
        f"{load0:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(
        json.dumps(
            {
                "bench": "zero",
                "netns": cluster.netns,
                "no_netns_reason": cluster.reason or None,
                "qdisc_last": qdisc if cluster.netns else None,
                "path_check": paths,
                "rates": a.rates,
                "dtypes": a.dtypes,
                "params": params,
                "config": {k: v for k, v in vars(a).items() if k not in ("systems", "names")},
                "systems": {d: {n: {"label": SYSTEMS[n][0], **results[d][n]} for n in a.names} for d in a.dtypes},
                "speedup": ratios,
                "headline": heads,
                "targets": targets,
                "warnings": warnings,
                "peer_wire_off": peer_off,
                "cpus": os.cpu_count(),
                "torch_threads_per_rank": 1,
                "expected_s": round(estimate, 1),
                "elapsed_s": round(elapsed, 1),
                "work_dir": work,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
