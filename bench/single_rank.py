"""Single-rank throughput: our GPT against a plain-PyTorch nanoGPT-style GPT of the same config.

`PeerGPT` (megatron_zpp/testing/peers/model.py, also bench/zero.py's peers' model) is a
straightforward model of the identical architecture (pre-norm RMSNorm, RoPE rotating (x[i],
x[i+d/2]), causal SDPA, SwiGLU, tied embeddings, no biases) built from separate nn.Linear
modules. It is loaded with OUR initialized weights (fused qkv = [q;k;v] and fc1 = [gate;up] are
split), and before any timing both must give the same loss and gradients
on the same batch in fp32 (1e-4 relative): identical config and init. Both are then cast to
--dtype (the whole model, as pretrain_gpt.py does with --bf16) and timed on forward + backward
+ torch.optim.AdamW(foreach) step, alternating ours/peer after warmup; the median step counts.
TFLOP/s use megatron_zpp.perf.flops_per_token for both; MFU is against perf.peak_tflops (GPU
data-sheet peak, or measured CPU matmul peak). The peer is softmax-only without GQA: with
--attention-type gla or --num-query-groups it is not timed.

`compiled` is our model with --torch-compile (training/builders.compile_model: each block's
forward through torch.compile, inductor), checked against eager first (fp32, 1e-4 relative); that
first call compiles, and its time is reported apart as the cold compile. The three systems
alternate step by step after warmup; the ratios are of medians, of the fastest steps, and the
median of the paired per-round ratios. `kernels` (--kernels-compare, where Triton runs natively:
a GPU) is our model on the Triton kernels (ops/dispatch.py mode triton) while `ours` then runs the
torch references, checked equal first (fp32, 1e-4). The last stdout line is one JSON object.

Run:  .venv/bin/python bench/single_rank.py            (CPU, fp32, < 3 min on an idle machine with compile)
      .venv/bin/python bench/single_rank.py --hidden-size 128 --num-attention-heads 4 --num-query-groups 2 \
          --seq-length 128 --micro-batch-size 4 --attention-type gla --softmax-attention-every 2
                                                         (the first-hour model, examples/configs/tiny_cpu.yaml)
      .venv/bin/python bench/single_rank.py --device cuda --dtype bf16 --micro-batch-size 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from megatron_zpp.config import ModelConfig
from megatron_zpp.model import GPT, count_parameters, init_weights
from megatron_zpp.ops import dispatch
from megatron_zpp.perf import flops_per_token, peak_tflops
from megatron_zpp.testing.peers.model import PeerGPT, to_peer_names
from megatron_zpp.training.builders import compile_model


def check_equal(ours: GPT, peer: PeerGPT, x, y, tol: float) -> dict:
    """Same loss and gradients on one batch; raises naming the first parameter that differs."""
    lo, lp = ours(x, y).mean(), peer(x, y)  # ours returns per-token losses, the peer (like nanoGPT) their mean
    (lo + lp).backward()
    rel = abs(lo.item() - lp.item()) / abs(lp.item())
    if not rel <= tol:
        raise AssertionError(f"loss differs: ours {lo.item():.6f} peer {lp.item():.6f} (rel {rel:.2e} > {tol})")
    ours_grads = to_peer_names({n: p.grad for n, p in ours.named_parameters()}, ours.cfg.num_layers)
    peer_grads = {n: p.grad for n, p in peer.named_parameters()}  # lm_head.weight is wte.weight: listed once
    worst = ("", 0.0)
    for name, g in ours_grads.items():
        e = ((g - peer_grads[name]).norm() / peer_grads[name].norm().clamp_min(1e-30)).item()
        if not e <= tol * 10:
            raise AssertionError(f"gradient of {name} differs: relative error {e:.2e}")
        worst = max(worst, (name, e), key=lambda t: t[1])
    return {
        "loss_ours": lo.item(),
        "loss_peer": lp.item(),
        "loss_rel_diff": rel,
        "worst_grad": worst[0],
        "worst_grad_rel_diff": worst[1],
    }


def check_compiled(ours: GPT, compiled: GPT, x, y, tol: float) -> dict:
    """The compiled model against eager on one batch (fp32); the first call compiles: its time is returned."""
    lo = ours(x, y).mean()
    lo.backward()
    t0 = time.perf_counter()
    lc = compiled(x, y).mean()
    lc.backward()
    compile_s = time.perf_counter() - t0
    rel = abs(lo.item() - lc.item()) / abs(lo.item())
    worst = max(
        ((pc.grad - po.grad).norm() / po.grad.norm().clamp_min(1e-30)).item()
        for po, pc in zip(ours.parameters(), compiled.parameters())
    )
    if not (rel <= tol and worst <= tol * 10):
        raise AssertionError(f"compiled differs from eager: loss rel {rel:.2e}, worst grad rel {worst:.2e}")
    return {"compile_s": compile_s, "compiled_loss_rel_diff": rel, "compiled_worst_grad_rel_diff": worst}


def with_kernels(mode: str, device: torch.device, fn):
    def run(*args):
        dispatch.set_kernels(mode, device)
        return fn(*args)

    return run


def check_kernels(ours, fused, x, y, device, tol: float) -> dict:
    """fp32: our model on the Triton kernels against the torch references, loss and gradients."""
    dispatch.set_kernels("torch", device)
    ours(x, y).mean().backward()
    dispatch.set_kernels("triton", device)
    loss_k, loss_t = fused(x, y).mean(), ours(x, y).mean().detach()
    loss_k.backward()
    rel = abs(loss_k.item() - loss_t.item()) / abs(loss_t.item())
    worst = max(
        ((pk.grad - po.grad).norm() / po.grad.norm().clamp_min(1e-30)).item()
        for po, pk in zip(ours.parameters(), fused.parameters())
    )
    ours.zero_grad(set_to_none=True)
    fused.zero_grad(set_to_none=True)
    if not (rel <= tol and worst <= tol * 10):
        raise AssertionError(f"Triton kernels differ from the references: loss rel {rel:.2e}, grad rel {worst:.2e}")
    return {"kernels_loss_rel_diff": rel, "kernels_worst_grad_rel_diff": worst}


def make_step(model, loss_fn, sync):
    model.zero_grad(set_to_none=True)  # drop the equivalence check's gradients
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    return step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in [
        ("--hidden-size", 256),
        ("--num-layers", 4),
        ("--num-attention-heads", 8),
        ("--seq-length", 256),
        ("--micro-batch-size", 8),
        ("--vocab-size", 4096),
        ("--steps", 15),
        ("--warmup", 3),
        ("--seed", 1234),
        ("--softmax-attention-every", 0),
        ("--linear-chunk-size", 16),
    ]:
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--num-query-groups", type=int, default=None, help="GQA kv heads (default: = heads; no peer)")
    ap.add_argument("--no-compile", action="store_true", help="time eager and the peer only")
    ap.add_argument(
        "--kernels-compare",
        action="store_true",
        help="also time our model on the Triton kernels ('kernels'); 'ours' then runs the torch references",
    )
    ap.add_argument("--max-seconds", type=float, default=50, help="stop the timed loop early past this (>= 3 steps)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--attention-type", choices=["softmax", "gla"], default="softmax")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    a = ap.parse_args(argv)

    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device(a.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cfg = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        seq_length=a.seq_length,
        vocab_size=a.vocab_size,
        attention_type=a.attention_type,
        softmax_attention_every=a.softmax_attention_every,
        group_query_attention=a.num_query_groups is not None,
        num_query_groups=a.num_query_groups,
        linear_chunk_size=a.linear_chunk_size,
        # the figures' block (this project's former defaults), the SwiGLU width rounded up as it was
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        ffn_hidden_size=64 * ((int(8 * a.hidden_size / 3) + 63) // 64),
    )
    assert cfg.hidden_size % cfg.num_attention_heads == 0 and cfg.head_dim % 2 == 0, "heads must divide hidden, even"
    load0 = os.getloadavg()[0]

    ours = GPT(cfg, a.vocab_size).to(device)
    init_weights(ours, a.seed)
    data = torch.randint(
        0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=torch.Generator().manual_seed(a.seed)
    )
    x, y = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    check, peer, compiled, fused = {}, None, None, None
    if a.kernels_compare:
        if dispatch.why_not_triton(device):
            raise SystemExit(f"--kernels-compare: {dispatch.why_not_triton(device)}")
        fused = GPT(cfg, a.vocab_size).to(device)
        init_weights(fused, a.seed)
        check.update(check_kernels(ours, fused, x, y, device, tol=1e-4))
    if not a.no_compile:
        compiled = GPT(cfg, a.vocab_size).to(device)
        init_weights(compiled, a.seed)
        compile_model([compiled], cfg.seq_length)
        check.update(check_compiled(ours, compiled, x, y, tol=1e-4))
        ours.zero_grad(set_to_none=True)
    if a.attention_type == "softmax" and cfg.kv_heads == cfg.num_attention_heads:
        peer = PeerGPT(cfg, a.vocab_size)
        peer.load_state_dict(to_peer_names(ours.state_dict(), cfg.num_layers), strict=False)  # lm_head tied to wte
        peer.to(device)
        check.update(check_equal(ours, peer, x, y, tol=1e-4))  # fp32: same config, same init
        peer.to(dtype)
    else:
        print("note: the peer is softmax-only without GQA: it is not timed here")
    ours.to(dtype)
    for model in (compiled, fused):
        if model is not None:
            model.to(dtype)
    if peer is not None and dtype != torch.float32:  # informative only: the two differ in where they round
        with torch.no_grad():
            lo, lp = ours(x, y).mean().item(), peer(x, y).item()
        check[f"loss_rel_diff_{a.dtype}"] = abs(lo - lp) / abs(lp)

    peak, peak_desc = peak_tflops(device, dtype, None)
    steps = {"ours": make_step(ours, lambda: ours(x, y).mean(), sync)}
    if fused is not None:  # the dispatch mode is read at call time: each system sets its own
        steps["ours"] = with_kernels("torch", device, steps["ours"])
        steps["kernels"] = with_kernels("triton", device, make_step(fused, lambda: fused(x, y).mean(), sync))
    if compiled is not None:
        steps["compiled"] = make_step(compiled, lambda: compiled(x, y).mean(), sync)
    if peer is not None:
        steps["peer"] = make_step(peer, lambda: peer(x, y), sync)
    times: dict[str, list[float]] = {k: [] for k in steps}
    first: dict[str, float] = {}  # each system's first warmup step (compiled: + any recompile for --dtype)
    start = time.perf_counter()
    for i in range(a.warmup + a.steps):  # alternate ours, compiled, peer, ours, ...
        for k, step in steps.items():
            t = step()
            first.setdefault(k, t)
            if i >= a.warmup:
                times[k].append(t)
        if a.warmup + 2 <= i < a.warmup + a.steps - 1 and time.perf_counter() - start > a.max_seconds:
            print(f"note: stopped after {i + 1 - a.warmup} timed steps (--max-seconds {a.max_seconds})")
            break
    peak, load1 = max(peak, peak_tflops(device, dtype, None)[0]), os.getloadavg()[0]  # peak: best of two

    fpt, tokens = flops_per_token(cfg, a.vocab_size), a.micro_batch_size * a.seq_length
    res = {}
    for k, ts in times.items():
        med = statistics.median(ts)
        res[k] = {
            "step_ms": med * 1e3,
            "min_step_ms": min(ts) * 1e3,
            "tokens_per_s": tokens / med,
            "tflops": fpt * tokens / med / 1e12,
            "mfu": fpt * tokens / med / 1e12 / peak if peak else None,
        }

    print(
        f"\nsingle-rank GPT: {count_parameters(ours) / 1e6:.2f}M params, hidden {a.hidden_size}, layers "
        f"{a.num_layers}, heads {a.num_attention_heads}, seq {a.seq_length}, micro-batch {a.micro_batch_size}, "
        f"vocab {a.vocab_size}, {a.attention_type}, {a.dtype}, {device}, {torch.get_num_threads()} threads"
    )
    print(dispatch.describe(device) + (" ('kernels' row: Triton; 'ours': torch)" if fused is not None else ""))
    if "loss_ours" in check:
        print(
            f"equivalence (fp32): loss ours {check['loss_ours']:.6f} peer {check['loss_peer']:.6f} (rel "
            f"{check['loss_rel_diff']:.1e}); worst grad {check['worst_grad']} rel {check['worst_grad_rel_diff']:.1e}"
        )
    print(
        f"peak: {peak:.3f} TFLOP/s ({peak_desc}); model FLOPs/token {fpt / 1e6:.2f}M (fwd+bwd); "
        f"median of {len(times['ours'])} alternating steps\n"
    )
    if "compile_s" in check:
        print(
            f"compiled vs eager (fp32): loss rel {check['compiled_loss_rel_diff']:.1e}, worst grad rel "
            f"{check['compiled_worst_grad_rel_diff']:.1e}; cold compile (first compiled fwd+bwd, fp32) "
            f"{check['compile_s']:.1f} s, not in the timed steps; first warmup step: "
            + ", ".join(f"{k} {t:.2f} s" for k, t in first.items())
            + "\n"
        )
    spread = max(r["step_ms"] / r["min_step_ms"] for r in res.values())
    speedups = {
        f"{fast}_vs_{slow}": {
            "median": res[slow]["step_ms"] / res[fast]["step_ms"],
            "fastest": res[slow]["min_step_ms"] / res[fast]["min_step_ms"],
            "paired": statistics.median(s / f for f, s in zip(times[fast], times[slow])),  # same round
        }
        for fast, slow in [("compiled", "ours"), ("kernels", "ours"), ("ours", "peer"), ("compiled", "peer")]
        if fast in res and slow in res
    }
    paired = speedups.get("ours_vs_peer", {}).get("paired")
    if spread > 1.15:  # something else runs on the device (seen on shared CPUs: bursts that slow a step 2-10x)
        print(
            f"WARNING: noisy timing (a median step is {spread:.2f}x the fastest; load {load0:.1f} -> {load1:.1f} "
            f"on {os.cpu_count()} CPUs): trust the fastest steps and the paired speedups\n"
        )
    print(f"{'':20}" + "".join(f"{c:>12}" for c in res))
    for key, label, fmt in [
        ("step_ms", "median step (ms)", "{:12.1f}"),
        ("min_step_ms", "fastest step (ms)", "{:12.1f}"),
        ("tokens_per_s", "tokens/s", "{:12.0f}"),
        ("tflops", "model TFLOP/s", "{:12.4f}"),
        ("mfu", "MFU", "{:12.2%}"),
    ]:
        row = "".join(fmt.format(res[c][key]) if res[c][key] is not None else f"{'n/a':>12}" for c in res)
        print(f"{label:20}{row}")
    if speedups:
        print(f"\n{'speedup (>1: first faster)':28}{'median':>10}{'fastest':>10}{'paired':>10}")
        for name, r in speedups.items():
            target = "   target >= 1.3 (CPU goal)" if name == "compiled_vs_eager" and device.type == "cpu" else ""
            label = name.replace("ours", "eager").replace("_vs_", " vs ")
            print(f"{label:28}{r['median']:10.3f}{r['fastest']:10.3f}{r['paired']:10.3f}{target}")

    out = {
        "bench": "single_rank",
        **{
            f"{k}_{f}" if f != "mfu" else f"mfu_{k}": res.get(k, {}).get(f)
            for f in res["ours"]
            for k in ("ours", "compiled", "peer")
        },
        "ratio": res["ours"]["tokens_per_s"] / res["peer"]["tokens_per_s"] if "peer" in res else None,
        "ratio_fastest": res["peer"]["min_step_ms"] / res["ours"]["min_step_ms"] if "peer" in res else None,
        "ratio_paired": paired,
        "speedups": speedups,
        "first_step_s": first,
        "peak_tflops": peak,
        "peak_desc": peak_desc,
        "flops_per_token": fpt,
        "params": count_parameters(ours),
        "steps_timed": len(times["ours"]),
        "loadavg": [load0, load1],
        "noisy": spread > 1.15,
        **check,
        "peer": "nanoGPT-style plain PyTorch (in bench)" if peer else "none (softmax-only peer)",
        "config": {**vars(a), "ffn_size": cfg.ffn_size, "threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}))


if __name__ == "__main__":
    main()
