"""AdamW on fp32 master weights, and the one rule for its parameter groups.

Weight decay applies to matrices (>= 2-D) only, not to norm weights and biases (Megatron's
rule: no decay for 1-D parameters and `*.bias`); with --apply-wd-to-qk-layernorm the query/key
norms decay too (`qk_norm_params`, Megatron's `q_layernorm.`/`k_layernorm.` names). AdamW
numbers its parameters by dimension, matrices first (`adamw_order`), which is also how a checkpoint's
optimizer state is indexed (checkpoint/layout.py reads it from here). The groups are the
runs of that numbering with one (decayed, decoupled) class: two groups (decayed, not)
without --decoupled-lr or --apply-wd-to-qk-layernorm; with them the word embedding and the untied
output layer (`decoupled_lr_params`, Megatron's is_embedding_or_output_parameter) and the
query/key norms get groups of their own, so the numbering, and every checkpoint, stays the same.
Each group says which rates it takes (`set_rates`): "decoupled" (the decoupled learning rate)
and "wd_mult" (1 or 0 times the scheduled weight decay), as Megatron's param groups do.

For an fp32 model the master weights are the parameters themselves. For bf16 the
optimizer keeps an fp32 copy of each parameter, steps it with the fp32 main gradient,
and writes the result back rounded to bf16 (Megatron's mixed-precision optimizer).

Which AdamW steps them (`new_adamw`, named in the start-up log): apex's FusedAdam when apex
is importable and the masters are on CUDA, else torch's fused AdamW (one kernel over all
tensors; CPU and CUDA, floating dtypes), else its foreach path. The choice depends only on
the masters' device and dtype, so a resumed run makes the same one; every path keeps
torch's state dict format (per-parameter step, exp_avg, exp_avg_sq)."""

from __future__ import annotations

import torch

from ..config import OptimConfig
from .schedules import Rates

try:  # optional GPU dependency (present in NGC images)
    from apex.optimizers import FusedAdam as _ApexFusedAdam

    HAVE_APEX = True
except Exception:  # noqa: BLE001  (ImportError, or apex built without its CUDA extension)
    HAVE_APEX = False

TORCH_FUSED_DEVICES = ("cpu", "cuda")  # torch's fused AdamW kernels, among the devices we run on


def adamw_order(ndims: list[int]) -> list[int]:
    """Indices of the parameters (by their ndim) in AdamW's numbering: decayed ones first."""
    return [i for i, n in enumerate(ndims) if n >= 2] + [i for i, n in enumerate(ndims) if n < 2]


def adamw_kind(params: list[torch.Tensor], allow_apex: bool = True) -> str:
    """The fastest AdamW that takes `params`: "apex", "fused" or "foreach" (the same on every call)."""
    if allow_apex and HAVE_APEX and params and all(p.is_cuda and p.dtype == torch.float32 for p in params):
        return "apex"
    if all(p.device.type in TORCH_FUSED_DEVICES and torch.is_floating_point(p) for p in params):
        return "fused"
    return "foreach"


ADAMW_NAMES = {"apex": "apex FusedAdam", "fused": "torch fused AdamW", "foreach": "torch foreach AdamW"}


def new_adamw(groups: list[dict], kind: str | None = None, **hyper) -> tuple[torch.optim.Optimizer, str]:
    """AdamW over param `groups` (the `kind` of `adamw_kind` unless given) and its name for the log."""
    params = [p for g in groups for p in g["params"]]
    kind = kind or adamw_kind(params)
    if kind == "apex":
        opt = apex_adamw_class(_ApexFusedAdam)(groups, adam_w_mode=True, **hyper)
    else:
        opt = torch.optim.AdamW(groups, **hyper, **({"fused": True} if kind == "fused" else {"foreach": True}))
    return opt, ADAMW_NAMES[kind]


def decoupled_lr_params(chunk) -> set[int]:
    """ids of the parameters of a model chunk that --decoupled-lr applies to (Megatron's
    is_embedding_or_output_parameter): the word embedding (also a tied copy on the last stage)
    and the untied output layer's weight."""
    parts = chunk.parts()
    mods = [parts.embedding, parts.output]
    return {id(m.weight) for m in mods if m is not None}


def qk_norm_params(chunk) -> set[int]:
    """ids of the parameters of a model chunk's query/key norms (--qk-layernorm), which
    --apply-wd-to-qk-layernorm decays (Megatron's names: `q_layernorm.`, `k_layernorm.`; ours: `q_norm.`, `k_norm.`)."""
    return {id(p) for name, p in chunk.named_parameters() if ".mixer.q_norm." in name or ".mixer.k_norm." in name}


