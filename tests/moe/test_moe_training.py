"""A mixture-of-experts GPT trained at a parallel layout reproduces the single-rank run: the per-step losses
and the final weights (experts reassembled by name from the ranks that hold them, over expert TP) equal the
single-process run's, fp32, dropless routing, with the load-balancing and z losses on (their gradients reach
the router through every layout's scaling) and gradient clipping active (the norm counts each expert once).

One spawn per world size runs every layout of that size (tests/test_parity.py's harness)."""

import numpy as np
import pytest
import torch

from megatron_zpp.tensor_parallel import unshard
from tests.dist import run_distributed
from tests.test_parity import BASE, KINDS, assert_close_relative, train_and_collect

MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 "
    "--num-layers 4 --moe-layer-freq ([1]*3+[0]) --train-iters 3"
).split()
MODELS = {
    "moe_gpt": KINDS["softmax"] + MOE,
    "moe_gpt_8": KINDS["softmax"] + MOE + ["--num-experts", "8"],
    # packed documents (positions and attention restart at each document)
    "moe_gdn_packed": KINDS["gdn_hybrid"] + MOE + ["--reset-position-ids", "--reset-attention-mask"],
    # token dropping: an expert takes at most 1.0 x its even share of a rank's routes, the lowest probabilities
    # dropped first, counted on each rank's own tokens (megatron-core's capacity)
    "moe_gpt_capacity": KINDS["softmax"]
    + MOE
    + "--moe-expert-capacity-factor 1.0 --moe-token-dispatcher-type alltoall".split(),
    "moe_gdn_hybrid": KINDS["gdn_hybrid"] + MOE + ["--moe-shared-expert-intermediate-size", "32"],
}
A2A = " --moe-token-dispatcher-type alltoall"
LAYOUTS = {  # world size: [(model, flags)]; EP carved from the stage's TP x CP x DP ranks, as Megatron
    2: [
        ("moe_gpt", "--expert-model-parallel-size 2 --overlap-grad-reduce --ddp-bucket-size 2000" + A2A),
        ("moe_gdn_hybrid", "--expert-model-parallel-size 2 --use-distributed-optimizer --zero-stage 3"),
        ("moe_gpt", "--tensor-model-parallel-size 2 --sequence-parallel"),  # expert TP 2 (= TP, Megatron's default)
        ("moe_gdn_hybrid", "--context-parallel-size 2 --expert-model-parallel-size 2" + A2A),
        (
            "moe_gpt",
            "--expert-model-parallel-size 2 --moe-layer-recompute --use-distributed-optimizer --zero-stage 2" + A2A,
        ),
        ("moe_gpt_capacity", "--expert-model-parallel-size 2"),  # the same local tokens: the same drops
        ("moe_gpt_capacity", "--pipeline-model-parallel-size 2 --use-distributed-optimizer --zero-stage 3"),
    ],
    4: [
        ("moe_gpt", "--expert-model-parallel-size 4" + A2A),
        (
            "moe_gpt",
            "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 "
            "--expert-model-parallel-size 2" + A2A,
        ),
        ("moe_gdn_hybrid", "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2" + A2A),
        (
            "moe_gdn_hybrid",
            "--expert-model-parallel-size 2 --use-distributed-optimizer --zero-stage 1 --overlap-grad-reduce "
            "--overlap-param-gather" + A2A,
        ),
        # expert TP apart from attention TP: experts cut over 4 ranks, attention over 2
        ("moe_gpt", "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 4" + A2A),
        # interleaved 1F1B (2 virtual stages a rank) x EP 2, whole layers recomputed, packed documents
        (
            "moe_gdn_packed",
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --expert-model-parallel-size 2 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" + A2A,
        ),
    ],
    8: [  # EP 8 over TP 2 (SP) x DP 4: each rank holds one of the 8 experts
        (
            "moe_gpt_8",
            "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 "
            "--expert-model-parallel-size 8" + A2A,
        ),
    ],
}


def collect(argv: list[str], world_size: int) -> dict:
    out = train_and_collect(argv, world_size)
    return out


def _worker(rank, world_size, runs):
    return [collect(argv, world_size) for argv in runs]


def reassemble(results: list[dict]) -> dict[str, np.ndarray]:
    """Full single-rank weights: each name's TP (or expert-TP) pieces, from the ranks that hold it; every
    replica of a piece (DP, CP, the expert-data-parallel group, a tied embedding's last-stage copy) equal."""
    pieces: dict[str, dict[int, np.ndarray]] = {}
    for r in results:
        for name, w in r["weights"].items():
            split_rank = r["coords"]["etp" if ".experts." in name else "tp"]
            seen = pieces.setdefault(name, {})
            if split_rank in seen:
                assert_close_relative(w, seen[split_rank], f"{name} (replica on {r['coords']})", tol=1e-6)
            else:
                seen[split_rank] = w
    splits = {name: s for r in results for name, s in r["splits"].items()}
    return {
        name: unshard([torch.from_numpy(by[i]) for i in sorted(by)], splits[name]).numpy()
        for name, by in pieces.items()
    }


