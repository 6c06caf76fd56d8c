"""--ckpt-format torch_dist: checkpoints through torch.distributed.checkpoint (DCP), keyed by the
single-rank model's names.

* The boxes a rank offers DCP are exactly its flat span, checked against index tensors.
* 2 gloo ranks, ZeRO-3 over DP2 (flat shards that cut parameters), dropout on: resuming the DCP
  checkpoint at the same layout continues bitwise (RNG included); loading it at TP2 (fused q|k|v
  and gate|up sections cut over TP) trains exactly as loading the same state saved in our own format
  and resharded by our reader; dcp_to_torch_save of it gives the consolidated single-rank weights.
"""

import math
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, files
from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.checkpoint.dcp import flat_boxes, slot_boxes
from megatron_zpp.checkpoint.layout import Slot
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.tensor_parallel.layers import shard
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS_WITH_DROPOUT

TINY = (
    OLD_DEFAULTS_WITH_DROPOUT
    + (
        "--mock-data --device cpu --hidden-size 32 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --seq-length 16 --vocab-size 128 --make-vocab-size-divisible-by 32 --num-layers 2 "
        "--attention-type gla --softmax-attention-every 2 --gla-chunk-size 8 --global-batch-size 4 "
        "--micro-batch-size 1 --lr 3e-3 --lr-warmup-iters 1 --seed 11 --peak-tflops 1"
    ).split()
)
ZERO3 = ["--zero-stage", "3"]
TP2 = ["--tensor-model-parallel-size", "2"]


