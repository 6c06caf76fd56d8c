"""The collectives of a mixture-of-experts layer, per micro-batch, as moe/dispatch.py and moe/router.py issue
them (read alongside them), with the ledger's bytes:

* the router's balancing loss under sequence or context parallelism: its token counts (fp32 [E], per sequence
  [b, E] for seq_aux_loss) all-reduced over tp_cp (`moe_aux_counts`, forward only);
* alltoall (EP or expert TP > 1): the per-expert counts exchanged over EP (int64 [E], `moe_counts`), the routed
  rows [T, h] sent over EP (`moe_dispatch`), under expert TP the received counts and rows all-gathered over
  it (`moe_etp_counts`, `moe_etp_gather`), the experts, the partial outputs reduce-scattered over expert TP
  (`moe_etp_scatter`) and sent back over EP (`moe_combine`); the backward runs the reverse of each token
  collective (`..._bwd`) in reverse order;
* allgather (etp_ep > 1): the tokens [n, h], the probabilities (fp32 [n, E]) and the routing map (uint8
  [n, E]) of the etp_ep group all-gathered, the outputs reduce-scattered back (`moe_ag_*`); backward: the
  output's gradient gathered, the probabilities' and tokens' gradients reduce-scattered.

Rows are data-dependent; the ledger counts an uneven all-to-all's rows exactly (comm.all_to_all). The byte
model is the even load's: T = n k rows leave each rank, (EP - 1) / EP of them for other ranks, which is also
the exact mean over an EP group whose ranks route alike (the same share of their tokens to each rank's
experts; tests/planning/test_simulator.py routes every token to the lowest experts). `imbalance` (>= 1: the
busiest rank's rows over the mean) leaves the bytes at the mean and stretches the token exchanges' transfer
time and the experts' compute on the rank that sets the step (model.py)."""

from __future__ import annotations

import dataclasses
import math

from ...config import Config
from ...model.moe_mlp import LOSS_NAMES
from ...topology import Group, ProcessGroups
from .calls import Coll, _coll


