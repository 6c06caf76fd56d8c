"""Kimi Delta Attention under context parallelism, through context_parallel/gdn.py with chunk_kda as the local
operator: the operator against the fp64 token loop (ops/kda_naive.py) over the whole sequence at CP 2/4/8 for
every algorithm, its bytes (All-Scan's flat in CP), and KDA hybrid models trained at CP layouts against one rank.

The model runs train at init std 0.2 with packed documents crossing every slice boundary: there, dropping the
entering-state correction or the convolution's halo moves the losses by orders of magnitude more than the
tolerance (docs/context_parallel.md lists the figures). Losses, reassembled weights and the first step's
per-parameter gradients equal the single rank's. One spawn per world size runs every check of that size."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import comm, training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.context_parallel.gdn import gdn_context_parallel
from megatron_zpp.ops.kda import chunk_kda
from megatron_zpp.ops.kda_naive import naive_recurrent_kda
from megatron_zpp.topology import Topology, build_groups
from megatron_zpp.validation import validate
from tests.context_parallel.test_gdn_cp import (
    ALGOS,
    CHUNK,
    T_LOCAL,
    B,
    H,
    K,
    V,
    assert_rel_close,
    outputs_and_grads,
    sent,
)
from tests.dist import run_distributed
from tests.test_parity import BASE, assert_close_relative, assert_matches_reference, full_weights, train_and_collect

# (dtype, gates, relative tolerance): mild, strong (log decay down to -20 per channel and token), mixed (channels
# from none to strong in one head) or with resets (-inf on every channel: a document start)
CASES = [
    (torch.float64, "mild", 1e-10),
    (torch.float64, "reset", 1e-10),
    (torch.float32, "strong", 1e-5),
    (torch.float32, "mixed", 1e-5),
]


def make_inputs(T, dtype, gates, seed=0):
    """Full-sequence q, k (L2-normalised), v, g [B,T,H,K], beta, h0 and the output cotangent."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    v, do, h0 = r(B, T, H, V), r(B, T, H, V), r(B, H, K, V)
    g = F.logsigmoid(r(B, T, H, K)) / 8
    if gates == "strong":
        g = -20.0 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) ** 2
    if gates == "mixed":  # channel c of a head decays at rate ~ 10^(c - K/2): none to strong side by side
        g = g * torch.logspace(-K / 2, K / 2, K, dtype=torch.float64)
    if gates == "reset":  # a hard reset (a document start) in some slices, one on a slice's first token
        g[:, T_LOCAL] = -torch.inf
        g[0, T_LOCAL + 5] = -torch.inf
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0, do)]


def _check_operator(rank, world, cp):
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    for dtype, gates, tol in CASES:
        with_h0 = gates != "strong"  # the initial state entering rank 0 (and its gradient) in most cases
        q, k, v, g, beta, h0, do = make_inputs(world * T_LOCAL, dtype, gates)
        h0 = h0 if with_h0 else None
        loop = lambda *a: naive_recurrent_kda(*[x.double() for x in a[:5]], 0.3, a[5])[0]  # noqa: E731
        ref = outputs_and_grads(loop, (q, k, v, g, beta), h0, do.double())
        ref = [x[:, sl] for x in ref[:6]] + (ref[6:] if rank == 0 else [])
        local = [x[:, sl] for x in (q, k, v, g, beta)]
        for algo, blocks in ALGOS:

            def fn(*a, algo=algo, blocks=blocks):
                kw = dict(algo=algo, blocks=blocks, scale=0.3, chunk_size=CHUNK, initial_state=a[5], op=chunk_kda)
                return gdn_context_parallel(*a[:5], cp, **kw)

            got = outputs_and_grads(fn, local, h0 if rank == 0 else None, do[:, sl])
            assert len(got) == len(ref)
            assert_rel_close(got, ref, tol, f"KDA CP{world} rank {rank} {algo}/{blocks} {dtype} {gates} h0={with_h0}")


def _check_ledger(rank, world, cp):
    """Bytes this rank sends per call: All-Scan and the ring one fp32 state [B,H,K,V] each way whatever P (flat in
    CP: the same figure at CP 2, 4 and 8); the all-gather (P-1) x (U, M) forward and (P-1) states backward."""
    state, transition = B * H * K * V * 4, B * H * K * K * 4
    q, k, v, g, beta, _, do = make_inputs(world * T_LOCAL, torch.float32, "mild")
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    local = [x[:, sl].clone().requires_grad_() for x in (q, k, v, g, beta)]
    for algo, blocks in ALGOS:
        comm.LEDGER.reset()
        o = gdn_context_parallel(*local, cp, algo=algo, blocks=blocks, chunk_size=CHUNK, op=chunk_kda)
        (o * do[:, sl]).sum().backward()
        name = {"all-scan": "allscan", "all-gather": "lasp2", "ring": "ring"}[algo]
        fwd, bwd = sent(f"cp_{name}_fwd"), sent(f"cp_{name}_bwd")
        assert {r["phase"] for r in comm.LEDGER.local_rows()} <= {f"cp_{name}_fwd", f"cp_{name}_bwd"}
        if algo == "all-gather":
            assert (fwd, bwd) == ((world - 1) * (state + transition), (world - 1) * state), (algo, fwd, bwd)
        else:
            assert fwd == (state if rank < world - 1 else 0), (algo, blocks, fwd)
            assert bwd == (state if rank > 0 else 0), (algo, blocks, bwd)


# KDA hybrids (softmax every 2nd layer) with packed documents, 64 tokens (CP 8: one chunk of 8 per rank), 2 steps
KDA_PACKED = (
    "--attention-type kda --softmax-attention-every 2 --seq-length 64 --num-layers 4 --reset-position-ids "
    "--reset-attention-mask --train-iters 2 --lr-warmup-iters 1"
).split()
INIT_STD = "0.2"  # where a dropped correction or halo moves the losses far beyond the tolerance (sabotage_figures)


