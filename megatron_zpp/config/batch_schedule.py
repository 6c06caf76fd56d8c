"""The global batch of each step: constant, Megatron's linear ramp-up (--rampup-batch-size), or
Megatron's step schedule (--step-batch-size-schedule). TrainConfig's batch methods are these
functions; a leaf module.

A step schedule is a list of (first sample, global batch): the batch of a step is that of the last
entry whose first sample is at or below the samples consumed before it (Megatron's
StepBatchsizeNumMicroBatchesCalculator).
"""

from __future__ import annotations

import math

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str, entry: str) -> int:
    """'2.4B' -> 2_400_000_000, as Megatron reads a schedule number (int(float(x) * suffix))."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ValueError(f"{entry!r} is not THRESHOLD:BATCH (numbers with an optional K/M/B/T suffix)") from None


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """'0:16 2.4B:320 ...' -> [(first sample, batch), ...], sorted. The thresholds are tokens and are
    divided by --seq-length, as Megatron does (it passes the sequence length); ValueError names the fault."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        if not sep:
            raise ValueError(f"{entry!r} is not THRESHOLD:BATCH")
        steps.append((_number(threshold, entry) // seq_length, _number(batch, entry)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError("the first threshold must be 0 (the batch of the first step)")
    if any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
        raise ValueError(f"thresholds must differ by at least one sample of --seq-length {seq_length} tokens")
    if any(batch < 1 for _, batch in steps):
        raise ValueError("every batch must be >= 1")
    return steps


def global_batch_at(t, consumed: int) -> int:
    """The global batch of the step that starts after `consumed` samples."""
    if t.batch_steps:
        return [batch for first, batch in t.batch_steps if first <= consumed][-1]
    if not t.rampup_batch_size:
        return t.global_batch_size
    # Megatron's ramp-up (RampupBatchsizeNumMicroBatchesCalculator): (GBS - START) / INCR increments
    # spread evenly over SAMPLES samples; past SAMPLES, --global-batch-size
    start, incr, samples = t.rampup_batch_size
    increments = (t.global_batch_size - start) // incr
    if consumed > samples or increments <= 0:  # the second: refused by the checks
        return t.global_batch_size
    return start + int(consumed / (samples / increments)) * incr


def _walk(t, consumed: int, samples: float = math.inf, steps: float = math.inf) -> tuple[int, int]:
    """Step through a step schedule from `consumed` until `samples` are consumed or `steps` are taken,
    a stretch of one batch at a time: (steps taken, samples consumed)."""
    done = 0
    while consumed < samples and done < steps:
        batch = global_batch_at(t, consumed)
        bound = min([first for first, _ in t.batch_steps if first > consumed] + [samples])
        n = steps - done if bound == math.inf else min(math.ceil((bound - consumed) / batch), steps - done)
        consumed, done = consumed + int(n) * batch, done + int(n)
    return done, consumed


def iterations_for_samples(t) -> int:
    """Steps that --train-samples make (Megatron's update_train_iters)."""
    if t.batch_steps:  # steps while fewer than --train-samples are consumed
        return _walk(t, 0, samples=t.train_samples)[0]
    if not t.rampup_batch_size:
        return t.train_samples // t.global_batch_size
    # the ramp-up steps that start within SAMPLES (and the train samples), then whole constant batches
    iterations = consumed = 0
    while consumed <= t.rampup_batch_size[2] and consumed <= t.train_samples:
        consumed += global_batch_at(t, consumed)
        iterations += 1
    return iterations + max(t.train_samples - consumed, 0) // t.global_batch_size


def samples_after(t, iterations: int, consumed: int = 0) -> int:
    """Samples consumed after `iterations` more steps that start after `consumed` samples."""
    if t.batch_steps:
        return _walk(t, consumed, steps=iterations)[1]
    done = 0
    while done < iterations and global_batch_at(t, consumed) != t.global_batch_size:  # the ramp's steps
        consumed += global_batch_at(t, consumed)
        done += 1
    return consumed + (iterations - done) * t.global_batch_size  # then full batches (the ramp never shrinks)
