"""megatron_zpp/zero/grad_reduce.py: qgZ's hierarchical reduce-scatter on gloo ranks.

Three layouts, one spawn each: 4 ranks as 2 nodes of 2, 6 ranks as 3 nodes of 2 (odd
node count), and 8 ranks as a 3-level hierarchy (pairs / nodes of 4 / cluster). Every
rank draws its inputs from a generator seeded by its rank, so the parent recomputes
the exact sum and the error bound for each.

Error bound with bits set (L = 7 for int4, 127 for int8). For an output element in
block b of chunk p, let a_s = absmax of sender s's block b of chunk p (blocks align
with chunks because C is a multiple of block). By induction over hops, every value a
rank sends at hop i for that block is bounded by the sum of a_s over the ranks already
folded into it (a dequantized value never exceeds its block's absmax), so that hop's
quantization error, summed over all partial sums that meet at the end, is at most
sum_s a_s / (2L). Hence |out - exact| <= n_hops * sum_s a_s / (2L), plus fp32 slack.
"""

import math

import pytest
import torch

from megatron_zpp import comm
from megatron_zpp.topology import Group, Topology, build_groups
from megatron_zpp.zero.grad_reduce import HierarchicalReduceScatter, hierarchical_reduce_scatter, padded_numel
from tests.dist import run_distributed

BLOCK, CHUNK = 32, 128  # C = 4 blocks per chunk

LAYOUTS = {  # name: (world, Topology kwargs, dp_tiers, link per hop, ranks per node D)
    "2x2": (4, dict(ranks_per_node=2), [2], ["intra_node", "inter_node"], 2),
    "3x2": (6, dict(ranks_per_node=2), [2], ["intra_node", "inter_node"], 2),
    "2x2x2": (8, dict(ranks_per_node=4, sub_node_tiers=(2,)), [2, 4], ["tier0", "intra_node", "inter_node"], 4),
}


