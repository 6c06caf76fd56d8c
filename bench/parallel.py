"""Pipeline bubble, TP and PP step times: ours vs theory and vs PyTorch's own parallelism.

    .venv/bin/python bench/parallel.py            (moderate, ~2 min on 2 CPU cores)
    .venv/bin/python bench/parallel.py --quick    (smoke run, smaller model and fewer steps)

Three comparisons, each printed side by side with ratios; the last stdout line is one JSON
object with every figure. All ranks are gloo processes (megatron_zpp/testing/dist.py), 1 thread each; the
model is our softmax GPT (RMSNorm, RoPE, causal SDPA, SwiGLU, tied embedding, fp32, no GQA).

1. Pipeline bubble. Our training (setup/train_step, --pipeline-model-parallel-size p) with
   Stage.forward/backward and the schedule call wrapped by timers (monkeypatched in the
   bench's processes; the schedule starts after a barrier). Bubble = 1 - sum(rank compute)
   / (p * span), span = the slowest rank's schedule wall (p2p waits count as bubble, the
   optimizer is outside). Theory as a fraction of the span: (p-1)/(V*m+p-1) (1F1B: V=1;
   = Megatron's interleaved (p-1)/(V*m) relative to the ideal time). "measured" uses the
   model; "emulated" a tiny model whose forward/backward also sleep, so no core contention:
   it isolates schedule + p2p costs. p=2 is the headline: 4 ranks time-share the 2 cores.
2. TP2: our train_step with --tensor-model-parallel-size 2 vs a nanoGPT-style model of the
   same architecture parallelized with torch.distributed.tensor.parallel.parallelize_module
   (Colwise q/k/v/gate/up/lm_head, Rowwise o/down/embedding, loss_parallel) on a 2-rank
   DeviceMesh, with the same micro-batches accumulated, grad-norm clip and AdamW.
3. PP2: our train_step with --pipeline-model-parallel-size 2 (1F1B) vs
   torch.distributed.pipelining PipelineStage + Schedule1F1B on the same split (stage 0:
   embedding + first half of the layers, stage 1: the rest + norm + output + loss), same
   micro-batches; the peer sums the tied-embedding grads of its two stages as we do, clips
   by the global grad norm and steps AdamW.
Step time = barrier, step, barrier; median over the timed steps after warmup. A peer that
fails in this torch version is reported with its exception instead of a time.
4. Plain DP with and without --overlap-grad-reduce on the emulated 2-node cluster of
   megatron_zpp/testing/cluster.py (root: 2 network namespaces x 2 ranks, the cross-node veth shaped with
   tc tbf; without root the ranks run on loopback, unshaped, and the table says so), through
   bench/zero.py's launcher and probe (pretrain_gpt.py unchanged, step time around each
   train_step): DP 4, one micro-batch per rank, fp32, --ddp-bucket-size elements per bucket,
   both variants in every round (order alternating), --dp-overlap-rates in one launch each.

    sudo .venv/bin/python bench/parallel.py --only-dp-overlap     (section 4 alone, ~10 min)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron_zpp.testing.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------ ours


def our_config(a: dict, world: int, extra: list[str]):
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.validation import validate

    argv = (
        f"--mock-data --num-layers {a['layers']} --hidden-size {a['hidden']} --num-attention-heads "
        f"{a['heads']} --seq-length {a['seq']} --vocab-size {a['vocab']} --micro-batch-size "
        f"{a['mbs']} --train-iters {a['warmup'] + a['steps']} --device cpu --log-interval 1000000 "
        # the block the peer mirrors (this project's former defaults; Megatron's are LayerNorm, GeLU, dropout 0.1)
        f"--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
        f"--hidden-dropout 0 --attention-dropout 0 --weight-decay 0.1 "
        f"--adam-beta2 0.95 --ffn-hidden-size {64 * ((int(8 * a['hidden'] / 3) + 63) // 64)}"
    ).split() + extra
    return validate(parse_args(argv), world)


@contextlib.contextmanager
def stage_timers(emulate: float = 0.0, V: int = 1):
    """Wraps Stage.forward/backward and the training step's run_schedule with timers (this process only);
    yields [compute, schedule wall], accumulated. With `emulate` > 0 each chunk's forward also
    sleeps emulate/V s and its backward 2*emulate/V s: an ideal machine without core contention."""
    from megatron_zpp.pipeline_parallel import schedules
    from megatron_zpp.training import step

    acc = [0.0, 0.0]
    fwd, bwd, sched = schedules.Stage.forward, schedules.Stage.backward, step.run_schedule

    def timed(fn, slot, sleep=0.0, barrier=False):
        def wrapper(*args, **kw):
            if barrier:
                dist.barrier()  # all stages start together: spans compare across ranks
            t = time.perf_counter()
            out = fn(*args, **kw)
            time.sleep(sleep)
            acc[slot] += time.perf_counter() - t
            return out

        return wrapper

    schedules.Stage.forward = timed(fwd, 0, emulate / V)
    schedules.Stage.backward = staticmethod(timed(bwd, 0, 2 * emulate / V))
    step.run_schedule = timed(sched, 1, barrier=True)
    try:
        yield acc
    finally:
        schedules.Stage.forward, schedules.Stage.backward = fwd, staticmethod(bwd)
        step.run_schedule = sched


def timed_steps(step, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t = time.perf_counter()
        step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def ours_step_time(a: dict, world: int, extra: list[str]) -> float:
    from megatron_zpp import training

    run = training.setup(our_config(a, world, extra))
    return statistics.median(timed_steps(lambda: training.train_step(run), a["warmup"], a["steps"]))


def ours_bubble(a: dict, world: int, m: int, V: int, emulate: float = 0.0) -> list[tuple[float, float]]:
    """(compute, schedule wall) of this rank for each timed step."""
    from megatron_zpp import training

    if emulate:  # a tiny model: its real compute is small next to the emulated one
        a = dict(a, hidden=64, heads=4, seq=32, warmup=1, steps=2)
    extra = ["--pipeline-model-parallel-size", str(world), "--global-batch-size", str(m * a["mbs"])]
    if V > 1:
        extra += ["--num-layers-per-virtual-pipeline-stage", str(a["layers"] // (world * V))]
    run = training.setup(our_config(a, world, extra))
    samples = []
    with stage_timers(emulate, V) as acc:
        for i in range(a["warmup"] + a["steps"]):
            acc[:] = [0.0, 0.0]
            training.train_step(run)
            if i >= a["warmup"]:
                samples.append(tuple(acc))
    return samples


# ------------------------------------------------------------------ peer: the same GPT in plain PyTorch


class Attention(nn.Module):
    def __init__(self, a: dict):
        super().__init__()
        h, self.d = a["hidden"], a["hidden"] // a["heads"]
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, self.d, 2).float() / self.d)
        angles = torch.arange(a["seq"]).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def rope(self, x):  # [B, heads, T, d], rotating (x[i], x[i + d/2])
        half = self.d // 2
        return x * self.cos + torch.cat([-x[..., half:], x[..., :half]], -1) * self.sin

    def forward(self, x):
        B, T, _ = x.shape  # heads = local heads under TP (q/k/v are column-sharded)
        q, k, v = (p(x).view(B, T, -1, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, a: dict):
        super().__init__()
        h, ffn = a["hidden"], 64 * ((int(8 * a["hidden"] / 3) + 63) // 64)  # our swiglu width
        self.ln_1, self.ln_2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.attn = Attention(a)
        self.gate, self.up, self.down = nn.Linear(h, ffn, False), nn.Linear(h, ffn, False), nn.Linear(ffn, h, False)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = self.ln_2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PeerPart(nn.Module):
    """Layers [lo, hi) of the peer GPT, with the embedding if first and norm + lm_head if last."""

    def __init__(self, a: dict, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.wte = nn.Embedding(a["vocab"], a["hidden"]) if first else None
        self.h = nn.ModuleList(Block(a) for _ in range(lo, hi))
        self.ln_f = nn.RMSNorm(a["hidden"], eps=1e-5) if last else None
        self.lm_head = nn.Linear(a["hidden"], a["vocab"], bias=False) if last else None
        for p in (p for p in self.parameters() if p.ndim == 2):
            nn.init.normal_(p, std=0.02)

    def forward(self, x):
        x = self.wte(x) if self.wte is not None else x
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.lm_head is not None else x


def batches(a: dict, m: int):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, a["vocab"], (m * a["mbs"], a["seq"] + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def adamw(params):
    """AdamW as ours: no decay on 1-D params; DTensor and plain tensors in separate groups (foreach can't mix)."""
    kinds = {}
    for p in params:
        kinds.setdefault((p.ndim >= 2, type(p).__name__), []).append(p)
    return torch.optim.AdamW(
        [{"params": ps, "weight_decay": 0.1 if decay else 0.0} for (decay, _), ps in kinds.items()],
        lr=3e-4,
        betas=(0.9, 0.95),
        foreach=True,
    )


def clip_and_step(params, opt, group, plain_replicated: bool):
    """Clip by the global grad norm (1.0): sharded grads' squares are summed over the group;
    plain tensors are replicated copies under TP (counted once), disjoint stage params under PP."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    shared = [g for g in grads if not isinstance(g, DTensor) and plain_replicated]
    split = [g.to_local() if isinstance(g, DTensor) else g for g in grads if not any(g is s for s in shared)]
    sq = torch.stack([g.pow(2).sum() for g in split]).sum()
    dist.all_reduce(sq, group=group)
    if shared:
        sq = sq + torch.stack([g.pow(2).sum() for g in shared]).sum()
    scale = (1.0 / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    opt.step()
    opt.zero_grad(set_to_none=True)


def dtensor_tp_step_time(a: dict, m: int, group) -> float:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    torch.manual_seed(0)
    mesh = DeviceMesh.from_group(group, "cpu")
    model = PeerPart(a, 0, a["layers"], True, True)
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(a["layers"]):
        plan.update({f"h.{i}.attn.{n}": ColwiseParallel() for n in "qkv"})
        plan.update({f"h.{i}.{n}": ColwiseParallel() for n in ("gate", "up")})
        plan.update({f"h.{i}.attn.o": RowwiseParallel(), f"h.{i}.down": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # tie: both are the vocab-sharded Shard(0) DTensor
    params = list(model.parameters())
    opt = adamw(params)
    tokens, labels = batches(a, m)

    def step():
        for x, y in zip(tokens.split(a["mbs"]), labels.split(a["mbs"])):
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / m
                loss.backward()
        clip_and_step(params, opt, group, plain_replicated=True)

    return statistics.median(timed_steps(step, a["warmup"], a["steps"]))


def pipelining_step_time(a: dict, m: int, group) -> float:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    rank, half = dist.get_rank(group), a["layers"] // 2
    part = PeerPart(a, 0, half, True, False) if rank == 0 else PeerPart(a, half, a["layers"], False, True)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), group=group)
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    params = list(part.parameters())
    opt = adamw(params)
    tied = part.wte.weight if rank == 0 else part.lm_head.weight
    tokens, labels = batches(a, m)

    def step():
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=labels, losses=[])
        dist.all_reduce(tied.grad, group=group)  # tied embedding: both copies take the summed gradient
        clip_and_step(params, opt, group, plain_replicated=False)

    return statistics.median(timed_steps(step, a["warmup"], a["steps"]))


def attempt(fn, *args):
    try:
        return {"time": fn(*args)}
    except Exception as e:  # noqa: BLE001  (a peer that fails is reported, not fatal)
        print(traceback.format_exc(), file=sys.stderr)
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}


# ------------------------------------------------------------------ rank entry points


def bubbles(a: dict, world: int) -> dict:
    return {
        "bubble": {f"m{m}_V{V}": attempt(ours_bubble, a, world, m, V) for m in a["m"] for V in (1, 2)},
        "emulated": {f"m{m}_V{V}": attempt(ours_bubble, a, world, m, V, a["emulate"]) for m in a["m"] for V in (1, 2)},
    }


def ranks(rank: int, world: int, a: dict) -> dict:
    sys.stdout = open(os.devnull, "w")  # our setup() logs on rank 0; the parent prints the table
    if world != 2:
        return bubbles(a, world)
    peer_group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=90))  # a failing peer errors, not hangs
    out = bubbles(a, world)
    mt = a["m"][0]
    gbs = ["--global-batch-size", str(mt * a["mbs"])]
    out["tp_ours"] = attempt(ours_step_time, a, world, ["--tensor-model-parallel-size", "2"] + gbs)
    out["tp_peer"] = attempt(dtensor_tp_step_time, a, mt, peer_group)
    out["pp_ours"] = attempt(ours_step_time, a, world, ["--pipeline-model-parallel-size", "2"] + gbs)
    out["pp_peer"] = attempt(pipelining_step_time, a, mt, peer_group)
    return out


# ------------------------------------------------------------------ 4. plain DP, overlap on/off, 2 emulated nodes

DP_OVERLAP = {  # bench/zero.py system name -> (label, kind, our flags); bucket size appended at run time
    "ours-dp-sync": ("plain DP --no-overlap-grad-reduce", "ours", ["--zero-stage", "0", "--no-overlap-grad-reduce"]),
    "ours-dp-overlap": ("plain DP --overlap-grad-reduce", "ours", ["--zero-stage", "0", "--overlap-grad-reduce"]),
}


def dp_overlap(args) -> dict:
    """Both variants over every rate, --dp-overlap-repeats rounds: {rate: row}, and the setup."""
    import tempfile

    from megatron_zpp.testing.cluster import Cluster, parse_rate, take_lock
    from megatron_zpp.testing.zero_bench.launch import launch, round_order
    from megatron_zpp.testing.zero_bench.results import combine
    from megatron_zpp.testing.zero_bench.systems import NODES, SYSTEMS

    a = argparse.Namespace(
        rates=args.dp_overlap_rates,
        steps=args.dp_overlap_steps,
        warmup=2,
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=256,
        vocab_size=512,
        micro_batch_size=1,
        seed=1234,
        malloc_mmap_threshold=2**20,
        gloo_native_reduce_scatter=False,
        world=2 * NODES,
        per_node=2,
    )
    for name, (label, kind, flags) in DP_OVERLAP.items():
        extra = ["--ddp-bucket-size", str(args.ddp_bucket_size)] if name == "ours-dp-overlap" else []
        SYSTEMS[name] = (label, kind, flags + extra)
    lock = take_lock()
    cluster = Cluster(True, lock)
    work = tempfile.mkdtemp(prefix="zpp_dp_overlap_")
    runs, paths, qdisc, load0 = {n: [] for n in DP_OVERLAP}, {}, None, os.getloadavg()[0]
    try:
        if cluster.netns:
            paths = cluster.check_paths(parse_rate(a.rates[0]) or 1e9)
        for rep in range(args.dp_overlap_repeats):
            for name in round_order(list(DP_OVERLAP), rep):
                out = os.path.join(work, f"r{rep}", name)
                runs[name].append(launch(cluster, name, a, "fp32", out, None, timeout=900))
                print(f"[dp-overlap] round {rep + 1} {name}: {runs[name][-1]['status']}", file=sys.stderr)
        qdisc = cluster.qdisc()
    finally:
        cluster.cleanup()
    results = {n: combine(rs, a.rates, a.per_node) for n, rs in runs.items()}
    rows = {}
    for rate in a.rates:
        row = {}
        for name, res in results.items():
            if res["status"] != "ok":
                row[name] = {"error": res.get("reason")}
                continue
            r, led = res["rates"][rate], res["ledger"] or {}
            row[name] = {
                "step_s": r["step_s"],
                "spread": r["spread"],
                "loss_last": r["loss_last"],
                "ledger_cross_node_mb_per_rank": (led.get("inter_node_per_rank") or 0) / 1e6,
                "wire_cross_node_mb_per_node": (r["wire_bytes_per_node"] or 0) / 1e6,
            }
        sync, over = (row.get(n, {}).get("step_s") for n in DP_OVERLAP)
        row["speedup"] = sync / over if sync and over else None
        rows[rate] = row
    return {
        "rows": rows,
        "netns": cluster.netns,
        "why_not_shaped": cluster.reason or None,
        "path_check": paths,
        "qdisc_last": qdisc,
        "model": {k: getattr(a, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")},
        "ddp_bucket_size": args.ddp_bucket_size,
        "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "work_dir": work,
    }


def print_dp_overlap(d: dict) -> None:
    m = d["model"]
    where = (
        "emulated 2 nodes x 2 ranks (tc tbf on the cross-node veth)"
        if d["netns"]
        else (f"ONE loopback host, NOT shaped ({d['why_not_shaped']})")
    )
    print(
        f"\n4. Plain DP 4 over {where}: GPT fp32 {m['num_layers']} layers, hidden {m['hidden_size']}, seq "
        f"{m['seq_length']}, 1 micro-batch per rank; --ddp-bucket-size {d['ddp_bucket_size']}; load average "
        f"{d['load_avg'][0]} -> {d['load_avg'][1]}"
    )
    if d["path_check"]:
        print(f"   path check: {d['path_check']}")
    print(
        f"   {'rate':<9} {'sync s':>7} {'overlap s':>9} {'sync/overlap':>12} {'x-node MB/rank':>14}"
        f" {'loss rel diff':>13}"
    )
    for rate, row in d["rows"].items():
        sync, over = row["ours-dp-sync"], row["ours-dp-overlap"]
        if "error" in sync or "error" in over:
            print(f"   {rate:<9} FAILED: {sync.get('error') or over.get('error')}")
            continue
        print(
            f"   {rate:<9} {sync['step_s']:>7.3f} {over['step_s']:>9.3f} {row['speedup']:>12.2f} "
            f"{over['ledger_cross_node_mb_per_rank']:>14.1f} {abs(over['loss_last'] / sync['loss_last'] - 1):>13.1e}"
        )


# ------------------------------------------------------------------ report


def bubble_of(per_rank: list[list[tuple[float, float]]]) -> tuple[float, list[float], float]:
    """Median over steps of 1 - sum(compute)/(p * span), span = the slowest rank's schedule wall."""
    p, steps = len(per_rank), range(len(per_rank[0]))
    spans = [max(r[i][1] for r in per_rank) for i in steps]
    bubble = [1 - sum(r[i][0] for r in per_rank) / (p * spans[i]) for i in steps]
    i = bubble.index(statistics.median_low(bubble))
    return bubble[i], [1 - r[i][0] / spans[i] for r in per_rank], spans[i]


def bubble_rows(per_rank: list[dict], p: int) -> list[dict]:
    rows = []
    for key in per_rank[0]["bubble"]:
        m, V = (int(s[1:]) for s in key.split("_"))
        row = {
            "p": p,
            "m": m,
            "V": V,
            "schedule": "1F1B" if V == 1 else f"interleaved V={V}",
            "theory": (p - 1) / (V * m + p - 1),
        }
        for kind, name in (("bubble", "measured"), ("emulated", "emulated")):
            got = [r[kind][key] for r in per_rank]
            errors = [g["error"] for g in got if "error" in g]
            if errors:
                row[f"{name}_error"] = errors[0]
                continue
            bubble, idle, span = bubble_of([g["time"] for g in got])
            row.update({name: bubble, f"{name}_span_s": span, f"{name}_per_rank_idle": idle})
        rows.append(row)
    return rows


def pair(ours: dict, peer: dict) -> dict:
    out = {"ours_s": ours.get("time"), "peer_s": peer.get("time")}
    out["ratio_ours_over_peer"] = out["ours_s"] / out["peer_s"] if out["ours_s"] and out["peer_s"] else None
    return out | {f"{k}_error": r["error"] for k, r in (("ours", ours), ("peer", peer)) if "error" in r}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small model, few steps")
    ap.add_argument("--smoke", action="store_true", help="seconds: a toy model, 2 ranks only, no section 4")
    ap.add_argument("--only-dp-overlap", action="store_true", help="run section 4 alone (plain DP overlap on/off)")
    ap.add_argument("--no-dp-overlap", action="store_true", help="skip section 4")
    ap.add_argument("--dp-overlap-rates", nargs="+", default=["unshaped", "1gbit", "200mbit"])
    ap.add_argument("--dp-overlap-steps", type=int, default=5, help="timed steps per rate (section 4)")
    ap.add_argument("--dp-overlap-repeats", type=int, default=2, help="rounds of both variants (section 4)")
    ap.add_argument("--ddp-bucket-size", type=int, default=1_000_000, help="section 4's buckets (elements)")
    args = ap.parse_args(argv)
    if args.only_dp_overlap:
        d = dp_overlap(args)
        print_dp_overlap(d)
        print(json.dumps({"bench": "parallel", "dp_overlap": d}))
        return
    if args.smoke:
        a = dict(layers=8, hidden=32, heads=2, seq=16, vocab=128, mbs=1, warmup=0, steps=1, m=[4], emulate=0.001)
        args.no_dp_overlap = True
    elif args.quick:
        a = dict(layers=8, hidden=128, heads=4, seq=64, vocab=512, mbs=1, warmup=1, steps=2, m=[4], emulate=0.01)
    else:
        a = dict(layers=8, hidden=256, heads=4, seq=128, vocab=512, mbs=1, warmup=2, steps=4, m=[4, 8], emulate=0.04)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    two = run_distributed(ranks, 2, a, timeout=600)
    rows = bubble_rows(two, 2)
    try:
        rows += [] if args.smoke else bubble_rows(run_distributed(ranks, 4, a, timeout=600), 4)
    except Exception as e:  # noqa: BLE001
        rows.append({"p": 4, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    tp, pp = pair(two[0]["tp_ours"], two[0]["tp_peer"]), pair(two[0]["pp_ours"], two[0]["pp_peer"])
    overlap = None if args.no_dp_overlap else dp_overlap(args)

    ffn = 64 * ((int(8 * a["hidden"] / 3) + 63) // 64)
    print(
        f"\nGPT fp32: {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, ffn {ffn} (SwiGLU), seq "
        f"{a['seq']}, vocab {a['vocab']}, micro-batch {a['mbs']}; gloo on {os.cpu_count()} CPU cores, 1 thread/rank; "
        f"median of {a['steps']} steps after {a['warmup']} warmup\n"
    )
    print("1. Pipeline bubble = 1 - sum(rank compute) / (p * span), span = schedule wall of the slowest rank")
    print("   theory = (p-1)/(V*m+p-1) of the span (1F1B: V=1; = Megatron's (p-1)/(V*m) relative to ideal time)")
    print(
        f"   measured: the model above; emulated: a tiny model whose forward/backward per stage also sleep "
        f"{1e3 * a['emulate']:.0f}/{2e3 * a['emulate']:.0f} ms"
    )
    print("   (no core contention: isolates the schedule + p2p from the 2 shared cores)")
    print(
        f"   {'p':>2} {'m':>3} {'schedule':<16} {'theory':>6} {'measured':>8} {'/theory':>7} {'span s':>6} "
        f"{'emulated':>8} {'/theory':>7}  measured per-rank idle"
    )
    f = lambda r, k: f"{r[k]:>8.3f} {r[k] / r['theory']:>7.2f}" if k in r else f"{'FAILED':>16}"  # noqa: E731
    for r in rows:
        if "error" in r:
            print(f"   {r['p']:>2} FAILED: {r['error']}")
            continue
        idle = " ".join(f"{x:.2f}" for x in r.get("measured_per_rank_idle", []))
        note = "  <- 4 ranks time-share 2 cores" if r["p"] > (os.cpu_count() or 2) else ""
        span = f"{r['measured_span_s']:>6.3f}" if "measured_span_s" in r else f"{'':>6}"
        print(
            f"   {r['p']:>2} {r['m']:>3} {r['schedule']:<16} {r['theory']:>6.3f} {f(r, 'measured')} {span} "
            f"{f(r, 'emulated')}  {idle}{note}"
        )
        for k in ("measured_error", "emulated_error"):
            if k in r:
                print(f"      {k}: {r[k]}")
    print(f"\n2./3. Step time (forward+backward+clip+AdamW), {a['m'][0]} micro-batches, 2 ranks")
    print(f"   {'comparison':<46} {'ours s':>8} {'peer s':>8} {'ours/peer':>9}")
    for name, r in (("TP2 vs DTensor parallelize_module", tp), ("PP2 1F1B vs torch.distributed.pipelining", pp)):
        fmt = lambda v: f"{v:>8.3f}" if v is not None else f"{'n/a':>8}"  # noqa: E731
        ratio = f"{r['ratio_ours_over_peer']:>9.2f}" if r["ratio_ours_over_peer"] else f"{'n/a':>9}"
        print(f"   {name:<46} {fmt(r['ours_s'])} {fmt(r['peer_s'])} {ratio}")
        for side in ("ours", "peer"):
            if f"{side}_error" in r:
                print(f"      {side} FAILED: {r[f'{side}_error']}")
    if overlap is not None:
        print_dp_overlap(overlap)
    load = round(load_before, 2)
    busy = " -- BUSY: other processes share these cores, figures are distorted" if load > 1.0 else ""
    print(f"\ntotal bench time {time.perf_counter() - t0:.0f} s; 1-min load average at start {load}{busy}")
    print(
        json.dumps(
            {
                "bench": "parallel",
                "config": a,
                "cpu_cores": os.cpu_count(),
                "torch": torch.__version__,
                "load_avg_at_start": load,
                "bubble_theory": "(p-1)/(V*m+p-1) of the schedule span",
                "bubble": rows,
                "tp2": tp,
                "pp2": pp,
                "dp_overlap": overlap,
            }
        )
    )


if __name__ == "__main__":
    main()
