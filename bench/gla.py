"""GLA operator on CPU: ours (ChunkGLAFunction via chunk_gla) against causal SDPA, the previous autograd
chunked form and fla's naive token loop.

Shape B=1, H=8, D=64 (K = V = D), chunk 16, at T = 2048, 8192, 32768, in fp32 and bf16 (bf16: q, k, v in
bf16, g in fp32 as the GLA layer makes it; g = logsigmoid(x) / 16, GLA's default normalizer). Systems:

  ours      megatron_zpp.ops.gla.chunk_gla (ChunkGLAFunction: own backward, saves only q, k, v, g)
  sdpa      F.scaled_dot_product_attention(is_causal=True) on [B, H, T, D]: the field's peer for a token mixer
            (on CPU torch runs its flash kernel, which keeps no T x T scores)
  baseline  the previous plain-autograd chunked form, copied verbatim below (BASELINE section)
  fla       fla.ops.gla.naive.naive_recurrent_gla (fp32 token loop)

Measured per (T, dtype, system):
  time    forward + backward (o.backward(do), do fixed random), median of --repeats timed calls after one
          warmup, systems interleaved within every repeat; a call estimated over --slow-call seconds is timed
          once without warmup (n=1)
  mem     bytes saved for backward (torch.autograd.graph.saved_tensors_hooks around the forward; unique
          storages, the inputs included) as a multiple of one [B, T, H, D] fp32 tensor
  err     norm-wise relative error ||got - ref|| / ||ref|| against an fp64 recurrence (our naive_recurrent_gla in
          fp64 on the same inputs, upcast): max over o, dq, dk, dv, dg at T <= --ref-grad-max-t, o only at
          T <= --ref-fwd-max-t; SDPA against SDPA in fp64
Skips: every system is first probed at T=512 and 1024 (fp32); a cell's call time is extrapolated from
the system's largest measured length with its known power of T (TIME_EXPONENT; from the slower of its
first call and median, the worse of the dtypes), its saved bytes linearly.
A cell over --max-call-seconds or --max-saved-gib is skipped and the estimate printed instead. A second
table gives the fp32 error at T=512, H=2 for mild gates, gates in [-50, 0], mixed -1000 / -1e-4 gates and
gates with 5% -inf (hard resets). Timings on a shared CPU are noisy: the load average is printed with them.
Targets (MET / NOT MET): ours' saved bytes <= 6x, no slower than SDPA at T=8192, fp32 error <= 1e-5. The
time target is judged only when SDPA ran at T=8192 in every dtype: else "not judged: SDPA <dtype> did
not run (<why>); <fix>" and exit status 3 (--allow-missing-peers: 0 and a warning).
The last stdout line is one JSON object.

Run:  .venv/bin/python bench/gla.py                  (CPU; 10-20 min on a 2-core machine, most of it the peers)
      .venv/bin/python bench/gla.py --seq-lens 2048 8192 --dtypes fp32 --max-call-seconds 60
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_zpp.ops.chunking import check_shapes, compute_dtype
from megatron_zpp.ops.gla import chunk_gla
from megatron_zpp.ops.gla_naive import naive_recurrent_gla
from megatron_zpp.testing.verdict import ALLOW_FLAG, ALLOW_HELP, Absent, exit_status, verdict

B, H, D, CHUNK = 1, 8, 64, 16
PROBE_LENS = (512, 1024)
# One fwd+bwd's time as a power of T, assumed by the skip estimates (the table's times bear it out): ours is
# linear, SDPA quadratic; the previous form's backward is quadratic in the number of chunks (a full-size
# zero gradient per chunk), fla's too (every o[:, :, i] = ... write is a full-size CopySlices in backward).
TIME_EXPONENT = {"ours": 1.0, "sdpa": 2.0, "baseline": 2.0, "fla": 2.0}
TARGETS = {"mem_x": 6.0, "time_vs_sdpa_at_8192": 1.0, "fp32_err": 1e-5}
SDPA_TARGET_T = 8192


# ----------------------------------------------------------------------------------------
# BASELINE: megatron_zpp/ops/gla.py's chunked form before ChunkGLAFunction (plain autograd), verbatim.


def _sub_block(C: int) -> int:
    """Sub-block size ~sqrt(C): the pairwise-decay tensors are C*c*K and C*(C/c)*K, not C*C*K."""
    return next((c for c in (4, 8, 16) if c * c >= C and C % c == 0), C)


def _intra_chunk_scores(q: Tensor, k: Tensor, b: Tensor, c: int) -> Tensor:
    """A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) for j <= i, else 0. q, k, b: [..., C, K].

    Split the chunk into sub-blocks of c tokens. Within a diagonal sub-block the decay is
    taken pairwise; b_i - b_j > 0 above the diagonal (may overflow), so mask to -inf
    *before* exp (exact 0, zero gradient). For sub-block J before token i, factor through
    r = last token of J: exp(b_i - b_r) * exp(b_r - b_j), both exponents <= 0.
    """
    C = q.shape[-2]
    M = C // c
    neg_inf = float("-inf")
    qs, ks, bs = (x.unflatten(-2, (M, c)) for x in (q, k, b))  # [..., M, c, K]
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)[:, :, None]
    decay = (bs[..., :, None, :] - bs[..., None, :, :]).masked_fill(upper, neg_inf).exp()
    A_diag = ((qs[..., :, None, :] * decay) * ks[..., None, :, :]).sum(-1)  # [..., M, c, c]
    if M == 1:
        return A_diag.squeeze(-3)
    b_ref = bs[..., -1, :]  # [..., M, K]
    k_ref = ks * (b_ref[..., None, :] - bs).exp()  # [..., M, c, K]
    blk = torch.arange(C, device=q.device) // c
    not_after = (blk[None, :] <= torch.arange(M, device=q.device)[:, None])[:, :, None]
    e = (b[..., None, :, :] - b_ref[..., :, None, :]).masked_fill(not_after, neg_inf)
    A_off = (q[..., None, :, :] * e.exp()) @ k_ref.transpose(-1, -2)  # [..., M(J), C, c]
    A = A_off.movedim(-3, -2).flatten(-2)  # [..., C, C]
    eye = torch.eye(M, dtype=q.dtype, device=q.device)  # place diagonal blocks
    return A + torch.einsum("...Iij,IJ->...IiJj", A_diag, eye).reshape(A.shape)


def _chunk_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None, initial_state: Tensor | None, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Chunked GLA in the compute dtype. Returns (o [B,T,H,V] compute dtype, S_T)."""
    check_shapes(q, k, v, initial_state, True, g=g)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if C <= 0 or T % C != 0:
        raise ValueError(f"sequence length T={T} must be a multiple of chunk_size={C}")
    N = T // C
    scale = K**-0.5 if scale is None else scale
    dt = compute_dtype(q, k, v, g, initial_state)

    # [B, T, H, D] -> [B, H, N, C, D]: one matmul-friendly block per chunk.
    def blocks(x: Tensor) -> Tensor:
        return x.to(dt).reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = blocks(q), blocks(k), blocks(v), blocks(g)
    b = g.cumsum(dim=3)  # log decay from chunk start, inclusive; <= 0
    b_last = b[..., -1:, :]  # [B, H, N, 1, K] total decay of each chunk

    # Intra-chunk (causal, decayed q.k scores), all chunks at once; no state involved.
    A = _intra_chunk_scores(q, k, b, _sub_block(C))  # [B, H, N, C, C]
    o = (A @ v) * scale

    # Per-chunk state contributions (from zero state) and chunk decays, all chunks at once.
    k_dec = k * (b_last - b).exp()  # exponent <= 0
    U = k_dec.transpose(-1, -2) @ v  # [B, H, N, K, V]
    gamma = b_last.squeeze(-2).exp()[..., None]  # [B, H, N, K, 1]

    # Short sequential scan over chunks: state entering each chunk.
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    states = []
    for n in range(N):
        states.append(S)
        S = gamma[:, :, n] * S + U[:, :, n]
    S_in = torch.stack(states, dim=2)  # [B, H, N, K, V]

    # Inter-chunk: contribution of the incoming state, batched over chunks.
    o = o + ((q * b.exp()) @ S_in) * scale
    o = o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V)
    return o, S