def adamw_groups(
    params: list, ndims: list[int], decoupled: list[bool] | None = None, decayed_1d: list[bool] | None = None
) -> list[dict]:
    """`params` (with their model parameters' `ndims`, whether each is `decoupled`, whether a 1-D one
    decays all the same: `decayed_1d`) in AdamW's numbering, cut into runs of one class: {"params",
    "wd_mult", "decoupled"} each."""
    decoupled = decoupled or [False] * len(params)
    decayed_1d = decayed_1d or [False] * len(params)
    groups: list[dict] = []
    for i in adamw_order(ndims):
        kind = (1.0 if ndims[i] >= 2 or decayed_1d[i] else 0.0, bool(decoupled[i]))
        if not groups or (groups[-1]["wd_mult"], groups[-1]["decoupled"]) != kind:
            groups.append({"params": [], "wd_mult": kind[0], "decoupled": kind[1]})
        groups[-1]["params"].append(params[i])
    if not any(g["wd_mult"] for g in groups):  # the two groups of old (an empty one kept): same param_groups
        groups.insert(0, {"params": [], "wd_mult": 1.0, "decoupled": False})
    if all(g["wd_mult"] for g in groups):
        groups.append({"params": [], "wd_mult": 0.0, "decoupled": False})
    return groups


def build_adamw(
    params: list[torch.Tensor],
    ndims: list[int],
    cfg: OptimConfig,
    kind: str | None = None,
    decoupled: list[bool] | None = None,
    qk_norm: list[bool] | None = None,
) -> tuple[torch.optim.Optimizer, str]:
    """AdamW over fp32 `params` whose model parameters have `ndims` dimensions (`decoupled`: which
    take --decoupled-lr; `qk_norm`: which are query/key norms), and its name. The rates are the first
    step's until `set_rates`."""
    groups = adamw_groups(
        params,
        ndims,
        decoupled if cfg.decoupled_lr is not None else None,
        qk_norm if cfg.apply_wd_to_qk_layernorm else None,
    )
    wd = cfg.weight_decay_span()[0]
    for g in groups:
        decoupled_lr = g["decoupled"] and cfg.decoupled_lr is not None
        g.update(lr=cfg.decoupled_lr if decoupled_lr else cfg.lr, weight_decay=wd * g["wd_mult"])
    return new_adamw(groups, kind, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def apex_adamw_class(fused_adam: type) -> type:
    """apex's FusedAdam keeping torch's state dict format: apex counts steps per group
    (group["step"]), torch per parameter (state[i]["step"], what checkpoints store)."""

    class ApexAdamW(fused_adam):
        def state_dict(self) -> dict:
            sd = super().state_dict()
            state = dict(sd["state"])  # its per-parameter dicts are the live ones: copy, never edit
            for group in sd["param_groups"]:
                step = group.pop("step", 0)
                for i in group["params"]:
                    if i in state:
                        state[i] = {**state[i], "step": torch.tensor(float(step))}
            return {"state": state, "param_groups": sd["param_groups"]}

        def load_state_dict(self, sd: dict) -> None:
            state = {i: {k: v for k, v in s.items() if k != "step"} for i, s in sd["state"].items()}
            groups = []
            for group in sd["param_groups"]:
                steps = [sd["state"][i]["step"] for i in group["params"] if "step" in sd["state"].get(i, {})]
                groups.append({**group, **({"step": int(steps[0])} if steps else {})})
            super().load_state_dict({"state": state, "param_groups": groups})

    return ApexAdamW


def set_rates(optimizer: torch.optim.Optimizer, rates: Rates | float) -> None:
    """Each group's lr and weight decay for the next step: `rates.lr`, or `rates.decoupled_lr` for a
    decoupled group when given; `rates.weight_decay` times the group's wd_mult when given. A bare
    float sets every group's lr and leaves the weight decay."""
    if not isinstance(rates, Rates):
        rates = Rates(float(rates))
    for group in optimizer.param_groups:
        decoupled = group.get("decoupled") and rates.decoupled_lr is not None
        group["lr"] = rates.decoupled_lr if decoupled else rates.lr
        if rates.weight_decay is not None:
            group["weight_decay"] = rates.weight_decay * group.get("wd_mult", 1.0)


set_lr = set_rates  # the old name (a float: every group's lr)


class MixedPrecisionAdamW:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        cfg: OptimConfig,
        decoupled: set[int] = frozenset(),
        qk_norms: set[int] = frozenset(),
    ):
        """`decoupled`: ids of the parameters that take --decoupled-lr (`decoupled_lr_params`); `qk_norms`:
        of the query/key norms (`qk_norm_params`)."""
        self.params = [p for p in params if p.requires_grad]
        self.masters = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone()) for p in self.params
        ]
        flags = [id(p) in decoupled for p in self.params]
        qk = [id(p) in qk_norms for p in self.params]
        self.opt, self.name = build_adamw(self.masters, [p.ndim for p in self.params], cfg, decoupled=flags, qk_norm=qk)

    @torch.no_grad()
    def step(self, rates: Rates | float) -> None:
        set_rates(self.opt, rates)
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            m.grad = None
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
