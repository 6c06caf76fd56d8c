"""megatron_zpp/topology.py: rank grid, groups (vs Megatron's generator), node layout, links.

Expected groups are derived here independently of Topology: a rank's coordinates come
from Megatron's formula (first axis of the order string fastest), e.g. for the default
order ``rank = tp + TP*(cp + CP*(dp + DP*pp))``.
"""

import itertools

import pytest
import torch

from megatron_zpp import comm
from megatron_zpp.topology import Group, ProcessGroups, Topology, build_groups
from tests.dist import run_distributed

AXES = ("tp", "cp", "dp", "pp")


# ------------------------------------------------------------------ reference (Megatron)


def megatron_rank_default(tp, cp, dp, pp, TP, CP, DP):
    """Megatron's RankGenerator for order tp-cp-dp-pp (ep=1), written out."""
    return tp + TP * (cp + CP * (dp + DP * pp))


def megatron_rank(coords, sizes, order):
    """Generic: first axis of `order` fastest."""
    rank, stride = 0, 1
    for a in order:
        rank += coords[a] * stride
        stride *= sizes[a]
    return rank


def expected_groups(sizes, varying, order=("tp", "cp", "dp", "pp")):
    """Groups whose members vary along `varying`, others fixed; members ascending, list sorted."""
    groups = {}
    for tp, cp, dp, pp in itertools.product(*(range(sizes[a]) for a in AXES)):
        c = dict(tp=tp, cp=cp, dp=dp, pp=pp)
        if tuple(order) == AXES:
            r = megatron_rank_default(tp, cp, dp, pp, sizes["tp"], sizes["cp"], sizes["dp"])
        else:
            r = megatron_rank(c, sizes, order)
        key = tuple(c[a] for a in AXES if a not in varying)
        groups.setdefault(key, []).append(r)
    return sorted(sorted(g) for g in groups.values())


LAYOUTS = [
    (world, tp, cp, pp)
    for world in (1, 2, 4, 8, 12, 16)
    for tp in (1, 2, 4)
    for cp in (1, 2)
    for pp in (1, 2, 4)
    if world % (tp * cp * pp) == 0
]


# ------------------------------------------------------------------ Megatron's examples


