"""Build what a run trains: the model chunks of this rank, the data iterators, the
pipeline link. The data-parallel engine comes from zero.build_engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import comm
from ..config import Config
from ..data.builder import build_gpt_datasets, describe_splits
from ..data.loader import BatchIterator, Packing
from ..data.mock import MockGPTDataset
from ..logging_utils import log
from ..model import GPT, ParallelContext
from ..model.init import RankInit
from ..pipeline_parallel import StageLink, build_rank_chunks
from ..topology import ProcessGroups
from .evaluation import eval_batch, eval_micro_batch, valid_samples_needed


def training_dtype(cfg: Config) -> torch.dtype:
    if cfg.train.fp16:
        return torch.float16
    return torch.bfloat16 if cfg.train.bf16 else torch.float32


def parallel_context(cfg: Config, groups: ProcessGroups) -> ParallelContext:
    p = cfg.parallel
    return ParallelContext(
        tp=groups.tp,
        sequence_parallel=p.sequence_parallel,
        cp=groups.cp,
        cp_algo=p.cp_algo,
        all_scan_blocks=p.all_scan_blocks,
        ep=groups.ep,
        etp=groups.etp,
        etp_ep=groups.etp_ep,
        tp_cp=groups.tp_cp,
    )


def rank_init(cfg: Config, groups: ProcessGroups, chunks: list[GPT], device: torch.device) -> RankInit:
    """What fills this rank's parameters on `device`: the single-rank weights of the seed, cut to its
    TP rank (model/init.py), a routed expert's to its expert-TP rank."""
    return RankInit(chunks, cfg.train.seed, groups.tp_rank, groups.tp.size, device, (groups.etp.rank, groups.etp.size))


def build_model(
    cfg: Config, groups: ProcessGroups, vocab_size: int, device: torch.device
) -> tuple[list[GPT], RankInit]:
    """This rank's model chunks on the meta device and what initializes them from the single-rank
    weights: `zero.build_engine(cfg, chunks, groups, init)` materializes what the rank holds
    (the whole slice for ZeRO-0, the flat buffers for ZeRO-1/2, the shards for ZeRO-3), one
    parameter at a time, straight on `device`."""
    chunks = build_rank_chunks(cfg, vocab_size, groups.pp_rank, parallel_context(cfg, groups), training_dtype(cfg))
    if cfg.train.torch_compile:
        compile_model(chunks, cfg.model.seq_length)
    return chunks, rank_init(cfg, groups, chunks, device)


def compile_model(chunks: list[GPT], seq_length: int) -> None:
    """--torch-compile: each block's forward and the last stage's cross-entropy (its passes over
    the logits, forward and backward) go through torch.compile (inductor), in place.

    The forwards, not the modules (nn.Module.compile would trace the module's hooks too): the hooks
    stay eager around the compiled code, so ZeRO-3 gathers a block's weights before it and frees
    them after exactly as without compile, and parameter names and state_dict keys are unchanged.
    Only the training length is compiled; other lengths (generation's growing prompt) run eager
    rather than recompiling for each."""

    for chunk in chunks:
        for block in chunk.layers.values():
            eager, compiled = block.forward, torch.compile(block.forward)

            def forward(x: torch.Tensor, rope, documents=None, eager=eager, compiled=compiled) -> torch.Tensor:
                return (compiled if x.shape[1] == seq_length else eager)(x, rope, documents)

            block.forward = forward
        if chunk.post_process:  # no parameters inside, so no hooks: always compiled
            chunk.loss = torch.compile(chunk.loss)


def build_stage_link(cfg: Config, groups: ProcessGroups, device: torch.device) -> StageLink | None:
    """p2p to the neighbouring pipeline stages (None without PP), for hidden states of
    [micro batch, sequence per CP (and SP) rank, hidden]."""
    if groups.pp.size == 1:
        return None
    seq = cfg.model.seq_length // groups.cp.size
    if cfg.parallel.sequence_parallel:
        seq //= groups.tp.size
    return StageLink(groups.pp, (cfg.train.micro_batch_size, seq, cfg.model.hidden_size), training_dtype(cfg), device)


def train_samples_needed(t, consumed: int, iteration: int) -> int:
    """Training samples the dataset must hold: a fresh run's (a ramp-up's batches, then full ones), or,
    resumed at `iteration` after `consumed` samples (perhaps at another --global-batch-size, which
    Megatron allows), those consumed plus the batches of the steps left."""
    fresh = max(t.samples_after(t.train_iters), t.train_samples or 0)
    return max(fresh, t.samples_after(max(t.train_iters - iteration, 0), consumed))


@dataclass
class EvalData:
    """Factories of the evaluation iterators: valid(from sample) and test(from sample); None where the
    split (or --eval-iters 0) leaves no such set."""

    valid: Callable[[int], BatchIterator] | None
    test: Callable[[int], BatchIterator] | None


def build_data(
    cfg: Config,
    groups: ProcessGroups,
    tokenizer,
    device: torch.device,
    consumed: int,
    iteration: int = 0,
    consumed_valid: int = 0,
):
    """(train iterator resumed at `consumed` samples after `iteration` steps, EvalData; the validation
    set holds the `consumed_valid` samples read before and those of the evaluations to come)."""
    t = cfg.train
    num_samples = (
        train_samples_needed(t, consumed, iteration),
        valid_samples_needed(t, consumed_valid, iteration),
        t.eval_iters * eval_batch(t),
    )
    seq, d = cfg.model.seq_length, cfg.data
    packing = None
    if d.packed_documents or d.eod_mask_loss:
        packing = Packing(tokenizer.eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)
    if cfg.data.mock_data:
        eod = packing.eod if packing is not None else None  # mock samples pack EOD-ended documents then
        train = MockGPTDataset(num_samples[0], seq, tokenizer.vocab_size, t.seed, eod)
        valid = MockGPTDataset(max(num_samples[1], 1), seq, tokenizer.vocab_size, t.seed + 1, eod)
        test = MockGPTDataset(max(num_samples[2], 1), seq, tokenizer.vocab_size, t.seed + 2, eod)
    else:
        train, valid, test = build_gpt_datasets(
            cfg.data.data_path,
            cfg.data.split,
            seq,
            t.seed,
            num_samples,
            cfg.data.data_cache_path,
            is_builder=groups.rank == 0,
            barrier=lambda: comm.barrier(),
            mmap_bin=cfg.data.mmap_bin_files,
        )
        for line in describe_splits((train, valid, test), cfg.data.split, seq):
            log(line, groups.rank)
    mbs, workers = t.micro_batch_size, cfg.data.num_workers

    def batches(dataset, consumed, micro=mbs):
        return BatchIterator(
            dataset, consumed, micro, groups, device, packing, num_workers=workers, vocab_size=tokenizer.vocab_size
        )

    def factory(dataset):
        micro = eval_micro_batch(t)
        return (lambda start: batches(dataset, start, micro)) if dataset is not None and t.eval_iters else None

    return batches(train, consumed), EvalData(factory(valid), factory(test))
