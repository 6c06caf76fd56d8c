"""An analytic step-time model of a training step under any layout of ours (TP, PP 1F1B /
interleaved, CP all-scan / all-gather / ring, ZeRO-0..3 with qwZ, hpZ, qgZ and tiers,
recompute), on preset or calibrated clusters.

    cfg = validate(parse_args(flags), world_size)
    bd = simulate(cfg, preset("v100-ib100"))      # Breakdown: step time, compute, exposed comm, bubble
    throughput(cfg, bd)                           # tokens/s, TFLOP/s per GPU

collectives.py enumerates every collective of a step with the ledger's bytes and links
(comm.model_bytes, topology.link_class); schedule.py takes the forward/backward order
from the real pipeline schedules; model.py times them (its docstring states the overlap
model); hardware.py holds the presets with their sources."""

from .collectives import ledger_rows, rank_step
from .hardware import Cluster, Link, preset
from .model import Breakdown, simulate, throughput

__all__ = ["Breakdown", "Cluster", "Link", "ledger_rows", "preset", "rank_step", "simulate", "throughput"]
