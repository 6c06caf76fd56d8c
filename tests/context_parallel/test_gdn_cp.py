"""Gated DeltaNet and Kimi Delta Attention under context parallelism (context_parallel/delta_rule.py with chunk_gdn or
chunk_kda as the local operator: All-Scan, all-gather, ring), one harness for both mixers.

The operator against the fp64 token loop over the whole sequence at CP 2/4/8 for every algorithm (an initial state
and its gradient; mild, strong, reset and, for KDA, mixed-rate gates; GDN also at slices that are not a multiple of
the chunk), its bytes (All-Scan's and the ring's flat in CP), the convolution's halo, and GDN and KDA hybrid models
trained at CP layouts against one rank. The models train at init std 0.2 with packed documents crossing every slice
boundary: there, dropping the entering-state correction or the convolution's halo moves the losses by orders of
magnitude more than the tolerance (docs/context_parallel.md lists the figures, `sabotage_figures` prints them).
Losses, reassembled weights and every parameter's gradient equal the single rank's. One spawn per world size runs
every check of that size, for both mixers."""

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import comm, training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.context_parallel.delta_rule import delta_rule_context_parallel
from megatron_zpp.context_parallel.halo import previous_tokens
from megatron_zpp.topology import Topology, build_groups
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.ops.test_delta_rule import MIXERS
from tests.test_parity import (
    BASE,
    KINDS,
    assert_close_relative,
    assert_matches_reference,
    full_weights,
    train_and_collect,
)

B, T_LOCAL, H, K, V, CHUNK = 2, 16, 2, 8, 4, 8
ALGOS = [("all-scan", 1), ("all-scan", 2), ("all-scan", 4), ("all-gather", 1), ("ring", 1)]
F64, F32 = torch.float64, torch.float32


# per mixer: (dtype, gates, relative tolerance, with an initial state: each of these): mild, strong (log decay down
# to -20 per token), mixed (KDA: channels from none to strong in one head) or with resets (-inf: a document start)
CASES = {
    "gdn": [(F64, "mild", 1e-10, (False, True)), (F64, "reset", 1e-10, (False, True)),
            (F32, "strong", 1e-5, (False, True))],
    "kda": [(F64, "mild", 1e-10, (True,)), (F64, "reset", 1e-10, (True,)), (F32, "strong", 1e-5, (False,)),
            (F32, "mixed", 1e-5, (True,))],
}  # fmt: skip
PADDED = {"gdn"}  # also slices that are not a multiple of the chunk (the op pads them with identity tokens)


def make_inputs(mixer, T, dtype, gates, seed=0):
    """Full-sequence q, k (L2-normalised as the layer feeds them), v, g (per head or per channel), beta, h0 and the
    output cotangent."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    v, do, h0 = r(B, T, H, V), r(B, T, H, V), r(B, H, K, V)
    g_shape = (B, T, H, K) if MIXERS[mixer].per_channel else (B, T, H)
    g = F.logsigmoid(r(*g_shape)) / 8
    if gates == "strong":
        g = -20.0 * torch.rand(*g_shape, generator=gen, dtype=torch.float64) ** 2
    if gates == "mixed":  # channel c of a head decays at rate ~ 10^(c - K/2): none to strong side by side
        g = g * torch.logspace(-K / 2, K / 2, K, dtype=torch.float64)
    if gates == "reset":  # a hard reset (a document start) in some slices, one on a slice's first token
        g[:, T_LOCAL] = -torch.inf
        g[0, T_LOCAL + 5] = -torch.inf
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0, do)]


def outputs_and_grads(fn, xs, h0, do):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    o = fn(*leaves, h0)
    grads = torch.autograd.grad((o * do).sum(), leaves + ([h0] if h0 is not None else []))
    return [o.detach()] + list(grads)


def assert_rel_close(got, ref, tol, what):
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, ref):
        assert torch.isfinite(a).all(), f"{what}: {name} not finite"
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1)).item()
        assert err <= tol, f"{what}: {name} relative error {err:.2e} > {tol:.0e}"


def sent(phase):
    return sum(r["bytes"] for r in comm.LEDGER.local_rows() if r["phase"] == phase)


def _cp_op(mixer, cp, algo, blocks, chunk):
    """The mixer's CP operator on (q, k, v, g, beta, head)."""

    def fn(*a):
        kw = dict(algo=algo, blocks=blocks, scale=0.3, chunk_size=chunk, initial_state=a[5], op=MIXERS[mixer].op)
        return delta_rule_context_parallel(*a[:5], cp, **kw)

    return fn


