"""Global gradient norm: each parameter counted once over TP/PP, fp64 sums, clipping."""

import math
from types import SimpleNamespace

import torch

from megatron_zpp.optim import clip_, clip_by_global_norm, counted_once, global_grad_norm
from tests.dist import run_distributed


def fp64_norm(tensors) -> float:
    """Reference: exact sum of squares of every element, in Python floats."""
    return math.sqrt(math.fsum(x * x for t in tensors for x in t.double().flatten().tolist()))


def test_tp_split_param_is_counted_on_every_tp_rank():
    p = SimpleNamespace(tp_split=(0, [8]))
    assert [counted_once(p, r, True) for r in range(4)] == [True] * 4


def test_replicated_param_is_counted_on_tp_rank_0_only():
    # same gradient on every TP rank: counting it TP times would inflate the norm
    for p in (SimpleNamespace(tp_split=None), SimpleNamespace()):
        assert [counted_once(p, r, True) for r in range(4)] == [True, False, False, False]


def test_pipeline_duplicate_is_counted_on_the_first_stage_only():
    # the tied embedding lives on the first and the last stage
    split = SimpleNamespace(tp_split=(0, [8]), pipeline_duplicate=True)
    assert counted_once(split, 1, is_first_stage=True)
    assert not counted_once(split, 0, is_first_stage=False)
    assert not counted_once(split, 1, is_first_stage=False)
    assert counted_once(SimpleNamespace(tp_split=(0, [8]), pipeline_duplicate=False), 0, False)


def test_global_grad_norm_matches_fp64_over_mixed_dtypes_and_shapes():
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(7, generator=g),
        torch.randn(3, 5, generator=g).bfloat16(),
        torch.randn(11, generator=g).bfloat16() * 1e3,
        torch.randn(4, 6, generator=g) * 1e-3,
    ]
    assert math.isclose(global_grad_norm([(grads, [])]), fp64_norm(grads), rel_tol=1e-12)


def test_global_grad_norm_of_nothing_is_zero():
    assert global_grad_norm([([], [])]) == 0.0


def test_clip_scales_by_max_norm_over_norm_plus_eps_when_above():
    grads = [torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([[0.0], [4.0]], dtype=torch.float64)]
    clip_(grads, 5.0, 1.0)  # norm 5 > 1
    scale = 1.0 / (5.0 + 1e-6)
    assert torch.equal(grads[0], torch.tensor([3.0 * scale, 0.0], dtype=torch.float64))
    assert torch.equal(grads[1], torch.tensor([[0.0], [4.0 * scale]], dtype=torch.float64))
    assert fp64_norm(grads) < 1.0


def test_clip_leaves_grads_untouched_when_off_or_not_above():
    for norm, max_norm in [(5.0, 0.0), (5.0, 10.0), (5.0, 5.0)]:  # off, below, equal
        grads = [torch.tensor([3.0, 4.0])]
        clip_(grads, norm, max_norm)
        assert torch.equal(grads[0], torch.tensor([3.0, 4.0])), (norm, max_norm)


def test_clip_by_global_norm_measures_counted_grads_and_clips_all():
    # a duplicate (e.g. the last stage's tied embedding) is clipped but not counted
    counted = torch.tensor([6.0, 8.0], dtype=torch.float64)
    duplicate = torch.tensor([1.0, -1.0], dtype=torch.float64)
    norm = clip_by_global_norm([([counted], [])], [counted, duplicate], max_norm=5.0)
    assert norm == 10.0
    scale = 5.0 / (10.0 + 1e-6)
    assert torch.equal(counted, torch.tensor([6.0 * scale, 8.0 * scale], dtype=torch.float64))
    assert torch.equal(duplicate, torch.tensor([scale, -scale], dtype=torch.float64))


# -- 2 ranks emulating TP = 2 ----------------------------------------------------------

FULL_SPLIT = torch.arange(12, dtype=torch.float32).reshape(4, 3) - 5.0  # cut over TP along dim 0
REPLICATED = torch.tensor([0.5, -2.0, 7.0])  # a norm weight: same on both


def _tp2_norm(rank, world_size):
    from megatron_zpp.topology import Topology, build_groups

    groups = build_groups(Topology(world_size, tp=2), rank)
    split = SimpleNamespace(tp_split=(0, [4]), grad=FULL_SPLIT.chunk(2, dim=0)[groups.tp_rank].clone())
    replicated = SimpleNamespace(tp_split=None, grad=REPLICATED.clone())
    counted = [p.grad for p in (split, replicated) if counted_once(p, groups.tp_rank, groups.is_first_stage)]
    return global_grad_norm([(counted, [groups.mp])])


def test_tp2_norm_counts_split_shards_and_the_replicated_param_once():
    norms = run_distributed(_tp2_norm, 2)
    expected = fp64_norm([FULL_SPLIT, REPLICATED])  # the unsharded model's gradient
    assert norms[0] == norms[1]
    assert math.isclose(norms[0], expected, rel_tol=1e-12)
    assert not math.isclose(norms[0], fp64_norm([FULL_SPLIT, REPLICATED, REPLICATED]))
