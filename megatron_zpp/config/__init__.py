"""Typed configuration: the one source of truth for every setting.

Each field carries its command-line flag (Megatron-LM's name where Megatron has the
concept, DeepSpeed's for ZeRO) and its help text; `arguments.py` builds the parser from
these dataclasses, so a setting is declared exactly once. validation/ derives the values
that follow from others and checks every section against the world size before any
process group exists. ModelConfig (config/model.py), TrainConfig and LogConfig (config/train.py)
live in modules of their own and are re-exported here: import every config name from this module.
Imports nothing of ours but those, config/fields.py and batch_schedule.py (the config leaves).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .fields import ConfigError, opt
from .model import ModelConfig, default_linear_chunk_size
from .train import LogConfig, TrainConfig

__all__ = [
    "SECTIONS",
    "TOKENIZER_TYPES",
    "Config",
    "ConfigError",
    "DataConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "ZeroConfig",
    "default_linear_chunk_size",
    "flag_of",
    "former_names",
    "opt",
]

# --tokenizer-type's values (data/tokenizer.py builds them; GPTSentencePieceTokenizer: Megatron's GPT variant)
TOKENIZER_TYPES = (
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "--tensor-model-parallel-size", "TP: ranks that split each layer")
    pipeline_model_parallel_size: int = opt(1, "--pipeline-model-parallel-size", "PP: pipeline stages")
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "--num-layers-per-virtual-pipeline-stage", "layers per virtual stage (interleaved 1F1B)"
    )
    num_virtual_stages_per_pipeline_rank: int | None = opt(
        None,
        "--num-virtual-stages-per-pipeline-rank",
        "virtual stages per pipeline rank (interleaved 1F1B): sets --num-layers-per-virtual-pipeline-stage to "
        "layers / (PP x this)",
    )
    account_for_embedding_in_pipeline_split: bool = opt(
        False,
        "--account-for-embedding-in-pipeline-split",
        "count the embedding as a layer of the first stage in the even split (it holds one layer fewer)",
    )
    account_for_loss_in_pipeline_split: bool = opt(
        False,
        "--account-for-loss-in-pipeline-split",
        "count the output layer and loss as a layer of the last stage in the even split (one layer fewer)",
    )
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "--decoder-first-pipeline-num-layers", "layers on the first pipeline stage (default: even split)"
    )
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "--decoder-last-pipeline-num-layers", "layers on the last pipeline stage (default: even split)"
    )
    context_parallel_size: int = opt(1, "--context-parallel-size", "CP: ranks that split each sequence")
    sequence_parallel: bool = opt(False, "--sequence-parallel", "Megatron sequence parallelism in norm/dropout regions")
    cp_algo: str = opt(
        "all-scan",
        "--cp-algo",
        "GLA/GDN state passing under CP: ZeCO all-scan, all-gather (LASP-2; fla KCP for GDN), LASP-1 ring "
        "(softmax layers all-gather K/V)",
        choices=["all-scan", "all-gather", "ring"],
    )
    all_scan_blocks: int = opt(
        0,
        "--all-scan-blocks",
        "All-Scan: pipeline the state in this many blocks (GLA: along d_k, GDN: along d_v); 0 = chosen from the state "
        "size and the CP "
        "group's link (context_parallel.auto_blocks: 1 at CP 2, about sqrt((CP-2) x transfer time / latency))",
    )
    order: str = opt("tp-cp-dp-pp", "--parallel-order", "rank order of the 4D grid, first axis fastest")
    ranks_per_node: int | None = opt(
        None, "--ranks-per-node", "ranks per node (default: LOCAL_WORLD_SIZE); smaller values emulate several nodes"
    )
    distributed_timeout_minutes: float = opt(
        10.0,
        "--distributed-timeout-minutes",
        "a collective waiting longer than this for another rank fails the run instead of hanging (fractions allowed; "
        "at most 10080, a week)",
    )

    # filled by validate()
    world_size: int = 1
    data_parallel_size: int = 1


@dataclass
class ZeroConfig:
    zero_stage: int = opt(0, "--zero-stage", "ZeRO stage over the data-parallel group", choices=[0, 1, 2, 3])
    zero_quantized_weights: bool = opt(False, "--zero-quantized-weights", "qwZ: int8 block-quantized weight all-gather")
    zero_hpz_partition_size: int = opt(
        1, "--zero-hpz-partition-size", "hpZ: secondary weight shard over K ranks of a node"
    )
    zero_quantized_gradients: bool = opt(
        False, "--zero-quantized-gradients", "qgZ: int4 hierarchical all-to-all gradient reduce"
    )
    zero_hierarchy: list[int] = opt(
        [],
        "--zero-hierarchy",
        "multi-level ZeRO++: ZeRO-group ranks per tier, innermost first (e.g. 2 4); the gradients are reduced tier "
        "by tier (quantized with --zero-quantized-gradients); the node boundary is always a tier",
        nargs="+",
        type=int,
    )
    zero_param_persistence: str = opt(
        "microbatch",
        "--zero-param-persistence",
        "ZeRO-3: free gathered weights after each micro-batch's forward and backward (least memory; 2 gathers per "
        "micro-batch), or keep them from their first gather until the optimizer step (1 gather per step; with "
        "pipelining and many micro-batches this trades ZeRO-2-like weight memory for far fewer gathers)",
        choices=["microbatch", "step"],
    )
    zero_quantization_block_size: int = opt(
        2048, "--zero-quantization-block-size", "qwZ: elements per int8 weight block (one fp32 scale each)"
    )
    zero_gradient_quantization_block_size: int = opt(
        64,
        "--zero-gradient-quantization-block-size",
        "qgZ: elements per int4 gradient block (one fp32 scale each); 64 has the least error x wire bytes in "
        "bench/quantize.py's table (Gaussian: 0.108 relative L2 at 0.5625 B/element, 0.150 at 2048)",
    )
    zero_gradient_stochastic_rounding: bool = opt(
        False,
        "--zero-gradient-stochastic-rounding",
        "qgZ: round the int4 gradients stochastically (unbiased; draws from the CPU generator, which checkpoints save)",
    )
    overlap_grad_reduce: bool = opt(
        True,
        "--overlap-grad-reduce",
        "reduce the gradients in buckets as the backward of the step's last micro-batch produces them, overlapping "
        "the backward (plain DP: all-reduce of --ddp-bucket-size buckets; ZeRO-1: reduce-scatter per unit; ZeRO-2/3 "
        "always reduce during the backward); --no-overlap-grad-reduce reduces everything after the backward",
    )
    grad_reduce_in_bf16: bool = opt(
        False,
        "--grad-reduce-in-bf16",
        "as Megatron: gradients cross the wire in bf16 (2 bytes per element; plain DP and ZeRO-1/2/3, and the "
        "unquantized hierarchy), accumulated over micro-batches and stepped in fp32; qgZ keeps its int4 wire",
    )
    zero_reduce_in_flight: int | None = opt(
        None,
        "--zero-reduce-in-flight",
        "ZeRO: gradient reductions in flight during the backward (each holds one unit's gradient until it lands); "
        "default 2; never fewer than the reduction's hops (1 flat, else the hierarchy's tiers + 1)",
    )
    check_collective_order: bool = opt(
        False,
        "--check-collective-order",
        "debug: after each step, hash every group's sequence of collectives and compare the hashes across the "
        "group; a difference stops the run naming the first collective that differs",
    )
    ddp_bucket_size: int | None = opt(
        None,
        "--ddp-bucket-size",
        "plain DP with --overlap-grad-reduce: gradient elements per all-reduce bucket (default, as Megatron: "
        "max(40M, 1M x DP x CP)); without overlap the gradients go in one bucket",
    )
    use_distributed_optimizer: bool = opt(
        False,
        "--use-distributed-optimizer",
        "Megatron's distributed optimizer (fp32 masters and AdamW state sharded over DP, gradients reduce-scattered): "
        "--zero-stage 1 here, unless --zero-stage is higher",
    )
    overlap_param_gather: bool = opt(
        False,
        "--overlap-param-gather",
        "ZeRO-1/2: start the all-gather of the updated weights at the end of the step and wait for each unit's "
        "weights just before its first forward of the next step (ZeRO-3 always gathers unit by unit, prefetching)",
    )


@dataclass
class OptimConfig:
    lr: float = opt(3e-4, "--lr", "peak learning rate")
    min_lr: float = opt(0.0, "--min-lr", "learning rate at the end of decay")
    lr_warmup_iters: int = opt(0, "--lr-warmup-iters", "linear warmup iterations")
    lr_warmup_samples: int = opt(
        0, "--lr-warmup-samples", "linear warmup over this many samples (sample-based training: --train-samples)"
    )
    lr_warmup_fraction: float | None = opt(
        None,
        "--lr-warmup-fraction",
        "warmup over this fraction of the decay iterations or samples (instead of --lr-warmup-iters/-samples)",
    )
    lr_decay_iters: int | None = opt(None, "--lr-decay-iters", "iterations of decay (default: train iters)")
    lr_decay_samples: int | None = opt(
        None, "--lr-decay-samples", "samples of decay, with --train-samples (default: train samples)"
    )
    lr_decay_style: str = opt(
        "linear",
        "--lr-decay-style",
        "decay after warmup (Megatron's OptimizerParamScheduler): to --min-lr at the end of the decay span",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_warmup_init: float = opt(
        0.0, "--lr-warmup-init", "learning rate of the first step: the warmup rises linearly from it to --lr"
    )
    lr_wsd_decay_iters: int | None = opt(
        None, "--lr-wsd-decay-iters", "WSD: iterations of the final decay, at the end of the decay span (required)"
    )
    lr_wsd_decay_samples: int | None = opt(
        None,
        "--lr-wsd-decay-samples",
        "WSD with --train-samples: samples of the final decay, at the end of the decay span (required)",
    )
    lr_wsd_decay_style: str = opt(
        "exponential",
        "--lr-wsd-decay-style",
        "WSD: shape of the final decay, over its fraction p: exponential min + (2*0.5^p - 1)(lr - min), "
        "linear, cosine, minus_sqrt min + (1 - sqrt(p))(lr - min)",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
    )
    decoupled_lr: float | None = opt(
        None,
        "--decoupled-lr",
        "peak learning rate of the word embedding and the untied output layer, on the same schedule (None: --lr)",
    )
    decoupled_min_lr: float | None = opt(
        None, "--decoupled-min-lr", "with --decoupled-lr: their learning rate at the end of decay (None: --min-lr)"
    )
    weight_decay: float = opt(
        0.01,
        "--weight-decay",
        "AdamW weight decay (not applied to norms and biases), with --weight-decay-incr-style constant",
    )
    apply_wd_to_qk_layernorm: bool = opt(
        False,
        "--apply-wd-to-qk-layernorm",
        "weight decay on the query/key norms of --qk-layernorm too (Megatron's rule, Qwen3-Next's recipe); "
        "every other norm weight and bias stays undecayed",
    )
    start_weight_decay: float | None = opt(
        None, "--start-weight-decay", "weight decay of the first step (--weight-decay-incr-style linear or cosine)"
    )
    end_weight_decay: float | None = opt(
        None, "--end-weight-decay", "weight decay at the end of training (--weight-decay-incr-style linear or cosine)"
    )
    weight_decay_incr_style: str = opt(
        "constant",
        "--weight-decay-incr-style",
        "weight decay over training: constant (--weight-decay), or linear/cosine from --start-weight-decay to "
        "--end-weight-decay over the train iterations or samples",
        choices=["constant", "linear", "cosine"],
    )
    use_checkpoint_opt_param_scheduler: bool = opt(
        False,
        "--use-checkpoint-opt_param-scheduler",
        "a resumed run takes the schedule of its checkpoint (as Megatron: --lr, --min-lr, the warmup and decay "
        "lengths, --lr-decay-style, the weight decay ends, increment length and style), not this command line's",
    )
    override_opt_param_scheduler: bool = opt(
        False,
        "--override-opt_param-scheduler",
        "a resumed run takes the schedule of this command line, not its checkpoint's: what happens here without "
        "--use-checkpoint-opt_param-scheduler (Megatron would refuse a resume whose schedule differs)",
    )
    adam_beta1: float = opt(0.9, "--adam-beta1", "AdamW beta1")
    adam_beta2: float = opt(0.999, "--adam-beta2", "AdamW beta2")
    adam_eps: float = opt(1e-8, "--adam-eps", "AdamW epsilon")
    clip_grad: float = opt(1.0, "--clip-grad", "global gradient-norm clip (0 = off)")

    def weight_decay_span(self) -> tuple[float, float]:
        """(first, last) weight decay of the schedule: --weight-decay for both when constant (Megatron's rule)."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        start, end = self.start_weight_decay, self.end_weight_decay
        assert start is not None and end is not None, "validation requires both with a weight-decay schedule"
        return start, end


@dataclass
class DataConfig:
    data_path: list[str] = opt(
        [], "--data-path", "dataset prefixes, optionally weighted: [w1] p1 [w2] p2 ...", nargs="+", type=str
    )
    split: str = opt("969,30,1", "--split", "train,valid,test proportions of each dataset")
    mock_data: bool = opt(False, "--mock-data", "synthetic learnable token sequences instead of --data-path")
    tokenizer_type: str | None = opt(
        None,
        "--tokenizer-type",
        "tokenizer (default: inferred from the files given and logged: --vocab-file and --merge-file "
        "GPT2BPETokenizer, as Megatron's GPT-3 example expects; a --tokenizer-model .model file "
        "SentencePieceTokenizer, a directory HuggingFaceTokenizer; none NullTokenizer)",
        choices=list(TOKENIZER_TYPES),
    )
    tokenizer_model: str | None = opt(None, "--tokenizer-model", "sentencepiece .model file or local HF tokenizer dir")
    vocab_file: str | None = opt(None, "--vocab-file", "GPT2BPETokenizer: the vocabulary (GPT-2's vocab.json)")
    merge_file: str | None = opt(None, "--merge-file", "GPT2BPETokenizer: the BPE merges (GPT-2's merges.txt)")
    data_cache_path: str | None = opt(None, "--data-cache-path", "where dataset indices are cached (.npy)")
    mmap_bin_files: bool = opt(
        True,
        "--mmap-bin-files",
        "memory-map the .bin token files (pages read on demand); --no-mmap-bin-files reads each sample's tokens "
        "from the file instead, as Megatron's file reader (for file systems where mapping is slow or refused)",
    )
    reset_position_ids: bool = opt(
        False, "--reset-position-ids", "packed documents: positions restart at 0 after each EOD token"
    )
    reset_attention_mask: bool = opt(
        False,
        "--reset-attention-mask",
        "packed documents: a token sees only its own document (ended by its EOD token): softmax attention "
        "masks other documents, GLA resets its state at each document start",
    )
    eod_mask_loss: bool = opt(False, "--eod-mask-loss", "no loss on the predictions made from EOD input tokens")

    # filled by validate(): why --tokenizer-type was inferred ("" when it was given)
    tokenizer_type_inferred: str = ""

    @property
    def packed_documents(self) -> bool:
        """Whether the model needs the document structure of each sample."""
        return self.reset_position_ids or self.reset_attention_mask

    num_workers: int = opt(
        2,
        "--num-workers",
        "background threads that build micro-batches ahead of the step (pinned on CUDA); 0 = in the step's thread; "
        "any value gives the same batches",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches of a full global batch (after any ramp-up; evaluation always uses it)."""
        batch = self.train.global_batch_size
        assert batch is not None, "read before validation.derive filled it"
        return batch // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def micro_batches_at(self, consumed_samples: int) -> int:
        """Micro-batches per DP rank of the step that starts after `consumed_samples` samples."""
        per_round = self.train.micro_batch_size * self.parallel.data_parallel_size
        return self.train.global_batch_at(consumed_samples) // per_round


SECTIONS = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


def flag_of(section: str, name: str) -> str:
    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == name:
            return f.metadata["flag"]
    raise KeyError(name)


def former_names(section: str) -> dict[str, str]:
    """{former name: field name} of a section's renamed settings (opt's `renamed_from`): the former flag, YAML key
    and checkpoint config key still set the field."""
    return {
        f.metadata["renamed_from"]: f.name
        for f in dataclasses.fields(SECTIONS[section])
        if "renamed_from" in f.metadata
    }
