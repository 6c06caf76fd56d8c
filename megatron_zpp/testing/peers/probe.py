"""The probe that measures a rank of bench/zero.py (ours and the peers alike, so that the figures
are measured the same way), and the flags every runner takes:
* step time: perf_counter around one optimizer step, which ends with the loss all-reduced
  over the ranks (our train_step does that; the peers do it too);
* peak memory: the rank's peak RSS (VmHWM) over the timed steps of each rate: reset through
  /proc/self/clear_refs after the warmup steps, read after the last one;
* rate gates: before the first step of each rate after the first, every rank writes
  gate<k>.rank<r> and waits (outside the timed step) for gate<k>.open, which bench/zero.py
  creates once it has reshaped the link (no traffic is in flight then);
* wire bytes: the first rank of each node reads its veth's tx_bytes (env ZPP_VETH) at every
  step boundary, so bench/zero.py can sum what both nodes put on the shaped link;
* peers: the trace of gloo_collectives.install_gloo_collectives (calls, bytes and modelled
  cross-node bytes per torch.distributed entry point), snapshotted at every step boundary too.
Each rank writes $ZPP_PROBE_DIR/rank<r>.json at the end."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from megatron_zpp.testing.peers import gloo_collectives


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


def _tx_bytes(iface: str | None) -> int | None:
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


class Probe:
    """Per-rank measurements. With gate_every = S (timed steps per rate) the rank also waits
    before steps warmup + S, warmup + 2S, ... until bench/zero.py has reshaped the link for
    the next rate (files in $ZPP_PROBE_DIR); only the first rate has warmup steps."""

    def __init__(self, warmup: int, gate_every: int = 0):
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.node = int(os.environ.get("ZPP_NODE", os.environ.get("GROUP_RANK", 0)))
        self.warmup, self.gate_every = warmup, gate_every
        self.iface = os.environ.get("ZPP_VETH") if self.local_rank == 0 else None
        self.out_dir = os.environ.get("ZPP_PROBE_DIR")
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.tx_begin: list[int | None] = []  # veth tx_bytes at the start of step i
        self.tx_end: list[int | None] = []  # and at its end
        self.comm_begin: list[dict] = []  # the peers' CommTrace totals at the start of step i
        self.comm_end: list[dict] = []  # and at its end
        self.peak_rss_by_rate: list[int | None] = []  # VmHWM over the timed steps of each rate
        self.hwm_reset = False
        self.rss_start = _vm("VmRSS")
        self._t0 = 0.0

    def _close_rate(self) -> None:
        self.peak_rss_by_rate.append(_vm("VmHWM") if self.hwm_reset else None)
        self.hwm_reset = False

    def _gate(self, k: int) -> None:
        if not self.out_dir:
            return
        with open(os.path.join(self.out_dir, f"gate{k}.rank{self.rank}"), "w"):
            pass
        while not os.path.exists(os.path.join(self.out_dir, f"gate{k}.open")):
            time.sleep(0.02)

    def step_begin(self) -> None:
        s = len(self.step_times)
        rel = s - self.warmup
        gate = bool(self.gate_every) and rel > 0 and rel % self.gate_every == 0
        if gate:
            self._close_rate()
            self._gate(rel // self.gate_every)
        if s == self.warmup or gate:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
                self.hwm_reset = True
            except OSError:
                pass
        self.tx_begin.append(_tx_bytes(self.iface))
        if gloo_collectives.TRACE is not None:
            self.comm_begin.append(gloo_collectives.TRACE.snapshot())
        self._t0 = time.perf_counter()

    def step_end(self, loss: float | None = None) -> float:
        dt = time.perf_counter() - self._t0
        self.tx_end.append(_tx_bytes(self.iface))
        if gloo_collectives.TRACE is not None:
            self.comm_end.append(gloo_collectives.TRACE.snapshot())
        self.step_times.append(dt)
        if loss is not None:
            self.losses.append(float(loss))
        return dt

    def finish(self, **extra) -> None:
        self._close_rate()
        res = {
            "rank": self.rank,
            "node": self.node,
            "local_rank": self.local_rank,
            "iface": self.iface,
            "warmup": self.warmup,
            "step_times": self.step_times,
            "losses": self.losses,
            "tx_begin": self.tx_begin,
            "tx_end": self.tx_end,
            "peak_rss_by_rate": self.peak_rss_by_rate,
            **(
                {
                    "comm_begin": self.comm_begin,
                    "comm_end": self.comm_end,
                    "native_rs": gloo_collectives.TRACE.native_rs,
                }
                if gloo_collectives.TRACE is not None
                else {}
            ),
            "rss_start": self.rss_start,
            "rss_end": _vm("VmRSS"),
            **extra,
        }
        try:
            import resource

            res["maxrss_lifetime"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except Exception:  # noqa: BLE001
            pass
        if self.out_dir:
            with open(os.path.join(self.out_dir, f"rank{self.rank}.json"), "w") as f:
                json.dump(res, f)


def peer_args(add_own=None) -> tuple[argparse.Namespace, list[str]]:
    """(this runner's flags, the flags after `--`): every runner takes --warmup and
    --gate-every; `add_own(parser)` adds its own."""
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gate-every", type=int, default=0, help="timed steps per link rate (bench/zero.py)")
    if add_own:
        add_own(ap)
    return ap.parse_args(argv[:split]), argv[split + 1 :]
