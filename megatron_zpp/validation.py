"""Validation: the values that follow from others, then every setting checked against the others
and the world size, before any process group exists. Each problem is one line naming the flags
to change (ConfigError lists them all). What depends on the node layout is checked with the
topology (topology.check_node_layout).
"""

from __future__ import annotations

import math

from .batch_schedule import parse_step_schedule
from .config import SECTIONS, Config, ConfigError, TrainConfig, default_gla_chunk_size, flag_of
from .data.tokenizer import infer_tokenizer_type
from .optim.schedules import schedule_errors

# Features whose flags exist but whose implementation has not landed. Each is refused
# with its reason until it works (a flag that is accepted must work).
NOT_YET: dict = {}

EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")  # what --exit-signal-handler may catch


def launch_env(environ) -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as the launcher (torchrun, srun) set them; ConfigError when they cannot be a
    launch: not integers, RANK outside WORLD_SIZE, or several ranks without MASTER_ADDR/MASTER_PORT."""
    values = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        text = environ.get(name, default)
        try:
            values[name] = int(text)
        except ValueError:
            raise ConfigError(
                f"{name}={text!r} is not an integer: launch with torchrun (or srun) or unset it"
            ) from None
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} with WORLD_SIZE={world}: a rank must be in [0, WORLD_SIZE)")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if world > 1 and not environ.get(v)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} but {' and '.join(missing)} not set: launch with torchrun (or srun with them exported)"
        )
    return rank, world


def _failed(checks: list[tuple[bool, str]]) -> list[str]:
    return [msg for ok, msg in checks if not ok]


def validate(cfg: Config, world_size: int, run: bool = True) -> Config:
    """Fill derived values, then check every setting against each other and the world size.

    run=False (the planning tools: tools/estimate_memory.py, tools/simulate_scaling.py) skips the
    checks of what only a run reads or writes: data, tokenizer files, checkpoint directories
    (_check_run_paths). Raises ConfigError listing every problem, each naming the flags to change.
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
        _check_megatron_model,
        _check_precision,
        _check_run_control,
    ):
        errors += check(cfg, world_size)
    if run:
        errors += _check_run_paths(cfg)
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
    if m.gla_chunk_size is None:  # by the device the run will use (--device auto: CUDA when available)
        m.gla_chunk_size = default_gla_chunk_size(_device_type(t.device))
    if t.step_batch_size_schedule and m.seq_length >= 1:
        try:
            t.batch_steps = parse_step_schedule(t.step_batch_size_schedule, m.seq_length)
        except ValueError:
            t.batch_steps = []  # _check_step_schedule says why
        if t.batch_steps and t.global_batch_size is None:  # Megatron: the schedule's last batch
            t.global_batch_size = t.batch_steps[-1][1]
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * p.data_parallel_size
    d = cfg.data
    if d.tokenizer_type is None:  # the one rule preprocess_data.py uses too
        d.tokenizer_type, d.tokenizer_type_inferred = infer_tokenizer_type(
            d.tokenizer_model, d.vocab_file, d.merge_file
        )
    if cfg.zero.use_distributed_optimizer and cfg.zero.zero_stage == 0:  # Megatron's distributed optimizer
        cfg.zero.zero_stage = 1
    if t.train_iters is None:  # Megatron: from --train-samples, else our default
        t.train_iters_from_samples = t.train_samples is not None
        t.train_iters = t.iterations_for_samples() if t.train_samples is not None else 100


