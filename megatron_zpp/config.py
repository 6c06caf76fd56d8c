"""Typed configuration: the one source of truth for every setting.

Each field carries its command-line flag (Megatron-LM's name where Megatron has the
concept, DeepSpeed's for ZeRO) and its help text; `arguments.py` builds the parser from
these dataclasses, so a setting is declared exactly once. `validate()` derives the values
that follow from others and checks every section against the world size before any
process group exists. A leaf module: what depends on the node layout is checked with the
topology (topology.check_node_layout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """An inconsistent or unsupported setting. The message says what to change."""


def opt(default, flag: str, help: str, **kw):
    """A config field with its CLI flag. kw: choices, nargs, type (element type for lists), metavar."""
    meta = {"flag": flag, "help": help, **kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    num_layers: int = opt(4, "--num-layers", "number of transformer layers")
    hidden_size: int = opt(128, "--hidden-size", "model width")
    num_attention_heads: int = opt(4, "--num-attention-heads", "attention heads (query heads)")
    num_query_groups: int | None = opt(
        None, "--num-query-groups", "key/value heads for grouped-query attention (default: = heads)"
    )
    ffn_hidden_size: int | None = opt(
        None, "--ffn-hidden-size", "MLP inner width (default 4*hidden for gelu, 8/3*hidden rounded to 64 for swiglu)"
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
    normalization: str = opt("RMSNorm", "--normalization", "norm layer", choices=["RMSNorm", "LayerNorm"])
    norm_epsilon: float = opt(1e-5, "--norm-epsilon", "epsilon of the norm layers")
    activation: str = opt("swiglu", "--activation", "MLP activation", choices=["swiglu", "gelu"])
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
    gla_chunk_size: int = opt(16, "--gla-chunk-size", "chunk length of the chunked GLA form")
    gla_gate_low_rank: int = opt(
        0,
        "--gla-gate-low-rank",
        "rank of the GLA decay-gate projection x W_down W_up + b (the GLA paper uses 16); "
        "0 = full rank (one more head-split section of the input projection)",
    )
    gla_gate_normalizer: float = opt(16.0, "--gla-gate-normalizer", "GLA log-decay = logsigmoid(.) / normalizer")
    hidden_dropout: float = opt(0.0, "--hidden-dropout", "dropout after attention and MLP outputs")
    attention_dropout: float = opt(0.0, "--attention-dropout", "dropout on softmax attention probabilities")
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

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 64 * ((int(8 * self.hidden_size / 3) + 63) // 64)
        return 4 * self.hidden_size

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
    ddp_bucket_size: int | None = opt(
        None,
        "--ddp-bucket-size",
        "plain DP with --overlap-grad-reduce: gradient elements per all-reduce bucket (default, as Megatron: "
        "max(40M, 1M x DP x CP)); without overlap the gradients go in one bucket",
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
    min_lr: float = opt(3e-5, "--min-lr", "learning rate at the end of decay")
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
        "cosine", "--lr-decay-style", "decay after warmup", choices=["constant", "linear", "cosine", "WSD"]
    )
    lr_wsd_decay_iters: int | None = opt(
        None,
        "--lr-wsd-decay-iters",
        "WSD: iterations of the final decay (default: a tenth of the decay iters after warmup)",
    )
    lr_wsd_decay_samples: int | None = opt(
        None,
        "--lr-wsd-decay-samples",
        "WSD with --train-samples: samples of the final decay (default: a tenth of the decay samples after warmup)",
    )
    lr_wsd_decay_style: str = opt(
        "linear", "--lr-wsd-decay-style", "WSD: shape of the final decay", choices=["linear", "cosine", "exponential"]
    )
    weight_decay: float = opt(0.1, "--weight-decay", "AdamW weight decay (not applied to norms and biases)")
    adam_beta1: float = opt(0.9, "--adam-beta1", "AdamW beta1")
    adam_beta2: float = opt(0.95, "--adam-beta2", "AdamW beta2")
    adam_eps: float = opt(1e-8, "--adam-eps", "AdamW epsilon")
    clip_grad: float = opt(1.0, "--clip-grad", "global gradient-norm clip (0 = off)")


@dataclass
class DataConfig:
    data_path: list[str] = opt(
        [], "--data-path", "dataset prefixes, optionally weighted: [w1] p1 [w2] p2 ...", nargs="+", type=str
    )
    split: str = opt("969,30,1", "--split", "train,valid,test proportions of each dataset")
    mock_data: bool = opt(False, "--mock-data", "synthetic learnable token sequences instead of --data-path")
    tokenizer_type: str = opt(
        "NullTokenizer",
        "--tokenizer-type",
        "tokenizer",
        choices=["NullTokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"],
    )
    tokenizer_model: str | None = opt(None, "--tokenizer-model", "sentencepiece .model file or local HF tokenizer dir")
    data_cache_path: str | None = opt(None, "--data-cache-path", "where dataset indices are cached (.npy)")
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
    train_iters: int | None = opt(None, "--train-iters", "optimizer steps (default 100, or from --train-samples)")
    train_samples: int | None = opt(
        None,
        "--train-samples",
        "train on this many samples instead of --train-iters (the LR schedule then counts samples)",
    )
    eval_interval: int = opt(0, "--eval-interval", "evaluate every N steps (0 = never)")
    eval_iters: int = opt(2, "--eval-iters", "validation batches per evaluation")
    seed: int = opt(1234, "--seed", "seed of weights, data order and dropout")
    bf16: bool = opt(False, "--bf16", "bf16 compute with fp32 master weights")
    device: str = opt("auto", "--device", "cpu, cuda, or auto (cuda when available)")
    kernels: str = opt(
        "auto",
        "--kernels",
        "op implementations: triton (our Triton kernels; on CPU only under TRITON_INTERPRET=1), torch (the "
        "PyTorch references), auto (Triton on CUDA when importable, else torch)",
        choices=["auto", "triton", "torch"],
    )
    torch_compile: bool = opt(
        False, "--torch-compile", "compile each transformer block and the cross-entropy with torch.compile (inductor)"
    )
    save: str | None = opt(None, "--save", "checkpoint directory to write")
    load: str | None = opt(None, "--load", "checkpoint directory to resume from")
    save_interval: int = opt(0, "--save-interval", "save every N steps (0 = at the end only, when --save)")
    ckpt_step: int | None = opt(
        None, "--ckpt-step", "with --load: load this iteration instead of the one `latest` names"
    )
    exit_signal_handler: bool = opt(
        False, "--exit-signal-handler", "on SIGTERM (preemption), finish the step, save to --save and exit"
    )
    generate_tokens: int = opt(0, "--generate-tokens", "after training, greedy-decode N tokens and print them")
    generate_prompt: str = opt(
        "def",
        "--generate-prompt",
        "prompt text for --generate-tokens (a trailing space becomes a lone word-start token: leave it out)",
    )

    # filled by validate(): --train-iters came from --train-samples
    train_iters_from_samples: bool = False

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples.

        Megatron's ramp-up (RampupBatchsizeNumMicroBatchesCalculator): (GBS - START) / INCR
        increments spread evenly over SAMPLES samples; past SAMPLES, --global-batch-size."""
        if not self.rampup_batch_size:
            return self.global_batch_size
        start, incr, samples = self.rampup_batch_size
        increments = (self.global_batch_size - start) // incr
        if consumed_samples > samples or increments <= 0:  # the second: refused by the checks
            return self.global_batch_size
        return start + int(consumed_samples / (samples / increments)) * incr

    def iterations_for_samples(self) -> int:
        """Steps that --train-samples make (Megatron's update_train_iters): the ramp-up steps
        that start within SAMPLES (and the train samples), then whole constant batches."""
        if not self.rampup_batch_size:
            return self.train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup_batch_size[2] and consumed <= self.train_samples:
            consumed += self.global_batch_at(consumed)
            iterations += 1
        return iterations + max(self.train_samples - consumed, 0) // self.global_batch_size

    def samples_after(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` steps."""
        consumed = done = 0
        while done < iterations and self.global_batch_at(consumed) != self.global_batch_size:
            consumed += self.global_batch_at(consumed)
            done += 1
        return consumed + (iterations - done) * self.global_batch_size


@dataclass
class LogConfig:
    log_interval: int = opt(1, "--log-interval", "print a log line every N steps")
    metrics_file: str | None = opt(None, "--metrics-file", "JSONL of per-iteration metrics (written by one rank)")
    comm_report: str | None = opt(None, "--comm-report", "JSON of communication bytes per group/phase/link")
    tensorboard_dir: str | None = opt(None, "--tensorboard-dir", "write tensorboard scalars here")
    wandb_project: str | None = opt(None, "--wandb-project", "log to Weights & Biases under this project")
    wandb_mode: str = opt(
        "offline", "--wandb-mode", "W&B mode (offline unless you say so)", choices=["offline", "online", "disabled"]
    )
    peak_tflops: float | None = opt(
        None, "--peak-tflops", "dense peak TFLOP/s per rank for MFU (default: known GPU peak, or measured CPU matmul)"
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

# Features whose flags exist but whose implementation has not landed. Each is refused
# with its reason until it works (a flag that is accepted must work).
NOT_YET: dict = {}


def flag_of(section: str, name: str) -> str:
    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == name:
            return f.metadata["flag"]
    raise KeyError(name)


def _failed(checks: list[tuple[bool, str]]) -> list[str]:
    return [msg for ok, msg in checks if not ok]


def validate(cfg: Config, world_size: int) -> Config:
    """Fill derived values, then check every setting against each other and the world size.

    Raises ConfigError listing every problem, each naming the flags to change.
    """
    errors = _refused(cfg) + _check_sizes(cfg)
    if len(errors) > len(_refused(cfg)):  # the checks below divide by these sizes
        raise ConfigError("\n".join(errors))
    derive(cfg, world_size)
    for check in (
        _check_layout,
        _check_model,
        _check_pipeline,
        _check_recompute,
        _check_batch,
        _check_checkpointing,
        _check_compile,
        _check_optim,
        _check_data,
        _check_zero,
        _check_log,
    ):
        errors += check(cfg, world_size)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def derive(cfg: Config, world_size: int) -> None:
    """The values that follow from others: world and data-parallel sizes, defaults that
    depend on other settings."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    p.world_size, p.data_parallel_size = world_size, max(world_size // model_parallel, 1)
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * p.data_parallel_size
    if t.train_iters is None:  # Megatron: from --train-samples, else our default
        t.train_iters_from_samples = t.train_samples is not None
        t.train_iters = t.iterations_for_samples() if t.train_samples is not None else 100


def _refused(cfg: Config) -> list[str]:
    return [
        f"{flag_of(section, name)}: {why}; leave it at its default"
        for section in SECTIONS
        for name, (is_set, why) in NOT_YET.items()
        if hasattr(getattr(cfg, section), name) and is_set(cfg)
    ]


def _check_sizes(cfg: Config) -> list[str]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    given = [("--train-iters", t.train_iters), ("--train-samples", t.train_samples)]
    given += [("--global-batch-size", t.global_batch_size)]
    return [
        f"{flag} must be >= 1 (got {v})"
        for flag, v in [
            ("--tensor-model-parallel-size", p.tensor_model_parallel_size),
            ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
            ("--context-parallel-size", p.context_parallel_size),
            ("--num-layers", m.num_layers),
            ("--hidden-size", m.hidden_size),
            ("--num-attention-heads", m.num_attention_heads),
            ("--seq-length", m.seq_length),
            ("--micro-batch-size", t.micro_batch_size),
            *[(flag, v) for flag, v in given if v is not None],
            *[(f"--rampup-batch-size {what}", v) for what, v in zip(("START", "INCR", "SAMPLES"), t.rampup_batch_size)],
        ]
        if v < 1
    ] + _failed(
        [
            (
                len(t.rampup_batch_size) in (0, 3),
                "--rampup-batch-size takes three numbers: START INCR SAMPLES",
            ),
            (
                t.train_samples is None or t.train_iters is None or t.train_iters_from_samples,
                "give either --train-iters or --train-samples, not both",
            ),
        ]
    )


def _check_layout(cfg: Config, world_size: int) -> list[str]:
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    model_parallel = tp * pp * cp
    return _failed(
        [
            (
                world_size % model_parallel == 0,
                f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
                f"--pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp} = {model_parallel}; "
                f"launch a multiple of {model_parallel} ranks or change the parallel sizes",
            ),
            (
                p.distributed_timeout_minutes > 0,
                f"--distributed-timeout-minutes must be > 0 (got {p.distributed_timeout_minutes})",
            ),
            (
                p.ranks_per_node is None or (p.ranks_per_node >= 1 and world_size % p.ranks_per_node == 0),
                f"--ranks-per-node {p.ranks_per_node} must be >= 1 and divide the world size {world_size}",
            ),
            (
                sorted(p.order.split("-")) == sorted(["tp", "cp", "dp", "pp"]),
                f"--parallel-order {p.order!r} must name each of tp, cp, dp, pp exactly once, e.g. tp-cp-dp-pp",
            ),
        ]
    )


def _check_model(cfg: Config, world_size: int) -> list[str]:
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    return _failed(
        [
            (
                m.hidden_size % m.num_attention_heads == 0,
                f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
            ),
            (
                m.num_attention_heads % m.kv_heads == 0,
                f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.kv_heads}",
            ),
            (
                m.num_attention_heads % tp == 0,
                f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}",
            ),
            (
                m.kv_heads % tp == 0,
                f"--num-query-groups {m.kv_heads} is not divisible by --tensor-model-parallel-size {tp}",
            ),
            (
                m.head_dim % 2 == 0,
                f"head dim {m.head_dim} (--hidden-size / --num-attention-heads) must be even for RoPE",
            ),
            (
                m.ffn_size % tp == 0,
                f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}",
            ),
            (m.softmax_attention_every >= 0, "--softmax-attention-every must be >= 0"),
            (
                not (m.softmax_attention_every and m.attention_type == "softmax"),
                "--softmax-attention-every needs --attention-type gla (the other layers are GLA)",
            ),
            (m.gla_gate_low_rank >= 0, f"--gla-gate-low-rank must be >= 0 (got {m.gla_gate_low_rank})"),
            (
                m.seq_length <= m.max_position_embeddings,
                f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_position_embeddings}",
            ),
            (m.seq_length % cp == 0, f"--seq-length {m.seq_length} is not divisible by --context-parallel-size {cp}"),
            (
                p.all_scan_blocks == 0 or (p.all_scan_blocks >= 1 and m.head_dim % p.all_scan_blocks == 0),
                f"--all-scan-blocks {p.all_scan_blocks} must divide the head dim {m.head_dim} (or be 0: auto)",
            ),
            (
                m.attention_type != "gla" or (m.seq_length // cp) % m.gla_chunk_size == 0,
                f"sequence per CP rank {m.seq_length // cp} is not divisible by --gla-chunk-size {m.gla_chunk_size}",
            ),
            (
                not p.sequence_parallel or (m.seq_length // cp) % tp == 0,
                f"--sequence-parallel: sequence per CP rank {m.seq_length // cp} is not divisible by TP {tp}",
            ),
        ]
    )


def _check_pipeline(cfg: Config, world_size: int) -> list[str]:
    m, p = cfg.model, cfg.parallel
    pp, vpp = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if vpp is not None:
        return _failed(
            [
                (pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
                (
                    vpp >= 1 and m.num_layers % (pp * vpp) == 0,
                    f"--num-layers {m.num_layers} is not divisible by PP x --num-layers-per-virtual-pipeline-stage "
                    f"= {pp} x {vpp}",
                ),
                (
                    first is None and last is None,
                    "uneven first/last pipeline stages cannot be combined with --num-layers-per-virtual-pipeline-stage",
                ),
            ]
        )
    if first is not None or last is not None:
        fixed = (first or 0) + (last or 0)
        free = pp - (first is not None) - (last is not None)
        rest = m.num_layers - fixed
        return _failed(
            [
                (pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1"),
                (
                    rest >= 0 and (rest % free == 0 if free else rest == 0),
                    f"--num-layers {m.num_layers} minus first/last stage layers ({fixed}) does not split evenly over "
                    f"the other {free} stages",
                ),
            ]
        )
    return _failed(
        [
            (
                m.num_layers % pp == 0,
                f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                f"change one, or set --decoder-first/last-pipeline-num-layers",
            )
        ]
    )


def chunk_layer_counts(cfg: Config) -> list[int]:
    """Layers of each pipeline stage, or of each virtual stage with interleaving (stages.py's split)."""
    m, p = cfg.model, cfg.parallel
    pp, vpp = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    if vpp:
        return [vpp] * (m.num_layers // vpp)
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    free = pp - (first is not None) - (last is not None)
    rest = (m.num_layers - (first or 0) - (last or 0)) // max(free, 1)
    sizes = [rest] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def _check_recompute(cfg: Config, world_size: int) -> list[str]:
    m = cfg.model
    gran, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    if gran != "full":
        return _failed(
            [
                (method is None, "--recompute-method needs --recompute-granularity full"),
                (n is None, "--recompute-num-layers needs --recompute-granularity full"),
            ]
        )
    if method is None or n is None:
        return [
            "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
            "(or use --recompute-granularity selective)"
        ]
    most = max(chunk_layer_counts(cfg), default=m.num_layers)
    return _failed(
        [
            (n >= 1, f"--recompute-num-layers must be >= 1 (got {n})"),
            (
                method != "block" or n <= most,
                f"--recompute-num-layers {n} exceeds the {most} layers of a (virtual) pipeline stage: with "
                f"--recompute-method block use at most {most}",
            ),
        ]
    )


def _check_batch(cfg: Config, world_size: int) -> list[str]:
    p, t = cfg.parallel, cfg.train
    dp, pp, cp = p.data_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    per_step = t.micro_batch_size * dp
    errors = _failed(
        [
            (
                t.global_batch_size % per_step == 0,
                f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size x DP = "
                f"{t.micro_batch_size} x {dp}; use a multiple of {per_step}",
            )
        ]
    ) + _check_rampup(t, per_step)
    if t.train_iters_from_samples and t.train_iters < 1:
        errors.append(f"--train-samples {t.train_samples} is less than one step (--global-batch-size)")
    if p.num_layers_per_virtual_pipeline_stage is not None and not errors:
        sizes = sorted({t.global_batch_size, *t.rampup_batch_size[:2]})  # START, INCR: all ramp sizes follow
        errors += _failed(
            [
                (
                    (size // per_step) % pp == 0,
                    f"the interleaved schedule needs the number of micro-batches per step ({size // per_step} = "
                    f"batch {size} / (micro batch x DP)) to be a multiple of --pipeline-model-parallel-size {pp}",
                )
                for size in sizes
            ]
        )
    if t.generate_tokens:
        errors += _failed(
            [
                (
                    pp == 1 and cp == 1,
                    "--generate-tokens needs --pipeline-model-parallel-size 1 and "
                    "--context-parallel-size 1 (or use tools/generate.py on a checkpoint)",
                )
            ]
        )
    return errors


def _check_rampup(t: TrainConfig, per_step: int) -> list[str]:
    """--rampup-batch-size START INCR SAMPLES: every batch of the ramp is START + k INCR, so
    START and INCR multiples of micro x DP keep each one whole micro-batches (Megatron checks
    each batch as it comes; these two checks say it at start-up)."""
    if not t.rampup_batch_size:
        return []
    start, incr, _ = t.rampup_batch_size
    flag = "--rampup-batch-size"
    return _failed(
        [
            (t.train_samples is not None, f"{flag} needs --train-samples (sample-based training, as in Megatron)"),
            (
                start % per_step == 0 and incr % per_step == 0,
                f"{flag}: START {start} and INCR {incr} must be multiples of --micro-batch-size x DP = {per_step}",
            ),
            (
                start < t.global_batch_size and (t.global_batch_size - start) % incr == 0,
                f"{flag}: START {start} must be below --global-batch-size {t.global_batch_size} and reach it in "
                f"steps of INCR {incr}",
            ),
        ]
    )


def _check_compile(cfg: Config, world_size: int) -> list[str]:
    """--torch-compile: what has been verified to compose with it (the block's collectives and the
    per-TP-rank dropout stream run inside the compiled code under TP/CP, and are not verified there)."""
    if not cfg.train.torch_compile:
        return []
    p, m = cfg.parallel, cfg.model
    why = "collectives inside the compiled blocks are not verified (the byte ledger could miss them)"
    return _failed(
        [
            (p.tensor_model_parallel_size == 1, f"--torch-compile needs --tensor-model-parallel-size 1: {why}"),
            (p.context_parallel_size == 1, f"--torch-compile needs --context-parallel-size 1: {why}"),
            (
                m.attention_dropout == 0,
                "--torch-compile needs --attention-dropout 0 (its per-TP-rank RNG stream is not verified under "
                "torch.compile); --hidden-dropout is fine",
            ),
            (
                cfg.train.kernels != "triton",
                "--torch-compile compiles the PyTorch references: use --kernels torch or auto with it, not triton",
            ),
            (
                not cfg.data.packed_documents,
                "--torch-compile is not verified with packed documents (--reset-position-ids, "
                "--reset-attention-mask): drop one or the other",
            ),
        ]
    )


def _check_checkpointing(cfg: Config, world_size: int) -> list[str]:
    t = cfg.train
    return _failed(
        [
            (t.save_interval >= 0, f"--save-interval must be >= 0 (got {t.save_interval})"),
            (not (t.save_interval and t.save is None), "--save-interval needs --save DIR (where to write checkpoints)"),
            (
                t.ckpt_step is None or t.load is not None,
                "--ckpt-step needs --load DIR (which checkpoints to choose from)",
            ),
            (not (t.exit_signal_handler and t.save is None), "--exit-signal-handler needs --save DIR (where to save)"),
        ]
    )


def _check_optim(cfg: Config, world_size: int) -> list[str]:
    o = cfg.optim
    return _failed(
        [
            (0 <= o.min_lr <= o.lr, f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}"),
            (o.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0"),
            (o.lr_warmup_samples >= 0, "--lr-warmup-samples must be >= 0"),
            (
                o.lr_warmup_fraction is None or 0 <= o.lr_warmup_fraction <= 1,
                f"--lr-warmup-fraction {o.lr_warmup_fraction} must be between 0 and 1",
            ),
            (
                o.lr_warmup_fraction is None or not (o.lr_warmup_iters or o.lr_warmup_samples),
                "give one of --lr-warmup-fraction, --lr-warmup-iters and --lr-warmup-samples",
            ),
        ]
    ) + _check_schedule_units(cfg)


def _check_schedule_units(cfg: Config) -> list[str]:
    """Megatron's rule: with --train-samples the LR schedule is given in samples, with
    --train-iters in iterations; a setting in the other unit is refused, not ignored."""
    o = cfg.optim
    if cfg.train.train_samples is not None:
        wrong = [("--lr-warmup-iters", o.lr_warmup_iters), ("--lr-decay-iters", o.lr_decay_iters)]
        wrong += [("--lr-wsd-decay-iters", o.lr_wsd_decay_iters)]
        return [
            f"{f} is for --train-iters: with --train-samples use {f.replace('iters', 'samples')}" for f, v in wrong if v
        ]
    wrong = [("--lr-warmup-samples", o.lr_warmup_samples), ("--lr-decay-samples", o.lr_decay_samples)]
    wrong += [("--lr-wsd-decay-samples", o.lr_wsd_decay_samples)]
    return [
        f"{f} needs --train-samples (with --train-iters use {f.replace('samples', 'iters')})" for f, v in wrong if v
    ]


def _check_data(cfg: Config, world_size: int) -> list[str]:
    d = cfg.data
    parts = d.split.replace("/", ",").split(",")
    return _failed(
        [
            (d.mock_data or d.data_path, "give --data-path PREFIX [...] or --mock-data"),
            (d.num_workers >= 0, f"--num-workers must be >= 0 (got {d.num_workers})"),
            (not (d.mock_data and d.data_path), "give either --data-path or --mock-data, not both"),
            (
                d.tokenizer_type == "NullTokenizer" or d.tokenizer_model is not None,
                f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model",
            ),
            (
                all(s.strip().replace(".", "", 1).isdigit() for s in parts) and len(parts) <= 3,
                f"--split {d.split!r} must be up to three non-negative numbers like 969,30,1",
            ),
        ]
    )


def _check_zero(cfg: Config, world_size: int) -> list[str]:
    z = cfg.zero
    zero_group = cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size  # replicas of each weight
    hpz, tiers = z.zero_hpz_partition_size, z.zero_hierarchy
    zpp = [
        f
        for f, on in [
            ("--zero-param-persistence step", z.zero_param_persistence == "step"),
            ("--zero-quantized-weights", z.zero_quantized_weights),
            ("--zero-hpz-partition-size", hpz > 1),
            ("--zero-quantized-gradients", z.zero_quantized_gradients),
            ("--zero-gradient-stochastic-rounding", z.zero_gradient_stochastic_rounding),
            ("--zero-hierarchy", bool(tiers)),
        ]
        if on
    ]
    return _failed(
        [
            (
                z.ddp_bucket_size is None or z.ddp_bucket_size >= 1,
                f"--ddp-bucket-size must be >= 1 gradient elements (got {z.ddp_bucket_size})",
            ),
            (
                z.ddp_bucket_size is None or z.zero_stage == 0,
                "--ddp-bucket-size applies to plain data parallelism (--zero-stage 0); ZeRO reduces one unit "
                "(a transformer block, the embedding, the head) at a time: leave it unset",
            ),
            (
                z.overlap_grad_reduce or z.zero_stage < 2,
                "--no-overlap-grad-reduce: ZeRO-2/3 reduce each unit's gradients during the backward (that is what "
                "keeps them sharded); use --zero-stage 0 or 1 to reduce after the backward",
            ),
            (
                not z.overlap_param_gather or z.zero_stage in (1, 2),
                "--overlap-param-gather applies to ZeRO-1/2 (the all-gather of the updated weights after the step); "
                "ZeRO-3 gathers unit by unit with prefetch already, plain DP gathers nothing: drop it",
            ),
            (hpz >= 1, "--zero-hpz-partition-size must be >= 1"),
            (
                z.zero_gradient_quantization_block_size >= 2 and z.zero_gradient_quantization_block_size % 2 == 0,
                "--zero-gradient-quantization-block-size must be an even number >= 2 (int4 packs two values per byte)",
            ),
            (z.zero_quantization_block_size >= 1, "--zero-quantization-block-size must be >= 1"),
            (
                not z.zero_gradient_stochastic_rounding or z.zero_quantized_gradients,
                "--zero-gradient-stochastic-rounding needs --zero-quantized-gradients (it rounds qgZ's int4 values)",
            ),
            *[(z.zero_stage == 3, f"{flag} applies to ZeRO-3 sharded weights: add --zero-stage 3") for flag in zpp],
            (
                hpz <= 1 or zero_group % hpz == 0,
                f"--zero-hpz-partition-size {hpz} must divide the ZeRO group size "
                f"(data parallel x context parallel = {zero_group})",
            ),
            (
                not tiers
                or (
                    all(b % a == 0 for a, b in zip(tiers, tiers[1:]))
                    and all(t >= 1 for t in tiers)
                    and all(zero_group % t == 0 for t in tiers)
                ),
                f"--zero-hierarchy {' '.join(map(str, tiers))}: each tier must divide the next and the ZeRO group "
                f"size {zero_group}",
            ),
        ]
    )


def _check_log(cfg: Config, world_size: int) -> list[str]:
    return _failed([(cfg.log.log_interval >= 1, "--log-interval must be >= 1")])