def grad(rank, world, kind, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * world + 10 * rank + ord(kind[0]))
    n = world * CHUNK
    if kind == "int":  # integer-valued: every partial sum is exact
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)
    # gaussian with block scales spanning 4 decades, different per rank
    scale = torch.logspace(-2, 2, n // BLOCK)[torch.randperm(n // BLOCK, generator=g)]
    return (torch.randn(n, generator=g) * scale.repeat_interleave(BLOCK)).to(dtype)


def _snap():
    return {k: (r.bytes, r.calls) for k, r in comm.LEDGER.records.items()}


def _run(rank, world, topo_kwargs, dp_tiers):
    g = build_groups(Topology(world, **topo_kwargs), rank, dp_tiers=dp_tiers)
    hops = g.dp_tier_hops()
    assert len(hops) == len(dp_tiers) + 1
    res = {
        "digits": [h.rank for h in hops],
        "sizes": [h.size for h in hops],
        "dp_rank": g.dp_rank,
        "links": [h.link for h in hops],
        "roles": [h.role for h in hops],
    }
    x = grad(rank, world, "int")
    ref = torch.empty(CHUNK)
    comm.reduce_scatter(ref, x, g.dp, "grad")
    comm.LEDGER.reset()
    res["int_none"] = (hierarchical_reduce_scatter(x, hops, "grad", None, BLOCK), ref.clone(), _snap())
    x = grad(rank, world, "randn")
    comm.reduce_scatter(ref, x, g.dp, "grad")
    res["randn_none"] = (hierarchical_reduce_scatter(x, hops, "grad", None, BLOCK), ref.clone())
    comm.LEDGER.reset()
    res["randn_4"] = (hierarchical_reduce_scatter(x, hops, "grad", 4, BLOCK), _snap())
    res["randn_8"] = hierarchical_reduce_scatter(x, hops, "grad", 8, BLOCK)
    res["bf16_4"] = hierarchical_reduce_scatter(grad(rank, world, "randn", torch.bfloat16), hops, "grad", 4, BLOCK)
    res["bf16_none"] = hierarchical_reduce_scatter(grad(rank, world, "int", torch.bfloat16), hops, "grad", None, BLOCK)
    # two in flight at once, advanced hop by hop in the same order on every rank, as the engine does
    a = HierarchicalReduceScatter(grad(rank, world, "randn"), hops, "grad", 4, BLOCK)
    a.advance()
    b = HierarchicalReduceScatter(grad(rank, world, "int"), hops, "grad", None, BLOCK)
    a.advance(), b.advance()
    res["in_flight"] = (b.result(), a.result())
    return res


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    world, kwargs, tiers, links, D = LAYOUTS[request.param]
    return request.param, run_distributed(_run, world, kwargs, tiers)


def exact(world, kind, dtype=torch.float32):
    """[world, C]: row p = chunk p of the sum over ranks, in fp64."""
    return sum(grad(r, world, kind, dtype).double() for r in range(world)).reshape(world, CHUNK)


def qgz_bound(world, n_hops, levels, dtype=torch.float32):
    """[world, C]: n_hops * sum_s (block absmax of sender s) / (2L), see the docstring."""
    absmax = sum(grad(r, world, "randn", dtype).double().reshape(-1, BLOCK).abs().amax(1) for r in range(world))
    return (n_hops * absmax / (2 * levels)).repeat_interleave(BLOCK).reshape(world, CHUNK)


def test_hops_are_mixed_radix_digits_with_link_classes(layout):
    name, results = layout
    world, _, tiers, links, _ = LAYOUTS[name]
    for rank, res in enumerate(results):
        radix, p = 1, 0
        for d, r in zip(res["digits"], res["sizes"]):
            p, radix = p + d * radix, radix * r
        assert radix == world and p == res["dp_rank"] == rank
        assert res["links"] == links and res["roles"] == [f"dp_tier{i}" for i in range(len(tiers) + 1)]


def test_unquantized_equals_reduce_scatter(layout):
    name, results = layout
    world = LAYOUTS[name][0]
    for rank, res in enumerate(results):
        out, ref, _ = res["int_none"]
        assert out.dtype == torch.float32 and torch.equal(out, ref)
        assert torch.equal(out.double(), exact(world, "int")[rank])
        assert torch.equal(res["bf16_none"], exact(world, "int")[rank].to(torch.bfloat16))  # small ints: exact
        out, ref = res["randn_none"]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,levels,rel", [(4, 7, 0.2), (8, 127, 0.01)])
def test_quantized_within_bound(layout, bits, levels, rel):
    name, results = layout
    world, n_hops = LAYOUTS[name][0], len(LAYOUTS[name][2]) + 1
    ref = exact(world, "randn")
    lim = qgz_bound(world, n_hops, levels) * (1 + 1e-5) + 1e-6
    errs = []
    for rank, res in enumerate(results):
        out = res["randn_4"][0] if bits == 4 else res["randn_8"]
        assert out.dtype == torch.float32
        err = out.double() - ref[rank]
        assert (err.abs() <= lim[rank]).all(), (rank, (err.abs() / lim[rank]).max())
        errs.append(err)
    # relative error of the whole result: one int4 step on gaussian blocks of 32 (absmax ~2.5
    # sigma) has rms ~ 2.5/(7*sqrt(12)) ~ 0.1 sigma; compounded over 2-3 hops this stays < 0.2
    assert torch.cat(errs).norm() / ref.norm() < rel
    if bits == 4:  # bf16 gradients: the same bound, plus the bf16 rounding of the output
        ref16 = exact(world, "randn", torch.bfloat16)
        lim16 = qgz_bound(world, n_hops, levels, torch.bfloat16) * (1 + 1e-5) + ref16.abs() * 2.0**-8 + 1e-6
        for rank, res in enumerate(results):
            assert res["bf16_4"].dtype == torch.bfloat16
            assert ((res["bf16_4"].double() - ref16[rank]).abs() <= lim16[rank]).all()


def test_ledger_per_hop(layout):
    """Each hop sends a buffer of N / (product of the earlier hop sizes) elements, pairwise
    all-to-all: (n-1)/n of it, as int4 (0.5 B/elem) + fp32 scales (4 B/block) in one buffer."""
    name, results = layout
    world, _, tiers, links, D = LAYOUTS[name]
    N = world * CHUNK
    for res in results:
        ledger4, ledger_none = res["randn_4"][1], res["int_none"][2]
        numel = N
        want4, want_none = {}, {}
        for i, (n, link) in enumerate(zip(res["sizes"], links)):
            key = (f"dp_tier{i}", "grad", "all_to_all", link)
            want4[key] = ((n - 1) / n * (numel * 0.5 + 4 * numel / BLOCK), 1)
            want_none[key] = ((n - 1) / n * numel * 4, 1)
            numel //= n
        for got, want in ((ledger4, want4), (ledger_none, want_none)):
            assert set(got) == set(want)
            for key, (b, calls) in want.items():
                assert got[key][0] == pytest.approx(b) and got[key][1] == calls, key
        # cross-node bytes per rank: (nodes-1)/nodes * (N/D elements) * 0.5 B + their scales
        nodes = world // D
        cross = sum(b for k, (b, _) in ledger4.items() if k[3] == "inter_node")
        assert cross == pytest.approx((nodes - 1) / nodes * (N / D * 0.5 + 4 * N / D / BLOCK))


def test_reductions_in_flight_equal_the_sync_ones(layout):
    _, results = layout
    for res in results:
        unquantized, quantized = res["in_flight"]
        assert torch.equal(unquantized, res["int_none"][0]) and torch.equal(quantized, res["randn_4"][0])


def test_padding_error_names_padded_numel():
    hops = [Group("dp_tier0", (0, 1), 0, "intra_node"), Group("dp_tier1", (0, 2, 4), 0, "inter_node")]
    assert padded_numel(1000, 6, 32) == 1152 and padded_numel(1152, 6, 32) == 1152
    with pytest.raises(ValueError, match=r"padded_numel\(1000, 6, 32\) = 1152"):
        hierarchical_reduce_scatter(torch.zeros(1000), hops, "grad", 4, 32)
    with pytest.raises(ValueError, match="bits"):
        hierarchical_reduce_scatter(torch.zeros(1152), hops, "grad", 2, 32)
    # a single-rank "hierarchy" of size-1 hops moves and quantizes nothing
    one = [Group("dp_tier0", (0,), 0, "intra_node")]
    x = torch.randn(64)
    assert torch.equal(hierarchical_reduce_scatter(x, one, "grad", 4, 32), x)
    assert math.prod(h.size for h in hops) == 6
