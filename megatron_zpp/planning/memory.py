"""Memory estimator: the bytes one rank holds at its peak, from a validated config.

Parameters are counted exactly: each pipeline stage's model chunks are built on the meta
device (with stand-in groups of the right sizes) and, for ZeRO, cut into the engine's units
with its padding (zero/sharded_params.py). Every other term is a closed form in the micro
batch b, the sequence s, the hidden size h, heads, kv heads, head dim d, the FFN size f, the
vocabulary V and the training dtype's bytes e, derived from what each op of OUR model saves
for its backward (see `softmax_layer`, `gla_layer` and `gdn_layer`, GDN's context-parallel operator
included), and checked against measured peaks
(bench/memory.py, tests/planning/test_memory.py; live_bytes.LiveBytes measures on CPU).

The peak is the larger of two moments of the backward of the step's last micro-batch in
flight: its start (every micro-batch in flight keeps its activations; the output layer's
cross-entropy backward holds the logits, their gradient and an fp32 row chunk) and the
backward of each layer after that (the groups before it keep what they keep, a recomputed
group's earlier layers are rebuilt, the layer itself peaks in its MLP's backward or in the GLA or
GDN operator's; ZeRO-2/3 unit gradients in flight add). `backend="gloo"` adds what our gloo
reduce-scatter allocates (a full receive buffer per reduction in flight), for the CPU validation.

Not modelled (GPU): the CUDA context (~0.5-1 GiB), NCCL's communicator buffers, the caching
allocator's fragmentation and reserved-but-unused blocks (often 5-20% above the live bytes
counted here), cuBLAS/flash workspaces. Softmax attention is SDPA's fused kernels (flash or
memory-efficient: output and logsumexp kept), what a GPU runs; attention dropout with layout-invariant
masks (the default, model/dropout.py) runs the attention explicitly and reruns it in the backward
(`softmax_backward_live`). The figures are live tensor bytes, what `LiveBytes` measures.
Activations are the PyTorch reference ops' (ops/*.py without kernels); the Triton kernels and
apex norms on GPU keep less (a norm its input and row statistics, SwiGLU its input, RoPE rotates
in place, the GLA kernels their own working set), so there the estimate is an upper bound.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..config import Config
from ..data.tokenizer import pad_vocab_size
from ..model.init import full_shape
from ..pipeline_parallel.stages import build_rank_chunks, stage_chunks, stand_in_context
from ..topology import topology_from_config
from ..zero.reduce_schedule import reductions_in_flight
from ..zero.sharded_params import EXPERTS_SUFFIX, flat_geometry, is_expert_unit, model_units, pad_block
from .activations import (  # noqa: F401  (re-exported: the estimator's closed forms)
    MIXERS,
    Dims,
    chunk_activations,
    cp_kv_saved,
    dims,
    dropout_saved,
    ffn_backward_transient,
    ffn_saved,
    gdn_backward_live,
    gdn_conv_saved,
    gdn_cp_saved,
    gdn_layer,
    gla_backward_live,
    gla_layer,
    head_backward_transient,
    head_saved,
    kda_backward_live,
    kda_layer,
    layer_bytes,
    layer_table,
    linear_input,
    mlp_backward_transient,
    mlp_saved,
    norm_saved,
    softmax_backward_live,
    softmax_core_saved,
    softmax_layer,
)

GiB = 2**30


# ---------------------------------------------------------------- parameters, gradients, optimizer


def stage_model(cfg: Config, pp_rank: int):
    """This stage's chunks (TP rank 0) on the meta device: exact parameter shapes, no memory."""
    p = cfg.parallel
    vocab = pad_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, p.tensor_model_parallel_size)
    return build_rank_chunks(cfg, vocab, pp_rank, stand_in_context(cfg))  # the builder training starts from


@dataclass
class Rank:
    """One rank's estimate (bytes), term by term, and its peak."""

    stage: int
    terms: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    transient: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    in_flight: int = 1
    startup: dict[str, int] = field(default_factory=dict)  # what the rank holds when set-up ends
    startup_transient: int = 0  # the init's one full parameter (fp32): host memory on a GPU run
    startup_peak: int = 0  # on the device: startup (+ startup_transient when the device is the CPU)
    slice_fp32: int = 0  # this rank's whole (TP, PP) slice in fp32: what a start-up building it first would hold