@pytest.mark.parametrize(
    "shape, lo, hi", [((5,), 1, 4), ((4, 6), 3, 20), ((4, 6), 6, 18), ((3, 4, 5), 7, 53), ((3, 4, 5), 0, 60)]
)
def test_flat_boxes_are_the_flat_range(shape, lo, hi):
    index = torch.arange(math.prod(shape)).view(shape)
    got = []
    for offsets, sizes, flat in flat_boxes(shape, lo, hi):
        box = index[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
        assert box.reshape(-1)[0] == flat and box.numel() == math.prod(sizes)
        got += box.reshape(-1).tolist()
    assert got == list(range(lo, hi))


def test_slot_boxes_place_a_tp_piece_with_sections():
    full_shape, split = (12, 3), (0, (4, 4, 4))  # q|k|v rows, TP2: each rank holds 2+2+2 rows
    full = torch.arange(36.0).view(full_shape)
    for tp_rank in range(2):
        piece = shard(full, split, tp_rank, 2)
        start, n = 4, 11  # a ZeRO span from the middle of row 1 into row 5 of the piece
        s = Slot("k", 0, n, 0, "w", split, tp_rank, 2, full_shape, tuple(piece.shape), start, None)
        boxes = slot_boxes(s, piece.reshape(-1)[start : start + n].clone())
        assert sum(b.numel() for b in boxes.values()) == n
        for offsets, b in boxes.items():
            region = full[tuple(slice(o, o + z) for o, z in zip(offsets, b.shape))]
            assert torch.equal(region, b), (tp_rank, offsets)


def _setup(argv, world):
    return training.setup(validate(parse_args(TINY + argv), world))


def _losses(run):
    return [h["loss"] for h in training.train(run)]


def _dcp_runs(rank, world, root):
    dist, ours, ref = (os.path.join(root, d) for d in ("dist", "ours", "ref"))
    plain = _losses(_setup(ZERO3 + ["--train-iters", "4"], world))
    _losses(_setup(ZERO3 + ["--train-iters", "2", "--save", dist, "--ckpt-format", "torch_dist"], world))
    _losses(_setup(ZERO3 + ["--train-iters", "2", "--save", ours], world))
    same = _setup(ZERO3 + ["--train-iters", "4", "--load", dist], world)
    at = (same.state.iteration, same.state.consumed_samples)
    resumed = _losses(same)
    tp_dist = _losses(_setup(TP2 + ["--train-iters", "4", "--load", dist, "--no-load-rng"], world))
    tp_ours = _losses(_setup(TP2 + ["--train-iters", "4", "--load", ours], world))
    # and back: TP2 saves torch_dist, ZeRO-3 loads it (weights only, at iteration 0 of a finetune)
    _losses(_setup(TP2 + ["--train-iters", "2", "--save", ref, "--ckpt-format", "torch_dist"], world))
    back = _setup(ZERO3 + ["--train-iters", "1", "--lr-warmup-iters", "0", "--load", ref, "--finetune"], world)
    return plain, at, resumed, tp_dist, tp_ours, back.state.iteration


def test_torch_dist_resumes_exactly_and_reshards(tmp_path):
    plain, at, resumed, tp_dist, tp_ours, back = run_distributed(_dcp_runs, 2, str(tmp_path), timeout=300)[0]
    assert at == (2, 8) and resumed == plain[2:]  # same layout: bitwise, dropout streams included
    assert tp_dist == tp_ours and len(tp_dist) == 2  # DCP's resharding = our reader's, to the bit
    assert back == 0
    dist = tmp_path / "dist"
    path, meta = files.find_checkpoint(str(dist))
    assert meta["format"] == files.DCP_FORMAT and ".metadata" in meta["files"]
    assert sorted(os.listdir(path)) == sorted([*meta["files"], "meta.json", files.META_DIGEST])
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    full = torch.load(str(tmp_path / "full.pt"), weights_only=True)
    weights, _ = consolidate(str(tmp_path / "ours"))
    assert set(full["model"]) == set(weights)
    for name, w in weights.items():
        assert torch.equal(full["model"][name], w), name
    assert set(full["optimizer"]["state"]) == set(weights)
    assert consolidate(str(dist))[0].keys() == weights.keys()


def test_torch_dist_checkpoint_consolidates_and_refuses_corruption(tmp_path):
    run_distributed(_save_one, 1, str(tmp_path / "c"))
    path, meta = files.find_checkpoint(str(tmp_path / "c"))
    weights, _ = consolidate(str(tmp_path / "c"))  # DCP assembles it: the HF export reads that
    assert weights["embedding.weight"].shape == (128, 32) and weights["embedding.weight"].dtype == torch.float32
    data = next(f for f in meta["files"] if f.endswith(".distcp"))
    with open(os.path.join(path, data), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff\xff")
    error = run_distributed(_load_error, 1, str(tmp_path / "c"))[0]
    assert f"checkpoint file {os.path.join(path, data)} is corrupted or truncated" in error


def _save_one(rank, world, root, *extra):
    argv = ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", root, "--ckpt-format", "torch_dist"]
    _losses(_setup(argv + list(extra), world))


def test_async_torch_dist_save_is_the_synchronous_one(tmp_path):
    """--async-save --ckpt-format torch_dist: DCP writes from the writer thread on its own gloo group;
    every save is sealed (the first at the second, the second at the end) and holds what a synchronous
    save of the same run holds, bitwise."""
    sync, background = str(tmp_path / "sync"), str(tmp_path / "async")
    more = ["--train-iters", "2", "--save-interval", "1"]
    run_distributed(_save_one, 2, sync, *more)
    run_distributed(_save_one, 2, background, *more, "--async-save")
    for it in ("iter_0000001", "iter_0000002"):
        assert files.find_checkpoint(os.path.join(background, it))[1]["format"] == files.DCP_FORMAT
    want, got = consolidate(sync)[0], consolidate(background)[0]
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def _load_error(rank, world, root):
    try:
        _setup(["--train-iters", "2", "--load", root], world)
    except CheckpointError as e:
        return str(e)
    return None


PP2 = ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]


def _pipeline_runs(rank, world, root):
    """PP2 x DP2 with ZeRO-1 and the embedding tied to the output (both stages hold it) -> ZeRO-2 over DP4."""
    for fmt, d in (("torch_dist", "dist"), ("zpp", "ours")):
        _losses(_setup(PP2 + ["--train-iters", "2", "--save", os.path.join(root, d), "--ckpt-format", fmt], world))
    load = ["--zero-stage", "2", "--train-iters", "4", "--load"]
    return [_losses(_setup(load + [os.path.join(root, d)], world)) for d in ("dist", "ours")]


def test_torch_dist_reshards_pipeline_stages_with_a_tied_embedding(tmp_path):
    via_dcp, via_ours = run_distributed(_pipeline_runs, 4, str(tmp_path), timeout=300)[0]
    assert via_dcp == via_ours and len(via_dcp) == 2
