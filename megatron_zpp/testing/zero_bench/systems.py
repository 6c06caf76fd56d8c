"""bench/zero.py's systems and its model: which systems there are (ours, FSDP2, DeepSpeed), the
flags of each, the model every one of them trains (megatron_zpp.testing.peers.model.LLAMA_FLAGS),
whether DeepSpeed is there, and the rough duration estimate printed at start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from megatron_zpp.testing.cluster import parse_rate
from megatron_zpp.testing.peers import RUNNERS
from megatron_zpp.testing.peers.model import LLAMA_FLAGS, peer_shape_mismatch
from megatron_zpp.testing.verdict import INSTALL_FIX

NODES = 2  # the emulated cluster's namespaces; --ranks of them split evenly
DS_VERSION = "0.19.8"


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


# ---------------------------------------------------------------- DeepSpeed


def deepspeed_refusal() -> str | None:
    """None if this venv has DeepSpeed DS_VERSION and its CPU shm comm op builds; else one line why not."""
    from importlib import metadata

    try:
        version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return f"deepspeed is not installed in this venv ({sys.executable}); {INSTALL_FIX} (the [bench] extra)"
    if version != DS_VERSION:
        return f"deepspeed {version} is installed, the bench's peers are written against {DS_VERSION}; {INSTALL_FIX}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    try:
        res = subprocess.run([sys.executable, "-c", BUILD_SHM_OP], capture_output=True, text=True, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return "building DeepSpeed's CPU shm comm op timed out (15 min)"
    if res.returncode:
        return f"building DeepSpeed's CPU shm comm op failed: {last_error(res.stdout + res.stderr)}"
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


def last_error(text: str, exit_codes: list | None = None) -> str:
    """The line of a log that says what went wrong (an `error:` line, else the last exception)."""
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


def step_estimate_s(name: str, dtype: str, rate: str, params: int, compute: dict, world: int) -> float:
    shared = compute[dtype] * max(1.0, world / (os.cpu_count() or 1))  # the ranks share the cores
    wire = WIRE_BYTES_PER_PARAM[name][dtype == "bf16"] * params
    return COMPUTE_OVERHEAD * shared + wire * 8 / (parse_rate(rate) or UNSHAPED_BITS)


def launch_estimate_s(name: str, dtype: str, a, params: int, compute: dict) -> float:
    kind = SYSTEMS[name][1]
    if kind == "skip":
        return 0.0
    steps = {r: a.steps + (a.warmup if k == 0 else 0) for k, r in enumerate(a.rates)}
    return START_S[kind] + sum(n * step_estimate_s(name, dtype, r, params, compute, a.world) for r, n in steps.items())


def duration_estimate_s(a, params: int, compute: dict) -> float:
    return a.repeats * sum(launch_estimate_s(n, d, a, params, compute) for d in a.dtypes for n in a.names)


# ---------------------------------------------------------------- one system, every rate


def model_args(a, iters: int, dtype: str) -> list[str]:
    """pretrain_gpt.py's model, data and optimizer flags of the bench: every system trains this model."""
    return (
        f"--mock-data --{dtype} --num-layers {a.num_layers} --hidden-size {a.hidden_size} "
        f"--num-attention-heads {a.num_attention_heads} --seq-length {a.seq_length} --vocab-size "
        f"{a.vocab_size} --micro-batch-size {a.micro_batch_size} --global-batch-size "
        f"{a.micro_batch_size * a.world} --train-iters {iters} --seed {a.seed} --lr 3e-4 "
        f"--lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --ranks-per-node {a.per_node} "
        "--eval-iters 0"  # the peers do not evaluate; Megatron's default (100 batches at the end) is no step's work
    ).split() + LLAMA_FLAGS  # said explicitly: the peers' block, not Megatron's defaults


def model_config(a):
    """(our ModelConfig of the bench's model, as pretrain_gpt.py parses model_args; its padded vocabulary)."""
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.data.tokenizer import pad_vocab_size
    from megatron_zpp.validation import validate

    mcfg = validate(parse_args(model_args(a, 1, "fp32")), a.world).model
    return mcfg, pad_vocab_size(mcfg.vocab_size, mcfg.make_vocab_size_divisible_by, 1)


def count_params(a) -> int:
    from megatron_zpp.model import GPT, count_parameters

    return count_parameters(GPT(*model_config(a)))


def ours_refusal(args: list[str], world: int) -> str | None:
    """pretrain_gpt.py's own config check (no processes): its message if it refuses."""
    from megatron_zpp.config import ConfigError
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.validation import validate

    try:
        validate(parse_args(args), world)
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
        refused = ours_refusal(ours_args, a.world)
        if refused:
            return [], refused
        return [sys.executable, os.path.join(RUNNERS, "ours.py"), *runner_flags, "--", *ours_args], None
    refused = peer_shape_mismatch(model_config(a)[0])  # before 4 ranks fail on it
    if refused:
        return [], refused
    if kind == "fsdp2":
        return [sys.executable, os.path.join(RUNNERS, "fsdp2.py"), *runner_flags, *opts, "--", *margs], None
    if ds_reason:
        return [], ds_reason
    return [sys.executable, os.path.join(RUNNERS, "deepspeed_zero.py"), *runner_flags, *opts, "--", *margs], None
