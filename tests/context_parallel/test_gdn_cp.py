"""Gated DeltaNet under context parallelism (All-Scan, all-gather, ring) against the fp64 token loop over
the whole sequence, the conv halo, and the bytes each algorithm sends. One spawn per CP size runs every check."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import comm
from megatron_zpp.context_parallel.gdn import gdn_context_parallel
from megatron_zpp.context_parallel.halo import previous_tokens
from megatron_zpp.ops.gdn_naive import naive_recurrent_gdn
from megatron_zpp.topology import Topology, build_groups
from tests.dist import run_distributed

B, T_LOCAL, H, K, V, CHUNK = 2, 16, 2, 8, 4, 8
ALGOS = [("all-scan", 1), ("all-scan", 2), ("all-scan", 4), ("all-gather", 1), ("ring", 1)]
# (dtype, gates, relative tolerance): mild, strong (log decay down to -20 per token) or with resets
CASES = [(torch.float64, "mild", 1e-10), (torch.float64, "reset", 1e-10), (torch.float32, "strong", 1e-5)]


def make_inputs(T, dtype, gates, seed=0):
    """Full-sequence q, k (L2-normalised as the layer feeds them), v, g, beta, h0 and the output cotangent."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    v, do, h0 = r(B, T, H, V), r(B, T, H, V), r(B, H, K, V)
    g = F.logsigmoid(r(B, T, H)) / 8
    if gates == "strong":
        g = -20.0 * torch.rand(B, T, H, generator=gen, dtype=torch.float64) ** 2
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


def _check_operator(rank, world, cp):
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    for dtype, gates, tol in CASES:
        for with_h0 in (False, True):
            q, k, v, g, beta, h0, do = make_inputs(world * T_LOCAL, dtype, gates)
            h0 = h0 if with_h0 else None
            loop = lambda *a: naive_recurrent_gdn(*[x.double() for x in a[:5]], 0.3, a[5])[0]  # noqa: E731
            ref = outputs_and_grads(loop, (q, k, v, g, beta), h0, do.double())
            ref = [x[:, sl] for x in ref[:6]] + (ref[6:] if rank == 0 else [])
            local = [x[:, sl] for x in (q, k, v, g, beta)]
            for algo, blocks in ALGOS:

                def fn(*a, algo=algo, blocks=blocks):
                    kw = dict(algo=algo, blocks=blocks, scale=0.3, chunk_size=CHUNK, initial_state=a[5])
                    return gdn_context_parallel(*a[:5], cp, **kw)

                got = outputs_and_grads(fn, local, h0 if rank == 0 else None, do[:, sl])
                assert len(got) == len(ref)
                assert_rel_close(got, ref, tol, f"CP{world} rank {rank} {algo}/{blocks} {dtype} {gates} h0={with_h0}")
            # a slice of T_LOCAL = 16 tokens in a chunk of 24 (the op pads it with identity tokens); and of 12 in 8
            for chunk, short in ((24, 0), (8, 4)) if with_h0 and gates == "reset" else ():
                n = T_LOCAL - short
                part = [x[:, rank * T_LOCAL : rank * T_LOCAL + n] for x in (q, k, v, g, beta)]
                whole = [
                    torch.cat([x[:, r * T_LOCAL : r * T_LOCAL + n] for r in range(world)], 1)
                    for x in (q, k, v, g, beta)
                ]
                d_whole = torch.cat([do[:, r * T_LOCAL : r * T_LOCAL + n] for r in range(world)], 1)
                want = outputs_and_grads(loop, whole, h0, d_whole.double())
                want = [x[:, rank * n : (rank + 1) * n] for x in want[:6]] + (want[6:] if rank == 0 else [])

                def padded(*a, chunk=chunk):
                    kw = dict(algo="all-scan", blocks=2, scale=0.3, chunk_size=chunk, initial_state=a[5])
                    return gdn_context_parallel(*a[:5], cp, **kw)

                got = outputs_and_grads(
                    padded, part, h0 if rank == 0 else None, do[:, rank * T_LOCAL : rank * T_LOCAL + n]
                )
                assert_rel_close(got, want, tol, f"CP{world} rank {rank} {n} tokens in chunk {chunk} {dtype} {gates}")


def _check_ledger(rank, world, cp):
    """Bytes this rank sends per call: All-Scan one fp32 state each way whatever P; the all-gather
    (P-1) x (U, M) forward and (P-1) states backward."""
    state, transition = B * H * K * V * 4, B * H * K * K * 4
    q, k, v, g, beta, _, do = make_inputs(world * T_LOCAL, torch.float32, "mild")
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    local = [x[:, sl].clone().requires_grad_() for x in (q, k, v, g, beta)]
    for algo, blocks in ALGOS:
        comm.LEDGER.reset()
        o = gdn_context_parallel(*local, cp, algo=algo, blocks=blocks, chunk_size=CHUNK)
        (o * do[:, sl]).sum().backward()
        name = {"all-scan": "allscan", "all-gather": "lasp2", "ring": "ring"}[algo]
        fwd, bwd = sent(f"cp_{name}_fwd"), sent(f"cp_{name}_bwd")
        assert {r["phase"] for r in comm.LEDGER.local_rows()} <= {f"cp_{name}_fwd", f"cp_{name}_bwd"}
        if algo == "all-gather":
            assert (fwd, bwd) == ((world - 1) * (state + transition), (world - 1) * state), (algo, fwd, bwd)
        else:
            assert fwd == (state if rank < world - 1 else 0), (algo, blocks, fwd)
            assert bwd == (state if rank > 0 else 0), (algo, blocks, bwd)


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


def _worker(rank, world):
    cp = build_groups(Topology(world, cp=world), rank).cp
    _check_operator(rank, world, cp)
    _check_ledger(rank, world, cp)
    _check_halo(rank, world, cp)
    return True


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gdn_context_parallel_matches_token_loop(world):
    assert all(run_distributed(_worker, world, timeout=300))


def test_single_rank_and_bad_algo():
    q, k, v, g, beta, h0, _ = make_inputs(2 * T_LOCAL, torch.float64, "mild")
    o = gdn_context_parallel(q, k, v, g, beta, None, chunk_size=CHUNK, initial_state=h0)
    torch.testing.assert_close(o, naive_recurrent_gdn(q, k, v, g, beta, initial_state=h0)[0])
    with pytest.raises(ValueError, match="unknown CP algorithm"):
        gdn_context_parallel(q, k, v, g, beta, None, algo="zigzag")
