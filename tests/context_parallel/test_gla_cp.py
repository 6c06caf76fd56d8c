"""GLA under context parallelism (All-Scan, LASP-2 all-gather, LASP-1 ring) against
single-process chunk_gla over the whole sequence, and the bytes each algorithm sends.

One spawn per CP size runs every check (spawns are the slow part)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import comm
from megatron_zpp.context_parallel import gla_context_parallel
from megatron_zpp.ops.gla import chunk_gla
from megatron_zpp.topology import Topology, build_groups
from tests.dist import run_distributed

B, T_LOCAL, H, K, V, CHUNK = 2, 16, 2, 8, 4, 8
ALGOS = [("all-scan", 1), ("all-scan", 2), ("all-gather", 1), ("ring", 1)]
# (dtype, strongest log decay per token or None for mild gates, relative tolerance)
CASES = [
    (torch.float64, None, 1e-10),
    (torch.float64, -50.0, 1e-10),
    (torch.float32, None, 1e-5),
    (torch.float32, -50.0, 1e-5),
]


def make_inputs(T, dtype, g_min, seed=0):
    """Full-sequence q, k, v, g, initial state and output cotangent (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, do = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H, K)) / 16
    if g_min is not None:  # mix of strong (down to g_min) and mild decays
        g = g_min * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) ** 2
    h0 = r(B, H, K, V)
    return [x.to(dtype) for x in (q, k, v, g, h0, do)]


def outputs_and_grads(fn, q, k, v, g, h0, do):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    o = fn(*leaves, h0)
    grads = torch.autograd.grad((o * do).sum(), leaves + ([h0] if h0 is not None else []))
    return [o.detach()] + list(grads)


def assert_rel_close(got, ref, tol, what):
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dh0"), got, ref):
        assert torch.isfinite(a).all(), f"{what}: {name} not finite"
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1)).item()
        assert err <= tol, f"{what}: {name} relative error {err:.2e} > {tol:.0e}"


def sent(phase):
    rows = [r for r in comm.LEDGER.local_rows() if r["phase"] == phase]
    return sum(r["bytes"] for r in rows), sum(r["calls"] for r in rows)


def _gla_worker(rank, world):
    cp = build_groups(Topology(world, cp=world), rank).cp
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    for dtype, g_min, tol in CASES:
        for with_h0 in (False, True):
            q, k, v, g, h0, do = make_inputs(world * T_LOCAL, dtype, g_min)
            h0 = h0 if with_h0 else None
            ref = outputs_and_grads(
                lambda *a: chunk_gla(*a[:4], initial_state=a[4], chunk_size=CHUNK)[0], q, k, v, g, h0, do
            )
            ref = [ref[0][:, sl]] + [x[:, sl] for x in ref[1:5]] + ref[5:]
            if with_h0 and rank > 0:
                ref = ref[:5]  # only rank 0 reads (and differentiates) the initial state
            local = [x[:, sl] for x in (q, k, v, g)]
            for algo, blocks in ALGOS:
                fn = lambda q_, k_, v_, g_, h_: gla_context_parallel(  # noqa: E731
                    q_, k_, v_, g_, cp, algo=algo, blocks=blocks, chunk_size=CHUNK, initial_state=h_
                )
                got = outputs_and_grads(fn, *local, h0 if rank == 0 else None, do[:, sl])
                assert len(got) == len(ref)
                assert_rel_close(
                    got, ref, tol, f"CP{world} rank {rank} {algo}/{blocks} {dtype} g_min={g_min} h0={with_h0}"
                )

    # Ledger: bytes each rank sends per layer call (fp32 state and gates).
    state, gamma = B * H * K * V * 4, B * H * K * 4
    q, k, v, g, _, do = make_inputs(world * T_LOCAL, torch.float32, None)
    local = [x[:, sl].clone().requires_grad_() for x in (q, k, v, g)]
    for algo, blocks in ALGOS:
        comm.LEDGER.reset()
        o = gla_context_parallel(*local, cp, algo=algo, blocks=blocks, chunk_size=CHUNK)
        (o * do[:, sl]).sum().backward()
        name = {"all-scan": "allscan", "all-gather": "lasp2", "ring": "ring"}[algo]
        fwd, fwd_calls = sent(f"cp_{name}_fwd")
        bwd, bwd_calls = sent(f"cp_{name}_bwd")
        assert {r["phase"] for r in comm.LEDGER.local_rows()} <= {f"cp_{name}_fwd", f"cp_{name}_bwd"}
        if algo == "all-gather":  # ring all-gather: (P-1)/P of P packed (state, gamma) buffers
            assert (fwd, bwd) == ((world - 1) * (state + gamma), (world - 1) * state), (algo, fwd, bwd)
        else:  # one state per direction whatever P; the chain's ends send nothing that way
            assert fwd == (state if rank < world - 1 else 0), (algo, blocks, fwd)
            assert bwd == (state if rank > 0 else 0), (algo, blocks, bwd)
            if algo == "all-scan" and rank < world - 1:
                assert fwd_calls == blocks, (blocks, fwd_calls)
    return True


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gla_context_parallel_matches_full_sequence(world):
    assert all(run_distributed(_gla_worker, world, timeout=300))


