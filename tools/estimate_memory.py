"""Estimate the memory of one rank before launching: the same flags as pretrain_gpt.py, plus

    --world-size N        ranks of the launch (default: $WORLD_SIZE or 1)
    --gpu-memory-gb G     device memory per GPU in GiB: also print the largest --micro-batch-size that fits
    --moe-imbalance F     mixture of experts: the busiest rank's routed tokens over an even share (default 1.0,
                          a perfectly balanced router; dropless routing is data-dependent: 1.2-2 early in
                          training is common). Capped by --moe-expert-capacity-factor; ignored when
                          --moe-pad-expert-input-to-capacity fixes every expert's rows

    python tools/estimate_memory.py --world-size 8 --gpu-memory-gb 80 --mock-data --num-layers 24 \\
        --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 2 \\
        --global-batch-size 256 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --bf16

Prints, for the worst pipeline stage (named), the bytes of each term (megatron_zpp/planning/memory.py
says how each is counted), the peak, and the other stages' peaks; then the start-up peak (what
the rank holds when set-up ends, plus the one full parameter the init draws at a time). Nothing is allocated: the
model is built on the meta device.
The flags are checked as pretrain_gpt.py checks them, less what only a run reads or writes (the
data, the tokenizer's files, the checkpoint directories): every examples/configs/*.yaml is accepted
as it is (--config examples/configs/gpt1.3b_zeropp.yaml).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_config
from megatron_zpp.planning import memory

ASSUMPTIONS = (
    "assumptions: live tensor bytes only (what the CPU validation measures, bench/memory.py). Not modelled on GPU: "
    "the CUDA context (~0.5-1 GiB), NCCL communicator buffers, cuBLAS/flash workspaces, and the caching "
    "allocator's fragmentation and reserved-but-unused blocks (commonly 5-20% above the live bytes). Softmax "
    "attention is SDPA's fused kernel, as on GPU (with attention dropout on CPU, SDPA's math path would keep "
    "[b, heads, s, s] besides). Activations are those of the PyTorch reference ops "
    "(--kernels torch, and auto on CPU): with the Triton kernels or apex on GPU the norms, SwiGLU, RoPE and the GLA "
    "operator keep less (e.g. a norm keeps its input and row statistics, not fp32 copies), so the estimate is an "
    "upper bound there. The fit below keeps 10% of the device free for what is not modelled."
)


def tool_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    ap.add_argument("--gpu-memory-gb", type=float, default=None)
    ap.add_argument("--moe-imbalance", type=float, default=1.0)
    return ap.parse_known_args(argv)


def fmt(n: int) -> str:
    return f"{n:>16,d}  {n / memory.GiB:>9.3f}"


def report(cfg, gpu_gb: float | None, moe_imbalance: float = 1.0) -> str:
    ranks = memory.estimate(cfg, moe_imbalance=moe_imbalance)
    worst = max(ranks, key=lambda r: r.peak)
    p = cfg.parallel
    lines = [
        f"layout: world {p.world_size} = TP {p.tensor_model_parallel_size} x CP {p.context_parallel_size} x "
        f"DP {p.data_parallel_size} x PP {p.pipeline_model_parallel_size}, ZeRO-{cfg.zero.zero_stage}, "
        f"micro-batch {cfg.train.micro_batch_size}, {cfg.num_micro_batches} micro-batches per step, "
        f"recompute {cfg.model.recompute_granularity or 'none'}"
        + (f" ({cfg.model.recompute_method}, {cfg.model.recompute_num_layers})" if cfg.model.recompute_method else "")
        + _experts_line(cfg, moe_imbalance),
        f"worst pipeline stage: {worst.stage} of {len(ranks)}",
        f"{'term':<52} {'bytes':>16}  {'GiB':>9}",
    ]
    for name, n in worst.terms.items():
        note = worst.notes.get(name, "")
        lines.append(f"{name:<52} {fmt(n)}" + (f"   {note}" if note else ""))
    for name, n in worst.transient.items():
        if n:
            lines.append(f"{'(transient) ' + name:<52} {fmt(n)}")
    lines.append(f"{'peak':<52} {fmt(worst.peak)}")
    boot = max(ranks, key=lambda r: sum(r.startup.values()) + r.startup_transient)
    lines.append(f"start-up (model built on the meta device; each rank fills what it holds), stage {boot.stage}:")
    for name, n in boot.startup.items():
        lines.append(f"{'  ' + name:<52} {fmt(n)}")
    held = sum(boot.startup.values())
    lines.append(f"{'  start-up peak on the device (GPU)':<52} {fmt(held)}")
    lines.append(
        f"{'  + one full parameter drawn by the init (fp32)':<52} {fmt(boot.startup_transient)}"
        "   host memory on GPU; on a CPU run it adds to the peak"
    )
    lines.append(f"{'  start-up peak on a CPU run':<52} {fmt(held + boot.startup_transient)}")
    lines.append(
        f"{'  (this rank: its whole (TP, PP) slice in fp32)':<52} {fmt(boot.slice_fp32)}"
        "   what building the slice before sharding it held"
    )
    if len(ranks) > 1:
        lines.append("per stage peak: " + ", ".join(f"{r.stage}: {r.peak / memory.GiB:.3f} GiB" for r in ranks))
    lines.append(
        "activations per micro-batch and layer, by kind and recompute mode (GiB): "
        + "; ".join(
            f"{k}: {v / memory.GiB:.4f}" for k, v in memory.layer_table(cfg, moe_imbalance=moe_imbalance).items()
        )
    )
    if gpu_gb is not None:
        budget = 0.9 * gpu_gb * memory.GiB
        best = memory.largest_micro_batch(cfg, budget, moe_imbalance=moe_imbalance)
        lines.append(
            f"largest --micro-batch-size that fits {gpu_gb:g} GiB (90% of it): {best}"
            if best
            else f"no micro-batch fits {gpu_gb:g} GiB (90% of it): shard more (ZeRO, TP, PP) or recompute"
        )
    lines.append(ASSUMPTIONS)
    return "\n".join(lines)


def _experts_line(cfg, imbalance: float) -> str:
    m, p = cfg.model, cfg.parallel
    if not m.num_experts:
        return ""
    etp = p.expert_tp_size
    return (
        f"\nexperts: {m.num_experts} per MoE layer, top-{m.moe_router_topk}, EP {p.expert_model_parallel_size} x "
        f"expert TP {etp} ({m.num_experts // p.expert_model_parallel_size} per rank), "
        f"{m.moe_token_dispatcher_type} dispatcher; routed rows: an even share x {imbalance:g} (--moe-imbalance)"
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # this tool's own flags, then pretrain_gpt.py's
        print(__doc__)
    ours, rest = tool_args(argv)
    if not ours.moe_imbalance >= 1.0:  # this tool's own argument first (nan too)
        print(
            f"error: --moe-imbalance {ours.moe_imbalance}: give a factor >= 1 (the busiest rank's share)",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = parse_config(rest, ours.world_size, run=False)
    except ConfigError as e:
        print("error: " + str(e).replace("\n", "\nerror: "), file=sys.stderr)
        return 2
    print(report(cfg, ours.gpu_memory_gb, ours.moe_imbalance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