def test_megatron_example_tp2_pp2_world8():
    t = Topology(8, tp=2, pp=2)
    assert t.sizes == {"tp": 2, "cp": 1, "pp": 2, "dp": 2}
    assert t.groups(["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups(["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.groups(["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups(["cp"]) == [[r] for r in range(8)]
    assert t.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_example_tp2_cp2_dp2_world8():
    t = Topology(8, tp=2, cp=2)
    assert t.sizes["dp"] == 2
    assert t.groups(["cp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups(["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.groups(["dp", "cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.all_group_kinds()["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.all_group_kinds()["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # pp = 1: every rank is its own first and last stage
    assert t.embedding_groups() == [[r] for r in range(8)]


def test_megatron_example_tp4_pp2_world16():
    t = Topology(16, tp=4, pp=2)
    assert t.sizes["dp"] == 2
    assert t.groups(["tp"]) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert t.groups(["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert t.groups(["pp"]) == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert t.all_group_kinds()["mp"] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_embedding_groups_first_and_last_stage_pp4():
    t = Topology(8, pp=4)  # dp 2: pipelines [0,2,4,6] and [1,3,5,7]
    assert t.groups(["pp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.embedding_groups() == [[0, 6], [1, 7]]


# ------------------------------------------------------------------ many layouts vs the formula


@pytest.mark.parametrize("world,tp,cp,pp", LAYOUTS)
def test_groups_match_megatron_formula(world, tp, cp, pp):
    t = Topology(world, tp=tp, cp=cp, pp=pp)
    sizes = dict(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp))
    assert t.sizes == sizes
    kinds = t.all_group_kinds()
    spans = {
        "tp": {"tp"},
        "cp": {"cp"},
        "dp": {"dp"},
        "pp": {"pp"},
        "dp_cp": {"dp", "cp"},
        "tp_cp": {"tp", "cp"},
        "mp": {"tp", "pp"},
        "tp_pp_cp": {"tp", "cp", "pp"},
    }
    for kind, axes in spans.items():
        assert kinds[kind] == expected_groups(sizes, axes), kind
        size = 1
        for a in axes:
            size *= sizes[a]
        assert all(len(g) == size for g in kinds[kind]), kind
    # embedding: first and last member of each pipeline
    exp_emb = sorted(sorted({g[0], g[-1]}) for g in expected_groups(sizes, {"pp"}))
    assert kinds["embedding"] == exp_emb
    assert all(len(g) == (2 if pp > 1 else 1) for g in kinds["embedding"])
    # coordinates round-trip through the formula
    for tpi, cpi, dpi, ppi in itertools.product(*(range(sizes[a]) for a in AXES)):
        r = megatron_rank_default(tpi, cpi, dpi, ppi, tp, cp, sizes["dp"])
        assert t.coords(r) == dict(tp=tpi, cp=cpi, dp=dpi, pp=ppi)
        assert t.rank_of(tp=tpi, cp=cpi, dp=dpi, pp=ppi) == r


@pytest.mark.parametrize("world,tp,cp,pp", [(8, 2, 1, 2), (8, 2, 2, 1), (16, 2, 2, 2), (16, 4, 1, 2), (12, 2, 1, 3)])
def test_every_rank_in_exactly_one_group_of_each_kind(world, tp, cp, pp):
    t = Topology(world, tp=tp, cp=cp, pp=pp, ranks_per_node=min(world, 4))
    kinds = t.all_group_kinds()
    assert {"tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "tp_pp_cp", "embedding"} <= set(kinds)
    for kind, groups in kinds.items():
        members = [r for g in groups for r in g]
        if kind == "embedding":  # only first/last stages belong to one
            assert len(members) == len(set(members)), kind
            continue
        assert sorted(members) == list(range(world)), kind
        assert len({len(g) for g in groups}) == 1, kind


# ------------------------------------------------------------------ order strings


def test_non_default_order_dp_fastest():
    t = Topology(8, tp=2, pp=2, order="dp-tp-cp-pp")
    assert t.groups(["dp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups(["tp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups(["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.coords(1) == dict(tp=0, cp=0, dp=1, pp=0)
    assert t.coords(2) == dict(tp=1, cp=0, dp=0, pp=0)


def test_non_default_order_tp_dp_cp_pp():
    t = Topology(8, tp=2, cp=2, order="tp-dp-cp-pp")
    assert t.groups(["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups(["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups(["cp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("order", ["tp-dp-cp-pp", "dp-tp-cp-pp", "pp-dp-cp-tp", "cp-pp-tp-dp"])
@pytest.mark.parametrize("world,tp,cp,pp", [(8, 2, 1, 2), (16, 2, 2, 2), (12, 3, 1, 2)])
def test_any_order_matches_formula(order, world, tp, cp, pp):
    t = Topology(world, tp=tp, cp=cp, pp=pp, order=order)
    sizes = dict(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp))
    o = order.split("-")
    for axes in ({"tp"}, {"cp"}, {"dp"}, {"pp"}, {"dp", "cp"}, {"tp", "pp"}):
        assert t.groups(axes) == expected_groups(sizes, axes, o), axes
    first = o[0]
    # first axis fastest: ranks 0 and 1 differ only in it (when it has size > 1)
    if sizes[first] > 1:
        c0, c1 = t.coords(0), t.coords(1)
        assert c1[first] == 1 and all(c1[a] == c0[a] == 0 for a in AXES if a != first)


@pytest.mark.parametrize("order", ["tp-cp-dp", "tp-tp-dp-pp", "tp-cp-ep-dp-pp", "", "tp-cp-dp-pp-xx", "TP-CP-DP-PP"])
def test_bad_order_raises(order):
    with pytest.raises(ValueError, match="order"):
        Topology(8, order=order)


# ------------------------------------------------------------------ node layout and links


def test_ranks_per_node_emulation():
    t = Topology(8, ranks_per_node=2)
    assert t.num_nodes == 4
    assert [t.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_ranks_per_node_defaults_to_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology(8).ranks_per_node == 4
    assert Topology(8).num_nodes == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Topology(8).ranks_per_node == 8
    assert Topology(8).num_nodes == 1


def test_link_class_pairs_and_groups():
    t = Topology(8, ranks_per_node=4)
    assert t.link_class([0, 1]) == "intra_node"
    assert t.link_class([0, 3]) == "intra_node"
    assert t.link_class([3, 4]) == "inter_node"
    assert t.link_class([0, 1, 2, 3]) == "intra_node"
    assert t.link_class([0, 1, 2, 3, 4]) == "inter_node"
    assert t.link_class([5]) == "intra_node"
    one_node = Topology(8)
    assert one_node.link_class(range(8)) == "intra_node"


def test_sub_node_tiers_naming():
    t = Topology(16, ranks_per_node=8, sub_node_tiers=(2, 4))
    assert [name for name, _ in t.levels] == ["tier0", "tier1", "intra_node"]
    assert t.link_class([0, 1]) == "tier0"
    assert t.link_class([6, 7]) == "tier0"
    assert t.link_class([1, 2]) == "tier1"
    assert t.link_class([0, 3]) == "tier1"
    assert t.link_class([0, 4]) == "intra_node"
    assert t.link_class([7, 8]) == "inter_node"
    assert t.link_class([0, 8]) == "inter_node"


def test_group_link_classes_via_build_groups_without_processes():
    # torch.distributed is not initialized here: membership and links only, no handles
    t = Topology(8, tp=2, pp=2, ranks_per_node=4)  # pp groups [0,4],... cross nodes
    g = build_groups(t, rank=5)
    assert g.tp == Group("tp", (4, 5), 1, "intra_node", ("intra_node", "intra_node"), ("intra_node",))
    assert g.dp.ranks == (5, 7) and g.dp.rank == 0 and g.dp.link == "intra_node"
    assert g.pp.ranks == (1, 5) and g.pp.rank == 1 and g.pp.link == "inter_node"
    assert g.pp.peer_links == ("inter_node", "intra_node")
    assert g.pp.hop_links == ("inter_node",)  # a chain over the group: one hop, across the nodes
    assert g.embedding.ranks == (1, 5)
    assert g.cp.size == 1 and g.cp.handle is None
    assert (g.tp_rank, g.cp_rank, g.dp_rank, g.pp_rank) == (1, 0, 0, 1)
    assert g.is_last_stage and not g.is_first_stage
    assert "dp_intra" in g and "dp_tier0" not in g
    with pytest.raises(AttributeError):
        _ = g.no_such_group


@pytest.mark.parametrize("rank", [0, 3, 6])
def test_every_group_kind_is_a_field(rank):
    # the rank's groups by role are exactly the kinds the topology makes that hold it, each a static field
    t = Topology(8, tp=2, pp=2, ranks_per_node=4, ep=2)
    g = build_groups(t, rank, dp_tiers=[2], hpz=2)
    assert (g.ep_rank, g.etp_rank, g.edp_rank) == (g.ep.rank, g.etp.rank, g.edp.rank) == (rank % 2, 0, rank // 2 % 2)
    assert g.ep.link == "intra_node" and g.tp_dp_cp.size == 4 and g.expert_mp.size == 4
    kinds = {k: v for k, v in t.all_group_kinds([2], 2).items() if any(rank in m for m in v)}
    assert set(g.by_role()) == set(kinds) and {"dp_tier0", "dp_hpz", "world"} <= set(kinds)
    assert all(list(grp.ranks) in kinds[role] for role, grp in g.by_role().items())
    assert g.dp_tiers == tuple(g.by_role()[f"dp_tier{i}"] for i in range(len(g.dp_tiers)))
    assert g.embedding is not None  # pp 2: every stage is the first or the last
    with pytest.raises(ValueError, match="no_such_kind"):
        ProcessGroups.from_kinds(t, rank, {**g.by_role(), "no_such_kind": g.tp})


def test_dp_node_groups_dp8():
    t = Topology(8, ranks_per_node=4)
    intra, inter = t.dp_node_groups()
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.link_class(intra[0]) == "intra_node"
    assert all(t.link_class(g) == "inter_node" for g in inter)


def test_dp_node_groups_with_tp2_are_strided():
    t = Topology(8, tp=2, ranks_per_node=4)  # dp groups [0,2,4,6], [1,3,5,7]
    intra, inter = t.dp_node_groups()
    assert intra == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert inter == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_dp_node_groups_three_nodes():
    t = Topology(12, ranks_per_node=4)
    intra, inter = t.dp_node_groups()
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert inter == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]


def test_dp_node_groups_uneven_layout_raises():
    # tp3 on nodes of 4: DP group [0,3,6,9] has two ranks on node 0, one on nodes 1 and 2
    t = Topology(12, tp=3, ranks_per_node=4)
    assert t.groups(["dp"])[0] == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="unevenly"):
        t.dp_node_groups()
    kinds = t.all_group_kinds()  # the rest still builds; only hierarchical DP kinds are absent
    assert "dp_intra" not in kinds and "dp_inter" not in kinds
    assert kinds["dp"] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def test_dp_tier_groups_two_tiers_dp8():
    t = Topology(8)
    hops = t.dp_tier_groups([2, 4])
    assert hops == [
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    ]
    kinds = t.all_group_kinds(dp_tiers=[2, 4])
    assert [kinds[f"dp_tier{i}"] for i in range(3)] == hops


def test_dp_tier_groups_three_nodes():
    t = Topology(12, ranks_per_node=4)
    hops = t.dp_tier_groups([4])
    assert hops == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]]
    assert hops == list(t.dp_node_groups())  # node tiers agree with the node layout


def test_dp_tier_groups_use_dp_group_members_with_tp():
    t = Topology(16, tp=2)  # dp 8 over [0,2,...,14] and [1,3,...,15]
    hop0, hop1, hop2 = t.dp_tier_groups([2, 4])
    assert hop0 == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert hop1 == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert hop2 == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]


@pytest.mark.parametrize("tiers", [[3], [4, 2], [2, 6], [16]])
def test_dp_tier_groups_bad_sizes_raise(tiers):
    with pytest.raises(ValueError):
        Topology(8).dp_tier_groups(tiers)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Topology(6, tp=4),  # world not divisible
        lambda: Topology(8, tp=2, cp=3),
        lambda: Topology(8, ranks_per_node=3),  # nodes not uniform
        lambda: Topology(8, ranks_per_node=16),
        lambda: Topology(8, ranks_per_node=4, sub_node_tiers=(3,)),  # tier does not nest
        lambda: Topology(16, ranks_per_node=8, sub_node_tiers=(4, 2)),
    ],
    ids=["tp4-world6", "tp2cp3-world8", "rpn3", "rpn16", "tier3-in-4", "tiers-4-2"],
)
def test_bad_layouts_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: Topology(8, tp=0),
        lambda: Topology(8, tp=-1),
        lambda: Topology(8, pp=-2),
        lambda: Topology(8, ranks_per_node=0),
        lambda: Topology(8, ranks_per_node=4, sub_node_tiers=(0,)),
        lambda: Topology(8).dp_tier_groups([0]),
        lambda: Topology(8).dp_tier_groups([-2]),
    ],
    ids=["tp0", "tp-1", "pp-2", "rpn0", "tier0size0", "dptier0", "dptier-2"],
)
def test_non_positive_sizes_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


# ------------------------------------------------------------------ build_groups on processes


def _build_groups_4ranks(rank, world_size):
    comm.LEDGER.reset()
    import torch.distributed as dist

    topo = Topology(world_size, tp=2, ranks_per_node=2)
    g = build_groups(topo, rank)
    out = {}
    for kind in ("tp", "dp", "cp", "pp", "dp_cp", "mp", "embedding"):
        grp = getattr(g, kind)
        info = {
            "ranks": list(grp.ranks),
            "rank": grp.rank,
            "size": grp.size,
            "link": grp.link,
            "has_handle": grp.handle is not None,
        }
        if grp.handle is not None:
            info["handle_size"] = dist.get_world_size(grp.handle)
            info["handle_rank"] = dist.get_rank(grp.handle)
        out[kind] = info
    out["coords"] = (g.tp_rank, g.cp_rank, g.dp_rank, g.pp_rank)
    t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    comm.all_reduce(t, g.tp, "test")
    out["tp_sum"] = t.tolist()
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, g.dp, "test")
    out["dp_sum"] = t.tolist()
    # size-1 group: a no-op
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, g.pp, "test")
    out["pp_sum"] = t.tolist()
    return out


@pytest.fixture(scope="module")
def four_rank_groups():
    return run_distributed(_build_groups_4ranks, 4)


def test_build_groups_membership_on_4_ranks(four_rank_groups):
    tp_groups = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    dp_groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, out in enumerate(four_rank_groups):
        assert out["tp"]["ranks"] == tp_groups[rank]
        assert out["tp"]["rank"] == rank % 2 and out["tp"]["size"] == 2
        assert out["tp"]["link"] == "intra_node"
        assert out["dp"]["ranks"] == dp_groups[rank]
        assert out["dp"]["rank"] == rank // 2 and out["dp"]["size"] == 2
        assert out["dp"]["link"] == "inter_node"
        assert out["dp_cp"]["ranks"] == dp_groups[rank]
        assert out["mp"]["ranks"] == tp_groups[rank]
        for kind in ("cp", "pp", "embedding"):
            assert out[kind]["ranks"] == [rank] and out[kind]["size"] == 1
            assert not out[kind]["has_handle"]
        assert out["coords"] == (rank % 2, 0, rank // 2, 0)


def test_build_groups_handles_match_groups(four_rank_groups):
    for out in four_rank_groups:
        for kind in ("tp", "dp", "dp_cp", "mp"):
            info = out[kind]
            assert info["has_handle"], kind
            assert info["handle_size"] == info["size"] == 2, kind
            assert info["handle_rank"] == info["rank"], kind


def test_build_groups_all_reduce_stays_in_group(four_rank_groups):
    tp_sums = {0: [3.0, 30.0], 1: [3.0, 30.0], 2: [7.0, 70.0], 3: [7.0, 70.0]}
    dp_sums = {0: [4.0], 1: [6.0], 2: [4.0], 3: [6.0]}
    for rank, out in enumerate(four_rank_groups):
        assert out["tp_sum"] == tp_sums[rank]
        assert out["dp_sum"] == dp_sums[rank]
        assert out["pp_sum"] == [float(rank + 1)]


# ------------------------------------------------------------------ the expert grid (vs megatron-core)

EXPERT_LAYOUTS = [  # world, tp, cp, pp, ep, etp
    (8, 1, 1, 1, 2, 1),
    (8, 1, 1, 1, 4, 2),
    (8, 2, 1, 2, 2, 1),
    (8, 2, 1, 1, 2, 2),
    (16, 2, 2, 2, 4, 1),
    (16, 2, 2, 1, 2, 4),
    (16, 4, 1, 2, 2, 2),
    (12, 2, 1, 3, 2, 1),
]


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", EXPERT_LAYOUTS)
def test_expert_groups_equal_megatron_core_rank_generator(world, tp, cp, pp, ep, etp):
    """ep, etp, edp, etp_ep, expert_mp and tp_dp_cp against megatron-core's own RankGenerators (the dense
    one of order tp-cp-ep-dp-pp with ep 1, the expert one with cp 1), as initialize_model_parallel builds them."""
    from megatron.core.parallel_state import RankGenerator

    t = Topology(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order="tp-cp-dp-pp")
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    kinds = t.all_group_kinds()
    mcore = {"ep": "ep", "etp": "tp", "edp": "dp", "etp_ep": "tp-ep", "expert_mp": "tp-ep-pp"}
    for ours, theirs in mcore.items():
        assert kinds[ours] == sorted(expert.get_ranks(theirs)), ours
    assert kinds["tp_dp_cp"] == sorted(dense.get_ranks("tp-cp-dp"))
    for r in range(world):
        c = t.expert_coords(r)
        assert kinds["ep"][[r in g for g in kinds["ep"]].index(True)].index(r) == c["ep"]
        assert kinds["edp"][[r in g for g in kinds["edp"]].index(True)].index(r) == c["edp"]


def test_expert_grid_of_a_non_default_order_is_carved_from_the_stage_in_rank_order():
    t = Topology(8, tp=2, pp=2, order="tp-pp-dp-cp", ep=2)  # stages {0,1,4,5} and {2,3,6,7}
    kinds = t.all_group_kinds()
    assert kinds["tp_dp_cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert kinds["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and kinds["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert kinds["expert_mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("ep,etp", [(3, 1), (2, 4), (8, 1)])
def test_expert_grid_not_dividing_the_stage_is_refused_by_flag(ep, etp):
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size .* --expert-tensor-parallel-size .* stage"):
        Topology(8, tp=2, pp=2, ep=ep, etp=etp)