def test_single_rank_and_bad_algo():
    q, k, v, g, h0, _ = make_inputs(2 * T_LOCAL, torch.float64, None)
    o = gla_context_parallel(q, k, v, g, None, chunk_size=CHUNK, initial_state=h0)
    torch.testing.assert_close(o, chunk_gla(q, k, v, g, initial_state=h0, chunk_size=CHUNK)[0])
    with pytest.raises(ValueError, match="unknown CP algorithm"):
        gla_context_parallel(q, k, v, g, None, algo="zigzag")


class FixedScan:
    """One rank's view of the scan: S_in and dS_out given; records the state gradient it was sent."""

    def __init__(self, S_in, dS_out):
        self.S_in, self.dS_out, self.sent = S_in, dS_out, None

    def forward(self, S_loc, log_gamma, head):
        return self.S_in.to(S_loc.dtype)

    def backward(self, dS_corr):
        self.sent = dS_corr
        return self.dS_out.to(dS_corr.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("gates", ["mild", "strong", "reset"])
def test_operator_is_chunk_gla_from_the_scanned_state(dtype, gates, tol):
    # The operator with S_in arriving and dS_out coming back equals the fp64 token loop started from
    # S_in whose loss also reads the final state; the scan is sent the gradient of S_in from o alone.
    # Slice T = 24, chunk 8, odd K = 5, V = 3; max-abs error relative to the reference's max.
    from megatron_zpp.context_parallel.gla import ContextParallelGLA
    from megatron_zpp.ops.gla_naive import naive_recurrent_gla

    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, do = r(2, 24, 2, 5), r(2, 24, 2, 5), r(2, 24, 2, 3), r(2, 24, 2, 3)
    S_in, dS_out = r(2, 2, 5, 3), r(2, 2, 5, 3)
    g = {"mild": F.logsigmoid(r(2, 24, 2, 5)) / 16, "strong": -50.0 * torch.rand(2, 24, 2, 5, generator=gen)}.get(
        gates, (F.logsigmoid(r(2, 24, 2, 5)) / 16).masked_fill(torch.rand(2, 24, 2, 5, generator=gen) < 0.1, -torch.inf)
    )
    q, k, v, g, do = (x.to(dtype) for x in (q, k, v, g, do))
    leaves = [x.double().requires_grad_() for x in (q, k, v, g, S_in)]
    o_ref, ht = naive_recurrent_gla(*leaves[:4], 0.4, leaves[4], True)
    ref = torch.autograd.grad((o_ref * do.double()).sum() + (ht * dS_out).sum(), leaves)
    sent_ref = torch.autograd.grad((naive_recurrent_gla(*leaves[:4], 0.4, leaves[4])[0] * do.double()).sum(), leaves[4])

    scan = FixedScan(S_in, dS_out)
    got_leaves = [x.clone().requires_grad_() for x in (q, k, v, g)] + [S_in.to(dtype).requires_grad_()]
    o = ContextParallelGLA.apply(*got_leaves, scan, 0.4, 8)
    grads = torch.autograd.grad((o * do).sum(), got_leaves)
    assert_rel_close([o.detach(), *grads], [o_ref.detach(), *ref], tol, f"{dtype} {gates}")
    assert_rel_close([scan.sent], sent_ref, tol, "state gradient sent")
    if gates == "reset":
        assert (grads[3][torch.isneginf(g)] == 0).all()
