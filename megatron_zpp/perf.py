"""Throughput accounting: model FLOPs per token, the peak they are measured against,
and memory in use.

FLOPs are model FLOPs (no recomputation), forward + backward = 3 x forward: every matmul
weight (output layer included, embedding lookup excluded) costs 2 FLOPs per token
forward; causal softmax attention 2*T*width per token (QK^T and AV, half of the full
square); GLA in the chunked form ~2*width*(C + 2*head_dim) per token (C = chunk); Gated DeltaNet's
WY form ~2*width*(2C + 3*head_dim) (k k^T, the W and U products, q k^T and the output's intra-chunk
product: C each per key or value width; the state's three d x d products) and its projections q|k|v|gate
plus a and b per head."""

from __future__ import annotations

import resource
import time

import torch

from .config import ModelConfig

# Dense peaks (TFLOP/s, no sparsity) from the vendors' data sheets, by the dtype the matmuls run in:
# bf16/fp16 on the tensor cores, tf32 on the tensor cores (fp32 with TF32 matmuls allowed), fp32 on
# the CUDA cores (torch's default for fp32 matmuls). SXM parts; a PCIe/NVL part is lower: pass --peak-tflops.
KNOWN_PEAKS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # no bf16 tensor cores, no TF32
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    h, width, seq = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.seq_length
    kv = cfg.kv_heads * cfg.head_dim
    mlp = (3 if cfg.activation == "swiglu" else 2) * h * cfg.ffn_size
    forward = 2 * vocab_size * h  # output layer
    for layer in range(cfg.num_layers):
        if cfg.layer_kind(layer) == "softmax":
            forward += 2 * (h * (width + 2 * kv) + width * h) + 2 * seq * width
        elif cfg.layer_kind(layer) == "gdn":
            heads = cfg.num_attention_heads
            forward += 2 * (h * (4 * width + 2 * heads) + width * h) + 2 * width * (
                2 * cfg.linear_chunk_size + 3 * cfg.head_dim
            )
        else:
            forward += 2 * (5 * h * width + width * h) + 2 * width * (cfg.linear_chunk_size + 2 * cfg.head_dim)
        forward += 2 * mlp
    return 3.0 * forward


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> tuple[float, str]:
    """(peak TFLOP/s per rank in the dtype the matmuls run in, what it is, e.g. "989.4 bf16 TFLOP/s
    (dense peak of NVIDIA H200)"); 0.0 when unknown."""
    kind = _matmul_kind(device, dtype)
    if override:
        return override, f"{override:g} {kind} TFLOP/s (--peak-tflops)"
    if device.type == "cuda":
        name = torch.get_device_module(device).get_device_name(device)
        for key, peaks in KNOWN_PEAKS.items():
            if key in name and kind in peaks:
                return peaks[kind], f"{peaks[kind]:g} {kind} TFLOP/s (dense peak of {name})"
        return 0.0, f"no known {kind} peak for {name}: pass --peak-tflops"
    peak = measured_matmul_tflops(device, dtype)
    return peak, f"{peak:.4g} {kind} TFLOP/s (measured {kind} matmul peak of this rank's CPU threads)"


def _matmul_kind(device: torch.device, dtype: torch.dtype) -> str:
    kind = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    if kind == "fp32" and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return kind


def measured_matmul_tflops(
    device: torch.device, dtype: torch.dtype, sizes=(128, 256, 512, 1024), seconds: float = 0.4
) -> float:
    """Best rate of square matmuls in `dtype` over short rounds at each of `sizes` (a CPU's fastest
    size depends on the dtype: fp16 is fastest small here, bf16 large), for about `seconds` in all: a
    peak, so the best round counts, not the mean (other processes may share the cores). A size
    whose one round would overrun what is left of the time is skipped."""
    best, deadline = 0.0, time.perf_counter() + seconds
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        start = time.perf_counter()
        a @ b  # warm up, and how long one takes
        if best and time.perf_counter() + 3 * (time.perf_counter() - start) > deadline:
            break
        for _ in range(3):  # at least a few rounds per size
            start = time.perf_counter()
            for _ in range(2):
                a @ b
            if device.type != "cpu":
                torch.get_device_module(device).synchronize(device)
            best = max(best, 2 * 2 * n**3 / (time.perf_counter() - start) / 1e12)
            if time.perf_counter() > deadline:
                break
    return best


def memory_gib(device: torch.device) -> float:
    if device.type != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB on Linux)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Megatron's tensorboard memory statistics (bytes, and the count of live allocations) of an
    accelerator; on CPU the peak RSS, the only figure there is."""
    if device.type == "cpu":
        return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0}
    s = torch.get_device_module(device).memory_stats(device)
    keys = {
        "mem-reserved-bytes": "reserved_bytes.all.current",
        "mem-allocated-bytes": "allocated_bytes.all.current",
        "mem-max-allocated-bytes": "allocated_bytes.all.peak",
        "mem-allocated-count": "allocation.all.current",
    }
    return {name: float(s.get(key, 0)) for name, key in keys.items()}


def memory_report(device: torch.device, device_used: bool = False) -> str:
    """Megatron's memory line (MB): allocated, max allocated, reserved, max reserved, and with
    `device_used` (--log-device-memory-used) the device's memory in use as nvidia-smi sees it; on CPU
    the peak RSS."""
    mb = 2.0**20
    if device.type == "cpu":
        return f"max RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0 / mb:.2f}"
    m = torch.get_device_module(device)
    text = (
        f"allocated: {m.memory_allocated(device) / mb:.2f} | "
        f"max allocated: {m.max_memory_allocated(device) / mb:.2f} | "
        f"reserved: {m.memory_reserved(device) / mb:.2f} | max reserved: {m.max_memory_reserved(device) / mb:.2f}"
    )
    if device_used:
        text += f" | total device memory used: {m.device_memory_used(device) / mb:.2f}"
    return text
