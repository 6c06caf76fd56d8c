"""Mixture of experts under expert parallelism: our MoE layer (alltoall and allgather dispatchers) against
megatron-core 0.19.2's MoELayer (the same two dispatchers), forward + backward, and the ledger's token bytes.

    sudo .venv/bin/python bench/moe.py         (EP 2, 4, 8 on the emulated cluster at 1 Gbit/s: ~5 min on 2 cores)
    sudo .venv/bin/python bench/moe.py --rate 200mbit
    .venv/bin/python bench/moe.py --quick      (smoke test: EP 2, a tiny shape, one timed iteration)
    .venv/bin/python bench/moe.py --eps 2 4 --tokens 2048 --iters 8 --dtype bf16

What runs, on EP gloo ranks (1 thread each; where: below), every rank with its own --tokens tokens (one
sequence, [1, T, H]; megatron-core's [T, 1, H] is the same memory):
  one rank, no EP  our layer holding all E experts on the rank's own tokens, no communication: the compute of
                   a balanced EP rank (the same router, T x topk expert rows), the floor under any dispatcher
  ours alltoall    megatron_zpp.moe.MoELayer, --moe-token-dispatcher-type alltoall: counts, tokens all-to-all
                   (uneven splits), the local experts, all-to-all back
  ours allgather   the same layer, allgather: tokens, probabilities and map all-gathered over EP, the local
                   experts on every rank's tokens routed to them, reduce-scattered back
  mcore alltoall   megatron-core's MoELayer (MoEAlltoAllTokenDispatcher) and
  mcore allgather  (MoEAllGatherTokenDispatcher), local spec: SequentialMLP experts, a GEMM per local expert,
                   its CPU path (its grouped GEMM needs CUDA); run on CPU through the shims of
                   megatron_zpp/testing/peers/megatron_moe.py (streams, host copies, buffers; none of its
                   arithmetic), with every reduce-scatter at the real-fabric volume, as ours
                   (testing/peers/gloo_collectives.py: gloo's own is an all-reduce)
Same weights everywhere (one full layer drawn on every rank from one seed, each system loaded from it: the
router replicated, each rank its E/EP experts by global index), same tokens and output gradient, softmax
top-k router in fp32, no capacity (dropless), no auxiliary loss, no shared expert: the router, dispatch,
experts and combine only. Ours runs a GEMM per local expert as megatron-core's SequentialMLP (--grouped-gemm:
our grouped GEMM op instead, on CPU a per-expert loop over stacked weights). Before timing, every system's
output and input gradient are compared with the single-rank layer on the same tokens (printed; a system that
disagrees is a bug, not a row). Also timed: "ours alltoall, skewed" and "mcore alltoall, skewed", the same
layers on tokens pushed toward EP rank 0's experts (--skew), where the busiest rank sets the pace.

Timing: per iteration every system once, in an order rotated each iteration (a load change hits all alike);
a sample is dist.barrier() then the forward + backward (loss sum(y * dy), input gradient included) on every
rank, the slowest rank's time; figures are medians over --iters after --warmup. Ratios are ours / mcore on the
same dispatcher (< 1: ours faster) and each system's exposed time over the floor. With EP ranks on 2 cores,
EP 4 and 8 run 2 and 4 ranks per core: the compute of every rank is serialized on the cores, so absolute times
grow with EP and communication hides nothing; the ratios between systems at one EP are the figures.

Ledger (megatron_zpp.comm.LEDGER; ours only, megatron-core's collectives do not pass through it): the bytes
each rank sends per forward + backward in the token all-to-alls (dispatch, combine, their backwards) against
the closed form T x topk x H x bytes x (EP-1)/EP per direction (uniform routing), and the exact count from
this rank's routing map (routes to experts of other EP ranks); the allgather dispatcher's all-gathers and
reduce-scatters against (EP-1) x T x (H x bytes + E x 5) per direction. Under --skew, each rank's all-to-all
bytes and the busiest rank's: a hot rank receives most of the routes and sends them all back in the combine.
Every system's torch.distributed calls and payload per forward + backward are printed from one trace that
both pass through (testing/peers/gloo_collectives.py), so the peer's bytes stand beside ours.

Where: the emulated 2-node cluster of megatron_zpp/testing/cluster.py (as root with iproute2: two network
namespaces, EP/2 ranks each, one torchrun per node, the veth link shaped by tc tbf at --rate; its lock keeps
one cluster bench at a time), else, and under --quick or --no-netns, loopback (run_distributed), said in the
header. The physical limit printed on the shaped link: the floor plus the link's time for the alltoall's
bytes (4 exchanges of EP/2 x EP/2 x T x topk / EP rows each way between the nodes), or, where ranks share
cores, the larger of the two (other ranks compute while one waits). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from megatron_zpp.testing.cluster import parse_rate

FLOOR = "one rank, no EP"
SYSTEMS = ("ours alltoall", "ours allgather", "mcore alltoall", "mcore allgather")
SKEWED = ("ours alltoall, skewed", "mcore alltoall, skewed")
PAIRS = (("ours alltoall", "mcore alltoall"), ("ours allgather", "mcore allgather"), SKEWED)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- one rank


def moe_config(cfg: dict, dispatcher: str):
    from megatron_zpp.moe.config import MoEConfig

    return MoEConfig(
        num_experts=cfg["experts"], hidden_size=cfg["hidden"], ffn_hidden_size=cfg["ffn"], topk=cfg["topk"],
        load_balancing_type="none", token_dispatcher=dispatcher, grouped_gemm=cfg["grouped_gemm"],
    )  # fmt: skip


def make_tokens(cfg: dict, rank: int, hot: torch.Tensor) -> dict:
    """This rank's tokens x [1, T, H], the output gradient dy, and x pushed along `hot` (the skewed tokens)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    dtype = DTYPES[cfg["dtype"]]
    x = torch.randn(1, cfg["tokens"], cfg["hidden"], generator=gen)
    dy = torch.randn(1, cfg["tokens"], cfg["hidden"], generator=gen)
    skewed = x + cfg["skew"] * hot
    return {"x": x.to(dtype), "dy": dy.to(dtype), "x_skew": skewed.to(dtype)}


