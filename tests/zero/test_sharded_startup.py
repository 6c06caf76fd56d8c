"""Start-up on the meta device: each rank allocates and fills only what it holds.

* the TP range writer equals cutting the TP shard and slicing it, for every split kind;
* materialize keeps each parameter object and its attributes, and computes meta buffers (reset_buffers);
* the weights each rank starts from are bitwise those of the start-up before it (the whole model part
  built on the device in fp32, `TODAYS_INIT` below, then cut by the engine), for ZeRO-0 with TP,
  ZeRO-1, ZeRO-2 and ZeRO-3 with TP, PP, hpZ and bf16: the engines' state dicts and the weights
  they compute with;
* a ZeRO-3 start-up on 4 ranks runs under a cap below the full model's fp32 bytes (LiveBytes: live
  tensor storage bytes of every op output on the rank, entered before training.setup; the cap
  raises when the live bytes pass it), where today's start-up passes the cap; it then trains 6 steps
  with the same losses, bitwise, as today's start-up, and within 1e-5 of plain data parallelism.
"""

import random
import zlib

import numpy as np
import pytest
import torch

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model.init import copy_tp_range
from megatron_zpp.planning import live_bytes, memory
from megatron_zpp.tensor_parallel import shard
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.zero.test_zero_training import BASE


def test_copy_tp_range_equals_the_cut_shard():
    rng = random.Random(0)
    cases = [  # (full shape, tp_split): replicated, column (fused sections), row, 1-D, 3-D middle and last dim
        ((5, 7), None),
        ((8, 6), (0, (4, 4))),
        ((12, 5), (0, (4, 8))),
        ((6, 8), (1, (8,))),
        ((12,), (0, (12,))),
        ((3, 4, 6), (1, (2, 2))),
        ((2, 3, 8), (2, (4, 4))),
    ]
    for shape, split in cases:
        full = torch.randn(shape)
        for tp in (1, 2):
            for r in range(tp):
                ref = shard(full, split, r, tp).reshape(-1)
                for _ in range(40):
                    a = rng.randint(0, ref.numel())
                    b = rng.randint(a, ref.numel())
                    got = torch.full((b - a,), float("nan"))
                    copy_tp_range(got, full, split, r, tp, a)
                    assert torch.equal(got, ref[a:b]), (shape, split, tp, r, a, b)
                got = torch.empty(ref.numel(), dtype=torch.bfloat16)
                copy_tp_range(got, full, split, r, tp, 0)
                assert torch.equal(got, ref.to(torch.bfloat16))


