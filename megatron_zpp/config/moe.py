"""The mixture-of-experts fields of ModelConfig, Megatron-LM's `--num-experts` / `--moe-*` flags with its
defaults, and the one reading of `--moe-layer-freq`. ModelConfig inherits them (config/model.py); the MoE
layer reads them through `moe.config.from_model_config`. Torch-free, imports nothing of ours but fields.py."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .fields import ConfigError, opt


@dataclass
class MoEFields:
    num_experts: int | None = opt(
        None, "--num-experts", "routed experts per MoE layer (None: every feed-forward network is a dense MLP)"
    )
    moe_ffn_hidden_size: int | None = opt(
        None, "--moe-ffn-hidden-size", "one routed expert's inner width (default --ffn-hidden-size, as Megatron)"
    )
    moe_router_topk: int = opt(2, "--moe-router-topk", "experts each token is routed to")
    moe_router_score_function: str = opt(
        "softmax",
        "--moe-router-score-function",
        "softmax: top-k of the logits, then a softmax over the k (pre-softmax: over all experts first); sigmoid: "
        "top-k of sigmoid(logits), renormalised when k > 1 (DeepSeek-V3, Kimi)",
        choices=["softmax", "sigmoid"],
    )
    moe_router_pre_softmax: bool = opt(
        False,
        "--moe-router-pre-softmax",
        "softmax over all experts before the top-k (no renormalisation); no effect with sigmoid scores, as Megatron",
    )
    moe_router_topk_scaling_factor: float | None = opt(
        None, "--moe-router-topk-scaling-factor", "multiply the chosen experts' probabilities by this"
    )
    moe_router_num_groups: int | None = opt(
        None, "--moe-router-num-groups", "device-limited routing: experts fall into this many groups"
    )
    moe_router_group_topk: int | None = opt(
        None, "--moe-router-group-topk", "device-limited routing: each token picks its top-k within this many groups"
    )
    moe_router_enable_expert_bias: bool = opt(
        False,
        "--moe-router-enable-expert-bias",
        "aux-loss-free balancing: a per-expert bias added to the scores for the selection only, moved after each "
        "step by --moe-router-bias-update-rate x sign(mean load - load), the loads summed over the stage's ranks",
    )
    moe_router_bias_update_rate: float = opt(1e-3, "--moe-router-bias-update-rate", "step of the expert-bias update")
    moe_router_load_balancing_type: str = opt(
        "aux_loss",
        "--moe-router-load-balancing-type",
        "aux_loss (GShard/Switch over the micro-batch), seq_aux_loss (per sequence, DeepSeek-V2) or none",
        choices=["aux_loss", "seq_aux_loss", "none"],
    )
    moe_aux_loss_coeff: float = opt(0.0, "--moe-aux-loss-coeff", "weight of the load-balancing loss")
    moe_z_loss_coeff: float | None = opt(None, "--moe-z-loss-coeff", "weight of the router z-loss (ST-MoE)")
    moe_router_dtype: str | None = opt(
        None,
        "--moe-router-dtype",
        "the router computes its logits, scores and losses in fp32 whatever the flag (fp32 and unset alike); fp64 "
        "is not built",
        choices=["fp32", "fp64"],
    )
    moe_shared_expert_intermediate_size: int | None = opt(
        None,
        "--moe-shared-expert-intermediate-size",
        "a dense shared expert of this width beside the routed ones (tensor-parallel like the dense MLP)",
    )
    moe_shared_expert_gate: bool = opt(
        False, "--moe-shared-expert-gate", "scale the shared expert's output by sigmoid(x w), Qwen3-Next's gate"
    )
    moe_layer_freq: str = opt(
        "1",
        "--moe-layer-freq",
        "which layers are MoE: N = every N-th layer from the first (0, N, 2N, ...), or Megatron's list pattern, one "
        "1 (MoE) or 0 (dense) per layer, e.g. '([0]*1+[1]*3)*2'",
    )
    moe_expert_capacity_factor: float | None = opt(
        None,
        "--moe-expert-capacity-factor",
        "token dropping: an expert takes at most factor x tokens x topk / experts of a rank's tokens, keeping the "
        "highest probabilities (None: dropless); with the alltoall dispatcher, as Megatron",
    )
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "--moe-pad-expert-input-to-capacity", "pad every expert's input to its capacity (static shapes)"
    )
    moe_token_drop_policy: str = opt(
        "probs",
        "--moe-token-drop-policy",
        "which tokens an over-capacity expert drops: probs (lowest probability first); position is not built",
        choices=["probs", "position"],
    )
    moe_token_dispatcher_type: str = opt(
        "allgather",
        "--moe-token-dispatcher-type",
        "how tokens reach the experts over expert parallelism: allgather (Megatron's default: every rank gathers "
        "the group's tokens and keeps those routed to its experts) or alltoall (each token sent only where routed, "
        "counts exchanged first); flex is not built",
        choices=["allgather", "alltoall", "flex"],
    )
    moe_grouped_gemm: bool = opt(
        False,
        "--moe-grouped-gemm",
        "the local experts as one grouped GEMM (our Triton kernel on CUDA); without it a loop of one GEMM per "
        "expert (Megatron's SequentialMLP). Equal results",
    )
    moe_layer_recompute: bool = opt(
        False, "--moe-layer-recompute", "recompute each MoE layer in the backward instead of keeping its activations"
    )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer`'s feed-forward network is a mixture of experts."""
        if not self.num_experts:
            return False
        return bool(moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer])  # type: ignore[attr-defined]

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size  # type: ignore[attr-defined]


def moe_layer_pattern(freq: str | int, num_layers: int) -> list[int]:
    """--moe-layer-freq as one 0/1 per layer: an integer N (layers 0, N, 2N, ... are MoE) or Megatron's list
    expression (integers, lists, + and *). ConfigError names the flag when it is neither or has the wrong length."""
    text = str(freq).strip()
    try:
        value = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        raise ConfigError(
            f"--moe-layer-freq {text!r}: expected an integer or a list pattern such as '([0]*1+[1]*3)*2'"
        ) from None
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"--moe-layer-freq {value} must be >= 1")
        return [int(i % value == 0) for i in range(num_layers)]
    if len(value) != num_layers or any(v not in (0, 1) for v in value):
        raise ConfigError(
            f"--moe-layer-freq {text!r} gives {len(value)} entries for --num-layers {num_layers}; it needs one 0 "
            "(dense) or 1 (MoE) per layer"
        )
    return value


def _list_expression(node: ast.AST):
    """An integer or a list of integers from +, * and literals only (no eval)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        lists = isinstance(left, list) + isinstance(right, list)
        if isinstance(node.op, ast.Add) and lists != 1:
            return left + right
        if isinstance(node.op, ast.Mult) and lists < 2:
            return left * right
    raise ValueError("not a list pattern")