def startup_terms(cfg: Config, chunks) -> tuple[dict[str, int], int, int]:
    """(what the rank holds when set-up ends, by term; the largest full parameter in fp32; the
    rank's (TP, PP) slice in fp32). Start-up builds the model on the meta device and each engine
    allocates only what it keeps (model/init.py): its weights, fp32 masters and gradient buffers as
    in `static_terms` (AdamW's moments come with the first step, ZeRO-3's gathered units with the
    first forward), while the init draws one full single-rank parameter at a time on the CPU and
    copies the rank's piece of it into place."""
    terms, _, _ = static_terms(cfg, chunks)
    keep = ("parameters", "fp32 master copy", "gradients", "gradients (fp32 main_grad buffer)", "hpZ secondary shard")
    held = {k: v for k, v in terms.items() if k in keep}
    tp = cfg.parallel.tensor_model_parallel_size
    largest = max((4 * math.prod(full_shape(p, tp)) for c in chunks for p in c.parameters()), default=0)
    slice_fp32 = 4 * sum(p.numel() for c in chunks for p in c.parameters())
    return held, largest, slice_fp32


def static_terms(cfg: Config, chunks, backend: str = "nccl") -> tuple[dict[str, int], dict[str, str], dict[str, int]]:
    """(persistent bytes by term, notes, transient bytes by term) of the engine's buffers. On gloo
    (`backend`), comm.reduce_scatter runs as an all-to-all into a full-size receive buffer, one per
    ZeRO reduction in flight; NCCL reduce-scatters in place."""
    z, p = cfg.zero, cfg.parallel
    e = 2 if cfg.train.bf16 or cfg.train.fp16 else 4
    group = p.data_parallel_size * p.context_parallel_size  # the ZeRO group: DP x CP
    terms, notes, transient = {}, {}, {}
    if z.zero_stage == 0:
        n = sum(q.numel() for c in chunks for q in c.parameters())
        terms["parameters"] = e * n
        terms["fp32 master copy"] = 4 * n if e != 4 else 0
        terms["gradients (fp32 main_grad buffer)"] = 4 * n
        terms["AdamW exp_avg + exp_avg_sq (fp32)"] = 8 * n
        notes["parameters"] = f"{n:,} elements, replicated"
        return terms, notes, transient
    units = [(name, [q.numel() for q in params]) for c in chunks for name, params, _ in model_units(c)]
    edp = topology_from_config(cfg).expert_sizes["edp"]  # a block's routed experts: sharded over their replicas
    geo = [flat_geometry(numels, edp if is_expert_unit(name) else group, pad_block(z)) for name, numels in units]
    padded = [g[1] for g in geo]
    shard = [g[2] for g in geo]
    full, sh = sum(padded), sum(shard)
    stage = z.zero_stage
    terms["parameters"] = e * (full if stage < 3 else 0) + e * sh  # full weights (stages 1-2) + the e-byte shard
    terms["fp32 master copy"] = 0 if (e == 4 and stage == 3) else 4 * sh
    terms["gradients"] = 4 * sh + (4 * full if stage == 1 else 0)
    terms["AdamW exp_avg + exp_avg_sq (fp32)"] = 8 * sh
    experts = sum(pad for (name, _), pad in zip(units, padded) if is_expert_unit(name))
    notes["parameters"] = f"{full:,} padded elements in {len(units)} units, shard {sh:,} per rank of {group}" + (
        f" (routed experts: {experts:,} over the {edp} expert-data-parallel ranks)" if experts else ""
    )
    notes["gradients"] = "fp32 shard" + (" + fp32 full buffer (stage 1)" if stage == 1 else "")
    if stage == 3 and z.zero_hpz_partition_size > 1:  # not the experts' units (zero_engine: no hpZ over edp)
        terms["hpZ secondary shard"] = e * (full - experts) // z.zero_hpz_partition_size
    biggest = sorted(padded, reverse=True)
    in_flight = reductions_in_flight(cfg) + 1  # the pending reductions + the unit accumulating
    if stage >= 2:
        transient["unit gradients in flight (fp32)"] = 4 * sum(biggest[:in_flight])
    if backend == "gloo" and group > 1 and not (z.zero_quantized_gradients or z.zero_hierarchy):
        transient["gloo reduce-scatter receive buffers"] = 4 * sum(biggest[: in_flight - 1])
    if stage == 3:
        held = ("embedding", "position_embeddings", "head")
        ends = [pad for (name, _), pad in zip(units, padded) if name in held]
        block_of: dict[str, int] = defaultdict(int)  # a block with its experts (gathered with it: companions)
        for (name, _), pad in zip(units, padded):
            if name not in held:
                block_of[name.removesuffix(EXPERTS_SUFFIX)] += pad
        blocks = sorted(block_of.values(), reverse=True)
        gathered = sum(ends) + sum(blocks[:2])  # end units held through the micro-batch; a block + its prefetch
        terms["ZeRO-3 gathered units"] = e * gathered
        notes["ZeRO-3 gathered units"] = "embedding/head kept through the micro-batch, one block + one prefetched"
        if z.zero_quantized_weights:
            block = z.zero_quantization_block_size
            terms["qwZ wire buffers"] = sum(math.ceil(n * (1 + 4 / block) * (1 + 1 / group)) for n in blocks[:2])
        if z.zero_quantized_gradients:
            block = z.zero_gradient_quantization_block_size
            transient["qgZ wire buffers"] = sum(math.ceil(2 * n * (0.5 + 4 / block)) for n in biggest[:2])
    return terms, notes, transient