def _device_type(device: str) -> str:
    """--device as the run resolves it (training/distributed.py): auto is cuda when CUDA is available."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
    errors = (
        _failed(
            [
                (
                    t.global_batch_size % per_step == 0,
                    f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size x DP = "
                    f"{t.micro_batch_size} x {dp}; use a multiple of {per_step}",
                )
            ]
        )
        + _check_rampup(t, per_step)
        + _check_step_schedule(cfg, per_step)
    )
    if t.train_iters_from_samples and t.train_iters < 1:
        errors.append(f"--train-samples {t.train_samples} is less than one step (--global-batch-size)")
    if p.num_layers_per_virtual_pipeline_stage is not None and not errors:
        # START, INCR: all ramp sizes follow; every batch of a step schedule
        sizes = sorted({t.global_batch_size, *t.rampup_batch_size[:2], *(b for _, b in t.batch_steps)})
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


def _check_step_schedule(cfg: Config, per_step: int) -> list[str]:
    """--step-batch-size-schedule: parsed as Megatron parses it, alone (not with a ramp-up), ending at the
    global batch, and every batch whole micro-batches (Megatron checks each as it comes)."""
    t, flag = cfg.train, "--step-batch-size-schedule"
    if not t.step_batch_size_schedule:
        return []
    try:
        steps = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    except ValueError as e:
        return [f"{flag} {t.step_batch_size_schedule!r}: {e}"]
    odd = sorted({b for _, b in steps if b % per_step})
    return _failed(
        [
            (not t.rampup_batch_size, f"{flag} and --rampup-batch-size are two batch schedules: give one"),
            (
                steps[-1][1] == t.global_batch_size,
                f"{flag} ends at batch {steps[-1][1]} but --global-batch-size is {t.global_batch_size}: drop "
                "--global-batch-size (Megatron refuses both) or make them equal",
            ),
            (not odd, f"{flag}: batches {odd} are not multiples of --micro-batch-size x DP = {per_step}"),
        ]
    )


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
    per-TP-rank dropout stream run inside the compiled code under TP/CP, and are not verified there).
    Any --kernels composes: each Triton kernel is a custom op (ops/dispatch.kernel_op) that the compiled
    graph calls as it is (tests/kernels/test_torch_compile.py: compiled equals eager on the kernels)."""
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
                not cfg.data.packed_documents,
                "--torch-compile is not verified with packed documents (--reset-position-ids, "
                "--reset-attention-mask): drop one or the other",
            ),
        ]
    )


def _check_checkpointing(cfg: Config, world_size: int) -> list[str]:
    t = cfg.train
    unknown = [s for s in t.exit_signal if s not in EXIT_SIGNALS]
    return _failed(
        [
            (t.save_interval >= 0, f"--save-interval must be >= 0 (got {t.save_interval})"),
            (
                t.exit_signal_handler or t.exit_signal == ["SIGTERM"],
                f"--exit-signal {' '.join(t.exit_signal)} needs --exit-signal-handler (which catches it)",
            ),
            (
                not unknown,
                f"--exit-signal {' '.join(unknown)}: not one of {' '.join(EXIT_SIGNALS)}",
            ),
            *_checkpoint_flag_checks(t),
        ]
    )


def _checkpoint_flag_checks(t) -> list[tuple[bool, str]]:
    """Megatron's checkpoint flags (issue 24): --save-retain-interval, --finetune, --ckpt-format."""
    retain = t.save_retain_interval
    return [
        (retain is None or retain > 0, f"--save-retain-interval must be > 0 (got {retain})"),
        (retain is None or t.save is not None, "--save-retain-interval needs --save DIR (whose checkpoints it thins)"),
        (
            retain is None or not t.save_interval or retain <= 0 or retain % t.save_interval == 0,
            f"--save-retain-interval {retain} must be a multiple of --save-interval {t.save_interval}",
        ),
        (
            t.override_ckpt_iteration is None or t.override_ckpt_iteration >= 0,
            f"--override-ckpt-iteration must be >= 0 (got {t.override_ckpt_iteration})",
        ),
        (
            t.override_ckpt_iteration is None or not t.rampup_batch_size,
            "--override-ckpt-iteration takes N x --global-batch-size samples as consumed (Megatron's rule), which "
            "a --rampup-batch-size run did not consume: drop one of them",
        ),
        (
            t.override_ckpt_iteration is None or t.load is not None or t.pretrained_checkpoint is not None,
            "--override-ckpt-iteration needs --load DIR (the checkpoint whose iteration it replaces)",
        ),
        (
            not (t.finetune and t.load is None and t.pretrained_checkpoint is None),
            "--finetune needs --load DIR (the weights to start from)",
        ),
        (
            t.ckpt_format != "torch",
            "--ckpt-format torch (Megatron's legacy per-rank torch.save pickles) is not built: use zpp (the default, "
            "sharded safetensors) or torch_dist (torch.distributed.checkpoint)",
        ),
        (
            t.ckpt_format != "fsdp_dtensor",
            "--ckpt-format fsdp_dtensor is Megatron-FSDP's own DCP layout, not built: use torch_dist "
            "(torch.distributed.checkpoint, keyed by the single-rank model's names) or zpp (the default)",
        ),
    ]