# END BASELINE
# ----------------------------------------------------------------------------------------


def _fla(q, k, v, g):
    from fla.ops.gla.naive import naive_recurrent_gla as fla_naive  # imported on first use: it takes seconds (triton)

    return fla_naive(q, k, v, g)[0]


SYSTEMS: dict[str, Callable[..., Tensor]] = {
    "ours": lambda q, k, v, g: chunk_gla(q, k, v, g, chunk_size=CHUNK)[0],
    "sdpa": lambda q, k, v, g: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "baseline": lambda q, k, v, g: _chunk_forward(q, k, v, g, None, None, CHUNK)[0].to(v.dtype),
    "fla": _fla,
}
GATE_KINDS = ("mild", "[-50,0]", "mixed", "-inf")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_gates(kind: str, shape, gen) -> Tensor:
    """fp32 log decays <= 0: GLA's logsigmoid / 16, uniform in [-50, 0], -1000 or -1e-4, or mild with 5% -inf."""
    x = torch.randn(shape, generator=gen)
    u = torch.rand(shape, generator=gen)
    if kind == "[-50,0]":
        return -50.0 * u
    if kind == "mixed":
        return torch.where(u < 0.5, -1000.0, -1e-4)
    mild = F.logsigmoid(x) / 16
    return mild.masked_fill(u < 0.05, float("-inf")) if kind == "-inf" else mild


