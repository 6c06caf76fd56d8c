"""Causal softmax attention under context parallelism (all-gather of K and V) against the
slice of full causal SDPA, outputs and gradients, with and without GQA."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import comm
from megatron_zpp.context_parallel import attention_context_parallel
from megatron_zpp.topology import Topology, build_groups
from tests.dist import run_distributed

B, T_LOCAL, D = 2, 8, 8


def _grads(fn, q, k, v, do):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves)
    return [o.detach()] + list(torch.autograd.grad((o * do).sum(), leaves))


def _attention_worker(rank, world):
    cp = build_groups(Topology(world, cp=world), rank).cp
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    T = world * T_LOCAL
    for heads, groups in ((4, 2), (4, 4)):
        torch.manual_seed(0)  # same full tensors on every rank
        q, do = torch.randn(B, heads, T, D, dtype=torch.float64), torch.randn(B, heads, T, D, dtype=torch.float64)
        k, v = torch.randn(B, groups, T, D, dtype=torch.float64), torch.randn(B, groups, T, D, dtype=torch.float64)
        ref = _grads(
            lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=heads != groups),
            q,
            k,
            v,
            do,
        )
        comm.LEDGER.reset()
        got = _grads(
            lambda q_, k_, v_: attention_context_parallel(q_, k_, v_, cp), *(x[:, :, sl] for x in (q, k, v, do))
        )
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, b[:, :, sl], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
        kv_bytes = 2 * B * groups * T * D * 8  # gathered K|V, fp64
        fwd = comm.LEDGER.total(phase="cp_attn_fwd", op="all_gather")
        bwd = comm.LEDGER.total(phase="cp_attn_bwd", op="reduce_scatter")
        assert fwd == bwd == (world - 1) / world * kv_bytes, (fwd, bwd)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_attention_context_parallel_matches_full(world):
    assert all(run_distributed(_attention_worker, world))
