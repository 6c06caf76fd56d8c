"""What one MoE layer needs to know, in megatron-core's terms (the names follow its `--moe-*` flags).
The model config will fill it from the flags once they are wired; until then the flags stay refused by
megatron_flags.py and this dataclass is built directly (tests, the later EP work)."""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
ACTIVATIONS = ("swiglu", "gelu")
DISPATCHERS = ("allgather", "alltoall")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # --num-experts
    hidden_size: int
    ffn_hidden_size: int  # --moe-ffn-hidden-size (one expert's width)
    topk: int = 2  # --moe-router-topk
    score_function: str = "softmax"  # --moe-router-score-function
    pre_softmax: bool = False  # --moe-router-pre-softmax: softmax over all experts, then top-k (no renorm); as
    # megatron-core, it has no effect with sigmoid scores (DeepSeek-V3's scripts pass both)
    topk_scaling_factor: float | None = None  # --moe-router-topk-scaling-factor
    num_groups: int | None = None  # --moe-router-num-groups (device-limited routing)
    group_topk: int | None = None  # --moe-router-group-topk
    enable_expert_bias: bool = False  # --moe-router-enable-expert-bias (aux-loss-free balancing)
    bias_update_rate: float = 1e-3  # --moe-router-bias-update-rate
    load_balancing_type: str = "aux_loss"  # --moe-router-load-balancing-type
    aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff
    z_loss_coeff: float | None = None  # --moe-z-loss-coeff
    capacity_factor: float | None = None  # --moe-expert-capacity-factor (None: no dropping)
    pad_to_capacity: bool = False  # --moe-pad-expert-input-to-capacity
    activation: str = "swiglu"  # swiglu (--swiglu) or gelu
    shared_expert_size: int | None = None  # --moe-shared-expert-intermediate-size
    shared_expert_gate: bool = False  # --moe-shared-expert-gate (Qwen3-Next's sigmoid gate)
    token_dispatcher: str = "allgather"  # --moe-token-dispatcher-type (megatron-core's default: allgather)
    grouped_gemm: bool = True  # --moe-grouped-gemm: one grouped GEMM over the local experts, else a GEMM each

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise ValueError(f"MoEConfig: {problem}")


def _problem(c: MoEConfig) -> str | None:
    """The first inconsistency, in one line naming the flag, else None."""
    if c.num_experts < 1 or not 1 <= c.topk <= c.num_experts:
        return f"--moe-router-topk {c.topk} must lie in 1..--num-experts ({c.num_experts})"
    if c.score_function not in SCORE_FUNCTIONS:
        return f"--moe-router-score-function {c.score_function}: expected one of {', '.join(SCORE_FUNCTIONS)}"
    if c.load_balancing_type not in LOAD_BALANCING:
        return f"--moe-router-load-balancing-type {c.load_balancing_type}: expected one of {', '.join(LOAD_BALANCING)}"
    if c.activation not in ACTIVATIONS:
        return f"activation {c.activation}: an expert is swiglu or gelu"
    if (c.num_groups is None) != (c.group_topk is None):
        return "--moe-router-num-groups and --moe-router-group-topk go together"
    if c.num_groups is not None and c.group_topk is not None:
        if c.num_experts % c.num_groups or not 1 <= c.group_topk <= c.num_groups or c.topk % c.group_topk:
            return (
                f"--moe-router-num-groups {c.num_groups} must divide --num-experts {c.num_experts}, "
                f"and --moe-router-group-topk {c.group_topk} must lie in 1..num_groups and divide --moe-router-topk"
            )
    if c.enable_expert_bias and c.score_function != "sigmoid":
        return "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as megatron-core)"
    if c.topk == 1 and c.score_function == "softmax" and not c.pre_softmax:
        return "--moe-router-topk 1 with softmax needs --moe-router-pre-softmax (a softmax over one score is 1)"
    if c.capacity_factor is not None and c.capacity_factor <= 0:
        return f"--moe-expert-capacity-factor {c.capacity_factor} must be positive"
    if c.pad_to_capacity and c.capacity_factor is None:
        return "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"
    if c.token_dispatcher not in DISPATCHERS:
        return (
            f"--moe-token-dispatcher-type {c.token_dispatcher}: expected one of {', '.join(DISPATCHERS)} "
            "(flex needs DeepEP, not available here)"
        )
    if c.shared_expert_gate and not c.shared_expert_size:
        return "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"
    return None


def from_model_config(m) -> MoEConfig:
    """The MoE layer's settings from the model config's --num-experts / --moe-* fields (config/moe.py)."""
    return MoEConfig(
        num_experts=m.num_experts,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.expert_ffn_size,
        topk=m.moe_router_topk,
        score_function=m.moe_router_score_function,
        pre_softmax=m.moe_router_pre_softmax,
        topk_scaling_factor=m.moe_router_topk_scaling_factor,
        num_groups=m.moe_router_num_groups,
        group_topk=m.moe_router_group_topk,
        enable_expert_bias=m.moe_router_enable_expert_bias,
        bias_update_rate=m.moe_router_bias_update_rate,
        load_balancing_type=m.moe_router_load_balancing_type,
        aux_loss_coeff=m.moe_aux_loss_coeff,
        z_loss_coeff=m.moe_z_loss_coeff,
        capacity_factor=m.moe_expert_capacity_factor,
        pad_to_capacity=m.moe_pad_expert_input_to_capacity,
        activation="swiglu" if m.activation == "swiglu" else "gelu",
        shared_expert_size=m.moe_shared_expert_intermediate_size,
        shared_expert_gate=m.moe_shared_expert_gate,
        token_dispatcher=m.moe_token_dispatcher_type,
        grouped_gemm=m.moe_grouped_gemm,
    )


def config_problem(m) -> str | None:
    """The first inconsistency of the model config's MoE fields as the layer sees them, in one line."""
    try:
        from_model_config(m)
    except ValueError as e:
        return str(e).removeprefix("MoEConfig: ")
    return None
