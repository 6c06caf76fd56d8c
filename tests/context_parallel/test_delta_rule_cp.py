"""The context-parallel passes of the delta-rule ops (ops/delta_rule.py through context_parallel/delta_rule.py's
ScannedDeltaRule), Gated DeltaNet and KDA, against the wide pass they replace: the op on [v, 0_K] from the initial
state [0, I_K] (o = [o_loc, r], final state = [U, M]), differentiated by autograd through the op's own backward.
In fp64 with packed documents inside the slice (g = -inf on a chunk's first, a middle and a last token of
sequence 0; sequence 1 has none, so M = 0 there and dense here), the slice's (o, U, M), the gradient it sends
back (dS_corr) and every gradient (q, k, v, g, beta and the head state) agree to 1e-12. One process; the scan
is a stand-in that returns a given S_in and dS_out."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.context_parallel.delta_rule import ScannedDeltaRule
from megatron_zpp.ops.gdn import chunk_gdn
from megatron_zpp.ops.kda import chunk_kda

B, T, H, K, V, C, SCALE = 2, 48, 2, 8, 6, 16, 0.3
RESETS = (5, 16, 31)  # a middle token, a chunk's first, a chunk's last (in sequence 0)


class GivenScan:
    """The scans' interface: records what the slice sends, returns the given entering state and its gradient."""

    def __init__(self, S_in, dS_out):
        self.S_in, self.dS_out = S_in, dS_out

    def forward(self, U, transition, head):
        self.U, self.M = U, transition.M
        return self.S_in if head is None else head

    def backward(self, dS_corr):
        self.dS_corr = dS_corr
        return self.dS_out


def inputs(per_channel: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    g = F.logsigmoid(r(B, T, H, K) if per_channel else r(B, T, H)) / 16  # mild: M stays far from 0
    g[0, list(RESETS)] = -torch.inf  # packed documents in sequence 0; sequence 1 keeps its entering state
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [q, k, r(B, T, H, V), g, beta], r(B, H, K, V), r(B, T, H, V), r(B, H, K, V)


def wide_pass(op, q, k, v, g, beta):
    """(o_loc, r, U, M) as the old operator computed them: one op call on V + K value columns."""
    eye = torch.eye(K, dtype=q.dtype).expand(B, H, K, K)
    wide = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    o, S = op(q, k, wide, g, beta, SCALE, torch.cat([eye.new_zeros(B, H, K, V), eye], dim=-1), True, C)
    return o[..., :V], o[..., V:], S[..., :V], S[..., V:]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("op", [chunk_gdn, chunk_kda], ids=["gdn", "kda"])
@pytest.mark.parametrize("with_head", [False, True])
def test_transition_pass_and_backward_equal_the_wide_pass(op, with_head):
    xs, S_in, do, dS_out = inputs(op is chunk_kda, seed=3 + with_head)
    leaves = [x.clone().requires_grad_() for x in xs]
    head = S_in.clone().requires_grad_() if with_head else None
    scan = GivenScan(S_in, dS_out)
    o = ScannedDeltaRule.apply(*leaves, head, scan, SCALE, C, op)
    got = torch.autograd.grad((o * do).sum(), leaves + ([head] if with_head else []))

    ref_leaves = [x.clone().requires_grad_() for x in xs]
    ref_S = S_in.clone().requires_grad_()
    o_loc, r, U, M = wide_pass(op, *ref_leaves)
    ref_o = o_loc + torch.einsum("bthk,bhkv->bthv", r, ref_S)
    S_out = U + M @ ref_S
    loss = (ref_o * do).sum() + (S_out * dS_out).sum()  # what the next rank sends back reaches S_out
    ref = torch.autograd.grad(loss, ref_leaves + ([ref_S] if with_head else []))

    d_corr = torch.einsum("bthk,bthv->bhkv", r, do)
    checks = [("o", o, ref_o), ("U", scan.U, U), ("M", scan.M, M), ("dS_corr", scan.dS_corr, d_corr)]
    checks += list(zip(("dq", "dk", "dv", "dg", "dbeta", "dhead"), got, ref))
    for name, a, b in checks:
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        assert rel(a, b) <= 1e-12, f"{op.__name__} {name}: relative error {rel(a, b):.1e}"
    assert (got[3][torch.isneginf(xs[3])] == 0).all()  # no gradient reaches a reset gate
    assert (scan.M[0] == 0).all() and (r[0, RESETS[0] :] == 0).all()  # sequence 0: a reset clears S_in
    assert scan.M[1].abs().max() > 1e-3 and (r[0, : RESETS[0]] != 0).any()  # sequence 1: S_in reaches the end
