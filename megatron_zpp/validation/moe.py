"""Mixture of experts: the routing settings, the expert grid against the ranks, and the Megatron MoE options
not built here. One line each, in the first pass."""

from __future__ import annotations

from ..config import Config
from ..config.fields import ConfigError
from ..config.moe import moe_layer_pattern
from ..moe.config import config_problem
from .common import failed


def check_moe(cfg: Config, world_size: int) -> list[str]:
    m, p = cfg.model, cfg.parallel
    ep, etp, tp = p.expert_model_parallel_size, p.expert_tp_size, p.tensor_model_parallel_size
    if not m.num_experts:
        return failed(
            [
                (ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts (the model has no experts)"),
                (p.expert_tensor_parallel_size is None, "--expert-tensor-parallel-size needs --num-experts"),
            ]
        )
    try:
        moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    except ConfigError as e:
        return [str(e)]
    stage = world_size // max(p.pipeline_model_parallel_size, 1)
    problem = config_problem(m)
    return ([problem] if problem else []) + failed(
        [
            (ep >= 1 and etp >= 1, "--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1"),
            (
                m.num_experts % max(ep, 1) == 0,
                f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}",
            ),
            (
                stage % max(ep * etp, 1) == 0,
                f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} does not divide "
                f"the {stage} ranks of a pipeline stage (TP x CP x DP), which hold the experts",
            ),
            (
                m.expert_ffn_size % max(etp, 1) == 0,
                f"--moe-ffn-hidden-size {m.expert_ffn_size} is not divisible by --expert-tensor-parallel-size {etp}",
            ),
            (
                tp == 1 or p.sequence_parallel,
                f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel (as Megatron: each "
                "TP rank routes its own sequence shard)",
            ),
            (
                m.moe_expert_capacity_factor is None or m.moe_token_dispatcher_type == "alltoall",
                "--moe-expert-capacity-factor needs --moe-token-dispatcher-type alltoall (as Megatron)",
            ),
            (
                m.moe_token_dispatcher_type != "flex",
                "--moe-token-dispatcher-type flex (DeepEP) is not built: use alltoall or allgather",
            ),
            (m.moe_router_dtype != "fp64", "--moe-router-dtype fp64 is not built (the router computes in fp32)"),
            (
                m.moe_token_drop_policy == "probs",
                "--moe-token-drop-policy position is not built: drop it (probs, Megatron's default)",
            ),
            (
                m.activation in ("swiglu", "gelu"),
                f"--activation {m.activation}: an expert is swiglu or gelu here",
            ),
        ]
    )
