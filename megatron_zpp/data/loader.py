"""From datasets to this rank's micro-batches.

Sample order is Megatron's: a global batch of G sequences is consumed in rounds of
micro_batch x DP; in each round data-parallel rank d takes the d-th micro-batch. The
position is one number, `consumed_samples`, so a resumed run continues exactly; a
batch-size ramp-up only changes how many rounds a step takes. Within a model replica:
TP and CP ranks each read the same whole samples themselves (from the memory-mapped
files, page-cache reads of a few KB per sample: cheaper than a broadcast, which would put
a collective on the step's critical path; a whole sample also keeps the document
boundaries before a CP slice in sight), context-parallel rank c keeps the c-th
contiguous slice of every sequence, only the first pipeline stage keeps tokens and only
the last keeps labels; middle stages read nothing, except with packed documents
(`Packing`: --reset-position-ids, --reset-attention-mask), where every stage reads its
samples, since every layer needs the documents; they, and the --eod-mask-loss mask, are built
from the whole sequence (data/documents.py).

Loading runs off the critical path (--num-workers N, Megatron's flag): N background
threads build the micro-batches ahead (2 each in flight at most, as DataLoader's
prefetch_factor), pinned in host memory when the device is CUDA, and the step copies
them with non_blocking. Threads rather than DataLoader worker processes: micro-batch j
is a pure function of j (the sampler is arithmetic, the datasets read-only), workers take
the j in turn and the step receives them in order, so any N gives bitwise the batches of
N = 0 (in the step's own thread); threads need no picklable dataset (np.memmap) and no
child processes (which daemonic test ranks may not have), and the reads and numpy
collation release the GIL for most of their time. The time a step waits for its next
micro-batch is counted (`wait_seconds`) and logged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..context_parallel.slices import sequence_slice
from ..model.documents import Documents
from ..tensor_parallel.layers import TokenIdError
from .documents import build_documents, eod_loss_mask


@dataclass(frozen=True)
class Packing:
    """Megatron's packed-document flags and the tokenizer's EOD id."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def every_stage(self) -> bool:
        """Whether every pipeline stage needs the batch (the documents), not only the ends."""
        return self.reset_position_ids or self.reset_attention_mask


