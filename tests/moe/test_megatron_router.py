"""Our router against megatron-core's own `TopKRouter` module (not only its functions): the same weights
and input give the same probabilities and map, the same balancing and z losses, and the same gradient of
the router weight through the probabilities plus the losses.

Shims, all in `_mcore_router` and nothing else: megatron-core allocates its buffers on
`torch.cuda.current_device()` and moves the gate weight there (patched to 'cpu'); its process groups are
stand-ins of size one (`size() == 1`, which its reductions bypass) in place of a ProcessGroupCollection,
and `get_tensor_model_parallel_group_if_none` passes them through (it returns None without
torch.distributed); it attaches each loss to the probabilities' gradient (MoEAuxLossAutoScaler, scale 1),
which we also wrap to read the loss values."""

import types
from unittest import mock

import pytest
import torch
from megatron.core.transformer.moe import router as mcore_router
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_zpp.moe.config import MoEConfig
from megatron_zpp.moe.router import TopKRouter

E, H, S, B = 8, 16, 12, 3


class _GroupOfOne:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _mcore_router(cfg: MoEConfig, recorded: list):
    class Recording(MoEAuxLossAutoScaler):
        @staticmethod
        def forward(ctx, output, aux_loss):
            recorded.append(aux_loss.detach().clone())
            return MoEAuxLossAutoScaler.forward(ctx, output, aux_loss)

    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, add_bias_linear=False, num_moe_experts=E,
        moe_router_topk=cfg.topk, moe_router_score_function=cfg.score_function,
        moe_router_pre_softmax=cfg.pre_softmax, moe_router_topk_scaling_factor=cfg.topk_scaling_factor,
        moe_router_num_groups=cfg.num_groups, moe_router_group_topk=cfg.group_topk,
        moe_router_enable_expert_bias=cfg.enable_expert_bias, moe_router_load_balancing_type=cfg.load_balancing_type,
        moe_aux_loss_coeff=cfg.aux_loss_coeff, moe_z_loss_coeff=cfg.z_loss_coeff, moe_router_dtype="fp32",
    )  # fmt: skip
    group = _GroupOfOne()
    patches = [
        mock.patch("torch.cuda.current_device", lambda: "cpu"),
        mock.patch(
            "megatron.core.tensor_parallel.mappings.get_tensor_model_parallel_group_if_none", lambda g, *a, **k: g
        ),
        mock.patch.object(mcore_router, "MoEAuxLossAutoScaler", Recording),
    ]
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    pgs = types.SimpleNamespace(tp=group, cp=group, tp_cp=group, tp_dp_cp=group)
    return tcfg, pgs, patches


CASES = [
    dict(score_function="softmax", aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    dict(score_function="softmax", pre_softmax=True, topk=3, aux_loss_coeff=1e-2, load_balancing_type="seq_aux_loss"),
    dict(score_function="sigmoid", topk=4, num_groups=4, group_topk=2, topk_scaling_factor=2.5, aux_loss_coeff=1e-2),
    dict(score_function="sigmoid", topk=2, enable_expert_bias=True, load_balancing_type="none", z_loss_coeff=1e-3),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_router_equals_megatron_core_topk_router(kw):
    cfg = MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=8, **kw)
    recorded: list[torch.Tensor] = []
    tcfg, pgs, patches = _mcore_router(cfg, recorded)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0))
    cot = torch.randn(B * S, E, generator=torch.Generator().manual_seed(1))
    ours = TopKRouter(cfg)
    with patches[0], patches[1], patches[2]:
        ref = mcore_router.TopKRouter(tcfg, pg_collection=pgs)
        with torch.no_grad():
            ref.weight.copy_(ours.weight)
            if cfg.enable_expert_bias:
                bias = torch.linspace(-0.2, 0.2, E)
                ref.expert_bias.copy_(bias)
                ours.expert_bias.copy_(bias)
        ref_probs, ref_map = ref(x.transpose(0, 1).contiguous())  # megatron-core's tokens are [S, B]: sequence-major
    to_batch_major = torch.arange(S * B).view(S, B).T.reshape(-1)
    ref_probs, ref_map = ref_probs[to_batch_major], ref_map[to_batch_major]
    routing = ours(x)
    assert torch.equal(routing.routing_map, ref_map)
    torch.testing.assert_close(routing.probs, ref_probs, rtol=1e-6, atol=1e-7)
    # the losses: megatron-core attaches z_loss (to the logits) first, then the balancing loss
    assert len(recorded) == len(routing.losses)
    for got, expected in zip(sorted(routing.losses.items(), key=lambda kv: kv[0] != "z_loss"), recorded):
        torch.testing.assert_close(got[1], expected, rtol=1e-6, atol=0, msg=got[0])
    (ref_probs * cot).sum().backward()
    ((routing.probs * cot).sum() + sum(routing.losses.values(), torch.zeros(()))).backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    if cfg.enable_expert_bias:
        torch.testing.assert_close(ours.local_tokens_per_expert, ref.local_tokens_per_expert, rtol=0, atol=0)
