"""The ZeRO++-on-Frontier follow-up (Xu et al., "Scaling Large Language Model Training on
Frontier with Low-Bandwidth Partitioning", arXiv 2501.04266) beside our simulator.

    python examples/reproduce/frontier_table.py

Frontier nodes (preset "frontier", megatron_zpp/planning/simulator/hardware.py): 8 MI250X GCDs, the two
GCDs of a package joined by 200 GB/s Infinity Fabric (tier0), GCDs across packages by 50 GB/s,
4 x 25 GB/s Slingshot NICs per node. Our mapping of the three partitioning schemes:

* ZeRO-3: --zero-stage 3;
* ZeRO++: qwZ + hpZ over the node (8 GCDs) + qgZ over 2 levels (node, cluster);
* 3-level hierarchical partitioning: qwZ + hpZ over the GCD pair (2) + qgZ over 3 levels
  (--zero-hierarchy 2: GCD pair, node, cluster): the secondary weight shard and the first
  gradient hop stay on the fastest link.

The paper's numbers used: "a 1.71x increase in TFLOPS per GPU when compared with ZeRO++ up to
384 GCDs and a scaling efficiency of 0.94 for up to 384 GCDs" for a 20B GPT (abstract); "40.5%"
more TFLOPS per GPU for ZeRO++ over ZeRO-3 (as summarised from the paper's evaluation by
sciencestack.ai / devbytes: the table number was not retrieved here). Not retrieved: the 20B
model's exact shape, sequence length and batch (we assume 44 layers x 6144, 2048 tokens, one
sequence per GCD per step) and the scaling-efficiency baseline (we take 2 nodes, 16 GCDs).
"""

from __future__ import annotations

import sys

from megatron_zpp.testing.paper_tables import run, table

MODEL = (
    "--mock-data --num-layers 44 --hidden-size 6144 --num-attention-heads 48 --seq-length 2048 --micro-batch-size 1 "
    "--vocab-size 50257 --bf16 --ranks-per-node 8 --zero-quantization-block-size 2048 "
    "--zero-gradient-quantization-block-size 2048 --zero-stage 3"
)
ZEROPP = " --zero-quantized-weights --zero-hpz-partition-size 8 --zero-quantized-gradients"
THREE_LEVEL = " --zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients --zero-hierarchy 2"


def tflops(extra: str, world: int, gbps: float | None = None) -> float:
    return run(f"{MODEL} --global-batch-size {world} {extra}", world, "frontier", gbps)["tflops_per_gpu"]


def main() -> int:
    z3, zpp, three = (tflops(x, 384) for x in ("", ZEROPP, THREE_LEVEL))
    base = tflops(THREE_LEVEL, 16)
    print(
        f"simulated TFLOP/s per GCD, 20B, 384 GCDs: ZeRO-3 {z3:.1f}, ZeRO++ {zpp:.1f}, 3-level {three:.1f}; "
        f"3-level at 16 GCDs {base:.1f}\n"
    )
    ok = table(
        "Frontier low-bandwidth partitioning (arXiv 2501.04266) vs our simulator",
        [
            (
                "TFLOP/s per GCD, 3-level / ZeRO++, 384 GCDs",
                1.71,
                three / zpp,
                "abstract, arXiv 2501.04266",
                "our 3-level scheme moves the same inter-node bytes as ZeRO++ (only intra-node hops change); its "
                "extra quantized hop now runs on a reduce stream, hidden, but with nominal links the step is "
                "compute-bound, so neither gains; the paper's achieved RCCL rates were not retrieved",
            ),
            (
                "TFLOP/s per GCD, ZeRO++ / ZeRO-3, 384 GCDs",
                1.405,
                zpp / z3,
                "'40.5% over ZeRO-3' (paper evaluation, via summaries; table number not retrieved)",
                "compute-bound with nominal links: the quantizer and the hops now run on the communication streams "
                "(zero_engine's stream map; before, on the compute stream, 0.86x), so ZeRO++ hides what ZeRO-3 "
                "already hid; the paper's gain means its communication was exposed (see the what-if below)",
            ),
            (
                "weak-scaling efficiency, 3-level, 16 -> 384 GCDs",
                0.94,
                three / base,
                "abstract, arXiv 2501.04266 (baseline size not retrieved: 16 GCDs assumed)",
                "",
            ),
        ],
    )
    print("\nall rows within 15%" if ok else "\nsome rows differ by more than 15%: see the notes")
    # what-if, not a paper number: with nominal links our 20B step is compute-bound at 2K tokens per GCD,
    # so the bytes ZeRO++ saves were hidden anyway; the paper's gains mean its communication was
    # exposed. At an eighth of the nominal inter-node rate ZeRO++ wins as in the paper:
    slow = 640 / 8
    z3s, zpps, threes = (tflops(x, 384, slow) for x in ("", ZEROPP, THREE_LEVEL))
    print(
        f"what-if (inter-node {slow:g} Gbit/s per node, not from the paper): ZeRO-3 {z3s:.1f}, ZeRO++ {zpps:.1f}, "
        f"3-level {threes:.1f} TFLOP/s per GCD; 3-level/ZeRO++ {threes / zpps:.2f}, ZeRO++/ZeRO-3 {zpps / z3s:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