class MicroBatchSampler:
    """Index lists of one micro-batch for one DP rank, from `consumed_samples` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        round_size = self.mbs * self.dp_size
        start = self.consumed
        while start + round_size <= self.total:
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))
            start += round_size


def check_sample_ids(samples: list[np.ndarray], indices: list[int], vocab_size: int) -> None:
    """Refuse a sample holding an id outside [0, vocab_size) with the TRUE vocabulary (the embedding's
    own check sees only the padded one); on the host, where one min/max per sample is cheap. The
    start-up check (data/inputs.py) read every file; this catches a file changed since."""
    for i, sample in zip(indices, samples):
        low, high = int(sample.min()), int(sample.max())
        if low < 0 or high >= vocab_size:
            raise TokenIdError(
                f"token id {low if low < 0 else high} in sample {i} is outside the tokenizer's vocabulary of "
                f"{vocab_size}: a --data-path file changed after the start-up check, or was tokenized with another "
                "tokenizer"
            )


def make_batch(
    samples: list[np.ndarray],
    cp_rank: int,
    cp_size: int,
    keep_tokens: bool,
    keep_labels: bool,
    device: torch.device,
    packing: Packing | None = None,
) -> dict[str, torch.Tensor | None]:
    data = torch.from_numpy(np.stack(samples).astype(np.int64))
    tokens, labels = data[:, :-1], data[:, 1:]
    sl = sequence_slice(tokens.shape[1], cp_rank, cp_size)
    batch = {
        "tokens": tokens[:, sl].contiguous().to(device) if keep_tokens else None,
        "labels": labels[:, sl].contiguous().to(device) if keep_labels else None,
    }
    if packing is not None:
        batch.update(packed_fields(tokens.to(device), packing, sl.start, sl.stop - sl.start, keep_labels))
    return batch


def packed_fields(tokens: torch.Tensor, packing: Packing, offset: int, length: int, keep_labels: bool) -> dict:
    """documents (for the model), and on the last stage the loss mask of this CP slice with
    loss_tokens, the micro-batch's unmasked tokens per CP rank: each rank's loss is its masked
    sum over loss_tokens, so their mean over CP is the masked mean of the whole micro-batch
    (Megatron's), with no communication: every rank sees every token's mask."""
    p = packing
    out = {"documents": build_documents(tokens, p.eod, p.reset_position_ids, p.reset_attention_mask, offset, length)}
    if p.eod_mask_loss and keep_labels:
        mask = eod_loss_mask(tokens, p.eod)
        out["loss_mask"] = mask[:, offset : offset + length].contiguous()
        out["loss_tokens"] = mask.sum().clamp_min(1.0) * length / tokens.shape[1]
    return out


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class Prefetcher:
    """Builds `build(job)` for each job of `jobs` on `workers` threads, at most `depth` per
    worker ahead of the consumer, and yields the results in the jobs' order."""

    def __init__(self, jobs: Iterator, build: Callable, workers: int, depth: int = 2):
        self._jobs, self._build = jobs, build
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._slots = threading.Semaphore(workers * depth)
        self._results: dict[int, object] = {}
        self._taken = self._next = 0
        self._closed = self._done = False
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            self._slots.acquire()
            if self._closed:
                return
            with self._lock:  # number and draw the job together: job j is always the j-th
                j, job = self._taken, next(self._jobs, _END)
                self._taken += 1
            try:
                result = _END if job is _END else self._build(job)
            except BaseException as e:  # handed to the consumer, raised there
                result = _Failed(e)
            with self._ready:
                self._results[j] = result
                self._ready.notify_all()
            if job is _END:
                return

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        with self._ready:
            while self._next not in self._results:
                self._ready.wait()
            result = self._results.pop(self._next)
        self._next += 1
        self._slots.release()
        if result is _END:
            self._done = True
            raise StopIteration
        if isinstance(result, _Failed):
            raise result.error
        return result

    def close(self) -> None:
        """Stop the threads (each finishes the job it holds)."""
        self._closed = True
        for _ in self._threads:
            self._slots.release()


def _pinned(batch: dict) -> dict:
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _to_device(value, device: torch.device):
    """A batch field on the step's device: tensors (non_blocking from pinned memory) and Documents."""
    if isinstance(value, torch.Tensor | Documents):
        return value.to(device, non_blocking=True)
    return value


class BatchIterator:
    """Yields this rank's micro-batches forever (until the dataset runs out), built by
    `num_workers` background threads (0: in the caller's thread)."""

    def __init__(
        self,
        dataset,
        consumed_samples: int,
        micro_batch_size: int,
        groups,
        device: torch.device,
        packing: Packing | None = None,
        num_workers: int = 0,
        vocab_size: int | None = None,
    ):
        self.dataset, self.groups, self.device, self.packing = dataset, groups, device, packing
        self.vocab_size = vocab_size  # the tokenizer's true vocabulary: ids in the padding rows are refused too
        self.consumed, self.mbs, self.num_workers = consumed_samples, micro_batch_size, num_workers
        self.delivered = 0  # micro-batches handed out: the position a restarted prefetch resumes at
        self.wait_seconds = 0.0  # time next() blocked: loading (workers 0) or waiting for the workers
        self._pin = device.type == "cuda"  # pinned host memory only where a device copy follows
        reads = groups.is_first_stage or groups.is_last_stage
        # the workers start now, so the first batches are ready while the rest of the run is set up
        self._source: Iterator | None = self._start() if num_workers and reads else None

    def __iter__(self):
        return self

    def _start(self) -> Iterator:
        g = self.groups
        consumed = self.consumed + self.delivered * self.mbs * g.dp.size
        jobs = iter(MicroBatchSampler(len(self.dataset), consumed, self.mbs, g.dp_rank, g.dp.size))
        if not self.num_workers:
            return map(self._load, jobs)
        return Prefetcher(jobs, self._load, self.num_workers)

    def _load(self, indices: list[int]) -> dict:
        """One micro-batch on the host (a pure function of its indices)."""
        g = self.groups
        samples = [self.dataset[i] for i in indices]
        if self.vocab_size is not None:
            check_sample_ids(samples, indices, self.vocab_size)
        batch = make_batch(
            samples,
            g.cp_rank,
            g.cp.size,
            g.is_first_stage,
            g.is_last_stage,
            torch.device("cpu"),
            self.packing,
        )
        batch["samples"] = torch.tensor(indices, dtype=torch.int64)  # the dropout masks' keys (model/dropout.py)
        return _pinned(batch) if self._pin else batch

    def __next__(self) -> dict:
        g = self.groups
        every_stage = self.packing is not None and self.packing.every_stage
        if not (g.is_first_stage or g.is_last_stage or every_stage):  # reads nothing, ends where the data does
            first = self.consumed + self.delivered * self.mbs * g.dp.size
            if first + self.mbs * g.dp.size > len(self.dataset):
                raise StopIteration
            self.delivered += 1
            first += g.dp_rank * self.mbs  # the sampler's indices, which the stages that read take
            samples = torch.arange(first, first + self.mbs, device=self.device)
            return {"tokens": None, "labels": None, "samples": samples}
        start = time.perf_counter()
        if self._source is None:
            self._source = self._start()
        batch = next(self._source)
        batch = {k: _to_device(v, self.device) for k, v in batch.items()}
        self.delivered += 1
        self.wait_seconds += time.perf_counter() - start
        return batch

    def close(self) -> None:
        """Stop the workers; a later next() restarts them at the same position."""
        if isinstance(self._source, Prefetcher):
            self._source.close()
        self._source = None
