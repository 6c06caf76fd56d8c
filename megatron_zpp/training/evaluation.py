"""Evaluation as Megatron-LM's: --eval-iters global batches, forward only, every --eval-interval
steps (from --start-eval-at-iter) on the validation set, and after training once more on the
validation set and once on the test set (the third number of --split; mock data has its own).

The validation iterator continues from one evaluation to the next (TrainState.consumed_valid_samples,
kept in checkpoints: a resumed run evaluates the samples the uninterrupted one would); the test set
is read from its first sample. Each evaluation prints Megatron's block (loss and perplexity) and writes
tensorboard's "lm loss validation" (with --log-validation-ppl-to-tensorboard its perplexity)."""

from __future__ import annotations

import math

import torch

from ..logging_utils import log
from ..pipeline_parallel import run_schedule


def eval_batch(t) -> int:
    """Sequences per evaluation batch: --eval-global-batch-size, else --global-batch-size."""
    return t.eval_global_batch_size or t.global_batch_size


def eval_micro_batch(t) -> int:
    return t.eval_micro_batch_size or t.micro_batch_size


def evaluations_done(t, iteration: int) -> int:
    """Evaluations during training up to `iteration`: the multiples of --eval-interval from
    --start-eval-at-iter on."""
    if not t.eval_interval:
        return 0
    first = max(t.start_eval_at_iter or 0, 1)
    return max(iteration // t.eval_interval - (first - 1) // t.eval_interval, 0)


def eval_due(t, iteration: int) -> bool:
    start = t.start_eval_at_iter
    return bool(t.eval_interval) and iteration % t.eval_interval == 0 and (start is None or iteration >= start)


def valid_samples_needed(t, consumed_valid: int = 0, iteration: int = 0) -> int:
    """Samples the validation set must hold: every evaluation of the run and the final one; resumed at
    `iteration` with `consumed_valid` read (perhaps at another --eval-interval), those and the rest."""
    if not t.eval_iters:
        return 0
    per_round = t.eval_iters * eval_batch(t)
    if t.skip_train:
        return per_round
    fresh = (evaluations_done(t, t.train_iters) + 1) * per_round
    rest = evaluations_done(t, t.train_iters) - evaluations_done(t, iteration) + 1
    return max(fresh, consumed_valid + rest * per_round)


def resume_valid_position(t, state) -> None:
    """Where the validation iterator stands (in the TrainState `state`): the checkpoint's count, else
    (a fresh run, or a checkpoint saved before it was kept) the evaluations up to the iteration, as
    Megatron derives it; with --skip-train the first sample, as Megatron's."""
    if t.skip_train:
        state.consumed_valid_samples = 0
    elif state.consumed_valid_samples is None:
        state.consumed_valid_samples = evaluations_done(t, state.iteration) * t.eval_iters * eval_batch(t)


@torch.no_grad()
def evaluate(run, which: str = "valid") -> float | None:
    """Mean loss over --eval-iters global batches of the validation set (where the last evaluation
    stopped) or of the test set (from its start); None without that set."""
    from .step import report_loss  # step imports nothing of this module

    make = getattr(run.valid_data, which, None) if run.valid_data is not None else None
    if make is None or not run.cfg.train.eval_iters:
        return None
    t = run.cfg.train
    iters, micro_batches = t.eval_iters, eval_batch(t) // (eval_micro_batch(t) * run.cfg.parallel.data_parallel_size)
    data = make(run.state.consumed_valid_samples if which == "valid" else 0)
    for chunk in run.chunks:
        chunk.eval()
    losses = []
    for _ in range(iters):
        losses += run_schedule(run.chunks, data, micro_batches, run.link, forward_only=True)
    data.close()  # its loader threads
    for chunk in run.chunks:
        chunk.train()
    if which == "valid":
        run.state.consumed_valid_samples += iters * eval_batch(t)
    return report_loss(run, losses)


def evaluate_and_print(run, sink, which: str, prefix: str) -> dict:
    """evaluate(run, which), Megatron's block on the console, tensorboard; {} without that set, else
    {"val_loss", "val_ppl"} (or test_)."""
    loss = evaluate(run, which)
    if loss is None:
        return {}
    ppl = math.exp(min(20.0, loss))  # Megatron's cap
    text = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    rule = "-" * (len(text) + 1)
    log(f"{rule}\n{text}\n{rule}", run.rank)
    key = "lm loss validation" if which == "valid" else "lm loss test"
    g = run.cfg.log
    scalars = {key: loss, **({f"{key} ppl": ppl} if g.log_validation_ppl_to_tensorboard else {})}
    sink.tensorboard(scalars, run.state.iteration, run.state.consumed_samples)
    name = "val" if which == "valid" else "test"
    return {f"{name}_loss": loss, f"{name}_ppl": ppl}
