"""The parallel layout: the grid against the world size, pipeline stages and their layers, ZeRO
(DeepSpeed's flags and ZeRO++) and what --torch-compile has been verified with."""

from __future__ import annotations

from ..config import Config
from .common import failed

# a week: far past any collective that still makes progress, and within what timedelta and the
# process-group backends take (timedelta overflows past ~1.4e12 minutes)
MAX_TIMEOUT_MINUTES = 7 * 24 * 60


def check_layout(cfg: Config, world_size: int) -> list[str]:
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    model_parallel = tp * pp * cp
    return failed(
        [
            (
                world_size % model_parallel == 0,
                f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
                f"--pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp} = {model_parallel}; "
                f"launch a multiple of {model_parallel} ranks or change the parallel sizes",
            ),
            (
                0 < p.distributed_timeout_minutes <= MAX_TIMEOUT_MINUTES,  # False for nan
                f"--distributed-timeout-minutes must be in (0, {MAX_TIMEOUT_MINUTES}] (a week; got "
                f"{p.distributed_timeout_minutes})",
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


def _check_megatron_split(cfg: Config) -> list[str]:
    """Megatron's spellings of the split that derive could not map (validation/__init__._derive_pipeline_split)."""
    m, p = cfg.model, cfg.parallel
    pp, virtual = p.pipeline_model_parallel_size, p.num_virtual_stages_per_pipeline_rank
    accounted = [
        flag
        for flag, on in [
            ("--account-for-embedding-in-pipeline-split", p.account_for_embedding_in_pipeline_split),
            ("--account-for-loss-in-pipeline-split", p.account_for_loss_in_pipeline_split),
        ]
        if on
    ]
    extra = len(accounted)
    # derive filled first/last from the accounting when it could: anything else was given by hand
    accounted_layers = (m.num_layers + extra) // pp - 1
    split_by_hand = any(
        given is not None and not (on and given == accounted_layers)
        for given, on in [
            (p.decoder_first_pipeline_num_layers, p.account_for_embedding_in_pipeline_split),
            (p.decoder_last_pipeline_num_layers, p.account_for_loss_in_pipeline_split),
        ]
    )
    vpp_mapped = virtual is not None and p.num_layers_per_virtual_pipeline_stage == m.num_layers // (
        pp * max(virtual, 1)
    )
    return failed(
        [
            (virtual is None or virtual >= 1, f"--num-virtual-stages-per-pipeline-rank {virtual}: give at least 1"),
            (
                virtual is None or virtual < 1 or m.num_layers % (pp * virtual) == 0,
                f"--num-layers {m.num_layers} is not divisible by PP x --num-virtual-stages-per-pipeline-rank "
                f"= {pp} x {virtual}",
            ),
            (
                virtual is None or virtual < 1 or m.num_layers % (pp * virtual) != 0 or vpp_mapped,
                "give one of --num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage",
            ),
            (
                not accounted or pp == 1 or (p.num_layers_per_virtual_pipeline_stage is None and not split_by_hand),
                f"{' and '.join(accounted)}: not built with interleaving or with --decoder-first/last-pipeline-num-"
                "layers (give the stages' layers by hand instead)",
            ),
            (
                not accounted or pp == 1 or (m.num_layers + extra) % pp == 0,
                f"{' and '.join(accounted)}: --num-layers {m.num_layers} + {extra} is not divisible by PP {pp}",
            ),
        ]
    )


def check_pipeline(cfg: Config, world_size: int) -> list[str]:
    m, p = cfg.model, cfg.parallel
    split_errors = _check_megatron_split(cfg)
    if split_errors:
        return split_errors
    pp, vpp = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if vpp is not None:
        return failed(
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
        return failed(
            [
                (pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1"),
                (
                    rest >= 0 and (rest % free == 0 if free else rest == 0),
                    f"--num-layers {m.num_layers} minus first/last stage layers ({fixed}) does not split evenly over "
                    f"the other {free} stages",
                ),
            ]
        )
    return failed(
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


def check_zero(cfg: Config, world_size: int) -> list[str]:
    z = cfg.zero
    return failed(
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
        ]
    ) + _check_zeropp(cfg)


def _check_zeropp(cfg: Config) -> list[str]:
    """ZeRO++ (qwZ, hpZ, qgZ) and the hierarchy: ZeRO-3 only, their block sizes, hpZ and the tiers dividing the
    ZeRO group."""
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
    return failed(
        [
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


def check_compile(cfg: Config, world_size: int) -> list[str]:
    """--torch-compile: what has been verified to compose with it (the block's collectives and the
    per-TP-rank dropout stream run inside the compiled code under TP/CP, and are not verified there).
    Any --kernels composes: each Triton kernel is a custom op (ops/dispatch.kernel_op) that the compiled
    graph calls as it is (tests/kernels/test_torch_compile.py: compiled equals eager on the kernels)."""
    if not cfg.train.torch_compile:
        return []
    p, m = cfg.parallel, cfg.model
    why = "collectives inside the compiled blocks are not verified (the byte ledger could miss them)"
    return failed(
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