def estimate_rank(
    cfg: Config,
    pp_rank: int,
    micro_batch: int | None = None,
    cp_rank: int | None = None,
    backend: str = "nccl",
    moe_imbalance: float = 1.0,
) -> Rank:
    """One stage's estimate (`moe_imbalance`: an MoE layer's busiest rank's routed rows over an even share)."""
    p = cfg.parallel
    pp, cp = p.pipeline_model_parallel_size, p.context_parallel_size
    cp_rank = cp - 1 if cp_rank is None else cp_rank  # the last CP slice sees every key
    x = dims(cfg, micro_batch, moe_imbalance)
    chunks = stage_model(cfg, pp_rank)
    placements = stage_chunks(p, cfg.model.num_layers, pp_rank)
    terms, notes, transient = static_terms(cfg, chunks, backend)
    rank = Rank(pp_rank, terms, notes)
    rank.startup, rank.startup_transient, rank.slice_fp32 = startup_terms(cfg, chunks)
    rank.startup_peak = sum(rank.startup.values()) + (rank.startup_transient if backend == "gloo" else 0)

    kept = [chunk_activations(cfg, x, c.layer_ids, cp_rank) for c in placements]
    m, V = cfg.num_micro_batches, len(placements)
    if pp == 1:
        in_flight = [1]
    elif V == 1:
        in_flight = [min(pp - pp_rank, m)]  # 1F1B: warm-up forwards + the one in steady state
    else:  # interleaved: Megatron's warm-up count, in chunk-micro-batches, spread over the chunks in order
        total = m * V
        warm = total if m == pp else min((pp - pp_rank - 1) * 2 + (V - 1) * pp, total) + 1
        warm = min(warm, total)
        in_flight = [0] * V
        for k in range(warm):
            in_flight[(k % (pp * V)) // pp] += 1
    rank.in_flight = max(in_flight)
    rows = x.b * x.s_norm
    acts = sum(n * k for n, (k, _, _) in zip(in_flight, kept))
    pipe = 0
    for c, n in zip(placements, in_flight):  # the schedule keeps each chunk's received input and sent output
        pipe += n * x.e * rows * x.h * ((not c.pre_process and x.e != 4) + (not c.post_process))
    inputs = sum(in_flight) * x.b * x.s * 16  # token ids and labels (int64) of each micro-batch in flight
    # --hidden-dropout on the embedding output (the first stage): its bool mask per micro-batch
    embedding = sum(n * rows * x.h for c, n in zip(placements, in_flight) if c.pre_process and x.dropout)
    terms[f"activations ({rank.in_flight} micro-batch(es) in flight)"] = acts + pipe + inputs + embedding
    post = [n for c, n in zip(placements, in_flight) if c.post_process]  # micro-batches past the output layer
    head = head_saved(x) * post[0] if post else 0
    terms[f"logits + cross-entropy (saved, {post[0] if post else 0} micro-batch(es))"] = head
    head_bwd = head_backward_transient(x) if post else 0  # one micro-batch's backward at a time
    transient["cross-entropy backward"] = head_bwd
    transient["recomputed group rerun"] = max(r for _, r, _ in kept)
    transient["layer backward"] = mlp_backward_transient(x)
    static = sum(terms.values())
    start_of_backward = static + head_bwd
    # later in the backward: one micro-batch's head is gone, a group may rerun, ZeRO-2/3 gradients are in flight
    during_backward = static - (head_saved(x) if post else 0) + max(d for _, _, d in kept)
    during_backward += transient.get("unit gradients in flight (fp32)", 0)
    during_backward += transient.get("gloo reduce-scatter receive buffers", 0)
    rank.peak = max(start_of_backward, during_backward) + transient.get("qgZ wire buffers", 0)
    rank.transient = transient
    return rank


def estimate(cfg: Config, micro_batch: int | None = None, moe_imbalance: float = 1.0) -> list[Rank]:
    """Every pipeline stage's estimate (the worst CP slice); the worst is max(peak)."""
    stages = range(cfg.parallel.pipeline_model_parallel_size)
    return [estimate_rank(cfg, r, micro_batch, moe_imbalance=moe_imbalance) for r in stages]


def largest_micro_batch(cfg: Config, budget_bytes: float, limit: int = 4096, moe_imbalance: float = 1.0) -> int:
    """The largest micro-batch whose worst stage fits `budget_bytes` (0: none fits)."""
    best, b = 0, 1
    while b <= limit and max(r.peak for r in estimate(cfg, b, moe_imbalance)) <= budget_bytes:
        best, b = b, b * 2
    lo, hi = best, min(b, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if max(r.peak for r in estimate(cfg, mid, moe_imbalance)) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo
