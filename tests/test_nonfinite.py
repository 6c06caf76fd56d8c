"""--check-for-nan-in-loss-and-grad (on by default): a step whose loss or global gradient norm is
not finite is never applied nor saved, on every rank alike (one rank's NaN gradient stops all),
in fp32, bf16 (plain DP and ZeRO) and fp16 (overflow skips, more than --max-skipped-steps in a
row stops); with the check off, a save that would hold non-finite tensors is refused and `latest`
stays where it was."""

import math
import os

import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, files
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

TINY = (
    OLD_DEFAULTS
    + (
        "--mock-data --device cpu --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--vocab-size 128 --make-vocab-size-divisible-by 32 --global-batch-size 4 --micro-batch-size 1 "
        "--train-iters 4 --save-interval 1 --seed 3 --peak-tflops 1"
    ).split()
)


def _nan_grads_at(run, iterations: set[int]) -> None:
    """On the last rank only: the first parameter's gradient becomes NaN in the steps after `iterations`."""
    if run.rank != run.cfg.parallel.world_size - 1:
        return
    p = next(run.chunks[0].parameters())
    p.register_hook(lambda g: g * math.nan if run.state.iteration in iterations else g)


def _train(rank, world, argv, nan_after):
    cfg = validate(parse_args(argv), world)
    run = training.setup(cfg)
    _nan_grads_at(run, nan_after)
    try:
        training.train(run)
        error = None
    except (training.NonFiniteStepError, CheckpointError) as e:
        error = f"{type(e).__name__}: {e}"
    weights = {k: t.detach().clone() for k, t in run.dp.model_state_dict().items()}
    return error, run.state.iteration, weights


def _saved(directory, iteration, rank=0):
    path = os.path.join(directory, files.iter_name(iteration))
    _, meta = files.find_checkpoint(path)
    return files.read_rank_file(path, meta, rank)["model"]


def _assert_stopped_at(results, directory, what, stop=2):
    """Every rank stopped at iteration `stop` (None: the first non-finite one, which with --lr 1e6
    depends on the CPU's rounding: at 2 or later), with that step unapplied and unsaved, and the
    step before it the last good checkpoint."""
    errors = {error.split(":")[1] for error, _, _ in results}
    assert len(errors) == 1, errors  # one iteration, agreed by every rank
    n = int(errors.pop().split()[-1])
    assert n == stop if stop is not None else n >= 2
    for rank, (error, iteration, weights) in enumerate(results):
        assert error.startswith(f"NonFiniteStepError: iteration {n}: ") and what in error, error
        assert f"The last good checkpoint is {directory}/{files.iter_name(n - 1)}" in error
        assert iteration == n - 1
        saved = _saved(directory, n - 1, rank)
        assert all(torch.equal(weights[k], saved[k]) for k in saved)  # step n was not applied
    assert open(os.path.join(directory, "latest")).read().strip() == files.iter_name(n - 1)
    assert sorted(os.listdir(directory)) == [".lock", *(files.iter_name(i) for i in range(1, n)), "latest"]


def test_nan_gradient_on_one_rank_stops_every_rank_unapplied_fp32(tmp_path):
    save = str(tmp_path / "ck")
    results = run_distributed(_train, 2, TINY + ["--save", save, "--lr", "1e-3"], {1})
    _assert_stopped_at(results, save, "the gradients are not finite (loss ")


def test_lr_1e6_nan_gradients_stop_bf16_zero1_unapplied(tmp_path):
    save = str(tmp_path / "ck")
    argv = TINY + ["--save", save, "--lr", "1e6", "--bf16", "--use-distributed-optimizer"]
    _assert_stopped_at(run_distributed(_train, 2, argv, set()), save, "the gradients are not finite (loss 4.8", None)


def test_fp16_skips_overflows_then_stops_past_max_skipped_steps(tmp_path):
    save = str(tmp_path / "ck")
    argv = TINY + ["--save", save, "--lr", "1e-3", "--fp16", "--loss-scale", "1024", "--max-skipped-steps", "1"]
    ((error, iteration, _),) = run_distributed(_train, 1, argv, {1, 2})
    assert error.startswith("NonFiniteStepError: iteration 3: 2 steps in a row overflowed in fp16"), error
    # iteration 2 was skipped and (its weights unchanged) saved; iteration 3 is not
    assert iteration == 2 and open(os.path.join(save, "latest")).read().strip() == "iter_0000002"
    assert all(torch.equal(a, b) for a, b in zip(_saved(save, 1).values(), _saved(save, 2).values()))


def test_check_off_refuses_to_save_nonfinite_tensors(tmp_path):
    save = str(tmp_path / "ck")
    argv = TINY + ["--save", save, "--lr", "1e6", "--no-check-for-nan-in-loss-and-grad"]
    ((error, iteration, _),) = run_distributed(_train, 1, argv, set())
    assert error.startswith(f"CheckpointError: refused to save iteration {iteration} to {save}: "), error
    assert "non-finite tensors here, the first /model/" in error
    # the first non-finite save (with --lr 1e6 at 2 or later, by the CPU's rounding) is refused
    assert iteration >= 2
    assert sorted(os.listdir(save)) == [".lock", *(files.iter_name(i) for i in range(1, iteration)), "latest"]
    assert open(os.path.join(save, "latest")).read().strip() == files.iter_name(iteration - 1)