def build_layers(rank: int, world: int, cfg: dict) -> tuple[dict, object, torch.Tensor]:
    """Every system's layer on this rank, loaded from one full layer drawn from one seed on every rank;
    returns (name -> layer, our groups, the unit direction toward EP rank 0's experts)."""
    from megatron_zpp.moe.layer import MoELayer
    from megatron_zpp.testing.peers.megatron_moe import load_from_ours, mcore_moe_layer
    from megatron_zpp.topology import ParallelContext, Topology, build_groups

    dtype = DTYPES[cfg["dtype"]]
    g = build_groups(Topology(world, ep=world), rank)
    ctx = ParallelContext(ep=g.ep, etp=g.etp, etp_ep=g.etp_ep, tp_cp=g.tp_cp)
    torch.manual_seed(cfg["seed"])
    full = MoELayer(moe_config(cfg, "alltoall"), init_std=cfg["init_std"], out_std=cfg["init_std"], dtype=dtype)
    with torch.no_grad():  # megatron-core keeps its router weight in the params dtype: the same values in ours
        full.router.weight.copy_(full.router.weight.to(dtype).float())
    weights = dict(full.named_parameters())
    layers = {FLOOR: full}
    for dispatcher in ("alltoall", "allgather"):
        ours = MoELayer(moe_config(cfg, dispatcher), ctx, dtype=dtype)
        with torch.no_grad():
            for name, p in ours.named_parameters():
                p.copy_(weights[name])
        peer = mcore_moe_layer(ours.cfg, dispatcher, g.ep.handle, dtype)
        load_from_ours(peer, ours)
        layers[f"ours {dispatcher}"], layers[f"mcore {dispatcher}"] = ours, peer
    local = cfg["experts"] // world
    hot = full.router.weight.detach().float()[:local].sum(0)
    return layers, g, hot / hot.norm()


