"""Typed configuration: the one source of truth for every setting.

Each field carries its command-line flag (Megatron-LM's name where Megatron has the
concept, DeepSpeed's for ZeRO) and its help text; `arguments.py` builds the parser from
these dataclasses, so a setting is declared exactly once. validation.py derives the values
that follow from others and checks every section against the world size before any
process group exists. A leaf module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import batch_schedule

# --tokenizer-type's values (data/tokenizer.py builds them; GPTSentencePieceTokenizer: Megatron's GPT variant)
TOKENIZER_TYPES = (
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
)


class ConfigError(ValueError):
    """An inconsistent or unsupported setting. The message says what to change."""


def opt(default, flag: str, help: str, **kw):
    """A config field with its CLI flag. kw: choices, nargs, type (element type for lists), metavar."""
    meta = {"flag": flag, "help": help, **kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def default_gla_chunk_size(device_type: str) -> int:
    """--gla-chunk-size when not given: 64 on CUDA (the Triton kernels), 16 on CPU (see its help)."""
    return 64 if device_type == "cuda" else 16


@dataclass
class ModelConfig:
    num_layers: int = opt(4, "--num-layers", "number of transformer layers")
    hidden_size: int = opt(128, "--hidden-size", "model width")
    num_attention_heads: int = opt(4, "--num-attention-heads", "attention heads (query heads)")
    num_query_groups: int | None = opt(
        None,
        "--num-query-groups",
        "key/value heads with --group-query-attention (default 1, as Megatron; refused without it, which Megatron "
        "would ignore)",
    )
    ffn_hidden_size: int | None = opt(
        None,
        "--ffn-hidden-size",
        "MLP inner width (default, as Megatron: 4*hidden for gelu, int(8/3*hidden / 64)*64 for swiglu)",
    )
    seq_length: int = opt(256, "--seq-length", "training sequence length in tokens")
    max_position_embeddings: int | None = opt(
        None, "--max-position-embeddings", "longest position the model supports (default: seq length)"
    )
    vocab_size: int = opt(
        512, "--vocab-size", "vocabulary size when no tokenizer model gives one (mock data, NullTokenizer)"
    )
    make_vocab_size_divisible_by: int = opt(
        128, "--make-vocab-size-divisible-by", "pad the vocabulary to a multiple of this times TP"
    )
    normalization: str = opt("LayerNorm", "--normalization", "norm layer", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "--norm-epsilon", "epsilon of the norm layers")
    activation: str = opt(
        "gelu",
        "--activation",
        "MLP activation (Megatron's --swiglu is --activation swiglu, --squared-relu is squared_relu: relu(x)^2)",
        choices=["gelu", "swiglu", "squared_relu"],
    )
    bias_gelu_fusion: bool = opt(
        True,
        "--bias-gelu-fusion",
        "as Megatron: with biases, gelu is its fused bias-gelu, the tanh approximation; --no-bias-gelu-fusion (or "
        "no biases: --disable-bias-linear) computes the exact erf gelu instead",
    )
    openai_gelu: bool = opt(False, "--openai-gelu", "as Megatron: gelu is the tanh approximation (OpenAI's) always")
    rotary_base: float = opt(10000.0, "--rotary-base", "RoPE base frequency")
    untie_embeddings_and_output_weights: bool = opt(
        False, "--untie-embeddings-and-output-weights", "separate input embedding and output layer weights"
    )
    attention_type: str = opt("softmax", "--attention-type", "token mixer of every layer", choices=["softmax", "gla"])
    softmax_attention_every: int = opt(
        0,
        "--softmax-attention-every",
        "hybrid model: with --attention-type gla, every K-th layer (K-1, 2K-1, ...) uses softmax attention; 0 = none",
    )
    gla_chunk_size: int | None = opt(
        None,
        "--gla-chunk-size",
        "chunk length of the chunked GLA form; default 64 on CUDA, 16 on CPU. On a GPU 64 keeps per token and "
        "head (K = V = 128) K*V/C = 256 fp32 entering-state values and C = 64 scores, 1.3 KB, where 16 keeps "
        "1024 + 16, 4.2 KB, and the sequential state scan takes T/64 steps instead of T/16 (fla's chunk_gla uses "
        "64); on CPU 16 is the chunk bench/gla.py measures for the PyTorch reference",
    )
    gla_gate_low_rank: int = opt(
        0,
        "--gla-gate-low-rank",
        "rank of the GLA decay-gate projection x W_down W_up + b (the GLA paper uses 16); "
        "0 = full rank (one more head-split section of the input projection)",
    )
    gla_gate_normalizer: float = opt(16.0, "--gla-gate-normalizer", "GLA log-decay = logsigmoid(.) / normalizer")
    hidden_dropout: float = opt(
        0.1, "--hidden-dropout", "dropout on the embedding output and after the attention and MLP outputs"
    )
    attention_dropout: float = opt(0.1, "--attention-dropout", "dropout on softmax attention probabilities")
    init_method_std: float = opt(0.02, "--init-method-std", "std of the normal weight init")
    recompute_granularity: str | None = opt(
        None,
        "--recompute-granularity",
        "activation recompute: full = whole transformer layers (with --recompute-method and "
        "--recompute-num-layers); selective = the core of each token mixer (softmax attention's scores, softmax and "
        "weighted sum; GLA's gates, chunked operator, head norm and output gate)",
        choices=["full", "selective"],
    )
    recompute_method: str | None = opt(
        None,
        "--recompute-method",
        "with --recompute-granularity full: uniform = every group of --recompute-num-layers consecutive layers of a "
        "(virtual) pipeline stage is recomputed as one unit; block = the first --recompute-num-layers layers of each "
        "(virtual) pipeline stage are recomputed, the rest are not",
        choices=["uniform", "block"],
    )
    recompute_num_layers: int | None = opt(
        None,
        "--recompute-num-layers",
        "with --recompute-granularity full: layers per recomputed unit (uniform) or recomputed layers per (virtual) "
        "pipeline stage (block)",
    )

    # Megatron-LM compatibility (issue 16): its flags with its defaults; what is not built is refused by validation
    group_query_attention: bool = opt(
        False, "--group-query-attention", "grouped-query attention with --num-query-groups key/value heads"
    )
    kv_channels: int | None = opt(
        None, "--kv-channels", "head dim (default and only supported value: --hidden-size / --num-attention-heads)"
    )
    position_embedding_type: str = opt(
        "learned_absolute",
        "--position-embedding-type",
        "position embedding: learned_absolute (Megatron's default: a learned [max-position-embeddings, hidden] table "
        "added to the word embedding), rope, or none; yarn, mrope and relative are not built",
        choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
    )
    rotary_percent: float = opt(
        1.0,
        "--rotary-percent",
        "fraction of the head dim RoPE rotates, as Megatron: the first int(head dim x fraction) channels of each "
        "q/k head, with frequencies over that width; the rest pass unrotated",
    )
    add_bias_linear: bool = opt(
        True,
        "--add-bias-linear",
        "biases in the linear layers (qkv, attention output, fc1, fc2; never the output layer), as Megatron's "
        "default; --disable-bias-linear (Megatron's flag) turns them off. GLA's projections take none either way",
    )
    add_qkv_bias: bool = opt(
        False, "--add-qkv-bias", "a bias on the qkv projection only (implied by --add-bias-linear), as Megatron"
    )
    apply_layernorm_1p: bool = opt(
        False,
        "--apply-layernorm-1p",
        "zero-centred norm weights: stored w, initialised 0, applied as 1 + w (LayerNorm and RMSNorm, as Megatron's "
        "transformer-engine norms)",
    )
    attention_backend: str = opt(
        "auto",
        "--attention-backend",
        "softmax attention kernel, mapped to PyTorch SDPA's backends on CUDA: flash = flash attention, fused = "
        "cuDNN/memory-efficient, unfused/local = the math path, auto = SDPA's own choice (--use-flash-attn = flash); "
        "on CPU SDPA's CPU kernel runs whatever the choice (the log says which)",
        choices=["auto", "flash", "fused", "unfused", "local"],
    )

    @property
    def kv_heads(self) -> int:
        if self.group_query_attention:
            return self.num_query_groups or 1
        return self.num_attention_heads

    @property
    def gelu_approximate(self) -> str:
        """F.gelu's `approximate` for Megatron's flags: its fused bias-gelu and openai_gelu are the tanh form,
        its plain F.gelu (no biases, or --no-bias-gelu-fusion) the exact erf form."""
        return "tanh" if self.openai_gelu or (self.add_bias_linear and self.bias_gelu_fusion) else "none"

    @property
    def rotary_dim(self) -> int:
        """Channels of each q/k head that RoPE rotates (Megatron: kv_channels x rotary_percent)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.activation == "swiglu":  # Megatron's rounding: down to a multiple of 64 (5440 at hidden 2048)
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def qkv_bias(self) -> bool:
        """Whether softmax attention's qkv projection has a bias (Megatron: either flag)."""
        return self.add_bias_linear or self.add_qkv_bias

    def layer_kind(self, layer: int) -> str:
        """'softmax' or 'gla' for global layer index `layer` (0-based)."""
        if self.attention_type == "softmax":
            return "softmax"
        k = self.softmax_attention_every
        return "softmax" if k and (layer + 1) % k == 0 else "gla"


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "--tensor-model-parallel-size", "TP: ranks that split each layer")
    pipeline_model_parallel_size: int = opt(1, "--pipeline-model-parallel-size", "PP: pipeline stages")
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "--num-layers-per-virtual-pipeline-stage", "layers per virtual stage (interleaved 1F1B)"
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
        "GLA state passing under CP: ZeCO all-scan, LASP-2 all-gather, LASP-1 ring (softmax layers all-gather K/V)",
        choices=["all-scan", "all-gather", "ring"],
    )
    all_scan_blocks: int = opt(
        0,
        "--all-scan-blocks",
        "All-Scan: pipeline the state in this many blocks along d_k; 0 = chosen from the state size and the CP "
        "group's link (context_parallel.auto_blocks: 1 at CP 2, about sqrt((CP-2) x transfer time / latency))",
    )
    order: str = opt("tp-cp-dp-pp", "--parallel-order", "rank order of the 4D grid, first axis fastest")
    ranks_per_node: int | None = opt(
        None, "--ranks-per-node", "ranks per node (default: LOCAL_WORLD_SIZE); smaller values emulate several nodes"
    )
    distributed_timeout_minutes: float = opt(
        10.0,
        "--distributed-timeout-minutes",
        "a collective waiting longer than this for another rank fails the run instead of hanging (fractions allowed)",
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
        return self.start_weight_decay, self.end_weight_decay


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
class TrainConfig:
    micro_batch_size: int = opt(1, "--micro-batch-size", "sequences per micro-batch per data-parallel rank")
    global_batch_size: int | None = opt(
        None, "--global-batch-size", "sequences per step over all data-parallel ranks (default: micro x DP)"
    )
    rampup_batch_size: list[int] = opt(
        [],
        "--rampup-batch-size",
        "the global batch starts at START and grows by INCR in equal steps over the first "
        "SAMPLES samples up to --global-batch-size (needs --train-samples; START and INCR multiples of micro x DP)",
        nargs=3,
        type=int,
        metavar=("START", "INCR", "SAMPLES"),
    )
    step_batch_size_schedule: str | None = opt(
        None,
        "--step-batch-size-schedule",
        "the global batch by tokens consumed, as Megatron: 'THRESHOLD:BATCH ...' (thresholds in tokens, with "
        "K/M/B/T suffixes, the first 0; e.g. '0:16 2.4B:320 12B:1536'); its last batch is the global batch "
        "(Megatron refuses --global-batch-size beside it; here it may be given if it is the same)",
    )
    train_iters: int | None = opt(None, "--train-iters", "optimizer steps (default 100, or from --train-samples)")
    train_samples: int | None = opt(
        None,
        "--train-samples",
        "train on this many samples instead of --train-iters (the LR schedule then counts samples)",
    )
    eval_interval: int = opt(0, "--eval-interval", "evaluate every N steps (0 = never)")
    eval_iters: int = opt(
        100,
        "--eval-iters",
        "global batches per evaluation; also the final validation and test evaluations after training "
        "(0 = none), as Megatron",
    )
    start_eval_at_iter: int | None = opt(
        None, "--start-eval-at-iter", "evaluate every --eval-interval only from this iteration on"
    )
    skip_train: bool = opt(
        False, "--skip-train", "no training: evaluate the validation and test sets (of --load's weights) and exit"
    )
    eval_global_batch_size: int | None = opt(
        None, "--eval-global-batch-size", "sequences per evaluation batch (default: --global-batch-size)"
    )
    eval_micro_batch_size: int | None = opt(
        None, "--eval-micro-batch-size", "sequences per evaluation micro-batch (default: --micro-batch-size)"
    )
    seed: int = opt(1234, "--seed", "seed of weights, data order and dropout")
    deterministic_mode: bool = opt(
        False,
        "--deterministic-mode",
        "bitwise-reproducible kernels, as Megatron: torch.use_deterministic_algorithms(True), cuDNN deterministic "
        "and not benchmarking; sets CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring and "
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 where unset (a set value must be a deterministic one); the log says what",
    )
    bf16: bool = opt(False, "--bf16", "bf16 compute with fp32 master weights")
    # fp16 with loss scaling (Megatron's flags and defaults; issue 16)
    fp16: bool = opt(
        False, "--fp16", "fp16 compute with fp32 master weights and loss scaling (dynamic unless --loss-scale)"
    )
    loss_scale: float | None = opt(
        None, "--loss-scale", "--fp16: static loss scale (a power of 2); default: dynamic loss scaling"
    )
    check_for_nan_in_loss_and_grad: bool = opt(
        True,
        "--check-for-nan-in-loss-and-grad",
        "check the loss and the global gradient norm before every optimizer step (all ranks agree); a non-finite "
        "step is never applied and stops the run (--fp16 skips overflowing gradients instead); "
        "--no-check-for-nan-in-loss-and-grad applies fp32/bf16 steps whatever they hold",
    )
    max_skipped_steps: int = opt(
        100,
        "--max-skipped-steps",
        "--fp16: stop the run after more than N consecutive steps skipped for overflowing gradients",
    )
    initial_loss_scale: float = opt(2.0**32, "--initial-loss-scale", "--fp16: first scale of dynamic loss scaling")
    min_loss_scale: float = opt(1.0, "--min-loss-scale", "--fp16: the dynamic scale never falls below this")
    loss_scale_window: int = opt(
        1000, "--loss-scale-window", "--fp16: steps without overflow after which the dynamic scale doubles"
    )
    hysteresis: int = opt(
        2, "--hysteresis", "--fp16: overflowing steps (since the last growth) before the scale halves"
    )
    device: str = opt("auto", "--device", "cpu, cuda, or auto (cuda when available)")
    kernels: str = opt(
        "auto",
        "--kernels",
        "op implementations: triton (our Triton kernels; on CPU only under TRITON_INTERPRET=1), torch (the "
        "PyTorch references), auto (Triton on CUDA when importable, else torch); any of them with --torch-compile "
        "(each kernel is a custom op, called as it is inside the compiled graph)",
        choices=["auto", "triton", "torch"],
    )
    torch_compile: bool = opt(
        False,
        "--torch-compile",
        "compile each transformer block and the cross-entropy with torch.compile (inductor); the --kernels "
        "Triton kernels inside them stay opaque custom ops, the PyTorch code around them is compiled",
    )
    save: str | None = opt(None, "--save", "checkpoint directory to write")
    load: str | None = opt(
        None,
        "--load",
        "checkpoint to resume from: a checkpoint root (the directory with 'latest') or one iteration directory in "
        "it; one that holds no checkpoint is an error unless it is also --save (a first start of a requeued job)",
    )
    override_checkpoint: bool = opt(
        False,
        "--override-checkpoint",
        "let a run that did not --load from --save write into a --save that already holds checkpoints (overwriting "
        "them and moving 'latest' back)",
    )
    save_interval: int = opt(0, "--save-interval", "save every N steps (0 = at the end only, when --save)")
    ckpt_step: int | None = opt(
        None, "--ckpt-step", "with --load: load this iteration instead of the one `latest` names"
    )
    # Megatron-LM's checkpointing flags (issue 24); sharded.py and async_save.py use them
    ckpt_format: str = opt(
        "zpp",
        "--ckpt-format",
        "checkpoint format: zpp (this project's: one safetensors file per rank, sha256s in meta.json, resharded "
        "by our reader), torch_dist or torch_dcp (both torch.distributed.checkpoint, keys the single-rank model's "
        "names, resharded by DCP); Megatron's torch and fsdp_dtensor are refused",
        choices=["zpp", "torch_dist", "torch_dcp", "torch", "fsdp_dtensor"],
    )
    save_optim: bool = opt(
        True, "--save-optim", "save the AdamW state (--no-save-optim: weights and fp32 masters only)"
    )
    save_rng: bool = opt(True, "--save-rng", "save the RNG states (--no-save-rng: a resume draws from fresh seeds)")
    load_optim: bool = opt(
        True,
        "--load-optim",
        "load the AdamW state (--no-load-optim: weights and fp32 masters only, AdamW starts fresh from them)",
    )
    load_rng: bool = opt(
        True, "--load-rng", "load the RNG states (--no-load-rng: dropout and the rest draw from this run's seeds)"
    )
    finetune: bool = opt(
        False,
        "--finetune",
        "load weights only (no AdamW state, no RNG) and start at iteration 0 with 0 samples consumed",
    )
    pretrained_checkpoint: str | None = opt(
        None,
        "--pretrained-checkpoint",
        "when --load holds no checkpoint (or is not given): start from this one as --finetune does (weights only, "
        "iteration 0); a requeued job then resumes from its own --load",
    )
    exit_on_missing_checkpoint: bool = opt(
        False,
        "--exit-on-missing-checkpoint",
        "a --load that holds no checkpoint is an error even where it is also --save (by default that is the "
        "first start of a requeued job, from scratch)",
    )
    override_ckpt_iteration: int | None = opt(
        None,
        "--override-ckpt-iteration",
        "after --load: continue as at iteration N, with N x --global-batch-size samples consumed (so the data "
        "replays from there), whatever the checkpoint says",
    )
    save_retain_interval: int | None = opt(
        None,
        "--save-retain-interval",
        "keep only the checkpoints whose iteration is a multiple of N, and the latest: the previous one is "
        "deleted once a newer save is complete (a multiple of --save-interval)",
    )
    async_save: bool = opt(
        False,
        "--async-save",
        "each rank copies its state to host memory (pinned on CUDA), then writes its file from a background "
        "thread while training goes on; 'latest' moves when every rank's write is done (checked at the next save "
        "and at exit)",
    )
    exit_signal_handler: bool = opt(
        False,
        "--exit-signal-handler",
        "on --exit-signal (preemption), finish the step, save to --save and exit 0 (Ctrl-C is always caught: "
        "finish the step, save when --save is given, exit 130; a second Ctrl-C stops at once)",
    )
    exit_signal: list[str] = opt(
        ["SIGTERM"],
        "--exit-signal",
        "the signal(s) --exit-signal-handler catches, of SIGTERM SIGUSR1 SIGUSR2 SIGINT SIGHUP (SLURM: #SBATCH "
        "--signal=USR1@120 sends SIGUSR1 120 s before the time limit, a preemption sends SIGTERM: give both)",
        nargs="+",
        type=str,
    )
    exit_interval: int | None = opt(
        None, "--exit-interval", "stop after the iteration divisible by N (saving to --save when given)"
    )
    exit_duration_in_mins: float | None = opt(
        None,
        "--exit-duration-in-mins",
        "stop after the first step that ends this many minutes after start (all ranks agree; saving to --save)",
    )
    generate_tokens: int = opt(0, "--generate-tokens", "after training, greedy-decode N tokens and print them")
    generate_prompt: str = opt(
        "def",
        "--generate-prompt",
        "prompt text for --generate-tokens (a trailing space becomes a lone word-start token: leave it out)",
    )

    # Megatron-LM run-time flags (issue 16)
    calculate_per_token_loss: bool = opt(
        False,
        "--calculate-per-token-loss",
        "the loss is the mean over every token of the global batch (here every micro-batch has the same tokens, "
        "so it equals the mean of micro-batch means; refused with --eod-mask-loss, where they differ)",
    )
    manual_gc: bool = opt(
        False, "--manual-gc", "turn Python's automatic garbage collector off; collect every --manual-gc-interval steps"
    )
    manual_gc_interval: int = opt(
        0, "--manual-gc-interval", "with --manual-gc: collect every N steps (0 = only at start)"
    )
    empty_unused_memory_level: int = opt(
        0,
        "--empty-unused-memory-level",
        "release the accelerator's cached free memory: 1 = after each step's forward-backward, 2 = also after the "
        "optimizer step (0 = never; nothing to release on CPU)",
        choices=[0, 1, 2],
    )

    # filled by validate(): --train-iters came from --train-samples; --step-batch-size-schedule as
    # (first sample, global batch) entries
    train_iters_from_samples: bool = False
    batch_steps: list = field(default_factory=list)

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        return batch_schedule.global_batch_at(self, consumed_samples)

    def iterations_for_samples(self) -> int:
        """Steps that --train-samples make (Megatron's update_train_iters)."""
        return batch_schedule.iterations_for_samples(self)

    def samples_after(self, iterations: int, consumed: int = 0) -> int:
        """Samples consumed after `iterations` more steps that start after `consumed` samples."""
        return batch_schedule.samples_after(self, iterations, consumed)


@dataclass
class LogConfig:
    log_interval: int = opt(100, "--log-interval", "print a log line every N steps")
    metrics_file: str | None = opt(None, "--metrics-file", "JSONL of per-iteration metrics (written by one rank)")
    comm_report: str | None = opt(None, "--comm-report", "JSON of communication bytes per group/phase/link")
    tensorboard_dir: str | None = opt(None, "--tensorboard-dir", "write tensorboard scalars here")
    peak_tflops: float | None = opt(
        None, "--peak-tflops", "dense peak TFLOP/s per rank for MFU (default: known GPU peak, or measured CPU matmul)"
    )
    # -- Megatron-LM's logging flags (its names and defaults) --
    log_params_norm: bool = opt(
        False, "--log-params-norm", "log the L2 norm of all parameters (fp32 masters, each counted once) per step"
    )
    log_num_zeros_in_grad: bool = opt(
        False, "--log-num-zeros-in-grad", "log the number of zero gradient elements (all ranks, each counted once)"
    )
    timing_log_level: int = opt(
        0,
        "--timing-log-level",
        "0: only the iteration time; 1: + forward-backward and optimizer times; 2: + batch-generator (data wait); "
        "levels 1-2 synchronize the device around each timed phase",
        choices=[0, 1, 2],
    )
    timing_log_option: str = opt(
        "minmax",
        "--timing-log-option",
        "timers across ranks: max, min and max, or all",
        choices=["max", "minmax", "all"],
    )
    barrier_with_l1_time: bool = opt(
        True,
        "--barrier-with-level-1-timing",
        "--timing-log-level >= 1: a barrier over all ranks before each level-1 phase, so that its min and max "
        "are the phase's and not a wait for the slowest rank (--no-barrier-with-level-1-timing, as Megatron)",
    )
    log_device_memory_used: bool = opt(
        False, "--log-device-memory-used", "--log-memory-interval: add the device memory in use (as nvidia-smi sees it)"
    )
    logging_level: int | None = opt(None, "--logging-level", "level of Python's logging (10 DEBUG .. 50 CRITICAL)")
    log_memory_interval: int | None = opt(
        None, "--log-memory-interval", "print this rank's memory (allocated, peak, reserved; CPU: RSS) every N steps"
    )
    tensorboard_log_interval: int = opt(1, "--tensorboard-log-interval", "write tensorboard scalars every N steps")
    tensorboard_queue_size: int = opt(
        1000, "--tensorboard-queue-size", "tensorboard events queued before a write to disk"
    )
    log_timers_to_tensorboard: bool = opt(
        False,
        "--log-timers-to-tensorboard",
        "tensorboard: iteration-time, throughput and the --timing-log-level timers",
    )
    log_loss_scale_to_tensorboard: bool = opt(
        True, "--log-loss-scale-to-tensorboard", "tensorboard: loss-scale (1 without --fp16)"
    )
    log_validation_ppl_to_tensorboard: bool = opt(
        False, "--log-validation-ppl-to-tensorboard", "tensorboard: validation perplexity beside the validation loss"
    )
    log_memory_to_tensorboard: bool = opt(
        False, "--log-memory-to-tensorboard", "tensorboard: the accelerator's memory statistics (CPU: peak RSS)"
    )
    log_world_size_to_tensorboard: bool = opt(False, "--log-world-size-to-tensorboard", "tensorboard: world-size")
    # -- experiment tracking and profiling (Megatron-LM's names and defaults) --
    wandb_project: str | None = opt(None, "--wandb-project", "log to Weights & Biases under this project")
    wandb_exp_name: str | None = opt(None, "--wandb-exp-name", "W&B run name (default: a name W&B chooses)")
    wandb_entity: str | None = opt(None, "--wandb-entity", "W&B entity (user or team) owning the project")
    wandb_save_dir: str | None = opt(
        None,
        "--wandb-save-dir",
        "where W&B writes its local files (default, as Megatron: --save DIR/wandb; without --save, W&B's own: "
        "$WANDB_DIR or ./wandb)",
    )
    wandb_mode: str | None = opt(
        None,
        "--wandb-mode",
        "W&B mode (default: $WANDB_MODE, else offline: nothing leaves the machine unless you say so)",
        choices=["offline", "online", "disabled"],
    )
    profile: bool = opt(
        False,
        "--profile",
        "profile iterations --profile-step-start to --profile-step-end - 1 (numbered from 1, as logged) on the "
        "ranks of --profile-ranks: with --use-pytorch-profiler a torch.profiler chrome trace; without it (CUDA "
        "only) an nsys capture range (cudaProfilerStart/Stop: nsys profile --capture-range=cudaProfilerApi ...)",
    )
    use_pytorch_profiler: bool = opt(
        False, "--use-pytorch-profiler", "with --profile: torch.profiler, one chrome trace per rank (CPU and CUDA)"
    )
    profile_step_start: int = opt(10, "--profile-step-start", "first profiled iteration")
    profile_step_end: int = opt(12, "--profile-step-end", "profiling stops before this iteration")
    profile_ranks: list[int] = opt(
        [0], "--profile-ranks", "global ranks that profile and write memory snapshots", nargs="+", type=int
    )
    profile_dir: str | None = opt(
        None,
        "--profile-dir",
        "where --use-pytorch-profiler writes rank-R.json.gz (default, as Megatron: TENSORBOARD_DIR/../torch_profile "
        "with --tensorboard-dir, else ./torch_profile)",
    )
    record_memory_history: bool = opt(
        False,
        "--record-memory-history",
        "CUDA only: record the caching allocator's history from start-up and write a snapshot (view it at "
        "pytorch.org/memory_viz) at every log interval on the ranks of --profile-ranks",
    )
    memory_snapshot_path: str = opt(
        "snapshot.pickle", "--memory-snapshot-path", "memory snapshot file; rank R writes BASE_R.EXT"
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
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)

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
