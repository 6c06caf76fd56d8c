"""Throughput accounting: model FLOPs per token, the peak they are measured against,
and memory in use.

FLOPs are model FLOPs (no recomputation), forward + backward = 3 x forward: every matmul
weight (output layer included, embedding lookup excluded) costs 2 FLOPs per token
forward; causal softmax attention 2*T*width per token (QK^T and AV, half of the full
square); GLA in the chunked form ~2*width*(C + 2*head_dim) per token (C = chunk)."""

from __future__ import annotations

import resource
import time

import torch

from .config import ModelConfig

# Dense bf16 tensor-core peaks (TFLOP/s), from the vendors' data sheets (no sparsity).
KNOWN_PEAKS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    h, width, seq = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.seq_length
    kv = cfg.kv_heads * cfg.head_dim
    mlp = (3 if cfg.activation == "swiglu" else 2) * h * cfg.ffn_size
    forward = 2 * vocab_size * h  # output layer
    for layer in range(cfg.num_layers):
        if cfg.layer_kind(layer) == "softmax":
            forward += 2 * (h * (width + 2 * kv) + width * h) + 2 * seq * width
        else:
            forward += 2 * (5 * h * width + width * h) + 2 * width * (cfg.gla_chunk_size + 2 * cfg.head_dim)
        forward += 2 * mlp
    return 3.0 * forward


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> tuple[float, str]:
    """(peak TFLOP/s per rank, what it is)."""
    if override:
        return override, f"{override} TFLOP/s (--peak-tflops)"
    if device.type == "cuda":
        name = torch.get_device_module(device).get_device_name(device)
        for key, value in KNOWN_PEAKS.items():
            if key in name:
                return value, f"{value} TFLOP/s dense bf16 peak of {name}"
        return 0.0, f"unknown peak for {name}: pass --peak-tflops"
    return measured_matmul_tflops(device, dtype), "measured CPU matmul peak of this rank's threads"


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """Best rate of square matmuls over short rounds for about `seconds`: a peak, so the
    best round counts, not the mean (other processes may share the cores)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(2):
            a @ b
        if device.type != "cpu":
            torch.get_device_module(device).synchronize(device)
        best = max(best, 2 * 2 * n**3 / (time.perf_counter() - start) / 1e12)
    return best


def memory_gib(device: torch.device) -> float:
    if device.type != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB on Linux)
