"""The MoE layer under expert parallelism (alltoall and allgather dispatchers; EP, ETP, EP x TP with sequence
parallelism; capacity dropping and padding) against the single-rank MoELayer on the same full weights.

One gloo job per world size runs every case of that size. In each case every rank builds the single-rank
layer (the same seed everywhere) and the parallel layer holding its shards of the same weights (by name),
and feeds the parallel layer its own tokens: a micro-batch per data-parallel rank, its sequence shard under
TP. The reference runs all the tokens at once (under capacity dropping, each rank's tokens apart: megatron-core
drops per rank, before dispatch) and the losses per micro-batch. Compared, fp32: the output and the input
gradient (1e-6), the router's and the shared gate's gradients summed over the ranks that replicate them, the
TP-sharded shared expert's over DP, each expert shard's over the expert-data-parallel group (1e-6 absolute,
1e-5 relative: the order of the sums differs), the router losses summed over tp_cp. Also: the token
all-to-all's ledger bytes against the routed rows this rank sends to other ranks (from the reference's
routing), their mean against the closed form tokens x topk x (EP-1)/EP x H x 4 for random routing, and the
sequence of collectives of each group, the same on all its members although each routes different tokens."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron_zpp import comm
from megatron_zpp.moe.config import MoEConfig
from megatron_zpp.moe.layer import MoELayer
from megatron_zpp.moe.permute import drop_tokens
from megatron_zpp.tensor_parallel import shard
from megatron_zpp.topology import ParallelContext, Topology, build_groups
from tests.dist import run_distributed

E, H, F, B, T = 8, 16, 12, 2, 16  # B sequences of T tokens per data-parallel rank
LOSSES = dict(aux_loss_coeff=0.01, z_loss_coeff=1e-3)
SHARED = dict(shared_expert_size=20, shared_expert_gate=True)

CASES = {
    2: {
        "ep2-alltoall": dict(ep=2, kw=dict(token_dispatcher="alltoall", **SHARED, **LOSSES)),
        "ep2-allgather": dict(ep=2, kw=dict(score_function="sigmoid", activation="gelu", **LOSSES)),
        "ep2-alltoall-drop": dict(ep=2, kw=dict(token_dispatcher="alltoall", capacity_factor=0.5)),
        "ep2-alltoall-pad": dict(ep=2, kw=dict(token_dispatcher="alltoall", capacity_factor=1.0, pad_to_capacity=True)),
        "ep2-allgather-drop": dict(ep=2, kw=dict(capacity_factor=0.5)),
    },
    4: {
        "ep4-alltoall": dict(
            ep=4, uniform=True, kw=dict(token_dispatcher="alltoall", load_balancing_type="seq_aux_loss", **LOSSES)
        ),
        "ep4-allgather": dict(ep=4, kw=dict(topk=3, **LOSSES)),
        "etp2-alltoall": dict(etp=2, kw=dict(token_dispatcher="alltoall")),
        "etp2-allgather": dict(etp=2, kw=dict(activation="gelu")),
        "ep2-etp2-alltoall": dict(ep=2, etp=2, kw=dict(token_dispatcher="alltoall", capacity_factor=0.5)),
        "ep2-etp2-allgather": dict(ep=2, etp=2, kw=dict(**LOSSES)),
        "ep2-tp2sp-alltoall": dict(ep=2, tp=2, kw=dict(token_dispatcher="alltoall", **SHARED, **LOSSES)),
        "ep2-etp2-tp2sp-alltoall": dict(ep=2, etp=2, tp=2, kw=dict(token_dispatcher="alltoall", **SHARED, **LOSSES)),
        "ep2-tp2sp-allgather": dict(ep=2, tp=2, kw=dict(load_balancing_type="seq_aux_loss", **SHARED, **LOSSES)),
    },
}


def _build(case: dict, rank: int, world: int):
    tp, ep, etp = case.get("tp", 1), case.get("ep", 1), case.get("etp", 1)
    g = build_groups(Topology(world, tp=tp, ep=ep, etp=etp), rank)
    ctx = ParallelContext(tp=g.tp, sequence_parallel=tp > 1, ep=g.ep, etp=g.etp, etp_ep=g.etp_ep, tp_cp=g.tp_cp)
    cfg = MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F, **case["kw"])
    torch.manual_seed(0)
    ref = MoELayer(cfg, init_std=0.3, out_std=0.3)
    if case.get("uniform"):  # orthogonal router rows of one norm: iid logits for iid inputs, uniform routing
        with torch.no_grad():
            ref.router.weight.copy_(torch.linalg.qr(torch.randn(H, E))[0].T * 1.2)
    layer = MoELayer(cfg, ctx, init_std=0.3, out_std=0.3)
    full = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            split_over = g.etp if getattr(p, "expert_parallel", False) else g.tp
            p.copy_(shard(full[name], p.tp_split, split_over.rank, split_over.size))
    return g, ref, layer


def _reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    comm.all_reduce(t, group, "test")
    return t


def _grad_errors(g, ref, layer) -> dict[str, float]:
    """Each parameter's gradient summed over the ranks that hold the same piece, minus the reference's piece."""
    full = dict(ref.named_parameters())
    errors = {}
    for name, p in layer.named_parameters():
        if getattr(p, "expert_parallel", False):
            grad, want = _reduce(p.grad, g.edp), shard(full[name].grad, p.tp_split, g.etp.rank, g.etp.size)
        elif p.tp_split is not None:
            grad, want = _reduce(p.grad, g.dp), shard(full[name].grad, p.tp_split, g.tp.rank, g.tp.size)
        else:  # replicated (router, gate): a partial sum on every rank
            grad, want = _reduce(p.grad, g.world), full[name].grad
        errors[name] = _excess(grad, want, 1e-5)
    return errors


def _excess(got: torch.Tensor, want: torch.Tensor, rtol: float) -> float:
    """max |got - want| - rtol |want|: below 1e-6 is torch.testing.assert_close(rtol=rtol, atol=1e-6)."""
    return ((got - want).abs() - rtol * want.abs()).max().item()


def _sent_rows(ref, cfg: MoEConfig, x_mine: torch.Tensor, ep_rank: int, ep: int) -> int:
    """Routed (token, expert) pairs of this rank's tokens whose expert another EP rank holds."""
    with torch.no_grad():
        routing = ref.router(x_mine)
        probs, routing_map = routing.probs, routing.routing_map
        if cfg.capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, cfg.topk, cfg.capacity_factor, cfg.pad_to_capacity)
    owner = torch.arange(E) // (E // ep)
    return int(routing_map[:, owner != ep_rank].sum())


