"""The memory estimator against measured peaks: the peak live tensor bytes of a second training step
(LiveBytes, entered before the model is built) within 10% of megatron_zpp.planning.memory's estimate, for a
GLA+softmax and a GDN+softmax model without recompute (and GDN with grouped value heads, K != V), with selective
and with full recompute on one rank, a 2-rank ZeRO-3 + hpZ run with selective recompute and a GDN hybrid at CP2
(both ranks checked), and two mixture-of-experts layouts: one rank (8 experts, top-2, a gated shared expert,
balancing and z losses) and EP2 alltoall under ZeRO-1 over 2 ranks (both ranks: their routed rows are the
router's, the estimate's an even share).
bench/memory.py runs the full matrix of layouts and recompute modes at a larger size."""

import math

import pytest

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.planning import live_bytes, memory
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

TOLERANCE = 0.10
BASE = (
    OLD_DEFAULTS
    + (
        "--mock-data --hidden-size 64 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --seq-length 128 --vocab-size 256 "
        "--make-vocab-size-divisible-by 32 --gla-chunk-size 32 --micro-batch-size 4 --num-layers 2 --train-iters 2 "
        "--lr 1e-3 --seed 3 --attention-type gla --softmax-attention-every 2"
    ).split()
)
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()


def _measure(rank, world_size, flags):
    from bench.memory import estimated, measure  # the bench's measurement: test and table count alike

    argv = BASE + flags + ["--global-batch-size", str(4 * world_size // _tp(flags))]
    result = measure(argv, world_size)
    return {**result, "estimate": estimated(argv, world_size, result["stage"], result["cp"])}


def _tp(flags) -> int:
    return int(flags[flags.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in flags else 1


def _check(result, what):
    ratio = result["estimate"] / result["measured"]
    assert abs(ratio - 1) <= TOLERANCE, f"{what}: estimate {result['estimate']} vs measured {result['measured']}"


@pytest.mark.parametrize("mixer", ["gla", "gdn"])
@pytest.mark.parametrize("flags", [[], ["--recompute-granularity", "selective"], FULL], ids=["none", "sel", "full"])
def test_single_rank_estimate_matches_measured_peak(flags, mixer):
    _check(_measure(0, 1, flags + ["--attention-type", mixer]), f"single rank {mixer} {flags}")


def test_gdn_grouped_heads_estimate_matches_measured_peak():
    """GDN with Megatron's head layout scaled down: 2 key heads of K = 16 under 4 value heads of V = 32 (the
    estimate reads the shape: value heads, K and V apart; its fitted constants are K = V's)."""
    heads = "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 16 --linear-value-head-dim 32"
    _check(_measure(0, 1, ["--attention-type", "gdn", *heads.split()]), "single rank GDN, grouped heads, K != V")


def test_zero3_hpz_two_ranks_estimate_matches_measured_peak():
    flags = ["--zero-stage", "3", "--zero-hpz-partition-size", "2", "--recompute-granularity", "selective"]
    for r, result in enumerate(run_distributed(_measure, 2, flags, timeout=300)):
        _check(result, f"rank {r} of zero3 hpZ")


def _measure_each(rank, world_size, flag_sets):
    return [_measure(rank, world_size, flags) for flags in flag_sets]


def test_gdn_context_parallel_estimate_matches_measured_peak():
    """A GDN hybrid at CP2, All-Scan without recompute and the all-gather with selective recompute (its local
    pass on V + K columns, U, M and every rank's transitions): both ranks within the tolerance."""
    gdn = ["--attention-type", "gdn", "--context-parallel-size", "2"]
    flag_sets = [gdn, gdn + ["--cp-algo", "all-gather", "--recompute-granularity", "selective"]]
    for r, results in enumerate(run_distributed(_measure_each, 2, flag_sets, timeout=300)):
        for flags, result in zip(flag_sets, results):
            _check(result, f"rank {r} of {flags}")


MOE = (
    "--num-experts 8 --moe-ffn-hidden-size 48 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001"
).split()


def test_moe_single_rank_estimate_matches_measured_peak():
    flags = MOE + "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate".split()
    _check(_measure(0, 1, flags), "single rank MoE with a gated shared expert")


def test_moe_expert_parallel_estimate_matches_measured_peak():
    flags = MOE + "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --zero-stage 1".split()
    for r, result in enumerate(run_distributed(_measure, 2, flags, timeout=300)):
        _check(result, f"rank {r} of MoE EP2 alltoall ZeRO-1")


def test_experts_split_over_ep_and_etp_and_shard_over_their_replicas():
    """16 ranks, TP2 (SP) x DP8, 16 experts over EP4 x expert TP2: a rank's meta model holds 4 experts at half
    width (3 h F / 2 each, SwiGLU); ZeRO-3 shards them over the 2 expert-data-parallel ranks, the rest over DP 8."""
    flags = (
        BASE
        + MOE[2:]
        + (
            "--num-experts 16 --expert-model-parallel-size 4 --tensor-model-parallel-size 2 --sequence-parallel "
            "--global-batch-size 32"
        ).split()
    )
    cfg = validate(parse_args(flags + ["--zero-stage", "3"]), 16)
    h, f = cfg.model.hidden_size, 48
    chunks = memory.stage_model(cfg, 0)
    experts = sum(p.numel() for c in chunks for p in c.parameters() if getattr(p, "expert_parallel", False))
    assert experts == cfg.model.num_layers * 4 * 3 * h * f // 2
    dense = sum(p.numel() for c in chunks for p in c.parameters()) - experts
    adam = memory.estimate(cfg)[0].terms["AdamW exp_avg + exp_avg_sq (fp32)"]
    # each of the 6 units (embedding, 2 blocks, their 2 expert units, head) pads its shard by less than a block
    block = math.lcm(cfg.zero.zero_quantization_block_size, cfg.zero.zero_gradient_quantization_block_size)
    assert 8 * (dense / 8 + experts / 2) <= adam < 8 * (dense / 8 + experts / 2 + 6 * block)
    plain = validate(parse_args(flags), 16)  # no ZeRO: the rank's whole share, unpadded
    assert memory.estimate(plain)[0].terms["AdamW exp_avg + exp_avg_sq (fp32)"] == 8 * (dense + experts)


def test_moe_rows_follow_imbalance_capacity_and_padding():
    """The rows an MoE layer's experts run on the busiest rank: an even share n k x expert TP times the imbalance,
    capped by the capacity factor, and exactly E x capacity with padding; the peak grows with the imbalance."""
    from megatron_zpp.planning.moe_memory import moe_dims

    base = (
        BASE + MOE + "--global-batch-size 8 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall".split()
    )
    cfg = validate(parse_args(base), 2)
    b, s, k, E = 4, 128, 2, 8
    even = moe_dims(cfg, b, s, s, 4)
    assert (even.sent, even.run, even.local) == (b * s * k, b * s * k, E // 2)
    assert moe_dims(cfg, b, s, s, 4, imbalance=1.5).run == 1.5 * b * s * k
    capped = validate(parse_args(base + ["--moe-expert-capacity-factor", "1.25"]), 2)
    assert moe_dims(capped, b, s, s, 4, imbalance=3.0).run == 1.25 * b * s * k
    padded = validate(
        parse_args(base + "--moe-expert-capacity-factor 1.1 --moe-pad-expert-input-to-capacity".split()), 2
    )
    cap = math.ceil(b * s * k / E * 1.1)
    assert moe_dims(padded, b, s, s, 4, imbalance=3.0).run == E * cap  # padded: exact, whatever the routing
    assert memory.estimate(cfg, moe_imbalance=1.5)[0].peak > memory.estimate(cfg)[0].peak


def test_estimate_counts_parameters_exactly_and_shards_with_zero():
    """The meta-device count equals the built model's; ZeRO-3 over 4 ranks keeps a quarter of the
    fp32 state (padding aside) and the micro-batch search is monotone in the budget."""
    from megatron_zpp.model import count_parameters

    cfg = validate(parse_args(BASE + ["--global-batch-size", "4"]), 1)
    chunks = memory.stage_model(cfg, 0)
    n = sum(p.numel() for c in chunks for p in c.parameters())
    assert n == sum(count_parameters(c, 1) for c in chunks)
    plain = memory.estimate(cfg)[0].terms
    assert plain["parameters"] == 4 * n and plain["AdamW exp_avg + exp_avg_sq (fp32)"] == 8 * n
    z3 = validate(parse_args(BASE + ["--global-batch-size", "16", "--zero-stage", "3"]), 4)
    adam = memory.estimate(z3)[0].terms["AdamW exp_avg + exp_avg_sq (fp32)"]
    assert 8 * n / 4 <= adam <= 1.2 * 8 * n / 4
    small = memory.largest_micro_batch(cfg, 2**28)
    assert 1 <= small <= memory.largest_micro_batch(cfg, 2**30)


def test_fake_live_bytes_counts_what_the_dispatch_mode_counts():
    """FakeLiveBytes (the dry run's meter: a counter on FakeTensorMode.dispatch, no dispatch mode)
    sees the bytes LiveBytes sees, and both the hand count: a 4 KiB input, a 16 KiB matmul output, a view and an
    in-place op (nothing new), a storage resized to 0 and refilled, a tensor freed."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run(meter):
        trace = []
        with FakeTensorMode(), meter() as live:
            x = torch.empty(32, 32)  # 4 KiB
            y = x @ torch.empty(32, 128)  # + 16 KiB (+ the 16 KiB right operand while it lives)
            trace.append(live.live)
            y.view(-1).mul_(2)
            trace.append(live.live)
            y.untyped_storage().resize_(0)
            trace.append(live.live)
            y.untyped_storage().resize_(128 * 32 * 4)
            del x
            trace.append(live.live)
            return trace, live.peak

    expected = ([20480, 20480, 4096, 16384], 36864)
    assert run(live_bytes.LiveBytes) == expected
    assert run(live_bytes.FakeLiveBytes) == expected
