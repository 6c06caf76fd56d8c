"""ZeRO++ (Wang et al., arXiv 2306.10209) beside our simulator's predictions.

    python examples/reproduce/zeropp_table.py

The paper's cluster: 24 DGX-2 nodes of 16 V100 SXM3 32 GB (384 GPUs), NVSwitch inside a
node, 1/4/8 InfiniBand links of 100 Gbit/s per node (presets v100-ib100/400/800,
megatron_zpp/planning/simulator/hardware.py); an 18B GPT-2 (DeepSpeed's ZeRO++ tutorial, deepspeed.ai/
tutorials/zeropp: 40 layers, hidden 6144) at 1K tokens per GPU (micro-batch 2 x 512).
ZeRO++ = qwZ (int8 weights, block 2048 here) + hpZ over the node (16) + qgZ (int4 gradients,
2 levels). The paper's numbers used (and where they come from):

* "up to 2.16x better throughput at 384 GPU scale", "reduces communication volume of ZeRO
  by 4x": the abstract (arXiv 2306.10209v1);
* 18B at 100 Gbit/s, 1K tokens per GPU: ZeRO-3 14 -> ZeRO++ 31 TFLOP/s per GPU (2.21x), and
  ZeRO++ at 100 Gbit/s matching ZeRO-3 at 400 Gbit/s ("the same throughput at a quarter of the
  bandwidth"): as quoted from the paper's throughput-vs-bandwidth evaluation and
  the DeepSpeed ZeRO++ blog; the figure number could not be retrieved here, so it is not cited.
"""

from __future__ import annotations

import sys

from megatron_zpp.testing.paper_tables import cross_node_bytes, run, table

MODEL = (
    "--mock-data --num-layers 40 --hidden-size 6144 --num-attention-heads 48 --seq-length 512 --micro-batch-size 2 "
    "--global-batch-size 768 --vocab-size 50257 --bf16 --ranks-per-node 16 --zero-quantization-block-size 2048 "
    "--zero-gradient-quantization-block-size 2048"
)
# the DeepSpeed-like baseline: 16-bit gradients on the wire (--grad-reduce-in-bf16), 3P bytes per rank
ZERO3 = MODEL + " --zero-stage 3 --grad-reduce-in-bf16"
ZEROPP = MODEL + " --zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 16 --zero-quantized-gradients"
WORLD = 384
FP32_GRADS = (
    "our ZeRO-3 here reduce-scatters bf16 gradients (--grad-reduce-in-bf16), as DeepSpeed's fp16 ones: 3P bytes "
    "per rank, the paper's baseline"
)


def main() -> int:
    z3_100, zpp_100 = run(ZERO3, WORLD, "v100-ib100"), run(ZEROPP, WORLD, "v100-ib100")
    z3_400 = run(ZERO3, WORLD, "v100-ib400")
    volume = cross_node_bytes(ZERO3, WORLD) / cross_node_bytes(ZEROPP, WORLD)
    print(
        f"simulated TFLOP/s per GPU, 18B, 384 V100: ZeRO-3 {z3_100['tflops_per_gpu']:.1f} (100 Gbps), "
        f"{z3_400['tflops_per_gpu']:.1f} (400 Gbps); ZeRO++ {zpp_100['tflops_per_gpu']:.1f} (100 Gbps)\n"
    )
    ok = table(
        "ZeRO++ (arXiv 2306.10209) vs our simulator",
        [
            (
                "ZeRO-3 TFLOP/s per GPU, 18B, 100 Gbps, 1K tok/GPU",
                14.0,
                z3_100["tflops_per_gpu"],
                "the paper's bandwidth evaluation / DeepSpeed blog",
                FP32_GRADS + "; the sustained V100 rate (40% of peak) is our assumption",
            ),
            (
                "ZeRO++ TFLOP/s per GPU, same setup",
                31.0,
                zpp_100["tflops_per_gpu"],
                "the paper's bandwidth evaluation / DeepSpeed blog",
                "absolute TFLOP/s scale with the assumed sustained rate; the ratios below do not",
            ),
            (
                "throughput ZeRO++ / ZeRO-3, 18B, 100 Gbps",
                31.0 / 14.0,
                zpp_100["tflops_per_gpu"] / z3_100["tflops_per_gpu"],
                "14 -> 31 TFLOP/s above (2.21x)",
                FP32_GRADS,
            ),
            (
                "best ZeRO++ / ZeRO-3 throughput at 384 GPUs ('up to')",
                2.16,
                zpp_100["tflops_per_gpu"] / z3_100["tflops_per_gpu"],
                "abstract, arXiv 2306.10209",
                "the paper's 2.16x is its best case over its model sizes; ours is the 18B, 100 Gbps point",
            ),
            (
                "ZeRO++ at 100 Gbps / ZeRO-3 at 400 Gbps",
                1.0,
                zpp_100["tflops_per_gpu"] / z3_400["tflops_per_gpu"],
                "'same throughput at a quarter of the bandwidth' (DeepSpeed blog)",
                "",
            ),
            (
                "cross-node bytes per node, ZeRO-3 / ZeRO++ (per step)",
                4.0,
                volume,
                "abstract: 'reduces communication volume of ZeRO by 4x'",
                "the baseline reduces bf16 gradients: 3M -> 0.75M per node (M = 16-bit model bytes), less "
                "the padding and the hpZ/qwZ first-gather terms",
            ),
        ],
    )
    print("\nall rows within 15%" if ok else "\nsome rows differ by more than 15%: see the notes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
