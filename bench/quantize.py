"""ZeRO++ quantizer speed and error: our int8 (qwZ) and int4 (qgZ) codecs on one CPU core, against a copy.

Speed. On one thread (torch.set_num_threads(1)), for n fp32 elements (default 16M) and for the
same values in bf16, it times: a copy of n fp32 elements (the physical reference: it reads and
writes 4 B per element, so it runs at the core's memory bandwidth); our quantize_wire,
dequantize_wire (into a float tensor of the input's dtype), the two back to back, the
stochastic-rounding quantize, and dequantize_sum_wire of r = 2 and 4 rows of n/r elements (qgZ's
reduce after a hop); and the same operations done by the previous implementation (the eager
functions quantize.py had before the wire format, copied below as `baseline_*`, data and scales
as two tensors; its reduce dequantizes every row, then sums). Each operation runs --warmup
times, then --repeats times, each right after a copy of the same n elements (paired, so the
bursts of other work on a shared machine hit both alike); a row reports the median time, the
M elements/s and GB/s (bytes read + written) it gives, and its ratio to the copy (median of the
paired ratios: time(copy of n fp32) / time(operation on n elements)). The target is a
quantize + dequantize ratio >= 0.3.

Error. For each block size (32 ... 2048) and int4/int8, on Gaussian gradient-like values and
on heavy-tailed ones (Student-t, 3 degrees of freedom), with round-to-nearest and with
stochastic rounding: the relative L2 error of dequantize(quantize(x)), the fraction of nonzero
values that decode to zero, and the bytes per element on the wire. It then recommends a qgZ
(int4) block size: the least error x wire bytes (see `recommend_block`).

Run:  .venv/bin/python bench/quantize.py                 (about 2 minutes on an idle machine)
      .venv/bin/python bench/quantize.py --numel 4194304 --repeats 5    (quicker)
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megatron_zpp.ops.quantize import (
    dequantize_sum_wire,
    dequantize_wire,
    quantize_wire,
    quantizer_backend,
    wire_bytes,
)

TARGET = 0.3
BLOCKS = [32, 64, 128, 256, 512, 1024, 2048]  # 32: shows whether an optimum at 64 is interior

# ---------------------------------------------------------------- baseline: the previous implementation
# (megatron_zpp/zero/quantize.py before the wire format, shape checks left out; eager, fp32 temporaries)


def baseline_quantize(x: torch.Tensor, block: int, levels: int):
    xb = x.reshape(-1, block).float()
    scales = xb.abs().amax(dim=1) / levels
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(xb / safe[:, None]).clamp_(-levels, levels)
    return q, scales


def baseline_quantize_int8(x, block):
    q, scales = baseline_quantize(x, block, 127)
    return q.to(torch.int8).reshape(-1), scales


def baseline_dequantize_int8(q, scales, block, dtype=torch.float32):
    return (q.reshape(-1, block).float() * scales.float()[:, None]).reshape(-1).to(dtype)


def baseline_quantize_int4(x, block):
    q, scales = baseline_quantize(x, block, 7)
    nib = (q + 8).to(torch.uint8).reshape(-1, 2)
    return nib[:, 0] | (nib[:, 1] << 4), scales


def baseline_dequantize_int4(packed, scales, block, dtype=torch.float32):
    q = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1, block).float() - 8
    return (q * scales.float()[:, None]).reshape(-1).to(dtype)


BASELINE = {
    8: (baseline_quantize_int8, baseline_dequantize_int8),
    4: (baseline_quantize_int4, baseline_dequantize_int4),
}

# ---------------------------------------------------------------- timing


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(op, copy, warmup: int, repeats: int) -> dict:
    """Median time of `op`, and the median of time(copy) / time(op) over back-to-back pairs."""
    for _ in range(warmup):
        op()
    times, ratios = [], []
    for _ in range(repeats):
        t_copy = timed(copy)
        t_op = timed(op)
        times.append(t_op)
        ratios.append(t_copy / t_op)
    return {"s": statistics.median(times), "min_s": min(times), "ratio": statistics.median(ratios)}


class Speed:
    """The speed rows of one input dtype: each op on n elements, paired with the fp32 copy."""

    def __init__(self, n: int, block: int, dtype: torch.dtype, warmup: int, repeats: int):
        self.n, self.block, self.dtype, self.warmup, self.repeats = n, block, dtype, warmup, repeats
        g = torch.Generator().manual_seed(0)
        self.src32 = torch.randn(n, generator=g)
        self.dst32 = torch.empty(n)
        self.x = self.src32.to(dtype)
        self.out = torch.empty(n, dtype=dtype)
        self.rows: dict[str, dict] = {}

    def copy(self):
        self.dst32.copy_(self.src32)

    def add(self, label: str, op, nbytes: int) -> None:
        r = paired(op, self.copy, self.warmup, self.repeats)
        r.update(melem_s=self.n / r["s"] / 1e6, gb_s=nbytes / r["s"] / 1e9, bytes=nbytes)
        self.rows[label] = r

    def run(self) -> dict[str, dict]:
        n, esize = self.n, self.x.element_size()
        self.add("copy fp32 (reference)", self.copy, 8 * n)
        for bits in (8, 4):
            self.ours(bits, esize)
        for bits in (8, 4):
            self.baseline(bits, esize)
        return self.rows

    def ours(self, bits: int, esize: int) -> None:
        n, block, x, out = self.n, self.block, self.x.view(1, -1), self.out.view(1, -1)
        wire = quantize_wire(x, block, bits)
        wb = wire.numel()
        q = lambda: quantize_wire(x, block, bits, out=wire)  # noqa: E731
        dq = lambda: dequantize_wire(wire, n, block, bits, out)  # noqa: E731
        self.add(f"ours int{bits} quantize", q, n * esize + wb)
        self.add(f"ours int{bits} dequantize", dq, wb + n * esize)
        self.add(f"ours int{bits} quantize+dequantize", lambda: (q(), dq()), 2 * (n * esize + wb))
        gen = torch.Generator().manual_seed(1)
        self.add(
            f"ours int{bits} quantize stochastic",
            lambda: quantize_wire(x, block, bits, stochastic=True, generator=gen, out=wire),
            n * esize + wb,
        )
        for r in (2, 4):
            rows = quantize_wire(self.x.view(r, -1), block, bits)
            total = torch.empty(n // r)
            self.add(
                f"ours int{bits} dequantize_sum_wire r={r}",
                lambda: dequantize_sum_wire(rows, n // r, block, bits, total),
                rows.numel() + 4 * n // r,
            )

    def baseline(self, bits: int, esize: int) -> None:
        n, block, x = self.n, self.block, self.x
        quant, dequant = BASELINE[bits]
        data, scales = quant(x, block)
        wb = data.numel() + 4 * scales.numel()
        q = lambda: quant(x, block)  # noqa: E731
        dq = lambda: self.out.copy_(dequant(data, scales, block, self.dtype))  # noqa: E731
        self.add(f"baseline int{bits} quantize", q, n * esize + wb)
        self.add(f"baseline int{bits} dequantize", dq, wb + n * esize)
        self.add(f"baseline int{bits} quantize+dequantize", lambda: (q(), dq()), 2 * (n * esize + wb))
        for r in (2, 4):  # what grad_reduce did: dequantize every row, then sum in fp32
            self.add(
                f"baseline int{bits} dequantize + sum r={r}",
                lambda: dequant(data, scales, block, torch.float32).view(r, -1).sum(0),
                wb + 4 * n // r,
            )


def print_speed(rows: dict[str, dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'operation':44}{'median ms':>11}{'M elem/s':>11}{'GB/s':>8}{'x copy':>9}  target {TARGET:.0%}")
    for label, r in rows.items():
        mark = ""
        if label.endswith("quantize+dequantize"):
            mark = "met" if r["ratio"] >= TARGET else "NOT met"
        print(f"{label:44}{r['s'] * 1e3:11.2f}{r['melem_s']:11.0f}{r['gb_s']:8.2f}{r['ratio']:9.3f}  {mark}")


# ---------------------------------------------------------------- error


def student_t3(n: int, g: torch.Generator) -> torch.Tensor:
    """Student-t with 3 degrees of freedom: z / sqrt(chi2_3 / 3)."""
    z = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(3, n, generator=g, dtype=torch.float64).square().sum(0)
    return (z / (chi2 / 3).sqrt()).float()


def error_row(x: torch.Tensor, block: int, bits: int, stochastic: bool) -> dict:
    wire = quantize_wire(x.view(1, -1), block, bits, stochastic=stochastic, generator=torch.Generator().manual_seed(2))
    y = dequantize_wire(wire, x.numel(), block, bits, torch.empty(1, x.numel()))[0].double()
    xd, nonzero = x.double(), x != 0
    return {
        "rel_l2": ((y - xd).norm() / xd.norm()).item(),
        "zero_frac": ((y == 0) & nonzero).sum().item() / nonzero.sum().item(),
        "bytes_per_elem": wire_bytes(x.numel(), block, bits) / x.numel(),
    }


def error_table(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    data = {"gaussian": torch.randn(n, generator=g), "student_t3": student_t3(n, g)}
    rows = []
    for bits in (4, 8):
        for block in BLOCKS:
            for dist, x in data.items():
                for stochastic in (False, True):
                    rows.append(
                        {"bits": bits, "block": block, "data": dist, "stochastic": stochastic}
                        | error_row(x, block, bits, stochastic)
                    )
    return rows


def print_errors(rows: list[dict]) -> None:
    for bits in (4, 8):
        print(f"\nint{bits}: relative L2 error | nonzero values decoded as zero   (nearest / stochastic rounding)")
        print(f"{'block':>6}{'B/elem':>8}" + "".join(f"{d + ' rel L2':>24}{d + ' ->0':>22}" for d in ("gauss", "t3")))
        for block in BLOCKS:
            cells = {(r["data"], r["stochastic"]): r for r in rows if r["bits"] == bits and r["block"] == block}
            line = f"{block:6d}{cells['gaussian', False]['bytes_per_elem']:8.4f}"
            for dist in ("gaussian", "student_t3"):
                near, sto = cells[dist, False], cells[dist, True]
                line += f"{near['rel_l2']:12.4f} /{sto['rel_l2']:8.4f}"
                line += f"{near['zero_frac']:12.2%} /{sto['zero_frac']:7.2%}"
            print(line)


def error_per_byte(rows: list[dict], bits: int, dist: str) -> dict[int, float]:
    """block -> relative L2 error x wire bytes per element, round to nearest."""
    return {
        r["block"]: r["rel_l2"] * r["bytes_per_elem"]
        for r in rows
        if (r["bits"], r["data"], r["stochastic"]) == (bits, dist, False)
    }


def recommend_block(rows: list[dict], bits: int = 4) -> tuple[int, str]:
    """The block with the least relative L2 error x wire bytes per element (round to nearest) on the
    Gaussian data; the Student-t(3) minimizer is reported beside it. Halving a block pays while it cuts
    the error by a larger fraction than it adds bytes: on Gaussian values that stops at an interior
    block, on heavy tails it goes on, so the Gaussian optimum is the largest block worth having."""
    gauss = error_per_byte(rows, bits, "gaussian")
    heavy = error_per_byte(rows, bits, "student_t3")
    block, heavy_block = min(gauss, key=gauss.get), min(heavy, key=heavy.get)
    rule = (
        f"least int{bits} round-to-nearest relative L2 error x wire bytes/element on Gaussian data "
        f"(error x bytes: {', '.join(f'{b}: {v:.4f}' for b, v in gauss.items())}); on Student-t(3) data the "
        f"minimum is at {heavy_block}{' (the smallest block tried)' if heavy_block == BLOCKS[0] else ''}: heavy "
        f"tails reward smaller blocks still, so the default should be no larger than {block}"
    )
    return block, rule


# ---------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=16 << 20, help="elements per timed operation")
    ap.add_argument("--block", type=int, default=2048, help="block of the timed operations")
    ap.add_argument("--error-numel", type=int, default=4 << 20, help="elements per error measurement")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    print(
        f"quantizer bench: n = {a.numel / 2**20:.0f}M elements, block {a.block}, 1 thread, "
        f"{os.cpu_count()} CPUs, backend: {quantizer_backend()}, torch {torch.__version__}"
    )
    speed = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        speed[name] = Speed(a.numel, a.block, dtype, a.warmup, a.repeats).run()
        print_speed(
            speed[name], f"{name} input (dequantize into {name}; sums in fp32); x copy = time(copy n fp32) / time"
        )
    errors = error_table(a.error_numel)
    print_errors(errors)
    block, rule = recommend_block(errors)
    print(f"\nrecommended qgZ (int4) block: {block}  (rule: {rule})")
    load1 = os.getloadavg()[0]
    spread = max(r["s"] / r["min_s"] for rows in speed.values() for r in rows.values())
    if spread > 1.3:
        print(
            f"WARNING: noisy timing (a median is up to {spread:.2f}x its fastest run; load {load0:.1f} -> {load1:.1f} "
            f"on {os.cpu_count()} CPUs): the paired ratios are the figures to trust"
        )
    met = {
        f"int{bits} {name}": rows[f"ours int{bits} quantize+dequantize"]["ratio"] >= TARGET
        for name, rows in speed.items()
        for bits in (8, 4)
    }
    out = {
        "bench": "quantize",
        "numel": a.numel,
        "block": a.block,
        "threads": torch.get_num_threads(),
        "backend": quantizer_backend(),
        "target_ratio": TARGET,
        "target_met": met,
        "speed": speed,
        "errors": errors,
        "recommended_qgz_block": block,
        "recommendation_rule": rule,
        "loadavg": [load0, load1],
        "noisy": spread > 1.3,
        "torch": torch.__version__,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