def _check_optim(cfg: Config, world_size: int) -> list[str]:
    o = cfg.optim
    checks = _failed(
        [
            (math.isfinite(o.lr) and o.lr >= 0, f"--lr {o.lr} must be a finite number >= 0"),
            (
                not math.isfinite(o.lr) or 0 <= o.min_lr <= o.lr,
                f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}",
            ),
            (0 <= o.adam_beta1 < 1, f"--adam-beta1 {o.adam_beta1} must be in [0, 1)"),
            (0 <= o.adam_beta2 < 1, f"--adam-beta2 {o.adam_beta2} must be in [0, 1)"),
            (o.adam_eps > 0, f"--adam-eps {o.adam_eps} must be > 0"),
            (o.clip_grad >= 0, f"--clip-grad {o.clip_grad} must be >= 0 (0 turns clipping off)"),
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
            (
                not math.isfinite(o.lr) or 0 <= o.lr_warmup_init <= o.lr,
                f"--lr-warmup-init {o.lr_warmup_init} must be between 0 and --lr {o.lr}",
            ),
        ]
    )
    return checks + _check_schedule_units(cfg) + schedule_errors(cfg)  # the scheduler's own (optim/schedules.py)


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
    return _failed(
        [
            (d.num_workers >= 0, f"--num-workers must be >= 0 (got {d.num_workers})"),
            (not (d.mock_data and d.data_path), "give either --data-path or --mock-data, not both"),
        ]
    ) + _check_split_weights(cfg)


def _check_run_paths(cfg: Config) -> list[str]:
    """What only a run needs: the data, the tokenizer's files and the checkpoint directories
    (validate(run=False) skips these: the planning tools read none of them)."""
    d, t = cfg.data, cfg.train
    return _failed(
        [
            (d.mock_data or d.data_path, "give --data-path PREFIX [...] or --mock-data"),
            (
                d.tokenizer_type in ("NullTokenizer", "GPT2BPETokenizer") or d.tokenizer_model is not None,
                f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model",
            ),
            (
                d.tokenizer_type != "GPT2BPETokenizer" or (d.vocab_file and d.merge_file),
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)",
            ),
            (
                d.tokenizer_type == "GPT2BPETokenizer" or not (d.vocab_file or d.merge_file),
                "--vocab-file/--merge-file are read by --tokenizer-type GPT2BPETokenizer only: add it or drop them",
            ),
            (not (t.save_interval and t.save is None), "--save-interval needs --save DIR (where to write checkpoints)"),
            (
                t.ckpt_step is None or t.load is not None,
                "--ckpt-step needs --load DIR (which checkpoints to choose from)",
            ),
            (not (t.exit_signal_handler and t.save is None), "--exit-signal-handler needs --save DIR (where to save)"),
        ]
    )


