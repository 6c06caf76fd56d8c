"""Fused AdamW: the pick (apex on CUDA, else torch fused, else foreach), parity of fused with
foreach in the optimizer and in the plain and ZeRO engines, and one state dict format for all.

Tolerance: every parameter tensor within 1e-5 of its largest entry (max |fused - foreach| <=
1e-5 max |foreach|, as tests/test_parity.py's layouts). torch's fused kernel is not bitwise
foreach: it rounds the update differently, and the next step's gradients carry that on. Measured
here: the optimizer alone bitwise equal; the tiny model's fp32 weights after 2 steps 1.5e-8 apart
(3.9e-7 of the largest entry); in the bf16 ZeRO-1 run the bf16 weights were bitwise equal."""

import numpy as np
import pytest
import torch

from megatron_zpp import training
from megatron_zpp.config import OptimConfig
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.optim import optimizer as adamw
from megatron_zpp.optim.optimizer import MixedPrecisionAdamW, adamw_kind, build_adamw
from megatron_zpp.validation import validate
from tests.old_defaults import OLD_DEFAULTS


def assert_close_to_scale(a, b, tol=1e-5):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    err = (a - b).abs().max().item() / b.abs().max().item()
    assert err <= tol, f"max |fused - foreach| is {err:.2e} of the largest entry"


SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]  # decayed and not, odd sizes
CFG = OptimConfig(lr=3e-3, weight_decay=0.1)


def _steps(kind: str, n: int = 20):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt, name = build_adamw(params, [len(s) for s in SHAPES], CFG, kind)
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt, name


def test_the_pick_follows_device_and_dtype(monkeypatch):
    cpu = [torch.zeros(3), torch.zeros(2, 2)]
    assert adamw_kind(cpu) == "fused"  # torch 2.13 has fused AdamW on CPU
    assert adamw_kind([torch.zeros(3, device="meta")]) == "foreach"
    assert adamw_kind([torch.zeros(3, dtype=torch.int32)]) == "foreach"
    monkeypatch.setattr(adamw, "HAVE_APEX", True)
    assert adamw_kind(cpu) == "fused"  # apex only for CUDA tensors


def test_fused_equals_foreach_and_keeps_the_state_format():
    fused, opt_f, name_f = _steps("fused")
    foreach, opt_e, name_e = _steps("foreach")
    assert (name_f, name_e) == ("torch fused AdamW", "torch foreach AdamW")
    for a, b in zip(fused, foreach):
        assert_close_to_scale(a, b)
    sf, se = opt_f.state_dict(), opt_e.state_dict()
    assert sf["state"].keys() == se["state"].keys()
    for i, s in sf["state"].items():
        assert s.keys() == se["state"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in s.items():
            assert (v.dtype, v.shape, v.device) == (se["state"][i][k].dtype, se["state"][i][k].shape, v.device)
        assert s["step"].item() == 20
    assert [g.keys() for g in sf["param_groups"]] == [g.keys() for g in se["param_groups"]]


def test_a_foreach_state_resumes_bitwise_under_fused():
    """Load foreach's state after 10 steps into a fused optimizer: 10 more equal 20 straight."""
    straight, *_ = _steps("fused", 20)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    first, _ = build_adamw(params, [len(s) for s in SHAPES], CFG, "foreach")
    second, _ = build_adamw(params, [len(s) for s in SHAPES], CFG, "fused")
    g = torch.Generator().manual_seed(1)
    for i in range(20):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if i == 10:
            second.load_state_dict(first.state_dict())
        (first if i < 10 else second).step()
    for a, b in zip(params, straight):
        assert_close_to_scale(a, b)


def test_mixed_precision_masters_fused_equals_foreach(monkeypatch):
    results = {}
    for kind in ("fused", "foreach"):
        monkeypatch.setattr(adamw, "adamw_kind", lambda params, kind=kind: kind)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in SHAPES]
        opt = MixedPrecisionAdamW(params, CFG)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in params:
                p.main_grad = torch.randn(p.shape, generator=g)
            opt.step(CFG.lr)
        results[kind] = ([m.detach().clone() for m in opt.masters], opt.name)
    assert results["fused"][1] == "torch fused AdamW"
    for a, b in zip(results["fused"][0], results["foreach"][0]):
        assert_close_to_scale(a, b)


class _FakeApexAdam(torch.optim.Optimizer):
    """apex FusedAdam's bookkeeping (one step count per group, moments per parameter) over
    torch's functional AdamW: enough to test the state dict adapter without apex."""

    def __init__(self, params, lr, betas, eps, adam_w_mode=True, weight_decay=0.0):
        assert adam_w_mode
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                s = self.state[p]
                if not s:
                    s["exp_avg"], s["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                b1, b2 = group["betas"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                s["exp_avg"].lerp_(p.grad, 1 - b1)
                s["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                t = group["step"]
                denom = (s["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(s["exp_avg"], denom, value=-group["lr"] / (1 - b1**t))


def test_apex_state_dict_keeps_torch_format(monkeypatch):
    """The apex path saves per-parameter steps like torch and resumes from a torch state."""
    monkeypatch.setattr(adamw, "_ApexFusedAdam", _FakeApexAdam, raising=False)
    ref, opt_ref, _ = _steps("foreach", 20)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    apex_opt, name = build_adamw(params, [len(s) for s in SHAPES], CFG, "apex")
    assert name == "apex FusedAdam" and isinstance(apex_opt, _FakeApexAdam)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        apex_opt.step()
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # our fake's own arithmetic
    saved, want = apex_opt.state_dict(), opt_ref.state_dict()
    assert all("step" not in grp for grp in saved["param_groups"])
    for i, s in saved["state"].items():
        assert s.keys() == want["state"][i].keys() and s["step"].item() == 20
    assert "step" not in apex_opt.state[params[0]]  # the live state is untouched
    apex_opt.load_state_dict(want)  # a torch (foreach) state: the group counts come back
    assert [grp["step"] for grp in apex_opt.param_groups] == [20, 20]
    assert all("step" not in s for s in apex_opt.state.values())


TINY = (
    OLD_DEFAULTS
    + (
        "--mock-data --hidden-size 16 --ffn-hidden-size 64 --num-attention-heads 2 --seq-length 16 --vocab-size 64 "
        "--make-vocab-size-divisible-by 32 --num-layers 2 --global-batch-size 2 --lr 3e-3 --train-iters 2 --seed 5"
    ).split()
)


@pytest.mark.parametrize("engine", [["--zero-stage", "0"], ["--zero-stage", "1", "--bf16"]], ids=["plain", "zero1"])
def test_engines_step_fused_like_foreach(monkeypatch, engine):
    out = {}
    for kind in ("fused", "foreach"):
        monkeypatch.setattr(adamw, "adamw_kind", lambda params, kind=kind: kind)
        run = training.setup(validate(parse_args(TINY + engine), 1))
        losses = [h["loss"] for h in training.train(run)]
        weights = [w.detach().clone() for w in run.dp.model_state_dict().values()]  # fp32 masters
        out[kind] = losses, weights, run.dp.optimizer_name
    assert out["fused"][2] == "torch fused AdamW" and out["foreach"][2] == "torch foreach AdamW"
    np.testing.assert_allclose(out["fused"][0], out["foreach"][0], rtol=1e-6)
    for a, b in zip(out["fused"][1], out["foreach"][1]):
        assert_close_to_scale(a, b)
