"""What a mixture-of-experts layer keeps for its backward and holds in it, per rank and micro-batch: the closed
forms memory.py adds for a block whose FFN is `FfnShape("moe")` (derived from what moe/router.py, permute.py,
dispatch.py, experts.py and shared_expert.py save, the PyTorch reference ops; checked against measured peaks in
tests/planning/test_memory.py).

Rows. A rank routes its own n tokens (b x s / CP, / TP under sequence parallelism, which MoE requires with TP),
each to k experts: T = n k rows leave it (dropless). With an even load, the rows its E / EP local experts run are
R = n k x ETP (alltoall: the n k rows the EP ranks send it, all-gathered over expert TP; allgather: the etp_ep
group's tokens routed to its experts, the same count). Routing is data-dependent, so both are what an even load
gives times `imbalance` (the busiest rank's rows over the mean: 1.0 assumes perfect balance; Megatron's own
estimator assumes the same), capped by the capacity factor when tokens are dropped; with
--moe-pad-expert-input-to-capacity every expert takes exactly its capacity. The padded figures are exact, the
dropless ones an assumption, which `--moe-imbalance` of tools/estimate_memory.py states."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config


@dataclass(frozen=True)
class MoEDims:
    """One MoE layer on one rank: n tokens routed here, T rows sent, R rows run by the local experts."""

    n: int  # tokens this rank routes (its sequence shard under SP)
    seq_rows: int  # rows of the shared expert's inner products (b x s / CP: the TP region's)
    h: int
    experts: int  # E
    local: int  # E / EP
    topk: int
    width: int  # one expert's inner width per expert-TP rank (F / ETP)
    swiglu: bool
    sent: int  # T: rows this rank permutes and sends
    run: int  # R: rows its local experts run
    e: int  # bytes of the training dtype
    allgather: bool  # the allgather dispatcher (unpermute over the gathered rows)
    combined: int  # tokens the unpermute sums into: n, or the etp_ep group's G n under allgather
    exchanged: bool  # rows leave the rank (EP or ETP > 1): the chunk sorts' indices
    grouped: bool = True  # --moe-grouped-gemm: the local experts' weights stacked for one grouped GEMM
    shared: int = 0  # the shared expert's width per TP rank (0: none)
    shared_gate: bool = False
    z_loss: bool = False
    aux_loss: bool = False
    sigmoid: bool = False


def moe_dims(cfg: Config, b: int, s: int, s_norm: int, e: int, imbalance: float = 1.0) -> MoEDims:
    """The MoE layer's sizes for micro-batch `b`, CP slice `s` and routed rows per sequence `s_norm` (s / TP
    under SP), `imbalance`: the busiest rank's routed rows over an even share."""
    m, p = cfg.model, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    etp = p.expert_tp_size
    E, k, n = m.num_experts or 0, m.moe_router_topk, b * s_norm
    even = n * k
    cf = m.moe_expert_capacity_factor
    if cf is not None and m.moe_pad_expert_input_to_capacity:
        sent = E * min(math.ceil(n * k / E * cf), n)  # every expert's capacity, padded: exact
        run = sent * etp
    else:
        factor = imbalance if cf is None else min(imbalance, cf)
        sent, run = even, math.ceil(even * etp * factor)
    return MoEDims(
        n=n,
        seq_rows=b * s,
        h=m.hidden_size,
        experts=E,
        local=E // ep,
        topk=k,
        width=m.expert_ffn_size // etp,
        swiglu=m.activation == "swiglu",
        sent=sent,
        run=run,
        e=e,
        allgather=m.moe_token_dispatcher_type == "allgather" and ep * etp > 1,
        combined=n * (ep * etp if m.moe_token_dispatcher_type == "allgather" else 1),
        exchanged=ep * etp > 1,
        grouped=m.moe_grouped_gemm,
        shared=(m.moe_shared_expert_intermediate_size or 0) // tp,
        shared_gate=m.moe_shared_expert_gate,
        z_loss=bool(m.moe_z_loss_coeff),
        aux_loss=bool(m.moe_aux_loss_coeff) and m.moe_router_load_balancing_type != "none",
        sigmoid=m.moe_router_score_function == "sigmoid",
    )


