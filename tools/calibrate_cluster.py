"""Calibrate the simulator's `emulated` preset on this machine's emulated cluster
(megatron_zpp/testing/cluster.py: two network namespaces joined by a tc-shaped veth; root needed).

    python tools/calibrate_cluster.py [--rate 1gbit] [--ranks 4] [--out PRESET.json]
                                          (default: megatron_zpp/planning/simulator/presets/emulated_cluster.json)
    python tools/calibrate_cluster.py --refit PRESET.json --out PRESET.json   # terms only, no cluster

Measures, with 4 gloo ranks (2 per namespace) running at once as in training:

* the p2p alpha and bandwidth inside a namespace (loopback) and across the veth shaped at
  --rate (the inter-node bandwidth is stored as a fraction of the shaped rate, so the
  simulator can take any other rate: --link-gbps, bench/simulator_validation.py);
* the model FLOP/s per rank of forward + backward of three small GPTs (all ranks computing at
  once, so the shared cores are counted), fitted as seconds = FLOPs / rate + layers x overhead,
  and the extra seconds of a GLA layer over a softmax one at the CP runs' local length;
* the int8 quantize + dequantize throughput (ops/quantize.py), and per (bits, block) of the
  runs (int4 / int8 at 256) the quantizer's per-element and per-call cost;
* then six calibration-only training runs (other model sizes than the validation's), each
  launched 3 times interleaved (measure_runs), for the terms no microbenchmark sees: per-step
  and per-ZeRO-unit overhead, the overlap efficiency, the quantizer's per-call cost in a real
  step, the CP chain's per-message cost (fit_runs).

Only one emulated-cluster bench may run at a time (a lock): this tool waits for it (up to
--wait-minutes). Without root or iproute2 it says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_zpp.planning.simulator.hardware import EMULATED_JSON
from megatron_zpp.testing.calibration import calibrate, refit, wait_for_cluster


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="veth rate while measuring (e.g. 1gbit, 200mbit)")
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks, 2 per namespace")
    ap.add_argument("--out", default=os.path.normpath(EMULATED_JSON))
    ap.add_argument("--wait-minutes", type=float, default=30.0, help="how long to wait for another bench's lock")
    ap.add_argument(
        "--refit",
        metavar="PRESET",
        help="no measuring: refit PRESET's terms from its stored calibration runs (after a simulator change)",
    )
    a = ap.parse_args(argv)
    if a.refit:
        if not os.path.exists(a.refit):
            raise SystemExit(f"error: --refit {a.refit}: no such file")
        preset = refit(a.refit, a.ranks)
    else:
        cluster = wait_for_cluster(a.wait_minutes)
        try:
            preset = calibrate(cluster, a.rate, a.ranks)
        finally:
            cluster.cleanup()
        kept = json.load(open(a.out)).get("measured", {}) if os.path.exists(a.out) else {}
        if "cp_chain" in kept:  # the CP chain's per-message cost: measured by bench/cp.py, not here
            preset["measured"]["cp_chain"] = kept["cp_chain"]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(preset, fh, indent=1)
    links, eff = preset["links"], preset["measured"]["inter_node_efficiency"]
    intra, inter = links["intra_node"], links["inter_node"]
    print(
        f"wrote {a.out}: {preset['sustained_tflops'] * 1e3:.2f} GFLOP/s per rank "
        f"(+{preset['per_layer_s'] * 1e3:.2f} ms per layer), intra {intra['bandwidth'] / 1e6:.0f} MB/s "
        f"alpha {intra['alpha'] * 1e6:.0f} us, inter {inter['bandwidth'] / 1e6:.1f} MB/s ({eff:.2f} of {a.rate}) "
        f"alpha {inter['alpha'] * 1e6:.0f} us, quantizer {preset['quant_elems_per_s'] / 1e6:.0f} M elements/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