def make_case(T: int, heads: int, dtype: torch.dtype, kind: str = "mild", seed: int = 0):
    """(q, k, v, g, do) in [B, T, H, D]: q, k, v, do in dtype, g fp32."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, heads, D, generator=gen).to(dtype) for _ in range(4))
    return q, k, v, make_gates(kind, (B, T, heads, D), gen), do


def leaves_for(system: str, case) -> list[Tensor]:
    """Fresh leaves in the system's layout: SDPA takes [B, H, T, D] and no gate."""
    q, k, v, g, _ = case
    if system == "sdpa":
        return [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    return [x.clone().requires_grad_() for x in (q, k, v, g)]


def cotangent_for(system: str, case) -> Tensor:
    return case[4].transpose(1, 2).contiguous() if system == "sdpa" else case[4]


def fwd_bwd(system: str, leaves: list[Tensor], do: Tensor, record: dict | None = None):
    """One timed forward + backward. Returns (seconds, o, grads); record collects saved storages."""
    for x in leaves:
        x.grad = None
    fn = SYSTEMS[system]
    args = leaves if system != "sdpa" else [*leaves, None]
    t0 = time.perf_counter()
    if record is None:
        o = fn(*args)
    else:

        def pack(t):
            s = t.untyped_storage()
            record[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = fn(*args)
    o.backward(do)
    return time.perf_counter() - t0, o.detach(), [x.grad for x in leaves]


def rel_err(got: Tensor, ref: Tensor) -> float:
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm()).item()


def reference(system: str, case, with_grads: bool) -> list[Tensor]:
    """fp64 outputs (and grads of q, k, v, g) on the same inputs: naive_recurrent_gla, or SDPA for sdpa."""
    leaves = [x.detach().double().requires_grad_(with_grads) for x in leaves_for(system, case)]
    with torch.set_grad_enabled(with_grads):
        o = (
            naive_recurrent_gla(*leaves)[0]
            if system != "sdpa"
            else F.scaled_dot_product_attention(*leaves, is_causal=True)
        )
    if not with_grads:
        return [o]
    o.backward(cotangent_for(system, case).double())
    return [o.detach(), *(x.grad for x in leaves)]


def max_err(got: list[Tensor], ref: list[Tensor]) -> float:
    return max(rel_err(a, b) for a, b in zip(got, ref))


# ----------------------------------------------------------------------------------------
# Estimates and skips


def probe(systems: list[str]) -> dict[str, dict[int, dict]]:
    """fp32 fwd+bwd time (best of 2 after a warmup) and saved bytes of each system at T = 512, 1024."""
    out: dict[str, dict[int, dict]] = {s: {} for s in systems}
    for s in systems:
        case = make_case(PROBE_LENS[0], H, torch.float32)
        fwd_bwd(s, leaves_for(s, case), cotangent_for(s, case))
        for T in PROBE_LENS:
            case, record = make_case(T, H, torch.float32), {}
            t = min(fwd_bwd(s, leaves_for(s, case), cotangent_for(s, case), record)[0] for _ in range(2))
            out[s][T] = {"time_s": t, "saved_bytes": sum(record.values())}
            progress(T, "fp32", s, t, "probe")
    return out


def estimate(system: str, history: dict[str, dict[int, dict]], T: int) -> tuple[float, float]:
    """(seconds, saved bytes) of one call at T: time ~ T^TIME_EXPONENT and memory ~ T from each dtype's
    largest measured length, the worse of the dtypes (a cell's first call can be far slower than later ones)."""
    estimates = [(0.0, 0.0)]
    for by_len in history.values():
        if by_len:
            T0, m = max(by_len.items())
            estimates.append((m["time_s"] * (T / T0) ** TIME_EXPONENT[system], m["saved_bytes"] * T / T0))
    return max(e[0] for e in estimates), max(e[1] for e in estimates)


def skip_reason(system: str, history: dict[str, dict[int, dict]], T: int, a) -> str | None:
    secs, saved = estimate(system, history, T)
    mem_x = saved / (B * T * H * D * 4)
    if secs > a.max_call_seconds:
        p, limit = TIME_EXPONENT[system], a.max_call_seconds
        return (
            f"skipped: est. {secs:.0f} s per call (t ~ T^{p:.0f}) > --max-call-seconds {limit:.0f} (mem ~{mem_x:.0f}x)"
        )
    if saved > a.max_saved_gib * 2**30:
        gib = saved / 2**30
        return f"skipped: est. {gib:.1f} GiB ({mem_x:.0f}x) saved for backward > --max-saved-gib {a.max_saved_gib:.0f}"
    return None


def progress(T: int, dtype: str, system: str, seconds: float, what: str) -> None:
    print(f"[bench/gla] T={T} {dtype} {system}: {seconds:.2f} s ({what})", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------
# Measurements


def plan_cells(T: int, dtype: str, systems: list[str], history, a) -> dict[str, dict]:
    """Per system: {"skipped": reason}, or {"times": [], "slow": timed once without warmup}."""
    rows: dict[str, dict] = {}
    for s in systems:
        reason = skip_reason(s, history[s], T, a)
        rows[s] = {"skipped": reason} if reason else {"times": [], "slow": estimate(s, history[s], T)[0] > a.slow_call}
    return rows


def measure_cell_group(T: int, dtype: str, systems: list[str], history, a) -> dict[str, dict]:
    """Time, memory and error of every runnable system at (T, dtype), interleaved within each repeat."""
    case, unit = make_case(T, H, DTYPES[dtype]), B * T * H * D * 4
    rows = plan_cells(T, dtype, systems, history, a)
    runnable = [s for s in systems if "times" in rows[s]]
    for s in runnable:  # first call: warmup (or the one timed call of a slow cell), memory, outputs
        record: dict = {}
        t, o, grads = fwd_bwd(s, leaves_for(s, case), cotangent_for(s, case), record)
        rows[s].update(mem_x=sum(record.values()) / unit, outputs=[o, *grads])
        rows[s]["first_s"] = t
        if rows[s]["slow"]:
            rows[s]["times"].append(t)
        progress(T, dtype, s, t, "single call" if rows[s]["slow"] else "warmup")
    for r in range(a.repeats):
        for s in (s for s in runnable if not rows[s]["slow"]):
            rows[s]["times"].append(fwd_bwd(s, leaves_for(s, case), cotangent_for(s, case))[0])
            progress(T, dtype, s, rows[s]["times"][-1], f"repeat {r + 1}")
    for s in runnable:
        rows[s]["err"], rows[s]["err_of"] = error_of(s, case, rows[s].pop("outputs"), T, a)
        rows[s]["time_s"], rows[s]["min_s"] = statistics.median(rows[s]["times"]), min(rows[s]["times"])
        slowest = max(rows[s]["time_s"], rows[s]["first_s"])  # what a single uncached call costs
        history[s][dtype][T] = {"time_s": slowest, "saved_bytes": rows[s]["mem_x"] * unit}
    add_sdpa_ratios(rows)
    return rows


def add_sdpa_ratios(rows: dict[str, dict]) -> None:
    """vs_sdpa: median over repeats of t / t_sdpa within the same repeat (paired: robust to load bursts),
    or the ratio of medians when either side was timed once."""
    sdpa = rows.get("sdpa", {})
    for r in rows.values():
        if "times" in r and "times" in sdpa:
            paired = len(r["times"]) == len(sdpa["times"]) > 1
            ratios = [t / u for t, u in zip(r["times"], sdpa["times"])] if paired else [r["time_s"] / sdpa["time_s"]]
            r["vs_sdpa"], r["vs_sdpa_paired"] = statistics.median(ratios), paired


_REFS: dict = {}


def error_of(system: str, case, outputs: list[Tensor], T: int, a) -> tuple[float | None, str]:
    """Max relative error of o and grads (or o only) against the fp64 reference, when affordable."""
    with_grads = T <= a.ref_grad_max_t
    if not with_grads and T > a.ref_fwd_max_t:
        return None, "n/a: fp64 reference not run at this T"
    if system == "sdpa" and not with_grads:
        return None, "n/a: fp64 SDPA only at T <= --ref-grad-max-t"
    key = ("sdpa" if system == "sdpa" else "gla", T, case[0].dtype, with_grads)
    if key not in _REFS:
        _REFS[key] = reference(system, case, with_grads)
    ref = _REFS[key]
    return max_err(outputs[: len(ref)], ref), "o, grads" if with_grads else "o only"


def regime_errors(systems: list[str], T: int = 512, heads: int = 2) -> dict[str, dict[str, float]]:
    """fp32 max error over o, dq, dk, dv, dg per gate kind for the GLA systems."""
    out: dict[str, dict[str, float]] = {}
    for kind in GATE_KINDS:
        case = make_case(T, heads, torch.float32, kind)
        ref = reference("ours", case, True)
        out[kind] = {}
        for s in systems:
            _, o, grads = fwd_bwd(s, leaves_for(s, case), cotangent_for(s, case))
            out[kind][s] = max_err([o, *grads], ref)
    return out


# ----------------------------------------------------------------------------------------
# Report


def print_main_table(results: dict) -> None:
    head = f"{'T':>6} {'dtype':>5} {'system':>9} {'median s':>9} {'min s':>8} {'n':>2} {'vs sdpa':>8} {'mem x':>6}"
    print(f"{head} {'err':>8}  note")
    for (T, dtype), rows in results.items():
        for s, r in rows.items():
            if "skipped" in r:
                print(f"{T:>6} {dtype:>5} {s:>9} {'':>9} {'':>8} {'':>2} {'':>8} {'':>6} {'':>8}  {r['skipped']}")
                continue
            ratio = f"{r['vs_sdpa']:7.2f}{' ' if r['vs_sdpa_paired'] else '*'}" if "vs_sdpa" in r else f"{'n/a':>8}"
            err = f"{r['err']:8.1e}" if r["err"] is not None else f"{'n/a':>8}"
            times = f"{r['time_s']:9.3f} {r['min_s']:8.3f} {len(r['times']):>2}"
            print(f"{T:>6} {dtype:>5} {s:>9} {times} {ratio} {r['mem_x']:6.1f} {err}  {r['err_of']}")
    print("vs sdpa: median of the per-repeat ratios (paired); *: ratio of medians, one side timed once")


def print_noise(results: dict, load: tuple[float, float]) -> None:
    """Warn when a cell's median is well above its fastest call: other work ran on the machine."""
    spreads = [r["time_s"] / r["min_s"] for rows in results.values() for r in rows.values() if "min_s" in r]
    if max(spreads, default=1.0) > 1.3:
        print(
            f"WARNING: noisy timing (a median is {max(spreads):.1f}x its cell's fastest call; load {load[0]:.1f} -> "
            f"{load[1]:.1f} on {os.cpu_count()} CPUs): trust the fastest calls and the paired ratios"
        )


def print_regimes(regimes: dict) -> None:
    systems = list(next(iter(regimes.values())))
    print("\nfp32 error vs fp64 recurrence by gate regime (T=512, H=2, max over o, dq, dk, dv, dg):")
    print(f"{'gates':>10}" + "".join(f"{s:>12}" for s in systems))
    for kind, errs in regimes.items():
        print(f"{kind:>10}" + "".join(f"{errs[s]:12.1e}" for s in systems))


def sdpa_absent(results: dict) -> list[Absent]:
    """The SDPA cells at T = SDPA_TARGET_T that did not run (the peer of the time target), per dtype."""
    out = []
    for (T, dt), rows in results.items():
        r = rows.get("sdpa")
        if T == SDPA_TARGET_T and r is None:
            out.append(Absent(f"SDPA {dt}", "not among --systems", "add sdpa to --systems"))
        elif T == SDPA_TARGET_T and "skipped" in r:
            out.append(Absent(f"SDPA {dt}", r["skipped"], "raise --max-call-seconds / --max-saved-gib"))
    return out


def check_targets(results: dict, regimes: dict) -> dict:
    """Each target against the measurements: value, met (None when not measured) and the verdict (the
    time target is not judged when SDPA did not run at its T in every dtype that ran)."""
    ours = {key: rows["ours"] for key, rows in results.items() if "times" in rows.get("ours", {})}
    mem = [r["mem_x"] for r in ours.values()]
    ratios = [r["vs_sdpa"] for (T, _), r in ours.items() if T == SDPA_TARGET_T and "vs_sdpa" in r]
    errs = [r["err"] for (_, dt), r in ours.items() if dt == "fp32" and r["err"] is not None]
    errs += [e["ours"] for e in regimes.values() if "ours" in e]
    values = {"mem_x": mem, "time_vs_sdpa_at_8192": ratios, "fp32_err": errs}
    absent = {"time_vs_sdpa_at_8192": sdpa_absent(results)}
    out = {}
    for k, v in values.items():
        met = max(v) <= TARGETS[k] if v else None
        value = max(v) if v else None
        out[k] = {"value": value, "target": TARGETS[k], "met": met, "verdict": verdict(met, absent.get(k, ()))}
    return out


def print_targets(targets: dict) -> None:
    labels = {
        "mem_x": "activation memory of ours <= 6x one [B,T,H,D] fp32 tensor (max over T, dtype)",
        "time_vs_sdpa_at_8192": "fwd+bwd at T=8192 no slower than SDPA (ours / sdpa, paired, worst dtype)",
        "fp32_err": "fp32 error of ours <= 1e-5 (max over the table and every gate regime)",
    }
    print("\ntargets:")
    for key, t in targets.items():
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        print(f"  {labels[key]}: {value} (target {t['target']:g}) -> {t['verdict']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slow-call", type=float, default=10.0, help="cells estimated slower: one call, no warmup")
    ap.add_argument("--max-call-seconds", type=float, default=120.0)
    ap.add_argument("--max-saved-gib", type=float, default=4.0)
    ap.add_argument("--ref-grad-max-t", type=int, default=2048)
    ap.add_argument("--ref-fwd-max-t", type=int, default=8192)
    ap.add_argument("--no-regimes", action="store_true", help="skip the gate-regime error table")
    ap.add_argument(ALLOW_FLAG, action="store_true", help=ALLOW_HELP)
    a = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    load0, start = os.getloadavg()[0], time.perf_counter()

    probes = probe(a.systems)
    history = {s: {"fp32": dict(p), "bf16": {}} for s, p in probes.items()}  # measured cells join it
    results = {(T, dt): measure_cell_group(T, dt, a.systems, history, a) for T in sorted(a.seq_lens) for dt in a.dtypes}
    gla_systems = [s for s in a.systems if s != "sdpa"]
    regimes = regime_errors(gla_systems) if gla_systems and not a.no_regimes else {}
    load1, wall = os.getloadavg()[0], time.perf_counter() - start

    print(
        f"\nGLA fwd+bwd on CPU: B={B} H={H} D={D} chunk {CHUNK}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; median of {a.repeats} after a warmup, systems interleaved (n=1: one call); "
        f"load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs; bench {wall:.0f} s"
    )
    print("mem x: bytes saved for backward / one [B,T,H,D] fp32 tensor; err: vs fp64 recurrence (sdpa: vs fp64 SDPA)")
    lens = ", ".join(map(str, PROBE_LENS))
    times = "; ".join(f"{s} " + ", ".join(f"{p[T]['time_s']:.2f}" for T in PROBE_LENS) for s, p in probes.items())
    print(f"probes (fp32 fwd+bwd s at T={lens}; they set the skip estimates): {times}\n")
    print_main_table(results)
    print_noise(results, (load0, load1))
    if regimes:
        print_regimes(regimes)
    targets = check_targets(results, regimes)
    print_targets(targets)

    out = {
        "bench": "gla",
        "results": [
            {"T": T, "dtype": dt, "system": s, **{k: v for k, v in r.items() if k != "slow"}}
            for (T, dt), rows in results.items()
            for s, r in rows.items()
        ],
        "regime_errors_fp32": regimes,
        "targets": targets,
        "probes": probes,
        "loadavg": [load0, load1],
        "config": {**vars(a), "B": B, "H": H, "D": D, "chunk": CHUNK, "threads": torch.get_num_threads()},
    }
    print(json.dumps(_json_safe(out)))
    return exit_status([t["verdict"] for t in targets.values()], a.allow_missing_peers)


def _json_safe(x):
    """Non-finite floats (a NaN error) become null; dict keys strings."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


if __name__ == "__main__":
    sys.exit(main())