def _check_split_weights(cfg: Config) -> list[str]:
    """--split read as Megatron reads it (data.builder.parse_split); a --split of a --data-path must
    give the training set a share (validation and test may have none)."""
    from .data.builder import parse_split

    d = cfg.data
    try:
        weights = parse_split(d.split)
    except ValueError as e:
        return [str(e)]
    if d.mock_data or weights[0] > 0:
        return []
    return [f"--split {d.split!r} gives the training set no documents: its first number must be > 0"]


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
                z.zero_reduce_in_flight is None or z.zero_reduce_in_flight >= 1,
                f"--zero-reduce-in-flight must be >= 1 (got {z.zero_reduce_in_flight}; the engine raises it to the "
                "number of reduction hops)",
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
    """Logging and evaluation (Megatron's _add_logging_args and _add_validation_args)."""
    g, t = cfg.log, cfg.train
    checks = [
        (g.log_interval >= 1, "--log-interval must be >= 1"),
        (
            g.tensorboard_log_interval >= 1,
            f"--tensorboard-log-interval {g.tensorboard_log_interval}: must be >= 1",
        ),
        (g.tensorboard_queue_size >= 1, f"--tensorboard-queue-size {g.tensorboard_queue_size}: must be >= 1"),
        (
            g.log_memory_interval is None or g.log_memory_interval >= 1,
            f"--log-memory-interval {g.log_memory_interval}: must be >= 1 (leave it out for none)",
        ),
        (
            g.logging_level is None or 0 <= g.logging_level <= 50,
            f"--logging-level {g.logging_level}: a level of Python's logging, 0 to 50 (10 DEBUG, 20 INFO, 30 WARNING)",
        ),
        (t.eval_iters >= 0, f"--eval-iters {t.eval_iters}: must be >= 0 (0: no evaluation)"),
        (t.eval_interval >= 0, f"--eval-interval {t.eval_interval}: must be >= 0 (0: none during training)"),
        (
            t.start_eval_at_iter is None or t.start_eval_at_iter >= 0,
            f"--start-eval-at-iter {t.start_eval_at_iter}: must be >= 0",
        ),
    ]
    return _failed(checks + _eval_batch_checks(cfg)) + _check_profiling(cfg, world_size)


def _eval_batch_checks(cfg: Config) -> list:
    t, p = cfg.train, cfg.parallel
    micro = t.eval_micro_batch_size or t.micro_batch_size
    batch = t.eval_global_batch_size or t.global_batch_size
    per_round = micro * p.data_parallel_size
    return [
        (micro >= 1 and batch >= 1, "--eval-global-batch-size and --eval-micro-batch-size must be >= 1"),
        (
            micro < 1 or batch % per_round == 0,
            f"--eval-global-batch-size {batch} must be a multiple of the evaluation micro-batch {micro} x DP "
            f"{p.data_parallel_size} = {per_round}",
        ),
        (
            t.eval_micro_batch_size in (None, t.micro_batch_size) or p.pipeline_model_parallel_size == 1,
            f"--eval-micro-batch-size {t.eval_micro_batch_size} with pipeline parallelism is not built (the stages "
            f"exchange micro-batches of --micro-batch-size {t.micro_batch_size}): leave it out",
        ),
    ]


def _check_profiling(cfg: Config, world_size: int) -> list[str]:
    """--profile and --record-memory-history; what needs CUDA is checked once the device is known
    (training/profiling.check_device)."""
    g = cfg.log
    bad_ranks = [r for r in g.profile_ranks if not 0 <= r < world_size]
    return _failed(
        [
            (g.profile or not g.use_pytorch_profiler, "--use-pytorch-profiler needs --profile (which steps to trace)"),
            (
                not g.profile or 0 <= g.profile_step_start < g.profile_step_end,
                f"--profile-step-start {g.profile_step_start} must be >= 0 and below --profile-step-end "
                f"{g.profile_step_end}",
            ),
            (
                not (g.profile or g.record_memory_history) or not bad_ranks,
                f"--profile-ranks {' '.join(map(str, bad_ranks))}: no such rank (world size {world_size})",
            ),
        ]
    )


_UNBUILT_POSITIONS = {
    "yarn": "YaRN's RoPE scaling (for context extension) is not built",
    "mrope": "multimodal RoPE (sections per image axis) is not built: this is a text-only GPT",
    "relative": "T5-style relative position buckets are not built (a GPT-2/Llama codebase)",
}


