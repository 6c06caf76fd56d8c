"""TrainConfig and LogConfig: the run (batches, iterations, precision, checkpoints, device) and its
logging, tracking and profiling. Re-exported by the config package (import them from there); imports nothing
of ours but config_fields and batch_schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import batch_schedule
from .fields import opt


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
    # fp16 with loss scaling (Megatron's flags and defaults)
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
        "it, ours or megatron-core's torch_dist (converted on the fly); one that holds no checkpoint starts from "
        "scratch with a warning, as Megatron-LM (--exit-on-missing-checkpoint: an error)",
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
    # Megatron-LM's checkpointing flags; checkpoint/save.py, load.py and async_save.py use them
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
        "a --load that holds no checkpoint (absent, empty, no 'latest' or tracker) is an error (by default the run "
        "warns and starts from scratch, as Megatron-LM's)",
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

    # Megatron-LM run-time flags
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