def test_materialize_keeps_the_parameters_and_computes_buffers():
    """materialize: the same Parameter objects (hooks and references stay valid) with their init rule and
    TP split, on the device, filled as the old init_weights filled a real model; meta buffers come from the
    module's reset_buffers(device), and a module without one is refused by name."""
    from megatron_zpp.model.init import RankInit, materialize
    from megatron_zpp.tensor_parallel.layers import mark

    class Part(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mark(torch.nn.Parameter(torch.empty(6, 4)), ("normal", 0.5), (0, (12,)))
            self.g = mark(torch.nn.Parameter(torch.empty(4)), ("ones",))
            self.register_buffer("table", torch.empty(3), persistent=False)

        def reset_buffers(self, device):
            self.table = torch.arange(3.0, device=device)

    with torch.device("meta"):
        part = Part()
    w = part.w
    materialize([part], RankInit([part], 7, 1, 2, torch.device("cpu")))
    assert part.w is w and w.init == ("normal", 0.5) and w.tp_split == (0, (12,)) and not w.is_meta
    ref = Part()
    todays_init_weights(ref, 7, 1, 2)
    assert torch.equal(part.w, ref.w) and torch.equal(part.g, torch.ones(4))
    assert torch.equal(part.table, torch.arange(3.0))
    with torch.device("meta"):
        bare = torch.nn.Module()
        bare.register_buffer("table", torch.empty(3))
    with pytest.raises(NotImplementedError, match="reset_buffers"):
        materialize([bare], RankInit([bare], 7, 0, 1, torch.device("cpu")))


# ---------------------------------------------------------------- today's start-up, as it was


@torch.no_grad()
def todays_init_weights(model, seed, tp_rank, tp_size):
    """model/init.py's init_weights before the sharded start-up, verbatim."""
    from megatron_zpp.model.init import full_shape

    for name, p in model.named_parameters():
        rule = getattr(p, "init", ("normal", 0.02))
        if rule[0] == "ones":
            p.fill_(1.0)
        elif rule[0] == "zeros":
            p.zero_()
        else:
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            full = torch.randn(full_shape(p, tp_size), generator=gen, dtype=torch.float32) * rule[1]
            p.copy_(shard(full, p.tp_split, tp_rank, tp_size))


def todays_build_model(cfg, groups, vocab_size, device):
    """training/builders.build_model before the sharded start-up: the whole part in fp32, then moved."""
    from megatron_zpp.pipeline_parallel import build_stage_model
    from megatron_zpp.training.builders import parallel_context, training_dtype

    chunks = build_stage_model(cfg, vocab_size, parallel_context(cfg, groups), groups.pp_rank)
    for chunk in chunks:
        todays_init_weights(chunk, cfg.train.seed, groups.tp_rank, groups.tp.size)
    return [chunk.to(device=device, dtype=training_dtype(cfg)) for chunk in chunks], None  # no init: real


class CappedLiveBytes(live_bytes.LiveBytes):
    """LiveBytes that raises MemoryError when the live bytes pass `cap` (None: no cap)."""

    def __init__(self, cap=None):
        super().__init__()
        self.cap = cap

    def _track(self, st):
        super()._track(st)
        if self.cap is not None and self.live > self.cap:
            raise MemoryError(f"start-up passed the cap: {self.live:,} live bytes > {self.cap:,}")


def _setup(argv, world_size, today: bool, cap=None):
    cfg = validate(parse_args(argv), world_size)
    patch = pytest.MonkeyPatch()
    if today:
        patch.setattr(training.run, "build_model", todays_build_model)
    try:
        with CappedLiveBytes(cap) as live:
            run = training.setup(cfg)
    finally:
        patch.undo()
    return run, live.peak


def _held(run) -> dict[str, torch.Tensor]:
    """What the rank holds after start-up: the engine's state dict (fp32 masters, stage-0 weights) and
    the training-dtype tensors it computes with (ZeRO shards, stages 1-2's full buffers)."""
    out = {k: v.detach().clone() for k, v in run.dp.model_state_dict().items()}
    for i, u in enumerate(getattr(run.dp, "units", [])):
        out[f"unit{i}.shard"] = u.shard.clone()
        if not u.sharded_weights:
            out[f"unit{i}.full"] = u.full.clone()
    return out


def _startup_worker(rank, world_size, argvs):
    res = []
    for argv in argvs:
        held = []
        for today in (True, False):
            run, _ = _setup(argv, world_size, today)
            held.append(_held(run))
        old, new = held
        assert set(old) == set(new)
        res.append({k: bool(torch.equal(old[k], new[k]) and old[k].dtype == new[k].dtype) for k in old})
    return res


STARTUP_VARIANTS = {
    "zero0_tp2": ["--tensor-model-parallel-size", "2"],
    "zero1": ["--zero-stage", "1"],
    "zero2_bf16": ["--zero-stage", "2", "--bf16"],
    "zero3_tp2_pp2_bf16": "--zero-stage 3 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--bf16".split(),
    "zero3_hpz": ["--zero-stage", "3", "--zero-hpz-partition-size", "2"],
}


def test_every_engine_starts_from_todays_weights_bitwise():
    argvs = [BASE + ["--train-iters", "1", "--lr-warmup-iters", "0"] + v for v in STARTUP_VARIANTS.values()]
    per_rank = run_distributed(_startup_worker, 4, argvs, timeout=600)
    for rank, res in enumerate(per_rank):
        for name, same in zip(STARTUP_VARIANTS, res):
            assert same and all(same.values()), (
                f"{name} rank {rank}: differs in {[k for k, v in same.items() if not v]}"
            )


def _capped_worker(rank, world_size, argv, cap):
    run, today_peak = _setup(argv, world_size, today=True)  # uncapped: what the old start-up needs
    today_losses = [h["loss"] for h in training.train(run)]
    run, peak = _setup(argv, world_size, today=False, cap=cap)  # raises if it passes the cap
    losses = [h["loss"] for h in training.train(run)]
    plain = [h["loss"] for h in training.train(_setup(argv[:-2], world_size, today=False)[0])]  # ZeRO-0
    return {"today_peak": today_peak, "peak": peak, "today": today_losses, "losses": losses, "plain": plain}


def test_zero3_starts_below_the_full_model_and_trains_as_today():
    """ZeRO-3 on 4 ranks (fp32): the start-up's peak live bytes stay under a cap of the full model's fp32
    bytes (today's start-up holds more than that: its whole slice in fp32 before the first shard), and
    between what the estimator says the rank holds after set-up and that plus one full parameter; the
    run then trains 6 steps with today's losses bitwise, and within 1e-5 of plain data parallelism
    (the reference of test_zero_training, itself at parity with the single-rank run)."""
    argv = BASE + ["--train-iters", "6", "--zero-stage", "3"]
    cfg = validate(parse_args(argv), 4)
    full_fp32 = 4 * sum(p.numel() for c in memory.stage_model(cfg, 0) for p in c.parameters())
    estimate = memory.estimate_rank(cfg, 0, backend="gloo")
    per_rank = run_distributed(_capped_worker, 4, argv, full_fp32, timeout=600)
    for r in per_rank:
        print(
            f"start-up peak {r['peak']:,} B (today {r['today_peak']:,} B), full model fp32 {full_fp32:,} B, "
            f"estimated {sum(estimate.startup.values()):,} B held, {estimate.startup_peak:,} B peak"
        )
        assert r["today_peak"] > full_fp32 > r["peak"]
        assert sum(estimate.startup.values()) <= r["peak"] <= estimate.startup_peak
        assert r["losses"] == r["today"]  # bitwise
        np.testing.assert_allclose(r["losses"], r["plain"], rtol=1e-5)
    assert per_rank[0]["plain"][-1] < per_rank[0]["plain"][0]
