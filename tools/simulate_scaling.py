"""Predict the step time of a pretrain_gpt.py configuration on a cluster: the same flags as
pretrain_gpt.py, plus

    --world-size N          ranks (default: $WORLD_SIZE or 1)
    --system NAME           cluster preset: v100-ib100, v100-ib400, v100-ib800, frontier, a100,
                            h100, h200, emulated (megatron_zpp/planning/simulator/presets/emulated_cluster.json, written
                            by tools/calibrate_cluster.py)    [default: h100]
    --system-file PATH      the JSON of an emulated preset other than the checked-in one
    --link-gbps G           override the inter-node bandwidth per node (Gbit/s)
    --json                  print one JSONL row (plots, tools/plot_scaling.py) instead of the table
    --experiment NAME       the row's "experiment" key [default: simulate]
    --moe-imbalance F       mixture of experts: the busiest rank's routed rows over an even share (>= 1; default
                            1.0, a balanced router): its token exchanges and experts take F x as long and set
                            the step; the bytes printed stay the mean (what the ledger's mean records)

    python tools/simulate_scaling.py --system v100-ib100 --world-size 64 --mock-data --num-layers 40 \\
        --hidden-size 6144 --num-attention-heads 48 --seq-length 512 --global-batch-size 128 \\
        --zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 16 --zero-quantized-gradients \\
        --ranks-per-node 16 --bf16

Prints the step time and its parts (compute, exposed communication by kind, pipeline
bubble, step-end work), tokens/s, model TFLOP/s per GPU and MFU (against --peak-tflops when
given, else the preset's dense bf16/fp16 data-sheet peak; --peak-tflops changes only MFU's
denominator, not the preset's compute rate), and the bytes per rank per link
class (the ledger's byte model: what --comm-report would record). megatron_zpp/planning/simulator/
model.py states the overlap model. --ranks-per-node defaults to the preset's node size.
The flags are checked as pretrain_gpt.py checks them, less what only a run reads or writes (the
data, the tokenizer's files, the checkpoint directories): every examples/configs/*.yaml is accepted
as it is (--config examples/configs/gpt1.3b_zeropp.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_config
from megatron_zpp.planning.simulator import preset, simulate, throughput


def tool_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    ap.add_argument("--system", default="h100")
    ap.add_argument("--system-file", default=None)
    ap.add_argument("--link-gbps", type=float, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--experiment", default="simulate")
    ap.add_argument("--moe-imbalance", type=float, default=1.0)
    return ap.parse_known_args(argv)


def peak(cfg, cluster) -> tuple[float, str]:
    """(peak TFLOP/s per rank MFU is measured against, what it is): --peak-tflops, else the preset's
    dense bf16/fp16 peak from its data sheet; (0, why) when neither is known."""
    if cfg.log.peak_tflops:
        return cfg.log.peak_tflops, f"{cfg.log.peak_tflops:g} TFLOP/s (--peak-tflops)"
    if cluster.peak_tflops:
        return cluster.peak_tflops, f"{cluster.peak_tflops:g} TFLOP/s dense bf16/fp16 peak of {cluster.name}"
    return 0.0, f"unknown: {cluster.name} has no peak, pass --peak-tflops"


def mfu(cfg, cluster, tflops_per_gpu: float) -> float | None:
    """Model FLOP/s per rank over the peak (a fraction), None when the peak is unknown."""
    value, _ = peak(cfg, cluster)
    return tflops_per_gpu / value if value else None


def row(ours, cfg, cluster, bd) -> dict:
    tp = throughput(cfg, bd)
    inter = cluster.link("inter_node")
    return {
        "experiment": ours.experiment,
        "system": cluster.name,
        "ranks": cfg.parallel.world_size,
        "link_gbps": inter.bandwidth * 8 / 1e9,
        "seq_length": cfg.model.seq_length,
        "step_time_s": bd.step_time_s,
        "tokens_per_s": tp["tokens_per_s"],
        "tflops_per_gpu": tp["tflops_per_gpu"],
        "mfu": mfu(cfg, cluster, tp["tflops_per_gpu"]),
        "peak_tflops": peak(cfg, cluster)[0] or None,
        "source": "simulated",
    }


def report(cfg, cluster, bd) -> str:
    tp = throughput(cfg, bd)
    p, z = cfg.parallel, cfg.zero
    lines = [
        f"system {cluster.name}: {cluster.ranks_per_node} ranks per node, {cluster.sustained_tflops:.1f} TFLOP/s "
        "sustained per rank; links "
        + ", ".join(
            f"{k} {v.bandwidth * 8 / 1e9:.3g} Gbit/s per {v.shared}, alpha {v.alpha * 1e6:.3g} us"
            for k, v in cluster.links.items()
        ),
        f"layout: world {p.world_size} = TP {p.tensor_model_parallel_size} x CP {p.context_parallel_size} x "
        f"DP {p.data_parallel_size} x PP {p.pipeline_model_parallel_size}, ZeRO-{z.zero_stage}"
        + (" qwZ" if z.zero_quantized_weights else "")
        + (f" hpZ{z.zero_hpz_partition_size}" if z.zero_hpz_partition_size > 1 else "")
        + (" qgZ" if z.zero_quantized_gradients else "")
        + f", {cfg.num_micro_batches} micro-batches per step"
        + _experts(cfg),
        f"{'step time':<36} {bd.step_time_s * 1e3:12.3f} ms",
        f"{'  compute':<36} {bd.compute_s * 1e3:12.3f} ms",
    ]
    for k, v in bd.exposed_s.items():
        lines.append(f"{'  exposed ' + k:<36} {v * 1e3:12.3f} ms")
    if bd.bubble_s:
        lines.append(f"{'  pipeline bubble':<36} {bd.bubble_s * 1e3:12.3f} ms")
    for k, v in bd.other_s.items():
        lines.append(f"{'  step end: ' + k:<36} {v * 1e3:12.3f} ms")
    lines += [
        f"{'tokens/s':<36} {tp['tokens_per_s']:12.1f}",
        f"{'model TFLOP/s per GPU':<36} {tp['tflops_per_gpu']:12.2f}",
        f"{'MFU':<36} "
        + (f"{100 * share:11.1f}%" if (share := mfu(cfg, cluster, tp["tflops_per_gpu"])) is not None else f"{'-':>12}")
        + f"   of {peak(cfg, cluster)[1]}",
        "bytes per rank per step by link: "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(bd.bytes_per_rank.items())),
    ]
    return "\n".join(lines)


def _experts(cfg) -> str:
    m, p = cfg.model, cfg.parallel
    if not m.num_experts:
        return ""
    etp = p.expert_tp_size
    return (
        f"; {m.num_experts} experts top-{m.moe_router_topk}, EP {p.expert_model_parallel_size} x expert TP {etp}, "
        f"{m.moe_token_dispatcher_type} dispatcher"
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
        cluster = preset(ours.system, ours.system_file)
        if ours.link_gbps:
            cluster = cluster.with_inter_node(ours.link_gbps)
        if "--ranks-per-node" not in rest:
            rest += ["--ranks-per-node", str(min(cluster.ranks_per_node, ours.world_size))]
        cfg = parse_config(rest, ours.world_size, run=False)
        bd = simulate(cfg, cluster, ours.moe_imbalance)
    except (ConfigError, KeyError, FileNotFoundError, ValueError) as e:
        print("error: " + str(e).replace("\n", "\nerror: "), file=sys.stderr)
        return 2
    print(json.dumps(row(ours, cfg, cluster, bd)) if ours.json else report(cfg, cluster, bd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