@pytest.mark.parametrize("world", list(LAYOUTS))
def test_moe_layouts_match_single_rank(world):
    runs = [BASE + MODELS[model] + flags.split() for model, flags in LAYOUTS[world]]
    per_rank = run_distributed(_worker, world, runs, timeout=900)
    refs = {model: train_and_collect(BASE + MODELS[model], 1) for model in {m for m, _ in LAYOUTS[world]}}
    for k, (model, flags) in enumerate(LAYOUTS[world]):
        ref, results = refs[model], [r[k] for r in per_rank]
        for r in results:
            np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=f"{model} {flags} losses")
        got = reassemble(results)
        assert set(got) == set(ref["weights"]), f"{model} {flags}: {set(got) ^ set(ref['weights'])}"
        for name, w in ref["weights"].items():
            assert_close_relative(got[name], w, f"{model} {flags} {name}")
    for ref in refs.values():
        assert ref["losses"][-1] < ref["losses"][0]
    if "moe_gpt_capacity" in refs:  # the layouts above drop exactly the reference's routes
        assert all(0 < d < 0.5 for d in refs["moe_gpt_capacity"]["dropped"]), refs["moe_gpt_capacity"]["dropped"]


def test_capacity_counted_per_sequence_parallel_shard_drops_other_routes():
    """Megatron's capacity is counted on each rank's own tokens: under TP x SP a rank holds 1/TP of a sequence,
    so its capacity and its drops differ from one rank's (docs/moe.md). Both drop; the rates are shown."""
    flags = "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1".split()
    (tp_sp,) = {
        tuple(r[0]["dropped"]) for r in run_distributed(_worker, 2, [BASE + MODELS["moe_gpt_capacity"] + flags])
    }
    ref = train_and_collect(BASE + MODELS["moe_gpt_capacity"], 1)["dropped"]
    print(f"dropped routes per step: one rank {np.round(ref, 4)}, TP2 x SP {np.round(tp_sp, 4)}")
    assert all(0 < d < 0.5 for d in ref + list(tp_sp)) and list(tp_sp) != ref


ZERO_PP = (
    "--use-distributed-optimizer --zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 2 "
    "--zero-quantized-gradients --zero-gradient-stochastic-rounding --ranks-per-node 2"
).split()


def test_moe_zeropp_on_expert_weights_within_its_bound():
    """ZeRO++ on the expert-data-parallel groups, 4 ranks as 2 nodes: at EP 1 the experts' group is all 4
    ranks (qgZ's int4 hops inside then across the nodes, hpZ's secondary shard inside a node), at EP 2 one
    rank per node (one inter-node hop, no secondary shard). Losses within ZeRO++'s 2% of one rank's over 3
    steps (tests/zero: the dense bound), and the ledger shows the expert units' traffic on those groups."""
    runs = [BASE + MODELS["moe_gpt"] + ZERO_PP + flags.split() for flags in ("", "--expert-model-parallel-size 2")]
    per_rank = run_distributed(_worker, 4, runs, timeout=900)
    ref = np.array(train_and_collect(BASE + MODELS["moe_gpt"], 1)["losses"])
    for k, roles in enumerate(({"edp_tier0", "edp_tier1", "edp_hpz"}, {"edp_tier0"})):
        for r in (rank[k] for rank in per_rank):
            dev = np.abs(np.array(r["losses"]) - ref) / ref
            assert 0 < dev.max() < 0.02, (k, dev)  # quantized: off the reference, within the bound
            used = {row["role"] for row in r["ledger"] if row["phase"].startswith(("qgz_", "zero_"))}
            assert roles <= used, (k, used)


def test_moe_bf16_and_fp16_track_one_rank():
    """16-bit training through the dispatchers: bf16 at EP 2 (alltoall) and fp16 (the loss scale reaches the
    router losses' gradient) at EP 2 under ZeRO-3 stay within 1e-4 of one rank in the same precision (the
    order of the 16-bit sums differs; measured 8e-6 and 2e-6)."""
    ep2 = "--expert-model-parallel-size 2".split()
    runs = {
        "--bf16": ep2 + A2A.split(),
        "--fp16": ep2 + "--use-distributed-optimizer --zero-stage 3".split(),
    }
    per_rank = run_distributed(_worker, 2, [BASE + MODELS["moe_gpt"] + [p] + f for p, f in runs.items()])
    for k, precision in enumerate(runs):
        ref = np.array(train_and_collect(BASE + MODELS["moe_gpt"] + [precision], 1)["losses"])
        for r in per_rank:
            np.testing.assert_allclose(r[k]["losses"], ref, rtol=1e-4, err_msg=precision)
