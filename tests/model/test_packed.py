"""Packed documents (--reset-attention-mask --reset-position-ids): a packed batch equals its
documents run separately, per-token losses and every parameter's gradient, for softmax, GLA
and hybrid models, on one rank and over CP 2 and 4 (one spawn of 4 ranks); the GLA operator
with -inf gates at the document starts stays finite and exact, the Triton kernels too, alone
and under CP; and training with the three flags under PP2 interleaved x CP2 and TP2 x CP2 + SP
reproduces the single-rank run.

Samples of T = 32 tokens, GLA chunks of 8: documents start inside chunks, on chunk and CP
slice boundaries, last a single token, or span three CP4 slices (the state then crosses a
rank with no document start and is cut on the next). fp64: losses and gradients within 1e-10
relative (norm of the difference over the reference's), except the weights of the block norms,
which compute in fp32 (ops/norm.py): their gradients sum fp32 terms over tokens grouped
otherwise, so 1e-6.
"""

import numpy as np
import pytest
import torch

from megatron_zpp import comm
from megatron_zpp.config import ModelConfig
from megatron_zpp.context_parallel import gla_context_parallel
from megatron_zpp.data.documents import build_documents
from megatron_zpp.model import GPT, ParallelContext, init_weights
from megatron_zpp.ops import dispatch
from megatron_zpp.ops.gla import chunk_gla, chunk_gla_uses_kernels
from megatron_zpp.ops.gla_naive import naive_recurrent_gla
from megatron_zpp.topology import Topology, build_groups
from tests.dist import run_distributed
from tests.old_defaults import old_model
from tests.test_parity import argv_for, assert_close_relative, full_weights, train_and_collect

VOCAB, EOD, T = 96, 95, 32
LENGTHS = ([5, 11, 8, 8], [1, 20, 11])  # per sample; each document ends with EOD (the last one is cut)
KINDS = {
    "softmax": dict(attention_type="softmax", num_query_groups=2),
    "gla": dict(attention_type="gla"),
    "hybrid": dict(attention_type="gla", softmax_attention_every=2, gla_gate_low_rank=4),
}


def config(kind: str, chunk: int = 8) -> ModelConfig:
    return old_model(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=T, linear_chunk_size=chunk, **KINDS[kind]
    )


def packed_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, labels [2, T] of documents of LENGTHS: random tokens < EOD, EOD at each end."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, EOD, (len(LENGTHS), T + 1), generator=gen)
    for b, lengths in enumerate(LENGTHS):
        ends = torch.tensor(lengths).cumsum(0) - 1
        data[b, ends[ends < T + 1]] = EOD
    return data[:, :-1], data[:, 1:]


def spans(b: int) -> list[tuple[int, int]]:
    edges = torch.tensor([0] + LENGTHS[b]).cumsum(0).clamp_max(T).tolist()
    return [(s, e) for s, e in zip(edges, edges[1:]) if e > s]


def model_of(kind: str, ctx=ParallelContext(), dtype=torch.float64, chunk: int = 8) -> GPT:
    model = GPT(config(kind, chunk), VOCAB, ctx)
    init_weights(model, 5)
    return model.to(dtype)