def _check_operator(mixer, rank, world, cp):
    m, sl = MIXERS[mixer], slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    loop = lambda *a: m.loop(*[x.double() for x in a[:5]], 0.3, a[5])[0]  # noqa: E731
    for dtype, gates, tol, h0s in CASES[mixer]:
        for with_h0 in h0s:
            q, k, v, g, beta, h0, do = make_inputs(mixer, world * T_LOCAL, dtype, gates)
            h0 = h0 if with_h0 else None
            ref = outputs_and_grads(loop, (q, k, v, g, beta), h0, do.double())
            ref = [x[:, sl] for x in ref[:6]] + (ref[6:] if rank == 0 else [])
            local = [x[:, sl] for x in (q, k, v, g, beta)]
            for algo, blocks in ALGOS:
                got = outputs_and_grads(
                    _cp_op(mixer, cp, algo, blocks, CHUNK), local, h0 if rank == 0 else None, do[:, sl]
                )
                assert len(got) == len(ref)
                what = f"{mixer} CP{world} rank {rank} {algo}/{blocks} {dtype} {gates} h0={with_h0}"
                assert_rel_close(got, ref, tol, what)
            # a slice of T_LOCAL = 16 tokens in a chunk of 24 (the op pads it with identity tokens); and of 12 in 8
            for chunk, short in ((24, 0), (8, 4)) if mixer in PADDED and with_h0 and gates == "reset" else ():
                n = T_LOCAL - short
                part = [x[:, rank * T_LOCAL : rank * T_LOCAL + n] for x in (q, k, v, g, beta)]
                whole = [
                    torch.cat([x[:, r * T_LOCAL : r * T_LOCAL + n] for r in range(world)], 1)
                    for x in (q, k, v, g, beta)
                ]
                d_whole = torch.cat([do[:, r * T_LOCAL : r * T_LOCAL + n] for r in range(world)], 1)
                want = outputs_and_grads(loop, whole, h0, d_whole.double())
                want = [x[:, rank * n : (rank + 1) * n] for x in want[:6]] + (want[6:] if rank == 0 else [])
                padded = _cp_op(mixer, cp, "all-scan", 2, chunk)
                got = outputs_and_grads(
                    padded, part, h0 if rank == 0 else None, do[:, rank * T_LOCAL : rank * T_LOCAL + n]
                )
                assert_rel_close(got, want, tol, f"{mixer} CP{world} rank {rank} {n} tokens in chunk {chunk} {gates}")


def _check_ledger(mixer, rank, world, cp):
    """Bytes this rank sends per call: All-Scan and the ring one fp32 state [B,H,K,V] each way whatever P (flat in
    CP: the same figure at CP 2, 4 and 8); the all-gather (P-1) x (U, M) forward and (P-1) states backward."""
    state, transition = B * H * K * V * 4, B * H * K * K * 4
    q, k, v, g, beta, _, do = make_inputs(mixer, world * T_LOCAL, torch.float32, "mild")
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    local = [x[:, sl].clone().requires_grad_() for x in (q, k, v, g, beta)]
    for algo, blocks in ALGOS:
        comm.LEDGER.reset()
        o = delta_rule_context_parallel(*local, cp, algo=algo, blocks=blocks, chunk_size=CHUNK, op=MIXERS[mixer].op)
        (o * do[:, sl]).sum().backward()
        name = {"all-scan": "allscan", "all-gather": "lasp2", "ring": "ring"}[algo]
        fwd, bwd = sent(f"cp_{name}_fwd"), sent(f"cp_{name}_bwd")
        assert {r["phase"] for r in comm.LEDGER.local_rows()} <= {f"cp_{name}_fwd", f"cp_{name}_bwd"}
        if algo == "all-gather":
            assert (fwd, bwd) == ((world - 1) * (state + transition), (world - 1) * state), (mixer, algo, fwd, bwd)
        else:
            assert fwd == (state if rank < world - 1 else 0), (mixer, algo, blocks, fwd)
            assert bwd == (state if rank > 0 else 0), (mixer, algo, blocks, bwd)