def _check_megatron_model(cfg: Config, world_size: int) -> list[str]:
    """Megatron-LM model flags whose other values are not built here (issue 16)."""
    m = cfg.model
    return _failed(
        [
            (
                m.position_embedding_type in ("learned_absolute", "rope", "none"),
                f"--position-embedding-type {m.position_embedding_type}: "
                f"{_UNBUILT_POSITIONS.get(m.position_embedding_type)}; use learned_absolute (Megatron's default), "
                "rope or none",
            ),
            (
                m.kv_channels is None or m.kv_channels * m.num_attention_heads == m.hidden_size,
                f"--kv-channels {m.kv_channels}: only --hidden-size / --num-attention-heads = {m.head_dim} is built "
                "(the head dim); drop it",
            ),
            (
                0 < m.rotary_percent <= 1 and m.rotary_dim >= 2 and m.rotary_dim % 2 == 0,
                f"--rotary-percent {m.rotary_percent}: rotates {m.rotary_dim} of the {m.head_dim} channels of a head; "
                "give a fraction in (0, 1] that makes an even number of at least 2",
            ),
            (
                m.attention_backend not in ("flash", "fused")
                or cfg.train.bf16
                or cfg.train.fp16
                or cfg.train.device == "cpu",
                f"--attention-backend {m.attention_backend}: SDPA's flash and fused kernels take 16-bit inputs: add "
                "--bf16 or --fp16, or use --attention-backend auto/unfused",
            ),
            (
                m.num_query_groups is None or m.group_query_attention,
                f"--num-query-groups {m.num_query_groups} needs --group-query-attention (Megatron ignores it "
                "without, and uses one key/value head per query head): add it, or drop --num-query-groups",
            ),
            (
                m.num_query_groups is None or m.num_query_groups >= 1,
                f"--num-query-groups must be >= 1 (got {m.num_query_groups})",
            ),
            (
                m.ffn_size >= 1,
                f"--swiglu: Megatron's default MLP width int(8/3 x {m.hidden_size} / 64) x 64 is 0 at --hidden-size "
                f"{m.hidden_size}: give --ffn-hidden-size",
            ),
        ]
    )


def _check_precision(cfg: Config, world_size: int) -> list[str]:
    t = cfg.train
    return _failed(
        [
            (not (t.fp16 and t.bf16), "give either --fp16 or --bf16, not both"),
            (
                t.loss_scale is None or t.loss_scale > 0,
                f"--loss-scale must be > 0 (got {t.loss_scale}; leave it out for dynamic scaling)",
            ),
            (
                0 < t.min_loss_scale <= t.initial_loss_scale,
                f"--min-loss-scale {t.min_loss_scale} must be > 0 and at most --initial-loss-scale "
                f"{t.initial_loss_scale}",
            ),
            (t.loss_scale_window >= 1, f"--loss-scale-window must be >= 1 (got {t.loss_scale_window})"),
            (t.hysteresis >= 1, f"--hysteresis must be >= 1 (got {t.hysteresis})"),
            (
                not (t.calculate_per_token_loss and cfg.data.eod_mask_loss),
                "--calculate-per-token-loss with --eod-mask-loss (a mean over the global batch's unmasked tokens) is "
                "not built: drop one (--eod-mask-loss alone averages each micro-batch's unmasked tokens)",
            ),
        ]
    )


def _check_run_control(cfg: Config, world_size: int) -> list[str]:
    t, m = cfg.train, cfg.model
    return _failed(
        [
            (0 <= t.seed < 2**32, f"--seed {t.seed} must be in [0, 2^32)"),
            (0 <= m.hidden_dropout < 1, f"--hidden-dropout {m.hidden_dropout} must be in [0, 1)"),
            (0 <= m.attention_dropout < 1, f"--attention-dropout {m.attention_dropout} must be in [0, 1)"),
            (t.max_skipped_steps >= 0, f"--max-skipped-steps must be >= 0 (got {t.max_skipped_steps})"),
            (t.exit_interval is None or t.exit_interval >= 1, f"--exit-interval must be >= 1 (got {t.exit_interval})"),
            (
                t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
                f"--exit-duration-in-mins must be > 0 (got {t.exit_duration_in_mins})",
            ),
            (t.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0 (got {t.manual_gc_interval})"),
        ]
    )