def model_argv(std: str = INIT_STD) -> list[str]:
    return BASE + KDA_PACKED + ["--init-method-std", std]


MODEL_LAYOUTS = {  # world size: the layouts its spawn trains (CP 2 runs beside DP 2)
    8: ["--context-parallel-size 8"],
    4: [
        "--context-parallel-size 4 --cp-algo all-gather",
        "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 --all-scan-blocks 2",
        "--context-parallel-size 2 --cp-algo ring --recompute-granularity selective",
    ],
    2: [],
}


def collect(argv, world_size):
    """train_and_collect's figures, the first step's gradient of every parameter (after the DP x CP reduction
    and the clip) and whether a document crossed into this rank's slice."""
    import megatron_zpp.model.kda as kda

    conv, straddled, grads = kda.conv_with_halo, [], {}

    def recording_conv(x, weight, ctx, documents):
        if documents is not None and documents.offset > 0:
            ids = documents.doc_ids
            straddled.append(bool((ids[:, documents.offset - 1] == ids[:, documents.offset]).any()))
        return conv(x, weight, ctx, documents)

    setup = training.setup

    def recording_setup(cfg):
        run = setup(cfg)
        names = {id(p): n for chunk in run.chunks for n, p in chunk.named_parameters()}
        step = run.dp.optimizer.step

        def first_grads(*a, **kw):
            if not grads:
                grads.update({names[id(p)]: p.main_grad.detach().double().numpy().copy() for p in run.dp.params})
            return step(*a, **kw)

        run.dp.optimizer.step = first_grads
        return run

    kda.conv_with_halo, training.setup = recording_conv, recording_setup
    try:
        out = train_and_collect(argv, world_size)
    finally:
        kda.conv_with_halo, training.setup = conv, setup
    return {**out, "grads": grads, "straddled": any(straddled)}


def _worker(rank, world):
    cp = build_groups(Topology(world, cp=world), rank).cp
    _check_operator(rank, world, cp)
    _check_ledger(rank, world, cp)
    return [collect(model_argv() + flags.split(), world) for flags in MODEL_LAYOUTS[world]]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_kda_context_parallel_matches_token_loop_and_one_rank(world):
    per_rank = run_distributed(_worker, world, timeout=900)
    if not MODEL_LAYOUTS[world]:
        return
    ref = collect(model_argv(), 1)
    assert validate(parse_args(model_argv()), 1).model.layer_kind(0) == "kda"
    for k, flags in enumerate(MODEL_LAYOUTS[world]):
        results = [r[k] for r in per_rank]
        assert all(r["straddled"] for r in results if r["coords"]["cp"] > 0), f"{flags}: a boundary no document crosses"
        assert_matches_reference(results, ref, flags)
        got = full_weights([{**r, "weights": r["grads"]} for r in results])
        assert set(got) == set(ref["grads"])
        for name, grad in ref["grads"].items():  # per parameter: the norm of the difference over the norm
            assert_close_relative(got[name], grad, f"{flags} gradient of {name}")


def test_single_rank_is_chunk_kda():
    q, k, v, g, beta, h0, _ = make_inputs(2 * T_LOCAL, torch.float64, "mixed")
    o = gdn_context_parallel(q, k, v, g, beta, None, chunk_size=CHUNK, initial_state=h0, op=chunk_kda)
    torch.testing.assert_close(o, naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)[0])


def _sabotaged(rank, world, runs):
    """collect() of each (argv, sabotage) in `runs`: "correction" drops the entering state's term r^T S_in (the
    scan is skipped), "halo" gives the convolution zeros for the previous slice's tokens."""
    import megatron_zpp.context_parallel.gdn as cp_gdn
    import megatron_zpp.model.short_conv as short_conv

    entering, halo, out = cp_gdn.EnteringState.apply, short_conv.previous_tokens, []
    for argv, sabotage in runs:
        if sabotage == "correction":
            cp_gdn.EnteringState.apply = lambda U, M, head, scan: torch.zeros_like(U)
        if sabotage == "halo":
            short_conv.previous_tokens = lambda x, width, cp: x.new_zeros(x.shape[0], width, x.shape[2])
        try:
            out.append(collect(argv, world))
        finally:
            cp_gdn.EnteringState.apply, short_conv.previous_tokens = entering, halo
    return out


def sabotage_figures(stds=("0.02", "0.2"), flags="--context-parallel-size 4") -> None:
    """Print how far a correct run and each sabotage move the KDA hybrid's losses and first-step gradients from one
    rank's, at each init std (the figures of docs/context_parallel.md):
    python -c "from tests.context_parallel.test_kda_cp import sabotage_figures; sabotage_figures()" """
    import numpy as np

    cases = [(std, sabotage) for std in stds for sabotage in ("none", "correction", "halo")]
    per_rank = run_distributed(_sabotaged, 4, [(model_argv(std) + flags.split(), s) for std, s in cases], timeout=1800)
    refs = {std: collect(model_argv(std), 1) for std in stds}
    for i, (std, sabotage) in enumerate(cases):
        ref, results = refs[std], [r[i] for r in per_rank]
        loss = max(np.max(np.abs(np.array(r["losses"]) / np.array(ref["losses"]) - 1)) for r in results)
        got = full_weights([{**r, "weights": r["grads"]} for r in results])
        grad = max(np.linalg.norm(got[n] - g) / max(np.linalg.norm(g), 1e-30) for n, g in ref["grads"].items())
        print(f"{flags}, init std {std}, sabotage {sabotage}: losses {loss:.1e}, worst parameter gradient {grad:.1e}")
