"""The MoE layer against transformers' sparse MoE blocks (Qwen3-MoE with and without top-k renormalisation,
Mixtral, Qwen3-Next with its gated shared expert) on the same weights, fp32 within 1e-6, forward and
gradients; permutation and capacity dropping against megatron-core's moe_utils functions."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils as mcore
from transformers import MixtralConfig, Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from megatron_zpp.moe.config import MoEConfig
from megatron_zpp.moe.layer import MoELayer
from megatron_zpp.moe.permute import drop_tokens, permute, unpermute
from megatron_zpp.moe.router import topk_routing

E, H, F, K = 8, 16, 12, 2


def _hf_block(family: str, norm_topk: bool = True):
    common = dict(hidden_size=H, num_experts_per_tok=K, hidden_act="silu")
    if family == "qwen3_moe":
        return Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(num_experts=E, moe_intermediate_size=F, norm_topk_prob=norm_topk, **common)
        )
    if family == "mixtral":
        return MixtralSparseMoeBlock(MixtralConfig(num_local_experts=E, intermediate_size=F, **common))
    cfg = Qwen3NextConfig(num_experts=E, moe_intermediate_size=F, shared_expert_intermediate_size=20, **common)
    return Qwen3NextSparseMoeBlock(cfg)


def _ours_from(hf, family: str, norm_topk: bool = True) -> MoELayer:
    shared = family == "qwen3_next"
    cfg = MoEConfig(
        num_experts=E, hidden_size=H, ffn_hidden_size=F, topk=K, pre_softmax=not norm_topk,
        shared_expert_size=20 if shared else None, shared_expert_gate=shared,
    )  # fmt: skip
    ours = MoELayer(cfg)
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        for e in range(E):
            ours.experts.fc1[str(e)].copy_(hf.experts.gate_up_proj[e].T)  # [2F, H] -> [H, 2F]
            ours.experts.fc2[str(e)].copy_(hf.experts.down_proj[e].T)  # [H, F] -> [F, H]
        if shared:
            se = hf.shared_expert
            ours.shared_expert.fc1.weight.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
            ours.shared_expert.fc2.weight.copy_(se.down_proj.weight)
            ours.shared_expert.gate.weight.copy_(hf.shared_expert_gate.weight)
    return ours


@pytest.mark.parametrize(
    "family,norm_topk", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True), ("qwen3_next", True)]
)
def test_layer_equals_transformers(family, norm_topk):
    torch.manual_seed(0)
    hf = _hf_block(family, norm_topk)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = _ours_from(hf, family, norm_topk)
    x = torch.randn(2, 24, H)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = hf(x_hf)
    out, losses = ours(x_ours)
    assert losses == {}  # no coefficients set
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    out.backward(dy)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.router.weight.grad, hf.gate.weight.grad, rtol=1e-5, atol=1e-6)
    fc2_grad = torch.stack([ours.experts.fc2[str(e)].grad for e in range(E)])
    torch.testing.assert_close(fc2_grad, hf.experts.down_proj.grad.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_probs_before_the_activation_fails_by_orders_of_magnitude():
    """The bug the ordering guards against: scaling an expert's input by its probability (instead of its
    output) changes the result far beyond the tolerance of the test above."""
    torch.manual_seed(1)
    hf = _hf_block("qwen3_moe")
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = _ours_from(hf, "qwen3_moe")
    x = torch.randn(2, 24, H)
    with torch.no_grad():
        ref, good = hf(x), ours(x)[0]
        routing = ours.router(x)
        permuted, perm = permute(x.reshape(-1, H), routing.probs, routing.routing_map, K)
        y = ours.experts(permuted * perm.probs.unsqueeze(-1), perm.tokens_per_expert)
        perm.probs = torch.ones_like(perm.probs)
        bad = unpermute(y, perm, x.dtype).view_as(x)
    good_err, bad_err = (good - ref).abs().max().item(), (bad - ref).abs().max().item()
    assert good_err < 1e-6 and bad_err > 1e-2 * ref.abs().max().item(), (good_err, bad_err)


def _routed(n=40, seed=0, topk=K):
    logits = torch.randn(n, E, generator=torch.Generator().manual_seed(seed))
    return topk_routing(logits, MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F, topk=topk))


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5, 100.0])
def test_capacity_dropping_equals_megatron_core(capacity_factor, pad):
    probs, routing_map = _routed()
    ours = drop_tokens(probs, routing_map, K, capacity_factor, pad)
    ref = mcore.apply_router_token_dropping(probs, routing_map, K, capacity_factor, "probs", pad)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    if pad:  # the padding rows (probability 0) are torch.topk's unspecified pick there, the lowest tokens here
        assert torch.equal(ours[1] & (probs > 0), ref[1] & (probs > 0))
        assert torch.equal(ours[1].sum(0), ref[1].sum(0))
    else:
        assert torch.equal(ours[1], ref[1])
    cap = mcore.get_capacity(40 * K, E, capacity_factor)
    if cap <= 40:  # something is dropped (or padded): each expert holds at most (with padding, exactly) cap
        assert (ours[1].sum(0) == cap).all() if pad else (ours[1].sum(0) <= cap).all()
    if capacity_factor == 0.5 and not pad:
        assert ours[1].sum() <= 40 * K // 2  # half the routed copies at most survive


@pytest.mark.parametrize("drop", ["dropless", "dropped", "padded"])
def test_permute_unpermute_equal_megatron_core(drop):
    probs, routing_map = _routed(topk=3)
    num_out = 120
    if drop != "dropless":
        probs, routing_map = drop_tokens(probs, routing_map, 3, 0.5, pad_to_capacity=drop == "padded")
        num_out = int(routing_map.sum())
    x = torch.randn(40, H)
    pad = drop == "padded"
    for n in (num_out, None):  # given (no host sync) or counted
        permuted, perm = permute(x, probs, routing_map, 3, n)
        ref, ref_probs, ref_index, _, _ = mcore.permute(x, routing_map, probs, num_out_tokens=num_out, drop_and_pad=pad)
        assert torch.equal(permuted, ref) and torch.equal(perm.token_index, ref_index)
        assert torch.equal(perm.probs, ref_probs) and torch.equal(perm.tokens_per_expert, routing_map.sum(0))
    y = torch.randn_like(permuted)
    expected = mcore.unpermute(y, ref_index, x.shape, probs=probs, routing_map=routing_map, drop_and_pad=pad)
    torch.testing.assert_close(unpermute(y, perm, torch.float32), expected, rtol=1e-6, atol=1e-6)


def test_losses_reach_the_router():
    cfg = MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F, aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    layer = MoELayer(cfg)
    out, losses = layer(torch.randn(2, 8, H))
    assert set(losses) == {"load_balancing_loss", "z_loss"}
    (out.sum() * 0 + sum(losses.values())).backward()
    assert layer.router.weight.grad.abs().sum() > 0 and all(p.grad.abs().sum() == 0 for p in layer.experts.fc1.values())


def test_layer_on_the_triton_kernels_equals_transformers():
    """The same layer with its grouped GEMMs (and SwiGLU) on the Triton kernels (the CPU interpreter)."""
    from megatron_zpp.ops import dispatch

    torch.manual_seed(2)
    hf = _hf_block("qwen3_moe")
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = _ours_from(hf, "qwen3_moe")
    x = torch.randn(1, 16, H)
    dispatch.set_kernels("triton", torch.device("cpu"))
    try:
        out = ours(x)[0]
    finally:
        dispatch.set_kernels("auto", torch.device("cpu"))
    torch.testing.assert_close(out, hf(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, dict(capacity_factor=1.0, pad_to_capacity=True)], ids=["dropless", "padded"])
def test_layer_step_under_fake_tensor_mode(kw):
    """Shapes only (the memory estimator's and the dry run's way): no host sync on the kernel path, dropless
    or padded to capacity; forward and backward reach every parameter."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_zpp.ops import dispatch

    dispatch.set_kernels("triton", torch.device("cpu"))
    try:
        with FakeTensorMode():
            layer = MoELayer(MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F, aux_loss_coeff=0.01, **kw))
            out, losses = layer(torch.randn(2, 8, H))
            (out.sum() + sum(losses.values())).backward()
    finally:
        dispatch.set_kernels("auto", torch.device("cpu"))
    assert out.shape == (2, 8, H) and all(p.grad.shape == p.shape for p in layer.parameters())