def _reference(ref, cfg, x_all, dy_all, chunks):
    """The single-rank layer on all the tokens (or, dropping, on each rank's own), plus each micro-batch's
    losses; backward of sum(out * dy) + the losses."""
    x_ref = x_all.clone().requires_grad_()
    if cfg.capacity_factor is None:
        out = ref(x_ref)[0]
    else:
        out = torch.zeros_like(x_all)
        for c in chunks:
            out[c] = ref(x_ref[c])[0]
    losses = [sum(ref.router(x_ref[b * B : (b + 1) * B]).losses.values()) for b in range(x_all.shape[0] // B)]
    ((out * dy_all).sum() + sum(losses, torch.zeros(()))).backward()
    return out.detach(), x_ref.grad, losses


def _run_case(name: str, case: dict, rank: int, world: int) -> dict:
    comm.LEDGER.reset()
    comm.ORDER.keep = True
    comm.ORDER.seq.clear()
    g, ref, layer = _build(case, rank, world)
    cfg, tp = layer.cfg, g.tp.size
    dp = world // tp
    gen = torch.Generator().manual_seed(1234)
    x_all, dy_all = torch.randn(dp * B, T, H, generator=gen), torch.randn(dp * B, T, H, generator=gen)
    seq = T // tp

    def chunk_of(r: int) -> tuple[slice, slice]:
        c = g.topo.coords(r)
        return slice(c["dp"] * B, (c["dp"] + 1) * B), slice(c["tp"] * seq, (c["tp"] + 1) * seq)

    mine = chunk_of(rank)
    out_ref, dx_ref, losses_ref = _reference(ref, cfg, x_all, dy_all, [chunk_of(r) for r in range(world)])
    x = x_all[mine].clone().requires_grad_()
    out, losses = layer(x)
    ((out * dy_all[mine]).sum() + sum(losses.values(), torch.zeros(()))).backward()
    loss_sum = _reduce(sum(losses.values(), torch.zeros(())).detach(), g.tp_cp).item()
    return {
        "out": _excess(out.detach(), out_ref[mine], 1e-6),
        "dx": _excess(x.grad, dx_ref[mine], 1e-6),
        "scale": out_ref.abs().max().item(),
        "grads": _grad_errors(g, ref, layer),
        "loss": abs(loss_sum - float(losses_ref[g.dp_rank].detach())) if losses else 0.0,
        "a2a_bytes": comm.LEDGER.total(phase="moe_dispatch", op="all_to_all"),
        "a2a_expected": _sent_rows(ref, cfg, x_all[mine], g.ep_rank, g.ep.size) * H * 4,
        "routed_rows": B * seq * cfg.topk,
        "ag_bytes": comm.LEDGER.total(phase="moe_ag_tokens", op="all_gather"),
        "ag_expected": (g.etp_ep.size - 1) * B * seq * H * 4,  # ring all-gather: every other member's tokens
        "order": {(role, ranks): list(s) for (role, ranks), s in comm.ORDER.seq.items()},
        "tokens_per_expert": layer.tokens_per_expert.tolist(),
    }


def _sabotaged(rank: int, world: int) -> float:
    """ep2-alltoall with the source-major -> expert-major sort skipped: the relative output error."""
    with mock.patch("megatron_zpp.moe.dispatch.sort_chunks", lambda x, counts: x):
        res = _run_case("sabotage", CASES[2]["ep2-alltoall"], rank, world)
    return (res["out"] + 1e-6 * res["scale"]) / res["scale"]  # max |error| / max |output|, roughly


def _all_cases(rank: int, world: int) -> dict:
    results = {name: _run_case(name, case, rank, world) for name, case in CASES[world].items()}
    comm.ORDER.keep = False
    if world == 2:
        results["sabotage"] = _sabotaged(rank, world)
    return results


@pytest.fixture(scope="module")
def runs2():
    return run_distributed(_all_cases, 2, timeout=600)


@pytest.fixture(scope="module")
def runs4():
    return run_distributed(_all_cases, 4, timeout=600)


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def runs(request):
    return request.param, request.getfixturevalue(f"runs{request.param}")


def test_layer_equals_the_single_rank_layer(runs):
    world, results = runs
    for name in CASES[world]:
        for rank, res in enumerate(results):
            r = res[name]
            assert r["out"] < 1e-6 and r["dx"] < 1e-6, (name, rank, r["out"], r["dx"])
            assert max(r["grads"].values()) < 1e-6, (name, rank, r["grads"])
            assert r["loss"] < 1e-7, (name, rank, r["loss"])


def test_token_exchange_bytes_equal_the_closed_forms(runs):
    """alltoall: the rows routed to other EP ranks; allgather: (n - 1) x the rank's tokens over etp_ep."""
    world, results = runs
    for name, case in CASES[world].items():
        if case["kw"].get("token_dispatcher") != "alltoall":
            assert [res[name]["ag_bytes"] for res in results] == [res[name]["ag_expected"] for res in results], name
            continue
        sent = [res[name]["a2a_bytes"] for res in results]
        assert sent == [res[name]["a2a_expected"] for res in results], name
        if case.get("uniform"):  # uniform random routing: ~ tokens x topk x (EP-1)/EP rows per rank
            ep = case["ep"]
            closed = results[0][name]["routed_rows"] * (ep - 1) / ep * H * 4
            assert abs(sum(sent) / len(sent) / closed - 1) < 0.1, (name, sent, closed)


def test_every_rank_of_a_group_issues_the_same_collectives(runs):
    world, results = runs
    for name in CASES[world]:
        orders = [res[name]["order"] for res in results]
        for key in set().union(*orders):
            role, ranks = key
            seqs = {tuple(orders[r].get(key, [])) for r in ranks}
            assert len(seqs) == 1, (name, role, ranks, seqs)
        tokens = [res[name]["tokens_per_expert"] for res in results]
        if not CASES[world][name]["kw"].get("pad_to_capacity"):  # padded: every expert gets capacity rows
            assert len({tuple(t) for t in tokens}) > 1, name  # the ranks did route different counts


def test_skipping_the_expert_major_sort_fails_by_orders_of_magnitude(runs2):
    errors = [res["sabotage"] for res in runs2]
    assert min(errors) > 1e-2, errors  # against the 1e-6 the layer meets


def _shapes_only(rank: int, world: int) -> dict:
    """Ranks 0 and 3 of 4 on torch's fake process group under FakeTensorMode (the dry run's way): both
    dispatchers run forward and backward on the balanced stand-in counts, and issue their collectives."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_zpp.ops import dispatch

    out = {}
    dispatch.set_kernels("triton", torch.device("cpu"))
    for fake_rank in (0, 3):
        dist.init_process_group("fake", store=FakeStore(), rank=fake_rank, world_size=4)
        for name, (ep, etp, kind) in {"a2a": (4, 1, "alltoall"), "ag": (2, 2, "allgather")}.items():
            comm.LEDGER.reset()
            g = build_groups(Topology(4, ep=ep, etp=etp), fake_rank)
            ctx = ParallelContext(ep=g.ep, etp=g.etp, etp_ep=g.etp_ep, tp_cp=g.tp_cp)
            with FakeTensorMode():
                layer = MoELayer(MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F, token_dispatcher=kind), ctx)
                y, _ = layer(torch.randn(B, T, H))
                y.sum().backward()
            grads = all(p.grad is not None and p.grad.shape == p.shape for p in layer.parameters())
            out[(fake_rank, name)] = (tuple(y.shape), grads, sorted({k[1] for k in comm.LEDGER.records}))
        dist.destroy_process_group()
    return out


def test_both_dispatchers_run_shapes_only_on_the_fake_process_group():
    res = run_distributed(_shapes_only, 1, init_group=False)[0]
    for (rank, name), (shape, grads, phases) in res.items():
        assert shape == (B, T, H) and grads, (rank, name)
        want = {"moe_counts", "moe_dispatch", "moe_combine"} if name == "a2a" else {"moe_ag_tokens", "moe_ag_scatter"}
        assert want <= set(phases) and any(p.endswith("_bwd") for p in phases), (rank, name, phases)