def fwd_bwd(layer, x: torch.Tensor, dy: torch.Tensor, mcore: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of sum(y * dy) from a fresh input leaf; (y, dx) in ours' [1, T, H] layout. megatron-core's
    layers run inside megatron_moe.mcore_cpu(), which `measure` enters once for the whole run."""
    layer.zero_grad(set_to_none=True)
    if mcore:  # [T, 1, H]: the same memory for one sequence
        x = x.transpose(0, 1).detach().requires_grad_()
        y = layer(x)[0]
        (y * dy.transpose(0, 1)).sum().backward()
        return y.detach().transpose(0, 1), x.grad.transpose(0, 1)
    x = x.detach().requires_grad_()
    y = layer(x)[0]
    (y * dy).sum().backward()
    return y.detach(), x.grad


def runners(layers: dict, t: dict) -> dict:
    """name -> a call of that system's forward + backward on this rank's tokens."""
    calls = {}
    for name in (FLOOR, *SYSTEMS, *SKEWED):
        base = name.removesuffix(", skewed")
        x = t["x_skew"] if name in SKEWED else t["x"]
        calls[name] = lambda b=base, x=x: fwd_bwd(layers[b], x, t["dy"], b.startswith("mcore"))
    return calls


def agreement(calls: dict, layers: dict, t: dict) -> dict:
    """Each system's largest deviation from the single-rank layer on the same tokens, relative to the
    reference's largest magnitude: output and input gradient (skewed rows against the floor on x_skew)."""
    ref = calls[FLOOR]()
    ref_skew = fwd_bwd(layers[FLOOR], t["x_skew"], t["dy"], False)
    out = {}
    for name in (*SYSTEMS, *SKEWED):
        y, dx = calls[name]()
        want_y, want_dx = ref_skew if name in SKEWED else ref
        out[name] = max(
            float((y.float() - want_y.float()).abs().max() / want_y.float().abs().max()),
            float((dx.float() - want_dx.float()).abs().max() / want_dx.float().abs().max()),
        )
    return out


def ledger_of(fn) -> dict:
    """This rank's ledger bytes in one call of fn, by phase."""
    from megatron_zpp import comm

    comm.LEDGER.reset()
    fn()
    rows = comm.LEDGER.local_rows()
    comm.LEDGER.reset()
    phases: dict[str, float] = {}
    for r in rows:
        phases[r["phase"]] = phases.get(r["phase"], 0.0) + r["bytes"]
    return phases


def traced_of(trace, fn) -> dict:
    """torch.distributed's collectives one call of fn makes on this rank, as gloo_collectives' trace counts
    them for any caller: entry point -> [calls, payload bytes (all-to-all: the whole input, own slice too;
    all-gather: the output; reduce-scatter: the input)]."""
    before = trace.snapshot()
    fn()
    after = trace.snapshot()
    return {k: [v[0] - before.get(k, [0, 0])[0], v[1] - before.get(k, [0, 0])[1]] for k, v in after.items()}


def remote_routes(layer, x: torch.Tensor, rank: int, world: int) -> dict:
    """Routes of this rank's tokens to experts of other EP ranks (what it sends), and routes per EP rank."""
    with torch.no_grad():
        routing_map = layer.router(x).routing_map
    per_rank = routing_map.view(routing_map.shape[0], world, -1).sum(dim=(0, 2))
    return {"remote": int(per_rank.sum() - per_rank[rank]), "per_ep_rank": per_rank.tolist()}


def measure(rank: int, world: int, cfg: dict) -> dict:
    """Agreement, ledger bytes and every system's forward + backward times on this rank."""
    import warnings

    from megatron_zpp.testing.peers.gloo_collectives import install_gloo_collectives
    from megatron_zpp.testing.peers.megatron_moe import mcore_cpu

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")  # no TE / Apex: known
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated", category=FutureWarning)
    trace = install_gloo_collectives()  # before megatron.core binds torch.distributed's reduce-scatter
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    with mcore_cpu():  # once: no patching inside the timed calls (ours never asks torch.cuda anything)
        return _measure(rank, world, cfg, trace)


def _measure(rank: int, world: int, cfg: dict, trace) -> dict:
    import torch.distributed as dist

    layers, g, hot = build_layers(rank, world, cfg)
    t = make_tokens(cfg, rank, hot)
    calls = runners(layers, t)
    agree = agreement(calls, layers, t)  # also the first (untimed) call of each
    ledger = {n: ledger_of(calls[n]) for n in ("ours alltoall", "ours allgather", "ours alltoall, skewed")}
    traced = {n: traced_of(trace, calls[n]) for n in SYSTEMS}
    routes = {k: remote_routes(layers[FLOOR], t[k], rank, world) for k in ("x", "x_skew")}
    order, times = list(calls), {n: [] for n in calls}
    for it in range(cfg["warmup"] + cfg["iters"]):
        turn = it % len(order)
        for name in order[turn:] + order[:turn]:
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            if it >= cfg["warmup"]:
                times[name].append(time.perf_counter() - start)
    return {"agree": agree, "ledger": ledger, "traced": traced, "routes": routes, "times": times}


def worker_main(out_dir: str, cfg_json: str) -> None:
    """A rank launched by torchrun on the emulated cluster (env:// rendezvous): writes rank{r}.json."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = measure(rank, world, json.loads(cfg_json))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_shaped(cluster, ep: int, cfg: dict, work: str, timeout: float) -> list[dict]:
    """EP/2 ranks in each namespace of the emulated cluster (one torchrun per node); each rank's result."""
    from megatron_zpp.testing.cluster import REPO_ROOT, start_nodes, stop_nodes
    from megatron_zpp.testing.zero_bench.launch import wait_ranks

    out_dir = os.path.join(work, f"ep{ep}")
    os.makedirs(out_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    logs = [open(os.path.join(out_dir, f"node{n}.log"), "w") for n in range(2)]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", out_dir, json.dumps(cfg)]
    procs = start_nodes(cluster, cmd, env, logs, 2, ep // 2, 29700 + ep, cwd=REPO_ROOT)
    failed = wait_ranks(procs, time.perf_counter() + timeout)
    stop_nodes(cluster, procs)
    for f in logs:
        f.close()
    paths = [os.path.join(out_dir, f"rank{r}.json") for r in range(ep)]
    if failed is not None or not all(os.path.exists(p) for p in paths):
        tail = "".join(open(f.name, errors="replace").read() for f in logs).strip()[-1500:]
        raise RuntimeError(f"EP={ep} on the emulated cluster failed ({'timed out' if failed == 'timeout' else tail})")
    return [json.load(open(p)) for p in paths]


# ---------------------------------------------------------------- figures


def closed_forms(cfg: dict, ep: int) -> dict:
    """Bytes one rank sends per direction (forward; the backward sends the same): the token all-to-all under
    uniform routing, and the allgather dispatcher's all-gather (tokens, fp32 probabilities, 1-byte map)."""
    esize = DTYPES[cfg["dtype"]].itemsize
    T, H, E, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    return {
        "alltoall": T * k * H * esize * (ep - 1) / ep,
        "allgather": (ep - 1) * T * (H * esize + E * 4 + E),
        "allgather_scatter": (ep - 1) * T * H * esize,
    }


def summarize(per_rank: list[dict], cfg: dict, ep: int) -> dict:
    """Medians of the slowest rank, ratios, agreement and the ledger against the closed forms."""
    samples = {n: [max(ts) for ts in zip(*(r["times"][n] for r in per_rank))] for n in per_rank[0]["times"]}
    ms = {n: 1e3 * statistics.median(s) for n, s in samples.items()}
    ratios = {f"{a} / {b}": ms[a] / ms[b] for a, b in PAIRS}
    wins = {f"{a} / {b}": sum(x < y for x, y in zip(samples[a], samples[b])) for a, b in PAIRS}
    esize = DTYPES[cfg["dtype"]].itemsize
    row = cfg["hidden"] * esize

    def a2a(led: dict, phase: str) -> float:
        return led.get(phase, 0.0) + led.get(phase + "_bwd", 0.0)

    ledger = []
    for r in per_rank:
        uni, skew, ag = (
            r["ledger"]["ours alltoall"],
            r["ledger"]["ours alltoall, skewed"],
            r["ledger"]["ours allgather"],
        )
        ledger.append({
            "dispatch": uni.get("moe_dispatch", 0.0), "combine": uni.get("moe_combine", 0.0),
            "exact_dispatch": r["routes"]["x"]["remote"] * row,
            "fwd_bwd": a2a(uni, "moe_dispatch") + a2a(uni, "moe_combine"),
            "allgather_fwd": sum(v for p, v in ag.items() if p.startswith("moe_ag_") and not p.endswith("_bwd")),
            "skew_dispatch": skew.get("moe_dispatch", 0.0), "skew_combine": skew.get("moe_combine", 0.0),
            "skew_fwd_bwd": a2a(skew, "moe_dispatch") + a2a(skew, "moe_combine"),
            "skew_exact_dispatch": r["routes"]["x_skew"]["remote"] * row,
        })  # fmt: skip
    load = [sum(x) for x in zip(*(r["routes"]["x_skew"]["per_ep_rank"] for r in per_rank))]
    for me, (r, led) in enumerate(zip(per_rank, ledger)):  # exact: what it sends + what it receives and returns
        received = load[me] - r["routes"]["x_skew"]["per_ep_rank"][me]
        led["skew_exact_fwd_bwd"] = 2 * row * (r["routes"]["x_skew"]["remote"] + received)
    return {
        "ms": ms, "ratios": ratios, "wins": wins, "samples": len(samples[FLOOR]),
        "samples_ms": {n: [round(1e3 * x, 1) for x in v] for n, v in samples.items()},
        "agree": {n: max(r["agree"][n] for r in per_rank) for n in per_rank[0]["agree"]},
        "ledger": ledger, "closed": closed_forms(cfg, ep), "skew_load_share": max(load) / sum(load),
        "traced": {n: {k: v for k, v in per_rank[0]["traced"][n].items() if v[0]} for n in SYSTEMS},
    }  # fmt: skip


def cores_label(ep: int) -> str:
    ncpu = os.cpu_count() or 1
    return "1 core per rank" if ep <= ncpu else f"{ep / ncpu:g} ranks per core"


def link_ms(cfg: dict, ep: int) -> float | None:
    """The shaped link's time for the token all-to-alls of one forward + backward under uniform routing: each
    of the 4 carries EP/2 x EP/2 x T x topk / EP rows each way between the nodes (full duplex)."""
    if not cfg["rate_bps"]:
        return None
    rows = 4 * (ep // 2) ** 2 * cfg["tokens"] * cfg["topk"] / ep
    return 1e3 * rows * cfg["hidden"] * DTYPES[cfg["dtype"]].itemsize * 8 / cfg["rate_bps"]


def physical_limit(floor: float, link: float | None, ep: int) -> tuple[float | None, str]:
    """The alltoall layer's lower bound on the shaped link: with a core per rank a rank's exchange is on its
    critical path (floor + link); with ranks sharing cores, others compute while one waits (max of the two)."""
    if link is None:
        return None, ""
    if ep <= (os.cpu_count() or 1):
        return floor + link, "limit: floor + link"
    return max(floor, link), "limit: max(floor, link)"


def print_times(res: dict, cfg: dict) -> None:
    print("\n== forward + backward of the MoE layer, ms: median over iterations of the slowest rank ==")
    head = f"{'EP':>3} {'cores':<17} {'system':<24} {'ms':>9} {'over floor':>11} {'max rel. dev.':>14}"
    print(head + "\n" + "-" * len(head))
    for ep, r in res.items():
        floor = r["ms"][FLOOR]
        for i, (name, ms) in enumerate(r["ms"].items()):
            lead = f"{ep:>3} {cores_label(ep):<17}" if i == 0 else f"{'':>3} {'':<17}"
            dev = f"{r['agree'][name]:14.1e}" if name in r["agree"] else f"{'-':>14}"
            print(f"{lead} {name:<24} {ms:9.1f} {ms / floor - 1:+10.0%} {dev}")
        limit, how = physical_limit(floor, link_ms(cfg, ep), ep)
        if limit is not None:
            print(f"{'':>21} {how:<24} {limit:9.1f} {limit / floor - 1:+10.0%}  (link: alltoall bytes / rate)")
        for pair, ratio in r["ratios"].items():
            print(f"{'':>21} {pair}: x{ratio:.3f} (ours faster in {r['wins'][pair]}/{r['samples']} iterations)")


def print_ledger(res: dict, cfg: dict) -> None:
    mb = 1e6
    print(
        f"\n== ledger (comm.LEDGER), ours: bytes one rank sends, MB; closed form all-to-all = T x topk x H x "
        f"{DTYPES[cfg['dtype']].itemsize} B x (EP-1)/EP per direction (uniform routing) =="
    )
    head = (
        f"{'EP':>3} {'dispatch mean':>14} {'closed form':>12} {'ratio':>6} {'exact (routing)':>16} "
        f"{'fwd+bwd mean':>13} {'allgather fwd':>14} {'closed form':>12}"
    )
    print(head + "\n" + "-" * len(head))
    for ep, r in res.items():
        led, c = r["ledger"], r["closed"]
        disp = statistics.mean(x["dispatch"] for x in led)
        exact = statistics.mean(x["exact_dispatch"] for x in led)
        fb = statistics.mean(x["fwd_bwd"] for x in led)
        ag = statistics.mean(x["allgather_fwd"] for x in led)
        print(
            f"{ep:>3} {disp / mb:14.3f} {c['alltoall'] / mb:12.3f} {disp / c['alltoall']:6.3f} {exact / mb:16.3f} "
            f"{fb / mb:13.3f} {ag / mb:14.3f} {(c['allgather'] + c['allgather_scatter']) / mb:12.3f}"
        )
    print("   (fwd+bwd: dispatch + combine and their backwards, 4 x the dispatch; allgather fwd: its all-gathers")
    print("    of tokens, probabilities and map + the reduce-scatter back, padded to the largest rank's rows)")
    print("\n== collectives per forward + backward, rank 0, as torch.distributed sees them (both systems alike) ==")
    for ep, r in res.items():
        for name, calls in r["traced"].items():
            cells = ", ".join(f"{k} {int(c)} calls {b / mb:.3f} MB" for k, (c, b) in sorted(calls.items()))
            print(f"{ep:>3} {name:<16} {cells}")
    print("   (payload: all-to-all its whole input, own slice included; all-gather its output;")
    print("    reduce-scatter its input, sent as an all-to-all + local sum by both systems)")
    print(f"\n== under imbalance (--skew {cfg['skew']:g}): all-to-all MB per rank per forward + backward ==")
    head = (
        f"{'EP':>3} {'hot share':>10} {'per rank (rank 0 holds the hot experts)':<44} {'busiest':>8} "
        f"{'exact':>8} {'/ uniform':>10}"
    )
    print(head + "\n" + "-" * len(head))
    for ep, r in res.items():
        per = [x["skew_fwd_bwd"] for x in r["ledger"]]
        busiest = max(range(ep), key=lambda i: per[i])
        exact, uniform = r["ledger"][busiest]["skew_exact_fwd_bwd"], 4 * r["closed"]["alltoall"]
        cells = " ".join(f"{b / mb:.2f}" for b in per)
        print(
            f"{ep:>3} {r['skew_load_share']:10.1%} {cells:<44} {per[busiest] / mb:8.2f} {exact / mb:8.2f} "
            f"{per[busiest] / uniform:10.2f}"
        )
    print("   (hot share: routes to the busiest EP rank's experts, uniform 1/EP; exact: 2 x (routes it sends +")
    print("    routes it receives) x H x bytes, from the routing maps; / uniform: busiest over 4 x the closed form)")


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="See the module docstring.")
    ap.add_argument("--quick", action="store_true", help="smoke test: EP 2, a tiny shape, 1 timed iteration")
    ap.add_argument("--eps", type=int, nargs="+", default=None, help="expert-parallel sizes (default 2 4 8; quick 2)")
    ap.add_argument("--experts", type=int, default=8, help="--num-experts (default 8)")
    ap.add_argument("--topk", type=int, default=2, help="--moe-router-topk (default 2)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 512; quick 32)")
    ap.add_argument("--ffn", type=int, default=None, help="--moe-ffn-hidden-size (default 512; quick 16)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 512; quick 64)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights, tokens and GEMMs (default fp32)")
    ap.add_argument("--skew", type=float, default=None, help="push along EP rank 0's router rows (default 3)")
    ap.add_argument("--grouped-gemm", action="store_true", help="ours: the grouped GEMM op, not a GEMM per expert")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 6; quick 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations after the first call (default 1)")
    ap.add_argument("--rate", default="1gbit", help="the emulated cluster's link, e.g. 1gbit, 200mbit (default 1gbit)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only: no namespaces, no shaping")
    ap.add_argument("--lock-wait", type=float, default=0.0, help="seconds to wait for another bench's cluster lock")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per EP size")
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "CFG"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return a
    q = a.quick
    parse_rate(a.rate)  # a bad rate fails before anything runs
    a.eps = a.eps or ([2] if q else [2, 4, 8])
    bad = [ep for ep in a.eps if ep < 2 or ep % 2 or a.experts % ep]
    if bad:
        ap.error(f"--eps {bad[0]}: each EP size must be even (EP/2 ranks per emulated node) and divide --experts")
    if not 1 <= a.topk <= a.experts:
        ap.error(f"--topk {a.topk}: must lie in 1..--experts ({a.experts})")
    a.hidden, a.ffn = a.hidden or (32 if q else 512), a.ffn or (16 if q else 512)
    a.tokens = a.tokens or (64 if q else 512)
    a.iters = max(1, a.iters if a.iters is not None else (1 if q else 6))
    a.warmup = max(0, a.warmup if a.warmup is not None else (0 if q else 1))
    return a


def make_cfg(a: argparse.Namespace) -> dict:
    keys = ("experts", "topk", "hidden", "ffn", "tokens", "dtype", "grouped_gemm", "iters", "warmup")
    cfg = {k: getattr(a, k) for k in keys}
    extra = {"skew": 3.0 if a.skew is None else a.skew, "seed": 1234, "init_std": 0.02}
    return {**cfg, **extra, "rate_bps": None if a.no_netns or a.quick else parse_rate(a.rate)}


def run_all(a: argparse.Namespace, cfg: dict) -> tuple[dict, str]:
    """Every EP size on the emulated cluster (shaped at --rate) or on loopback; (results, where they ran)."""
    from megatron_zpp.testing.cluster import Cluster, wait_for_lock
    from megatron_zpp.testing.dist import run_distributed

    res, why = {}, "--quick" if a.quick else "--no-netns" if a.no_netns else ""
    cluster = None if why else Cluster(True, wait_for_lock(a.lock_wait))
    try:
        if cluster is not None and cluster.netns:
            cluster.shape(cfg["rate_bps"])
            where = f"the emulated cluster: 2 namespaces x EP/2 ranks, link {a.rate} ({cluster.qdisc()})"
            work = tempfile.mkdtemp(prefix="zpp_moe_bench_")
            for ep in a.eps:
                print(f"[moe-bench] EP={ep}, shaped {a.rate}", file=sys.stderr, flush=True)
                res[ep] = summarize(run_shaped(cluster, ep, cfg, work, a.timeout), cfg, ep)
            return res, where
        why = why or (cluster.reason if cluster is not None else "")
        cfg["rate_bps"] = None
        for ep in a.eps:
            print(f"[moe-bench] EP={ep}, loopback", file=sys.stderr, flush=True)
            res[ep] = summarize(run_distributed(measure, ep, cfg, timeout=a.timeout), cfg, ep)
        return res, f"loopback, unshaped (emulated cluster not used: {why})"
    finally:
        if cluster is not None:
            cluster.cleanup()


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker_main(*a.worker)
        return 0
    cfg, t0, load0 = make_cfg(a), time.time(), os.getloadavg()[0]
    res, where = run_all(a, cfg)
    print(
        f"\nMoE layer under expert parallelism, gloo ranks at 1 thread each on {os.cpu_count()} cores: E={a.experts}, "
        f"top-{a.topk} softmax, H={a.hidden}, F={a.ffn} (SwiGLU), {a.tokens} tokens per rank, {a.dtype}, dropless, "
        f"no aux loss; {a.iters} timed iterations after {1 + a.warmup} untimed, systems interleaved"
    )
    print(f"where: {where}")
    if a.dtype == "bf16":
        print(f"bf16 GEMMs: this CPU {'has' if _native_bf16() else 'lacks'} avx512_bf16")
    if load0 > (os.cpu_count() or 1) / 2:
        print(f"WARNING: machine busy at the start (1-min load {load0:.1f}): every row shares the cores alike")
    print_times(res, cfg)
    print_ledger(res, cfg)
    print(f"\nelapsed {time.time() - t0:.0f} s; 1-min load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    summary = {
        "bench": "moe", "config": {**cfg, "eps": a.eps}, "where": where, "cpus": os.cpu_count(),
        "torch_threads_per_rank": 1, "results": {str(ep): r for ep, r in res.items()},
        "elapsed_s": round(time.time() - t0, 1), "loadavg": [load0, os.getloadavg()[0]],
    }  # fmt: skip
    print(json.dumps(summary))
    return 0


def _native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