def test_capacity_ties_keep_the_lower_token():
    """Equal probabilities at the capacity boundary: the lower token index stays (every layout drops alike)."""
    probs = torch.zeros(6, 2)
    probs[:, 0] = torch.tensor([0.5, 0.7, 0.5, 0.5, 0.9, 0.5])
    routing_map = probs > 0
    _, kept = drop_tokens(probs, routing_map, topk=1, capacity_factor=1.0)  # capacity ceil(6 / 2) = 3
    assert kept[:, 0].nonzero().flatten().tolist() == [0, 1, 4]


def test_bf16_layer_on_the_kernels_is_close_to_fp32():
    """bf16 activations and experts on the Triton kernels (router in fp32) against the fp32 layer: the bf16
    rounding of inputs, weights and outputs, no more."""
    from megatron_zpp.ops import dispatch

    torch.manual_seed(3)
    cfg = MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F, shared_expert_size=20, shared_expert_gate=True)
    fp32 = MoELayer(cfg, init_std=0.3, out_std=0.3)
    bf16 = MoELayer(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in bf16.named_parameters():
            p.copy_(dict(fp32.named_parameters())[name])
    x = torch.randn(2, 16, H)
    dispatch.set_kernels("triton", torch.device("cpu"))
    try:
        out = bf16(x.bfloat16())[0]
    finally:
        dispatch.set_kernels("auto", torch.device("cpu"))
    ref = fp32(x.bfloat16().float())[0]
    assert out.dtype == torch.bfloat16
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err


def test_parameters_are_named_by_global_expert_and_marked():
    """The names the converters and the init rely on, and the marks the init, the finalize and the
    checkpoints read (the expert weights split over ETP, reduced over the expert-data-parallel group)."""
    cfg = MoEConfig(
        num_experts=E, hidden_size=H, ffn_hidden_size=F, shared_expert_size=20, shared_expert_gate=True,
        score_function="sigmoid", enable_expert_bias=True,
    )  # fmt: skip
    layer = MoELayer(cfg, init_std=0.01, out_std=0.005)
    params = dict(layer.named_parameters())
    experts = {f"experts.fc{i}.{e}" for i in (1, 2) for e in range(E)}
    shared = {f"shared_expert.{n}.weight" for n in ("fc1", "fc2", "gate")}
    assert set(params) == {"router.weight"} | experts | shared
    assert "router.expert_bias" in dict(layer.named_buffers())
    assert params["experts.fc1.5"].shape == (H, 2 * F) and params["experts.fc1.5"].tp_split == (1, (F, F))
    assert params["experts.fc2.5"].shape == (F, H) and params["experts.fc2.5"].tp_split == (0, (F,))
    assert params["experts.fc2.5"].init == ("normal", 0.005) and params["experts.fc1.0"].init == ("normal", 0.01)
    assert all(getattr(p, "expert_parallel", False) == (n in experts) for n, p in params.items())
    assert params["router.weight"].init == ("normal", 0.01) and params["shared_expert.fc1.weight"].tp_split == (
        0, (20, 20),
    )  # fmt: skip


def test_layouts_the_experts_cannot_split_are_refused_by_flag():
    from megatron_zpp.topology import Group, ParallelContext

    cfg = MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F)
    three, two = Group("ep", (0, 1, 2), 0, "intra_node"), Group("etp", (0, 1), 0, "intra_node")
    with pytest.raises(ValueError, match="--num-experts 8 is not divisible by --expert-model-parallel-size 3"):
        MoELayer(cfg, ParallelContext(ep=three))
    odd = MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=13)
    with pytest.raises(
        ValueError, match="--moe-ffn-hidden-size 13 is not divisible by --expert-tensor-parallel-size 2"
    ):
        MoELayer(odd, ParallelContext(etp=two))
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        MoELayer(cfg, ParallelContext(tp=two))
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type flex"):
        MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F, token_dispatcher="flex")
    assert MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F).token_dispatcher == "allgather"  # mcore's
