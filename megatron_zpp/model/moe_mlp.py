"""The feed-forward network of a block as a mixture of experts (--num-experts, --moe-layer-freq): the MoE
layer (moe/layer.py) under this model's flags, with its router losses joined to the training loss.

The router's losses (load balancing, z-loss) are made per MoE layer, on whatever pipeline stage holds it. As
megatron-core does, their gradient is attached to the layer's output instead of travelling to the loss:
`_AttachLoss` passes the output through unchanged and, in the backward, gives the loss the gradient a
micro-batch's language-model loss gets (1 / micro-batches, times the fp16 loss scale: `aux_loss_scale`, set
by the schedule). Each rank's loss is its share of the micro-batch's (summed over TP x CP it is the
micro-batch's own, moe/router.py); the data-parallel mean divides every gradient by DP x CP, so a CP rank's
share is counted CP times, as its language-model loss (a mean over its own slice) is.

Each layer also keeps, over a step's micro-batches, its losses (detached) and the router's token counts;
`moe_step` (after the optimizer step) sums the counts over the stage's ranks, moves the expert bias
(aux-loss-free balancing) and returns what the log line and the metrics show."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import comm
from ..config import ModelConfig
from ..moe.config import from_model_config
from ..moe.layer import MoELayer
from ..recompute import checkpoint, recomputing
from ..topology import ParallelContext

_SCALE = [1.0]  # the backward scale of a micro-batch's loss (aux_loss_scale)


@contextlib.contextmanager
def aux_loss_scale(scale: float):
    """Inside: the router losses' gradient is `scale` (the schedule's 1 / micro-batches x loss scale)."""
    before, _SCALE[0] = _SCALE[0], scale
    try:
        yield
    finally:
        _SCALE[0] = before


class _AttachLoss(torch.autograd.Function):
    """y unchanged; the backward also gives `loss` the gradient `scale` (megatron-core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.loss_shape = scale, loss.shape
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.loss_shape, ctx.scale, device=grad.device), None


class MoEMLP(MoELayer):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelContext, out_std: float):
        super().__init__(from_model_config(cfg), ctx, cfg.init_method_std, out_std)
        self.layer = layer  # its global index: the metrics name it
        self.cp_size, self.recompute = ctx.cp_size, cfg.moe_layer_recompute
        self.coeffs = {
            "load_balancing_loss": cfg.moe_aux_loss_coeff,
            "seq_load_balancing_loss": cfg.moe_aux_loss_coeff,
            "z_loss": cfg.moe_z_loss_coeff or 0.0,
        }
        self.step_losses: dict[str, torch.Tensor] = {}  # summed over the step's micro-batches, detached

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.recompute and self.training:
            y, losses = checkpoint(super().forward, x)
        else:
            y, losses = super().forward(x)
        if not losses:
            return y
        if torch.is_grad_enabled():
            y = _AttachLoss.apply(y, sum(losses.values()), _SCALE[0] * self.cp_size)
        if self.training and not recomputing():
            for name, value in losses.items():
                self.step_losses[name] = self.step_losses.get(name, 0.0) + value.detach().float()
        return y


def moe_layers(chunks) -> list[MoEMLP]:
    return [m for c in chunks for m in c.modules() if isinstance(m, MoEMLP)]


LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def moe_step(chunks, groups, num_micro_batches: int, num_layers: int) -> dict[str, float]:
    """After a step (collective, alike on every rank of a model with experts): each MoE layer's token counts
    summed over the stage's ranks move its expert bias (when enabled) and are reset; returns the metrics of
    the step: per layer the fewest and most tokens an expert received (`moe/expert_load_min/layer{i}`,
    `.../max/...`), the routes the capacity dropped (`moe/dropped_fraction`), and each router loss without its
    coefficient, averaged over the micro-batches, the
    data-parallel ranks and the MoE layers (`load_balancing_loss`, `z_loss`: Megatron's log names)."""
    layers = moe_layers(chunks)
    device = next(p.device for c in chunks for p in c.parameters())
    # by global layer: fewest, most and mean tokens per expert, the losses, then routes and routes kept (capacity)
    table = torch.zeros(num_layers, 5 + len(LOSS_NAMES), dtype=torch.float64, device=device)
    if layers:  # every rank of the stage holds the same layers: they reduce together
        counts = torch.stack([m.router.local_tokens_per_expert.double() for m in layers])
        values = torch.zeros(len(layers), len(LOSS_NAMES), dtype=torch.float64, device=device)
        for i, m in enumerate(layers):
            for j, name in enumerate(LOSS_NAMES):
                if name in m.step_losses and m.coeffs[name]:
                    values[i, j] = m.step_losses[name].double() / m.coeffs[name]
            m.step_losses.clear()
        none = torch.zeros(2, dtype=torch.float64, device=device)
        routes = torch.stack([none if m.route_counts is None else m.route_counts for m in layers])
        summed = torch.cat([counts, values, routes], dim=1)
        comm.all_reduce(summed, groups.tp_dp_cp, "moe_expert_load")
        e = counts.shape[1]
        counts, values, routes = summed[:, :e], summed[:, e : e + len(LOSS_NAMES)], summed[:, e + len(LOSS_NAMES) :]
        for i, m in enumerate(layers):
            if m.router.expert_bias is not None:
                m.router.update_expert_bias(counts[i])
            m.router.local_tokens_per_expert.zero_()
            table[m.layer, :3] = torch.stack([counts[i].min(), counts[i].max(), counts[i].mean()])
            table[m.layer, 3 : 3 + len(LOSS_NAMES)] = values[i] / (num_micro_batches * groups.dp.size)
            table[m.layer, 3 + len(LOSS_NAMES) :] = routes[i]
            m.route_counts = None
    comm.all_reduce(table, groups.pp, "moe_metrics")
    if is_fake(table):  # a dry run (fake tensors): the collectives ran, there are no values to report
        return {}
    return _metrics(table.cpu())


def _metrics(table: torch.Tensor) -> dict[str, float]:
    moe = table[:, 2] > 0  # the MoE layers (their experts received tokens)
    out: dict[str, float] = {}
    for j, name in enumerate(LOSS_NAMES):
        column = table[moe, 3 + j]
        if bool((column != 0).any()):
            out["load_balancing_loss" if name.endswith("load_balancing_loss") else name] = float(column.mean())
    for layer in moe.nonzero().flatten().tolist():
        out[f"moe/expert_load_min/layer{layer}"] = float(table[layer, 0])
        out[f"moe/expert_load_max/layer{layer}"] = float(table[layer, 1])
    if bool(moe.any()):  # the worst layer's busiest expert against an even share
        out["moe/expert_load_max_over_mean"] = float((table[moe, 1] / table[moe, 2]).max())
    routes, kept = table[:, -2].sum(), table[:, -1].sum()
    if routes > 0:  # --moe-expert-capacity-factor: the routes the capacity dropped, over every MoE layer
        out["moe/dropped_fraction"] = float(1 - kept / routes)
    return out