def weights_of(shape, seed: int = 1) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def separate(model: GPT, tokens, labels, w) -> tuple[torch.Tensor, dict]:
    """Per-token losses [B, T] and gradients of sum(w * losses), each document run on its own."""
    model.zero_grad()
    losses = torch.zeros(tokens.shape, dtype=torch.float64)
    for b in range(tokens.shape[0]):
        for s, e in spans(b):
            out = model(tokens=tokens[b : b + 1, s:e], labels=labels[b : b + 1, s:e])
            (out * w[b : b + 1, s:e]).sum().backward()
            losses[b, s:e] = out[0].detach()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def packed(model: GPT, tokens, labels, w, documents) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    out = model(tokens=tokens, labels=labels, documents=documents)
    (out * w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_same(got, ref, what, tol=1e-10):
    assert rel(got[0], ref[0]) <= tol, f"{what} losses: {rel(got[0], ref[0]):.1e}"
    for name, g in ref[1].items():
        fp32_norm = name.endswith(("norm1.weight", "norm2.weight", "final_norm.weight"))
        assert rel(got[1][name], g) <= (1e-6 if fp32_norm else tol), f"{what} grad {name}: {rel(got[1][name], g):.1e}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_batch_equals_documents_run_separately(kind):
    tokens, labels = packed_batch()
    w = weights_of(tokens.shape)
    model = model_of(kind)
    ref = separate(model, tokens, labels, w)
    assert_same(packed(model, tokens, labels, w, build_documents(tokens, EOD, True, True, 0, T)), ref, kind)
    # without the flags the documents see each other: the check above is not vacuous
    crossing = packed(model, tokens, labels, w, None)
    assert (crossing[0] - ref[0]).abs().max() > 1e-3


def gla_inputs(H: int = 2, K: int = 8, V: int = 8):
    """(q, k, v, g leaves [2, T, H, *] fp32 with g = -inf at the document starts, do, starts [2, T])."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(LENGTHS), T, H, D, generator=gen) for D in (K, K, V))
    g = torch.nn.functional.logsigmoid(torch.randn(len(LENGTHS), T, H, K, generator=gen)) / 4
    starts = build_documents(packed_batch()[0], EOD, False, True, 0, T).starts(T)
    g = g.masked_fill(starts[:, :, None, None], float("-inf"))
    do = torch.randn(len(LENGTHS), T, H, V, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g)], do, starts


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_gla_hard_resets_are_finite_and_exact(kernels):
    # -inf log decays at document starts: outputs and gradients equal the token loop run per document,
    # finite everywhere, and the gate gradient is exactly 0 where the gate is -inf (reference and kernels)
    C = 16
    leaves, do, starts = gla_inputs()
    q, k, v, g = (x.detach() for x in leaves)
    dispatch.set_kernels(kernels, torch.device("cpu"))
    try:
        assert chunk_gla_uses_kernels(q, k, v, g, C) == (kernels == "triton")
        o = chunk_gla(*leaves, chunk_size=C)[0]
        grads = torch.autograd.grad((o * do).sum(), leaves)
    finally:
        dispatch.set_kernels("auto", torch.device("cpu"))
    assert all(torch.isfinite(x).all() for x in (o, *grads))
    assert (grads[3][starts] == 0).all()
    for b in range(len(LENGTHS)):
        for s, e in spans(b):
            doc = [x[b : b + 1, s:e].double().requires_grad_() for x in (q, k, v, g)]
            ref_o = naive_recurrent_gla(*doc)[0]
            ref_grads = torch.autograd.grad((ref_o * do[b : b + 1, s:e].double()).sum(), doc)
            torch.testing.assert_close(o[b : b + 1, s:e].double(), ref_o, rtol=1e-4, atol=1e-5)
            for name, got, ref in zip("qkvg", grads, ref_grads):
                got = got[b : b + 1, s:e].double()
                if name == "g":  # the first token's gate multiplies a zero state: gradient 0 either way
                    got, ref = got[:, 1:], ref[:, 1:]
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name} {s}:{e}: {m}")


def _cp_worker(rank, world):
    tokens, labels = packed_batch()
    w = weights_of(tokens.shape)
    cases = {  # (CP size, GLA state scan): softmax layers all-gather K and V whatever the scan
        "softmax": [(4, "all-scan"), (2, "all-scan")],
        "gla": [(4, "all-scan"), (4, "all-gather"), (2, "all-scan")],
        "hybrid": [(4, "all-gather"), (2, "all-scan")],
    }
    groups = {size: build_groups(Topology(world, cp=size), rank).cp for size in (4, 2)}
    for kind in KINDS:
        ref = separate(model_of(kind), tokens, labels, w)
        for cp_size, algo in cases[kind]:
            cp = groups[cp_size]
            n = T // cp_size
            sl = slice(cp.rank * n, (cp.rank + 1) * n)
            model = model_of(kind, ParallelContext(cp=cp, cp_algo=algo))
            docs = build_documents(tokens, EOD, True, True, cp.rank * n, n)
            losses, grads = packed(model, tokens[:, sl], labels[:, sl], w[:, sl], docs)
            for g in grads.values():  # each rank holds its slice's share of the weights' gradient
                comm.all_reduce(g, cp, "test")
            assert_same((losses, grads), (ref[0][:, sl], ref[1]), f"{kind} CP{cp_size} {algo} rank {rank}")
    # the GLA operator under CP2 with -inf gates, on the reference (staged) path and on the Triton kernels
    # (interpreted; the corrected local pass), fp32, against the fp64 token loop over the whole sequence
    cp = groups[2]
    leaves, do, starts = gla_inputs()
    sl = slice(cp.rank * T // 2, (cp.rank + 1) * T // 2)
    ref_leaves = [x.double().requires_grad_() for x in leaves]
    ref_o = naive_recurrent_gla(*ref_leaves)[0]
    ref = [ref_o] + list(torch.autograd.grad((ref_o * do.double()).sum(), ref_leaves))
    for kernels in ("torch", "triton"):
        local = [x[:, sl].clone().requires_grad_() for x in leaves]
        dispatch.set_kernels(kernels, torch.device("cpu"))
        try:
            assert chunk_gla_uses_kernels(*local, 16) == (kernels == "triton")
            o = gla_context_parallel(*local, cp, chunk_size=16)
            got = [o] + list(torch.autograd.grad((o * do[:, sl]).sum(), local))
        finally:
            dispatch.set_kernels("auto", torch.device("cpu"))
        assert all(torch.isfinite(x).all() for x in got) and (got[4][starts[:, sl]] == 0).all(), kernels
        for name, a, b in zip(["o", "dq", "dk", "dv", "dg"], got, ref):
            err = rel(a.double(), b[:, sl])
            assert err <= 1e-5, f"{kernels} CP2 rank {rank} {name}: {err:.1e}"
    return True


def test_packed_documents_under_context_parallel():
    # CP4 (all-scan, all-gather) and CP2 (all-scan; and the GLA operator with and without the Triton
    # kernels, fp32, 1e-5) in one spawn
    assert all(run_distributed(_cp_worker, 4, timeout=300))


PACKED_FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--train-iters", "2"]
PACKED_FLAGS += ["--lr-warmup-iters", "1"]  # shorter than the 2 iterations of decay, as Megatron asserts
PP2_VPP_CP2 = (
    "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --context-parallel-size 2".split()
)
TP2_CP2_SP = "--tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel".split()


def _train_worker(rank, world, argvs):
    return [train_and_collect(argv, world) for argv in argvs]


def test_training_with_packed_documents_matches_single_rank():
    # hybrid, 4 layers, mock data packing EOD-ended documents, 2 steps: losses and weights within 1e-5 for
    # PP2 interleaved x CP2 (each rank's second chunk is a middle one, neither embedding nor loss, and
    # still needs the documents) and TP2 x CP2 with sequence parallelism (sequence-sharded activations)
    argv = argv_for("hybrid", 4, PACKED_FLAGS)
    ref = train_and_collect(argv, 1)
    per_rank = run_distributed(_train_worker, 4, [argv + PP2_VPP_CP2, argv + TP2_CP2_SP], timeout=600)
    for k, layout in enumerate(("pp2 interleaved x cp2", "tp2 x cp2 + sp")):
        results = [r[k] for r in per_rank]
        for r in results:
            np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=f"{layout} {r['coords']}")
        got = full_weights(results)
        for name, w in ref["weights"].items():
            assert_close_relative(got[name], w, f"{layout} {name}")
