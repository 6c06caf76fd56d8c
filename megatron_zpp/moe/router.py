"""The top-k router, megatron-core's `TopKRouter` semantics, computed in fp32.

Scores: softmax (top-k on the logits, then a softmax over the k: megatron-core's default, equal to
transformers' softmax-then-top-k-then-renormalise; with `pre_softmax` a softmax over all experts then
top-k, not renormalised) or sigmoid (top-k of sigmoid(logits), optionally chosen on scores + expert
bias, the chosen scores renormalised to sum 1 when k > 1), then times `topk_scaling_factor`.
Device-limited routing picks `group_topk` groups of experts by the sum of each group's best
topk/group_topk scores, then top-k inside them.

Selection is deterministic: equal scores go to the lower expert index (a stable descending sort, not
torch.topk, whose order among ties is unspecified), so every layout and device routes alike.

Losses (returned, not attached to the activations: the caller adds them to the loss):
aux_loss    coeff * E / (k T^2) * sum_i (sum_t P_ti) (tokens routed to i), P the scores over all
            experts (softmax, or sigmoid normalised per token), the routing the plain top-k of P
seq_aux_loss the same per sequence, averaged over the batch
z_loss      coeff * mean_t logsumexp(logits_t)^2
Under sequence and context parallelism (the `tp_cp` group: each member holds distinct tokens of the same
sequences) each rank returns its piece of each loss, the token counts summed over the group first (fixed-size
all-reduces, megatron-core's reduction of tokens_per_expert over tp_cp): the pieces sum over the group to the
loss of the whole micro-batch on one rank.
The aux-loss-free expert bias counts the tokens each expert received while training;
`update_expert_bias()` (the optimizer step's call) moves b_i += rate * sign(mean load - load_i)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..recompute import recomputing
from ..tensor_parallel.layers import mark
from ..topology import Group
from .config import MoEConfig


@dataclass
class Routing:
    probs: torch.Tensor  # [N, E] fp32, zero where not routed
    routing_map: torch.Tensor  # [N, E] bool
    losses: dict[str, torch.Tensor]  # name -> scalar already scaled by its coefficient


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk along the last dim with ties broken by the lower index (a stable descending sort)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _group_limited_topk(scores: torch.Tensor, k: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """The top-k expert indices within the `group_topk` best groups of each token (megatron-core's
    group_limited_topk: a group's score is the sum of its best k/group_topk scores)."""
    n, e = scores.shape
    grouped = scores.view(n, num_groups, e // num_groups)
    group_scores = stable_topk(grouped, k // group_topk)[0].sum(dim=-1)
    _, chosen = stable_topk(group_scores, group_topk)
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    expert_mask = group_mask.unsqueeze(-1).expand(n, num_groups, e // num_groups).reshape(n, e)
    return stable_topk(scores.masked_fill(~expert_mask, float("-inf")), k)[1]


def topk_routing(
    logits: torch.Tensor, cfg: MoEConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [N, E] -> (probs [N, E] fp32, routing_map [N, E] bool)."""

    def select(s: torch.Tensor) -> torch.Tensor:
        if cfg.group_topk:
            return _group_limited_topk(s, cfg.topk, cfg.num_groups, cfg.group_topk)  # type: ignore[arg-type]
        return stable_topk(s, cfg.topk)[1]

    if cfg.score_function == "softmax":
        if cfg.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            top = select(scores)
            probs = scores.gather(1, top)
        else:
            top = select(logits)
            probs = torch.softmax(logits.gather(1, top), dim=-1)
    else:
        scores = torch.sigmoid(logits)
        top = select(scores if expert_bias is None else scores + expert_bias)
        probs = scores.gather(1, top)
        if cfg.topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.topk_scaling_factor:
        probs = probs * cfg.topk_scaling_factor
    dense = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return dense, routing_map


def aux_loss_scores(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores over all experts [N, E], their plain top-k map [N, E]) that the balancing losses read."""
    if cfg.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = stable_topk(scores, cfg.topk)[1]
    return scores, torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)


def _all_reduced(counts: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Token counts summed over `group` (the tp_cp ranks that hold the other pieces of the sequences)."""
    counts = counts.detach().clone()
    comm.all_reduce(counts, group, "moe_aux_counts")  # a no-op on one rank
    return counts


def switch_aux_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, topk: int, coeff: float, group: Group | None = None
) -> torch.Tensor:
    """coeff * E * sum_i f_i P_i with f_i = tokens_i / (k T), P_i = sum_t scores_ti / T, over the T tokens
    of all members of `group` (T = local tokens x group size): this rank's piece, its own P_i sums times the
    counts summed over the group, so that the pieces sum to the loss of all the tokens."""
    num_tokens, num_experts = scores.shape
    num_tokens *= 1 if group is None else group.size
    tokens_per_expert = _all_reduced(routing_map.sum(dim=0).to(scores.dtype), group)
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * num_tokens * num_tokens))


def seq_aux_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, batch: int, topk: int, coeff: float, group: Group | None = None
) -> torch.Tensor:
    """switch_aux_loss of each sequence (tokens batch-major: [B * T, E]), averaged over the B sequences; with
    `group`, each sequence is spread over its members (sequence or context parallel): this rank's piece."""
    b_scores = scores.view(batch, -1, scores.shape[-1])
    b_map = _all_reduced(routing_map.view(batch, -1, scores.shape[-1]).to(scores.dtype).sum(dim=1), group)
    seq_len, num_experts = b_scores.shape[1] * (1 if group is None else group.size), b_scores.shape[2]
    per_seq = (b_scores.sum(dim=1) * b_map).sum(dim=-1)
    return per_seq.mean() * (num_experts * coeff / (topk * seq_len * seq_len))


def z_loss(logits: torch.Tensor, coeff: float, group: Group | None = None) -> torch.Tensor:
    """coeff * the mean over the tokens of all members of `group` of logsumexp^2: this rank's piece."""
    return torch.logsumexp(logits, dim=-1).square().mean() * (coeff / (1 if group is None else group.size))


class TopKRouter(nn.Module):
    """Linear(h, E) without bias, kept and applied in fp32 whatever the activations' dtype. Replicated over
    TP: under sequence parallelism each TP rank routes its own sequence shard, so the weight's gradient is a
    partial sum per TP rank (marked `tp_partial_grad`, summed over TP by the gradient finalize)."""

    def __init__(
        self, cfg: MoEConfig, init_std: float = 0.02, sequence_parallel: bool = False, tp_cp: Group | None = None
    ):
        super().__init__()
        self.cfg, self.tp_cp = cfg, tp_cp
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        mark(self.weight, ("normal", init_std), tp_partial_grad=sequence_parallel)
        if not self.weight.is_meta:  # on meta a draw is shapes only (and loads torch's decompositions)
            nn.init.normal_(self.weight, std=init_std)
        # the tokens each expert received while training, since the last update_expert_bias (or reset by the
        # training step: the log's expert load)
        self.register_buffer(
            "local_tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=False
        )
        if cfg.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def reset_buffers(self, device) -> None:
        """The buffers of a router built on the meta device: the counts and the expert bias start at 0."""
        self.local_tokens_per_expert = torch.zeros(self.cfg.num_experts, dtype=torch.float32, device=device)
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros(self.cfg.num_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [B, T, H] (or [N, H]) -> Routing over its B*T tokens, batch-major."""
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), self.weight.float())
        probs, routing_map = topk_routing(logits, self.cfg, self.expert_bias)
        losses = self._losses(logits, x.shape[0] if x.dim() == 3 else 1)
        if self.training and torch.is_grad_enabled() and not recomputing():  # a rerun routes the same tokens again
            self.local_tokens_per_expert += routing_map.sum(dim=0)
        return Routing(probs, routing_map, losses)

    def _losses(self, logits: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
        cfg, losses = self.cfg, {}
        if cfg.z_loss_coeff:
            losses["z_loss"] = z_loss(logits, cfg.z_loss_coeff, self.tp_cp)
        if cfg.aux_loss_coeff and cfg.load_balancing_type != "none":
            scores, routing_map = aux_loss_scores(logits, cfg)
            if cfg.load_balancing_type == "aux_loss":
                losses["load_balancing_loss"] = switch_aux_loss(
                    scores, routing_map, cfg.topk, cfg.aux_loss_coeff, self.tp_cp
                )
            else:
                losses["seq_load_balancing_loss"] = seq_aux_loss(
                    scores, routing_map, batch, cfg.topk, cfg.aux_loss_coeff, self.tp_cp
                )
        return losses

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """b_i += rate * sign(mean load - load_i) from the counts since the last call (or the given
        counts, e.g. summed over the data-parallel ranks by the caller), then reset the counts."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias: the router was built without --moe-router-enable-expert-bias")
        load = self.local_tokens_per_expert if tokens_per_expert is None else tokens_per_expert.float()
        offset = load.sum() / load.numel() - load
        self.expert_bias += torch.sign(offset) * self.cfg.bias_update_rate
        self.local_tokens_per_expert.zero_()
