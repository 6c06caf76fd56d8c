"""Our MoE layer against megatron-core's own `MoELayer` (its local spec: SequentialMLP experts, the
allgather dispatcher, SharedExpertMLP with its gate) on the same weights, fp32: output and gradients.

Shims, all in `_mcore_layer`: megatron-core asks `torch.cuda.current_device()` for its buffers (patched to
'cpu'); its process groups are stand-ins of size one (which its reductions and gathers bypass) and its
`get_tensor_model_parallel_group_if_none` passes them through (it returns None without torch.distributed).
The aux losses are not compared here (tests/moe/test_megatron_router.py does)."""

import contextlib
import importlib
import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_zpp.moe.config import MoEConfig
from megatron_zpp.moe.layer import MoELayer

E, H, FF, S, B = 8, 16, 12, 10, 2
PATCHED = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
)


class _GroupOfOne:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@contextlib.contextmanager
def _mcore_shims():
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
        for name in PATCHED:
            module = importlib.import_module(name)
            if hasattr(module, "get_tensor_model_parallel_group_if_none"):
                passthrough = mock.patch.object(module, "get_tensor_model_parallel_group_if_none", lambda g, *a, **k: g)
                stack.enter_context(passthrough)
        yield


def _mcore_layer(cfg: MoEConfig):
    swiglu = cfg.activation == "swiglu"
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, add_bias_linear=False, use_cpu_initialization=True,
        num_moe_experts=E, moe_ffn_hidden_size=FF, ffn_hidden_size=FF, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu, moe_router_topk=cfg.topk,
        moe_router_score_function=cfg.score_function, moe_router_num_groups=cfg.num_groups,
        moe_router_group_topk=cfg.group_topk, moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
        moe_expert_capacity_factor=cfg.capacity_factor, moe_pad_expert_input_to_capacity=cfg.pad_to_capacity,
        moe_shared_expert_intermediate_size=cfg.shared_expert_size, moe_shared_expert_gate=cfg.shared_expert_gate,
    )  # fmt: skip
    group = _GroupOfOne()
    pgs = types.SimpleNamespace(
        **{k: group for k in ("tp", "cp", "tp_cp", "tp_dp_cp", "ep", "expt_tp", "expt_dp", "tp_ep")}
    )
    return get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=tcfg, pg_collection=pgs)


def _copy_weights(ours: MoELayer, ref) -> None:
    with torch.no_grad():
        ref.router.weight.copy_(ours.router.weight)
        for i, expert in enumerate(ref.experts.local_experts):
            expert.linear_fc1.weight.copy_(ours.experts.fc1[str(i)].T)  # ours x @ W [H, 2F]; theirs [2F, H]
            expert.linear_fc2.weight.copy_(ours.experts.fc2[str(i)].T)
        if ours.shared_expert is not None:
            ref.shared_experts.linear_fc1.weight.copy_(ours.shared_expert.fc1.weight)
            ref.shared_experts.linear_fc2.weight.copy_(ours.shared_expert.fc2.weight)
            if ours.shared_expert.gate is not None:
                ref.shared_experts.gate_weight.copy_(ours.shared_expert.gate.weight)


CASES = [
    dict(topk=2, shared_expert_size=20, shared_expert_gate=True),
    dict(topk=2, activation="gelu", shared_expert_size=20),
    dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2, capacity_factor=1.0),
    dict(topk=2, capacity_factor=0.5),
    dict(topk=2, capacity_factor=0.5, pad_to_capacity=True),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_layer_equals_megatron_core_moe_layer(kw):
    torch.manual_seed(0)
    ours = MoELayer(MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=FF, **kw), init_std=0.3, out_std=0.3)
    x = torch.randn(B, S, H)
    x_ours, x_ref = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    with _mcore_shims():
        ref = _mcore_layer(ours.cfg)
        _copy_weights(ours, ref)
        ref_out, _ = ref(x_ref)  # [S, B, H]
        dy = torch.randn_like(ref_out)
        ref_out.backward(dy)
    out, _ = ours(x_ours)
    out.backward(dy.transpose(0, 1))
    torch.testing.assert_close(out, ref_out.transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_ours.grad, x_ref.grad.transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.router.weight.grad, ref.router.weight.grad, rtol=1e-5, atol=1e-6)
    ref_fc1 = torch.stack([e.linear_fc1.weight.grad.T for e in ref.experts.local_experts])
    ours_fc1 = torch.stack([ours.experts.fc1[str(i)].grad for i in range(E)])
    torch.testing.assert_close(ours_fc1, ref_fc1, rtol=1e-5, atol=1e-6)