def _check_halo(rank, world, cp):
    """previous_tokens gives the last tokens of rank p-1 (zeros on rank 0), and its gradient lands there."""
    full = torch.arange(world * 6 * 3, dtype=torch.float64).view(1, world * 6, 3)
    x = full[:, rank * 6 : (rank + 1) * 6].clone().requires_grad_()
    halo = previous_tokens(x, 2, cp)
    expect = full[:, rank * 6 - 2 : rank * 6] if rank > 0 else torch.zeros(1, 2, 3, dtype=torch.float64)
    torch.testing.assert_close(halo, expect, rtol=0, atol=0)
    (halo * (rank + 1)).sum().backward()  # rank p+1 weighs its halo by p+2
    expect_grad = torch.zeros(1, 6, 3, dtype=torch.float64)
    if rank < world - 1:
        expect_grad[:, -2:] = rank + 2
    torch.testing.assert_close(x.grad, expect_grad, rtol=0, atol=0)


# ---------------------------------------------------------------- hybrid models at CP layouts against one rank


@dataclass(frozen=True)
class Model:
    argv: tuple[str, ...]  # the model, its packed documents and init std 0.2 (the reference's flags too)
    layouts: dict[int, list[str]]  # world size: the layouts its spawn trains
    grads: str  # the gradients compared: the last step's ("grads") or the first step's ("first_grads")
    grad_tol: float
    learns: bool  # the reference's loss falls over its steps (GDN's 6; KDA's 2 steps do not show it)


PACKED = "--seq-length 64 --num-layers 4 --reset-position-ids --reset-attention-mask".split()  # CP 8: a chunk a rank
INIT_STD = "0.2"  # where a dropped correction or halo moves the losses far beyond the tolerance (sabotage_figures)
MODELS = {
    # GDN hybrids (softmax every 2nd layer), 6 steps: at init std 0.02 the GDN branch is so weak that dropping the
    # entering-state correction moved the losses by 1.7e-5 only (rtol 1e-5). The last step's gradients: fp32 sums
    # over the slices' chunks put A_log's at 1.2e-5.
    "gdn": Model(
        (*BASE, *KINDS["gdn_hybrid"], *PACKED),
        {
            8: ["--context-parallel-size 8", "--context-parallel-size 8 --cp-algo all-gather"],
            4: [
                "--context-parallel-size 4 --all-scan-blocks 2",
                "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 --cp-algo all-gather",
                "--context-parallel-size 2 --recompute-granularity selective",  # halo and state kept for the rerun
            ],
        },
        "grads",
        1e-4,
        True,
    ),
    # KDA hybrids, 2 steps; the first step's gradients
    "kda": Model(
        (
            *BASE,
            "--attention-type",
            "kda",
            "--softmax-attention-every",
            "2",
            *PACKED,
            "--train-iters",
            "2",
            "--lr-warmup-iters",
            "1",
        ),  # fmt: skip
        {
            8: ["--context-parallel-size 8"],
            4: [
                "--context-parallel-size 4 --cp-algo all-gather",
                "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 --all-scan-blocks 2",
                "--context-parallel-size 2 --cp-algo ring --recompute-granularity selective",  # CP 2 beside DP 2
            ],
        },
        "first_grads",
        1e-5,
        False,
    ),
}


def model_argv(mixer: str, std: str = INIT_STD) -> list[str]:
    return [*MODELS[mixer].argv, "--init-method-std", std]


def collect(argv, world_size):
    """train_and_collect's figures, the first step's gradient of every parameter (after the DP x CP reduction and
    the clip) and whether a document crossed into this rank's slice."""
    import megatron_zpp.model.gated_deltanet as gdn_layer
    import megatron_zpp.model.kda as kda_layer

    conv, straddled, grads = kda_layer.conv_with_halo, [], {}

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

    kda_layer.conv_with_halo = gdn_layer.conv_with_halo = recording_conv
    training.setup = recording_setup
    try:
        out = train_and_collect(argv, world_size)
    finally:
        kda_layer.conv_with_halo = gdn_layer.conv_with_halo = conv
        training.setup = setup
    return {**out, "first_grads": grads, "straddled": any(straddled)}