def _sizes(cfg: Config) -> tuple[int, int, int, int]:
    """(bytes per activation element, tokens n this rank routes per micro-batch, hidden, experts)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    rows = m.seq_length // p.context_parallel_size // (p.tensor_model_parallel_size if p.sequence_parallel else 1)
    return (2 if t.bf16 or t.fp16 else 4), t.micro_batch_size * rows, m.hidden_size, m.num_experts or 0


def sent_rows(cfg: Config) -> int:
    """T: the rows one rank permutes and sends per MoE layer and micro-batch (dropless: n k; padded to the
    capacity: E x capacity; dropping without padding: at most n k, counted as n k)."""
    m = cfg.model
    _, n, _, E = _sizes(cfg)
    cf = m.moe_expert_capacity_factor
    if cf is not None and m.moe_pad_expert_input_to_capacity:
        return E * min(math.ceil(n * m.moe_router_topk / E * cf), n)
    return n * m.moe_router_topk


def moe_colls(cfg: Config, g: ProcessGroups, fwd: bool, imbalance: float = 1.0) -> list[Coll]:
    """One MoE layer's collectives for one micro-batch's forward (fwd) or backward, in issue order."""
    out = _aux_colls(cfg, g) if fwd else []
    if cfg.model.moe_token_dispatcher_type == "alltoall":
        out += _alltoall(cfg, g, fwd)
    else:
        out += _allgather(cfg, g, fwd)
    if imbalance != 1.0:  # the token exchanges of the busiest rank take longer; their bytes stay the mean
        out = [dataclasses.replace(c, imbalance=imbalance) if c.phase != "moe_aux_counts" else c for c in out]
    return out


def _aux_colls(cfg: Config, g: ProcessGroups) -> list[Coll]:
    m = cfg.model
    if not m.moe_aux_loss_coeff or m.moe_router_load_balancing_type == "none":
        return []
    per_seq = cfg.train.micro_batch_size if m.moe_router_load_balancing_type == "seq_aux_loss" else 1
    return _some(g.tp_cp, "moe_aux_counts", "all_reduce", 4 * per_seq * (m.num_experts or 0))


def _some(group: Group, phase: str, op: str, nbytes: float) -> list[Coll]:
    """A collective over `group` (none on one rank: comm skips it)."""
    return [_coll(group, phase, op, nbytes, "moe")] if group.size > 1 else []


def _alltoall(cfg: Config, g: ProcessGroups, fwd: bool) -> list[Coll]:
    e, _, h, E = _sizes(cfg)
    ep, etp = g.ep, g.etp
    if ep.size == 1 and etp.size == 1:
        return []
    rows = sent_rows(cfg) * h * e  # as many rows come as go (even load)
    if fwd:
        out = _some(ep, "moe_counts", "all_to_all", 8 * E) + _some(ep, "moe_dispatch", "all_to_all", rows)
        out += _some(etp, "moe_etp_counts", "all_gather", 8 * E * etp.size)
        out += _some(etp, "moe_etp_gather", "all_gather", rows * etp.size)
        out += _some(etp, "moe_etp_scatter", "reduce_scatter", rows * etp.size)
        return out + _some(ep, "moe_combine", "all_to_all", rows)
    out = _some(ep, "moe_combine_bwd", "all_to_all", rows)
    out += _some(etp, "moe_etp_scatter_bwd", "all_gather", rows * etp.size)
    out += _some(etp, "moe_etp_gather_bwd", "reduce_scatter", rows * etp.size)
    return out + _some(ep, "moe_dispatch_bwd", "all_to_all", rows)


def _allgather(cfg: Config, g: ProcessGroups, fwd: bool) -> list[Coll]:
    e, n, h, E = _sizes(cfg)
    group = g.etp_ep
    tokens, probs, rmap = group.size * n * h * e, group.size * n * E * 4, group.size * n * E
    if fwd:
        out = _some(group, "moe_ag_tokens", "all_gather", tokens) + _some(group, "moe_ag_probs", "all_gather", probs)
        out += _some(group, "moe_ag_map", "all_gather", rmap)
        return out + _some(group, "moe_ag_scatter", "reduce_scatter", tokens)
    out = _some(group, "moe_ag_scatter_bwd", "all_gather", tokens)
    out += _some(group, "moe_ag_probs_bwd", "reduce_scatter", probs)
    return out + _some(group, "moe_ag_tokens_bwd", "reduce_scatter", tokens)


def moe_step_colls(cfg: Config, g: ProcessGroups, moe_layers_here: int) -> list[Coll]:
    """model/moe_mlp.moe_step after the optimizer step: the stage's MoE layers' token counts, router losses and
    capacity route counts (fp64 [layers, E + 3 + 2]) all-reduced over the stage, then the per-layer table (fp64
    [layers, 3 + 3 + 2]: expert loads, losses, routes) over PP."""
    m = cfg.model
    if not m.num_experts:
        return []
    out = []
    losses, routes = len(LOSS_NAMES), 2
    if moe_layers_here and g.tp_dp_cp.size > 1:
        nbytes = 8 * moe_layers_here * (m.num_experts + losses + routes)
        out.append(_coll(g.tp_dp_cp, "moe_expert_load", "all_reduce", nbytes, "misc"))
    if g.pp.size > 1:
        out.append(_coll(g.pp, "moe_metrics", "all_reduce", 8 * m.num_layers * (3 + losses + routes), "misc"))
    return out


def expert_flops_per_token(cfg: Config, layer: int) -> float:
    """Forward + backward matmul FLOPs of the routed experts per token of an MoE layer (perf.py's rule)."""
    ffn, h = cfg.model.ffn(layer), cfg.model.hidden_size
    if ffn.kind != "moe":
        return 0.0
    return 3 * ffn.topk * 2 * h * (sum(ffn.sections) + ffn.hidden)