def router_saved(d: MoEDims) -> int:
    """The router (fp32): its input (a copy for bf16; for fp32 the norm's output itself), its logits [n, E]
    (the top-k gather keeps them), the stable sort's int64 indices [n, E] (the top-k index the gather and
    scatter keep is a view of them), the top-k softmax's output [n, k] (sigmoid: the scores [n, E] too); the
    balancing loss's scores over all experts and its own sort's indices; the z-loss's logsumexp."""
    out = 4 * d.n * d.h + 12 * d.n * d.experts + 4 * d.n * d.topk
    if d.sigmoid:
        out += 4 * d.n * d.experts
    if d.z_loss:
        out += 8 * d.n
    if d.aux_loss:
        out += 12 * d.n * d.experts
    return out


def stacked_weights(d: MoEDims) -> int:
    """Elements of the local experts' weights as one stack (3 h F' per expert, gelu 2 h F')."""
    return d.local * d.h * d.width * (3 if d.swiglu else 2)


def experts_saved(d: MoEDims) -> int:
    """The local experts over their R rows: fc1's input (e), [gate | up] and silu(gate) and fc2's input (4 F';
    gelu: 2 F'); with --moe-grouped-gemm the stacked copy of the local experts' weights the grouped GEMMs keep
    (experts.py stacks the rank's E / EP fc1 and fc2 weights with torch.stack; without it, one GEMM per
    expert on the parameters themselves)."""
    inner = 4 if d.swiglu else 2
    return d.e * (d.run * d.h + d.run * d.width * inner + (stacked_weights(d) if d.grouped else 0))


def dispatch_saved(d: MoEDims) -> int:
    """The permutation's int64 row indices (token, expert, slot) and the routing probability of each row
    (fp32), the unpermute's fp32 copy of the experts' outputs; over the T rows sent (alltoall) or the R rows
    of the gathered tokens routed here (allgather); the chunk sorts' indices (2 x R) when rows are exchanged."""
    rows = d.run if d.allgather else d.sent
    sorts = 16 * d.run if d.exchanged and not d.allgather else 0
    return rows * (24 + 4 + 4 * d.h) + sorts


def shared_saved(d: MoEDims) -> int:
    """The shared expert, a dense MLP of width S / TP: its input (the norm's output, e; for fp32 the router's
    input already), [gate | up], silu(gate), fc2's input over the TP region's rows; its sigmoid gate's output
    and the gated product's other factor."""
    if not d.shared:
        return 0
    out = (d.e * d.n * d.h if d.e != 4 else 0) + d.e * d.seq_rows * d.shared * (4 if d.swiglu else 2)
    if d.shared_gate:
        out += d.e * d.n * (d.h + 1)
    return out


def moe_saved(d: MoEDims) -> int:
    """Everything one MoE layer keeps for its backward, per micro-batch."""
    return router_saved(d) + dispatch_saved(d) + experts_saved(d) + shared_saved(d)


def moe_backward_transient(d: MoEDims) -> int:
    """Above what the layer keeps, at its backward's peak: the larger of the combine's backward (the slot
    buffer's gradient [n, k + 1, h] (allgather: over the group's G n tokens) and two [rows, h] fp32 products:
    the rows' gradient and its product with the probabilities) and the experts' (the stacked weights'
    gradient, or one expert's without --moe-grouped-gemm, and the SwiGLU factors' gradients [R, 2 F'] (e),
    while fc2's saved input is already freed). Fitted to LiveBytes on one rank (within 20%)."""
    rows = d.run if d.allgather else d.sent
    combine = 4 * d.combined * (d.topk + 1) * d.h + 2 * 4 * rows * d.h
    weights = stacked_weights(d) // (1 if d.grouped else d.local)  # the stack's gradient, or one expert's
    experts = d.e * (weights + 2 * d.run * d.width)
    return max(combine, experts)