@functools.cache
def reference(mixer: str) -> dict:
    return collect(model_argv(mixer), 1)


def _worker(rank, world):
    cp = build_groups(Topology(world, cp=world), rank).cp
    for mixer in MIXERS:
        _check_operator(mixer, rank, world, cp)
        _check_ledger(mixer, rank, world, cp)
    _check_halo(rank, world, cp)
    return {
        mixer: [collect(model_argv(mixer) + f.split(), world) for f in m.layouts.get(world, [])]
        for mixer, m in MODELS.items()
    }


@pytest.mark.parametrize("world", [2, 4, 8])
def test_context_parallel_matches_token_loop_and_one_rank(world):
    per_rank = run_distributed(_worker, world, timeout=900)
    for mixer, m in MODELS.items():
        if not m.layouts.get(world):
            continue
        ref = reference(mixer)
        assert validate(parse_args(model_argv(mixer)), 1).model.layer_kind(0) == mixer
        assert ref["losses"][-1] < ref["losses"][0] or not m.learns, mixer
        for i, flags in enumerate(m.layouts[world]):
            results = [r[mixer][i] for r in per_rank]
            what = f"{mixer} {flags}"
            assert all(r["straddled"] for r in results if r["coords"]["cp"] > 0), (
                f"{what}: a boundary no document crosses"
            )
            assert_matches_reference(results, ref, what)
            got = full_weights(results, m.grads)
            assert set(got) == set(ref[m.grads])
            for name, grad in ref[m.grads].items():  # per parameter: the norm of the difference over the norm
                assert_close_relative(got[name], grad, f"{what} gradient of {name}", tol=m.grad_tol)


@pytest.mark.parametrize("mixer, gates", [("gdn", "mild"), ("kda", "mixed")])
def test_single_rank_is_the_op_and_a_bad_algo_is_refused(mixer, gates):
    q, k, v, g, beta, h0, _ = make_inputs(mixer, 2 * T_LOCAL, torch.float64, gates)
    op = MIXERS[mixer].op
    o = delta_rule_context_parallel(q, k, v, g, beta, None, chunk_size=CHUNK, initial_state=h0, op=op)
    torch.testing.assert_close(o, MIXERS[mixer].loop(q, k, v, g, beta, initial_state=h0)[0])
    with pytest.raises(ValueError, match="unknown CP algorithm"):
        delta_rule_context_parallel(q, k, v, g, beta, None, algo="zigzag", op=op)


def _sabotaged(rank, world, runs):
    """collect() of each (argv, sabotage) in `runs`: "correction" drops the entering state's term r^T S_in (the
    scan is skipped), "halo" gives the convolution zeros for the previous slice's tokens."""
    import megatron_zpp.context_parallel.delta_rule as cp_gdn
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


def sabotage_figures(mixer="kda", stds=("0.02", "0.2"), flags="--context-parallel-size 4") -> None:
    """Print how far a correct run and each sabotage move a hybrid's losses and first-step gradients from one rank's,
    at each init std (the figures of docs/context_parallel.md):
    python -c "from tests.context_parallel.test_gdn_cp import sabotage_figures; sabotage_figures('kda')" """
    import numpy as np

    cases = [(std, sabotage) for std in stds for sabotage in ("none", "correction", "halo")]
    runs = [(model_argv(mixer, std) + flags.split(), s) for std, s in cases]
    per_rank = run_distributed(_sabotaged, 4, runs, timeout=1800)
    refs = {std: collect(model_argv(mixer, std), 1) for std in stds}
    for i, (std, sabotage) in enumerate(cases):
        ref, results = refs[std], [r[i] for r in per_rank]
        loss = max(np.max(np.abs(np.array(r["losses"]) / np.array(ref["losses"]) - 1)) for r in results)
        got = full_weights(results, "first_grads")
        grad = max(np.linalg.norm(got[n] - g) / max(np.linalg.norm(g), 1e-30) for n, g in ref["first_grads"].items())
        print(f"{mixer} {flags}, init std {std}, sabotage {sabotage}: losses {loss:.1e}, worst gradient {grad:.1e}")
