"""What bench/cp.py runs on each rank (and its smoke test through it): the operators under context parallelism on
one rank's slice, built from a config dict: GLA's (context_parallel/gla.py) and the delta-rule one of Gated
DeltaNet and Kimi Delta Attention (context_parallel/delta_rule.py), the plain local pass they are measured against, and
the operator on a silent scan (its own arithmetic without communication)."""

from __future__ import annotations

import torch

NO_COMM = "none"  # the algorithm name of the operator on a SilentScan
DELTA_RULE = ("gdn", "kda")  # Gated DeltaNet and Kimi Delta Attention: one CP operator (context_parallel/delta_rule.py)


def make_inputs(cfg: dict, rank: int) -> dict:
    """This rank's slice (GLA: q, k, v, g; GDN: L2-normalised q, k, v, g per head, beta; as leaves), states of the
    scan's sizes for comm-only and the slice's transition (GLA: its decay; GDN: a K x K matrix)."""
    from megatron_zpp.context_parallel.transition import Decay, Dense

    gen = torch.Generator().manual_seed(1234 + rank)
    T, H, K, V = cfg["t_local"], cfg["heads"], cfg["head_k"], cfg["head_v"]
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    S, dS = (torch.randn(1, H, K, V, generator=gen) for _ in range(2))
    if cfg["mixer"] in DELTA_RULE:  # KDA: one decay per key channel
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
        gate = (1, T, H, K) if cfg["mixer"] == "kda" else (1, T, H)
        g = torch.nn.functional.logsigmoid(torch.randn(*gate, generator=gen)) / 16
        beta = torch.rand(1, T, H, generator=gen)
        transition = Dense(torch.randn(1, H, K, K, generator=gen) / K)
        return {"leaves": [x.requires_grad_() for x in (q, k, v, g, beta)], "S": S, "T": transition, "dS": dS}
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=gen)) / 16  # log decay <= 0
    return {"leaves": [x.requires_grad_() for x in (q, k, v, g)], "S": S, "T": Decay(g.detach().sum(1)), "dS": dS}


class SilentScan:
    """Sends nothing, returns zero states: run through the operator, it leaves the operator's own arithmetic
    (the local pass split in two, the state correction and its gradients, the thread), so that the
    communication a real scan leaves exposed is measured against it rather than against the ideal."""

    def forward(self, S_loc, transition, head):
        return torch.zeros_like(S_loc)

    def backward(self, dS_corr):
        return torch.zeros_like(dS_corr)


def run_operator(x: dict, cp, algo: str | None, blocks: int, chunk: int, mixer: str) -> None:
    from megatron_zpp.context_parallel import gla_context_parallel
    from megatron_zpp.context_parallel.delta_rule import delta_rule_context_parallel, scanned_delta_rule
    from megatron_zpp.context_parallel.gla import ContextParallelGLA
    from megatron_zpp.ops.gdn import chunk_gdn
    from megatron_zpp.ops.gla import chunk_gla_local
    from megatron_zpp.ops.kda import chunk_kda

    for t in x["leaves"]:
        t.grad = None
    scale = x["leaves"][0].shape[-1] ** -0.5
    op = {"gdn": chunk_gdn, "kda": chunk_kda}.get(mixer)
    if algo is None:
        o = (op or chunk_gla_local)(*x["leaves"], chunk_size=chunk)[0]
    elif algo == NO_COMM and op is not None:
        o = scanned_delta_rule(*x["leaves"], SilentScan(), None, scale, chunk, None, op)
    elif algo == NO_COMM:
        o = ContextParallelGLA.apply(*x["leaves"], None, SilentScan(), scale, chunk)
    elif op is not None:
        o = delta_rule_context_parallel(*x["leaves"], cp, algo, blocks, chunk_size=chunk, op=op)
    else:
        o = gla_context_parallel(*x["leaves"], cp, algo, blocks, chunk_size=chunk)
    o.sum().backward()
