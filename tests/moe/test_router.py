"""The router against megatron-core's own routing and loss functions (moe_utils: pure torch, they run on
CPU as they are) and transformers' Qwen3-MoE and Mixtral routers on the same weights.

Shim: megatron-core's `get_updated_expert_bias` all-reduces the counts over the TP x DP x CP group; the
test passes a group of one by replacing `torch.distributed.all_reduce` with the identity for that call."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils as mcore
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from megatron_zpp.moe.config import MoEConfig
from megatron_zpp.moe.router import TopKRouter, seq_aux_loss, stable_topk, topk_routing

E, H = 8, 16


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=8, **kw)


def _logits(n=64, seed=0):
    return torch.randn(n, E, generator=torch.Generator().manual_seed(seed))


CASES = [
    dict(score_function="softmax"),
    dict(score_function="softmax", pre_softmax=True, topk=3),
    dict(score_function="softmax", topk=4, num_groups=4, group_topk=2),
    dict(score_function="sigmoid", topk=3, topk_scaling_factor=2.5),
    dict(score_function="sigmoid", topk=1),
    dict(score_function="sigmoid", topk=4, num_groups=4, group_topk=2, enable_expert_bias=True),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_routing_equals_megatron_core(kw):
    cfg, logits = _cfg(**kw), _logits()
    bias = torch.linspace(-0.3, 0.3, E) if cfg.enable_expert_bias else None
    probs, routing_map = topk_routing(logits, cfg, bias)
    ref_probs, ref_map = mcore.topk_routing_with_score_function(
        logits,
        cfg.topk,
        use_pre_softmax=cfg.pre_softmax,
        num_groups=cfg.num_groups,
        group_topk=cfg.group_topk,
        scaling_factor=cfg.topk_scaling_factor,
        score_function=cfg.score_function,
        expert_bias=bias,
    )
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_losses_equal_megatron_core(score_function):
    cfg = _cfg(score_function=score_function, topk=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    router = TopKRouter(cfg)
    x = torch.randn(3, 10, H, generator=torch.Generator().manual_seed(1))
    losses = router(x).losses
    logits = torch.nn.functional.linear(x.reshape(-1, H), router.weight)
    ref_map, ref_scores = mcore.compute_routing_scores_for_aux_loss(logits, cfg.topk, score_function)
    ref_aux = mcore.switch_load_balancing_loss_func(ref_scores, ref_map.sum(0), 30, cfg.topk, E, 0.01)
    torch.testing.assert_close(losses["load_balancing_loss"], ref_aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(losses["z_loss"], mcore.z_loss_func(logits, 1e-3), rtol=1e-6, atol=0)

    # seq_aux_loss: megatron-core's tokens are [S, B] (sequence-major); ours [B, T]. Its recipe: fold
    # the batch into the expert dim, one switch loss with topk * B in the token count, divided by B.
    s_logits = logits.view(3, 10, E).transpose(0, 1).reshape(-1, E)
    s_map, s_scores = mcore.compute_routing_scores_for_aux_loss(s_logits, cfg.topk, score_function)
    ref_seq = (
        mcore.switch_load_balancing_loss_func(
            s_scores.reshape(10, -1), s_map.reshape(10, -1).sum(0), 10, cfg.topk, E, 0.01
        )
        / 3
    )
    scores, routing_map = ref_scores, ref_map  # ours, batch-major, from the same logits
    torch.testing.assert_close(seq_aux_loss(scores, routing_map, 3, cfg.topk, 0.01), ref_seq, rtol=1e-6, atol=0)
    seq_router = TopKRouter(
        _cfg(score_function=score_function, aux_loss_coeff=0.01, load_balancing_type="seq_aux_loss")
    )
    seq_router.load_state_dict(router.state_dict())
    torch.testing.assert_close(seq_router(x).losses["seq_load_balancing_loss"], ref_seq, rtol=1e-6, atol=0)


def test_expert_bias_update_equals_megatron_core(monkeypatch):
    router = TopKRouter(_cfg(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01))
    router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    x = torch.randn(4, 16, H, generator=torch.Generator().manual_seed(2))
    maps = [router(x[i : i + 2]).routing_map for i in (0, 2)]  # two micro-batches accumulate
    counts = (maps[0].sum(0) + maps[1].sum(0)).float()
    assert torch.equal(router.local_tokens_per_expert, counts)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: t)  # a group of one
    expected = mcore.get_updated_expert_bias(counts.clone(), router.expert_bias.clone(), 0.01, tp_dp_cp_group=object())
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, expected, rtol=0, atol=0)
    assert not router.local_tokens_per_expert.any()
    with torch.no_grad():  # evaluation does not count
        router(x)
    assert not router.local_tokens_per_expert.any()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_equals_transformers(family):
    torch.manual_seed(3)
    if family == "qwen3_moe":
        hf = Qwen3MoeTopKRouter(
            Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, norm_topk_prob=True)
        )
    else:
        hf = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2))
    torch.nn.init.normal_(hf.weight)
    ours = TopKRouter(_cfg(topk=2))
    ours.weight.data.copy_(hf.weight.data)
    x = torch.randn(2, 12, H)
    _, hf_weights, hf_index = hf(x)
    routing = ours(x)
    expected = torch.zeros(24, E).scatter(1, hf_index, hf_weights)
    torch.testing.assert_close(routing.probs, expected, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert():
    scores = torch.tensor([[0.5, 0.9, 0.9, 0.9, 0.1, 0.9]])
    assert stable_topk(scores, 3)[1].tolist() == [[1, 2, 3]]
    # all equal logits: every token, any order of tokens, picks experts 0..k-1
    cfg = _cfg(topk=4, score_function="sigmoid", num_groups=4, group_topk=2)
    _, routing_map = topk_routing(torch.zeros(5, E), cfg)
    assert routing_map.nonzero()[:, 1].view(5, 4).tolist() == [[0, 1, 2, 3]] * 5
    # a tie-break never reorders distinct fp32 scores, however close
    close = torch.tensor([[1.0, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()]])
    assert stable_topk(close, 1)[1].item() == 1


def test_sigmoid_without_renormalisation_fails_by_orders_of_magnitude():
    cfg, logits = _cfg(score_function="sigmoid", topk=3), _logits()
    ref, _ = mcore.topk_routing_with_score_function(logits, 3, score_function="sigmoid")
    ours, _ = topk_routing(logits, cfg)
    buggy = torch.zeros_like(logits).scatter(1, stable_topk(torch.sigmoid(logits), 3)[1], 1) * torch.sigmoid(logits)
    good, bad = (ours - ref).abs().max().item(), (buggy - ref).abs().max().item()
    assert good < 1e-6 and bad > 1e-2, (good, bad)


def test_bad_config_is_one_line():
    with pytest.raises(ValueError, match="--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"):
        _cfg(enable_expert_bias=True)
    with pytest.raises(ValueError, match="--moe-router-topk 9 must lie in 1..--num-experts"):
        _cfg(topk=9)
    with pytest.raises(ValueError, match="--moe-router-topk 1 with softmax needs --moe-router-pre-softmax"):
        _cfg(topk=1)  # megatron-core refuses it too: the probabilities would be 1, their gradient 0
