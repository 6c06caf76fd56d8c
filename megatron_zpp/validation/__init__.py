"""Validation: the values that follow from others, then every setting checked against the others
and the world size, before any process group exists. Each problem is one line naming the flags
to change (ConfigError lists them all). What depends on the node layout is checked with the
topology (topology.check_node_layout).

One module per section: parallel.py (grid, pipeline, ZeRO, compile), model.py, train.py (batches,
optimizer, precision, run control), checkpoint.py, data.py, log.py; this one derives the values
and runs them all.
"""

from __future__ import annotations

import dataclasses
import math

from ..config import SECTIONS, Config, ConfigError, default_linear_chunk_size
from ..config.batch_schedule import parse_step_schedule
from ..data.tokenizer import infer_tokenizer_type
from .checkpoint import check_checkpointing, check_load
from .common import failed, launch_device_type
from .data import check_data, check_run_paths
from .log import check_device_needs, check_log
from .model import check_gdn_heads, check_megatron_model, check_model, check_recompute
from .moe import check_moe
from .parallel import check_compile, check_layout, check_pipeline, check_zero, chunk_layer_counts
from .train import check_batch, check_optim, check_precision, check_run_control

__all__ = ["chunk_layer_counts", "derive", "launch_env", "validate"]


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


def validate(cfg: Config, world_size: int, run: bool = True) -> Config:
    """Fill derived values, then check every setting against each other and the world size.

    run=False (the planning tools: tools/estimate_memory.py, tools/simulate_scaling.py) skips the
    checks of what only a run reads or writes: data, tokenizer files, checkpoint directories
    (check_run_paths, check_load). Raises ConfigError listing every problem, each naming the flags to change.
    """
    errors = _check_numbers(cfg) or _check_sizes(cfg)
    if errors:  # the checks below divide by these sizes (and cast nan or 1e20 to int); --load's needs none
        raise ConfigError("\n".join(errors + (check_load(cfg) if run else [])))
    derive(cfg, world_size)
    for check in (
        check_layout,
        check_model,
        check_gdn_heads,
        check_moe,
        check_pipeline,
        check_recompute,
        check_batch,
        check_checkpointing,
        check_compile,
        check_optim,
        check_data,
        check_zero,
        check_log,
        check_megatron_model,
        check_precision,
        check_run_control,
    ):
        errors += check(cfg, world_size)
    if run:
        errors += check_run_paths(cfg) + check_load(cfg) + check_device_needs(cfg, launch_device_type(cfg.train.device))
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def derive(cfg: Config, world_size: int) -> None:
    """The values that follow from others: world and data-parallel sizes, defaults that
    depend on other settings."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    p.world_size, p.data_parallel_size = world_size, max(world_size // model_parallel, 1)
    _derive_pipeline_split(cfg)
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.linear_chunk_size is None:  # by the device the run will use (--device auto: CUDA when available)
        m.linear_chunk_size = default_linear_chunk_size(launch_device_type(t.device))
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


def _derive_pipeline_split(cfg: Config) -> None:
    """Megatron's other spellings of a split, as ours (check_pipeline refuses what they cannot say):
    virtual stages per rank -> layers per virtual stage; the embedding / the loss counted as a layer of the
    first / last stage -> that stage's layer count."""
    p, layers = cfg.parallel, cfg.model.num_layers
    pp, virtual = p.pipeline_model_parallel_size, p.num_virtual_stages_per_pipeline_rank
    if virtual and virtual >= 1 and p.num_layers_per_virtual_pipeline_stage is None and layers % (pp * virtual) == 0:
        p.num_layers_per_virtual_pipeline_stage = layers // (pp * virtual)
    embedding, loss = p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split
    explicit = p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None
    if pp == 1 or not (embedding or loss) or explicit or p.num_layers_per_virtual_pipeline_stage is not None:
        return
    if (layers + embedding + loss) % pp == 0:
        per_stage = (layers + embedding + loss) // pp
        if embedding:
            p.decoder_first_pipeline_num_layers = per_stage - 1
        if loss:
            p.decoder_last_pipeline_num_layers = per_stage - 1


INT64 = 1 << 63
# lower bounds of the numbers no section check bounds: (section, field) -> (bound, bound allowed)
LOWER_BOUNDS = {
    ("model", "ffn_hidden_size"): (1, True),
    ("model", "linear_chunk_size"): (1, True),
    ("model", "make_vocab_size_divisible_by"): (1, True),
    ("model", "norm_epsilon"): (0, False),
    ("model", "init_method_std"): (0, True),
    ("model", "rotary_base"): (0, False),
    ("model", "gla_gate_normalizer"): (0, False),
    ("log", "peak_tflops"): (0, False),
    ("train", "generate_tokens"): (0, True),
}


def _check_numbers(cfg: Config) -> list[str]:
    """Every number of every section finite (a float) or within 64 bits (an int), then the lower
    bounds above: before anything computes with them (timedelta, int(), tensor shapes)."""
    errors = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            value, flag = getattr(getattr(cfg, section), f.name), f.metadata.get("flag", f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            low, inclusive = LOWER_BOUNDS.get((section, f.name), (None, True))
            if isinstance(value, float) and not math.isfinite(value):
                errors.append(f"{flag} {value} must be a finite number")
            elif isinstance(value, int) and not -INT64 <= value < INT64:
                errors.append(f"{flag} {value} is past the 64-bit integer range")
            elif low is not None and (value < low or (value == low and not inclusive)):
                errors.append(f"{flag} {value} must be {'>=' if inclusive else '>'} {low}")
    return errors


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
    ] + failed(
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
