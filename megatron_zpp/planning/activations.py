"""Activation bytes per micro-batch, in closed forms: what each op of our model keeps for the backward (`Dims`:
one rank's sizes), per block kind and recompute mode, and how far a layer's backward rises above it
(`chunk_activations`). memory.py adds the parameters, gradients, optimizer state, buffers and the pipeline's
micro-batches in flight to these; see its docstring for what is and is not modelled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from .. import recompute
from ..config import Config
from ..config.shapes import GDN_CONV_KERNEL
from ..data.tokenizer import pad_vocab_size
from ..model.dropout import HASH_SLICE
from ..ops.cross_entropy import CHUNK_ELEMENTS as CE_CHUNK_ELEMENTS
from ..ops.gla_chunked import sub_block
from .moe_memory import MoEDims, moe_backward_transient, moe_dims, moe_saved

GDN_HALO = GDN_CONV_KERNEL - 1  # the tokens before a slice that GDN's convolution reads


# ---------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Dims:
    """Per-rank sizes of one micro-batch: s is this CP rank's slice, s_norm the rows of the
    norm/dropout regions (s / TP under sequence parallelism); heads, kv, width, ffn, vocab per TP rank."""

    b: int
    s: int
    s_norm: int
    h: int
    heads: int
    kv: int
    d: int
    ffn: int
    vocab: int
    e: int  # bytes of the training dtype
    low_rank: int
    dropout: bool
    masked: bool  # softmax attention with a mask (packed documents or CP): the keys it sees
    chunk: int  # GLA chunk size
    swiglu: bool = True  # the MLP's activation: SwiGLU, else an elementwise one (GeLU, squared ReLU)
    layer_norm: bool = False  # LayerNorm (else RMSNorm)
    rope: bool = True  # RoPE rotates q and k into new tensors (learned or no positions: views of qkv)
    cp: int = 1  # context-parallel ranks
    cp_gather: bool = False  # --cp-algo all-gather: every rank's state transition is kept for the backward
    linear_proj: int = 0  # the linear mixer's input-projection outputs per TP rank (its shape's sections + replicated)
    moe_imbalance: float = 1.0  # an MoE layer's busiest rank: its routed rows over an even share (moe_memory.py)
    gate: bool = False  # softmax attention's output gate (--attention-output-gate)
    keyed_probs: bool = False  # attention dropout with layout-invariant masks: explicit attention, its core rerun
    key_slices: int = 0  # the CP slices of keys a softmax query sees on this rank (cp_rank + 1; 0: the last rank's)
    # GDN per TP rank: value heads, key dim K, value dim V, convolution channels (zeros: heads, d, d, 3 width)
    gdn: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def width(self) -> int:
        return self.heads * self.d

    @property
    def gdn_heads(self) -> int:
        return self.gdn[0] or self.heads

    @property
    def gdn_k(self) -> int:
        return self.gdn[1] or self.d

    @property
    def gdn_width(self) -> tuple[int, int]:
        """GDN's key and value widths over its value heads (q, k repeated to every head of a group): Hv K, Hv V."""
        return self.gdn_heads * self.gdn_k, self.gdn_heads * (self.gdn[2] or self.d)

    @property
    def gdn_conv(self) -> int:
        """GDN's convolution channels, q | k | v (key heads' K each for q and k, value heads' V for v)."""
        return self.gdn[3] or 3 * self.width


def dims(cfg: Config, micro_batch: int | None = None, moe_imbalance: float = 1.0) -> Dims:
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    s = m.seq_length // cp
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    return Dims(
        b=micro_batch or cfg.train.micro_batch_size,
        s=s,
        s_norm=s // tp if p.sequence_parallel else s,
        h=m.hidden_size,
        heads=m.num_attention_heads // tp,
        kv=m.kv_heads // tp,
        d=m.head_dim,
        ffn=m.ffn_size // tp,
        vocab=vocab // tp,
        e=2 if cfg.train.bf16 or cfg.train.fp16 else 4,
        low_rank=m.gla_gate_low_rank,
        dropout=m.hidden_dropout > 0,
        masked=cp > 1 or cfg.data.reset_attention_mask,
        chunk=m.linear_chunk_size,
        swiglu=m.activation == "swiglu",
        layer_norm=m.normalization == "LayerNorm",
        rope=m.position_embedding_type == "rope",
        cp=cp,
        cp_gather=p.cp_algo == "all-gather",
        linear_proj=_linear_proj(m.mixer_of_kind(m.attention_type), tp),
        moe_imbalance=moe_imbalance,
        gate=m.attention_output_gate,
        keyed_probs=m.attention_dropout > 0 and m.dropout_masks == "layout-invariant",
        gdn=_gdn_dims(m.mixer_of_kind("gdn"), tp) if m.attention_type == "gdn" else (0, 0, 0, 0),
    )


def _gdn_dims(mixer, tp: int) -> tuple[int, int, int, int]:
    return mixer.heads // tp, mixer.key_dim, mixer.value_dim, mixer.conv_channels // tp


def _linear_proj(mixer, tp: int) -> int:
    return sum(mixer.sections) // tp + mixer.replicated


# ---------------------------------------------------------------- activations (closed forms)


def norm_saved(x: Dims) -> int:
    """ops/norm.py reference: F.rms_norm on x.float() keeps x in fp32 (x itself for fp32: the
    block's input or mid residual, counted here), x * rstd in fp32 and rstd [rows]; F.layer_norm's
    one operator keeps only x in fp32, the mean and rstd [rows]. The output's e-byte copy is what
    the next linear keeps (counted there: `linear_input`)."""
    rows = x.b * x.s_norm
    return rows * (4 * x.h + 8) if x.layer_norm else rows * (8 * x.h + 4)


def linear_input(x: Dims) -> int:
    """What a column-parallel product keeps of its input [b, s, h] (e): under sequence parallelism
    this rank's sequence shard [b, s/TP, h], all-gathered again in the backward (as Megatron)."""
    return x.e * x.b * x.s_norm * x.h


def mlp_saved(x: Dims) -> int:
    """fc1 keeps its input (`linear_input`); SwiGLU keeps [gate | up] (2f) and silu(gate) (f); fc2
    keeps its input (f). GeLU (or squared ReLU): fc1's output (relu's) and fc2's input."""
    bs = x.b * x.s
    return linear_input(x) + x.e * bs * (4 * x.ffn if x.swiglu else 2 * x.ffn)


def softmax_core_saved(x: Dims) -> int:
    """SDPA (flash on CPU): output [b, heads, s, d] and logsumexp (fp32) [b, heads, s]."""
    return x.b * x.s * x.heads * (x.e * x.d + 4)


def softmax_layer(x: Dims, selective: bool) -> int:
    """One softmax block: norm1, qkv's input (`linear_input`) and output (heads + 2 kv heads: SDPA
    keeps v as a view of it), the rotated q and k (new tensors under RoPE; views of qkv without),
    the core, proj's input (the re-laid-out output), norm2, hidden dropout masks (the FFN: `ffn_saved`).
    Selective recompute drops the core, and so does attention dropout with layout-invariant masks (the explicit
    attention reruns in the backward: `softmax_backward_live`). The output gate adds its qkv section (e), its
    sigmoid (fp32) and
    the gated product, proj's input (e), beside the output the product keeps."""
    bs = x.b * x.s
    rotated = (x.heads + x.kv) * x.d if x.rope else 0
    gate = (2 * x.e + 4) * x.width if x.gate else 0
    qkv = linear_input(x) + x.e * bs * ((x.heads + 2 * x.kv) * x.d + rotated + x.heads * x.d) + bs * gate
    core = 0 if selective or x.keyed_probs else softmax_core_saved(x)
    return 2 * norm_saved(x) + qkv + core + dropout_saved(x)


def softmax_backward_live(x: Dims) -> int:
    """With layout-invariant attention dropout (model/dropout.py), while the explicit attention reruns in the
    backward: the block's kept bytes and, per [b, heads, s, keys] element, the fp32 softmax output, its copy in
    the training dtype (none at fp32), the bool keep mask and the dropped probabilities (e): 9 bytes at fp32 and
    at bf16, beside the mask hash's three int64 temporaries (24, over at most dropout.HASH_SLICE elements at a
    time). Measured: 33 bytes per element at fp32 (LiveBytes, tests/planning/test_memory.py); the Llama-3-70B
    dry run (bf16, docs/dry_run.md) 9.7. keys: the slices up to this CP rank's (`key_slices`). 0 otherwise:
    SDPA's fused backward stays below its FFN's."""
    if not x.keyed_probs:
        return 0
    elements = x.b * x.heads * x.s * x.s * (x.key_slices or x.cp)
    return softmax_layer(x, True) + elements * 9 + min(elements, HASH_SLICE) * 24


def gla_layer(x: Dims, selective: bool) -> int:
    """One GLA block: norm1, proj_in's input (`linear_input`; the low-rank gate's down-projection
    shares it) and outputs (5 sections, 4 and the down-projection's r with a low-rank gate),
    proj_out's input (e), then the core (selective recompute keeps none of it: its inputs are
    proj_in's outputs): logsigmoid's fp32 input (a copy for bf16 or a low-rank gate) and its fp32
    buffer, the fp32 log decay g (ChunkGLAFunction keeps q, k, v: views of proj_in's output, and
    g), the operator's output in fp32, rms_norm's fp32 x * rstd and rstd, the output gate's two
    factors (e); norm2, hidden dropout masks (the FFN: `ffn_saved`)."""
    bs, w = x.b * x.s, x.width
    proj = linear_input(x) + x.e * bs * (x.linear_proj + w)
    core = 0
    if not selective:
        gate_copy = 4 * w if (x.low_rank or x.e != 4) else 0
        core = bs * (gate_copy + 16 * w + 4 * x.heads + 2 * x.e * w)
    return 2 * norm_saved(x) + proj + core + dropout_saved(x)


def gdn_layer(x: Dims, selective: bool) -> int:
    """One Gated DeltaNet block (model/gated_deltanet.py): norm1, proj_in's input (`linear_input`) and
    output (its sections), proj_out's input (e; widths: GDN's value heads x V, `Dims.gdn_width`); the core (none
    under selective recompute): `gdn_conv_saved`, SiLU's output and the q, k the op reads (e; L2-normalised,
    repeated to the value heads; ChunkGDNFunction keeps
    those and v, a view), the gates and the norms' statistics (~10 fp32 per head), the operator's fp32
    output, the head norm's normalised and weighted products and silu(gate) (4 fp32 width; the gate's fp32
    copy for bf16); norm2, hidden dropout masks (the FFN: `ffn_saved`)."""
    bs, (wk, w) = x.b * x.s, x.gdn_width
    proj = linear_input(x) + x.e * bs * (x.linear_proj + w)
    core = 0
    if not selective:
        gate_copy = 4 * w if x.e != 4 else 0
        core = gdn_conv_saved(x) + x.e * bs * (x.gdn_conv + 2 * wk) + bs * (40 * x.gdn_heads + 16 * w + gate_copy)
        core += gdn_cp_saved(x)
    return 2 * norm_saved(x) + proj + core + dropout_saved(x)


def gdn_cp_saved(x: Dims) -> int:
    """Under CP (context_parallel/delta_rule.py's ScannedDeltaRule), beyond the single-rank layer: r [b, s, heads, d]
    (1 fp32 width; the op's inputs are the single-rank layer's), S_in and M (the scan's transition; 2 fp32
    [b, heads, d, d]); the all-gather also every rank's packed (state, M) buffer (P x 2 of them)."""
    if x.cp == 1:
        return 0
    wk, wv = x.gdn_width
    states = 4 * x.b * x.gdn_heads * x.gdn_k * (x.gdn_k + wv // x.gdn_heads) // 2  # K x V and K x K: 2 per head
    return 4 * x.b * x.s * wk + states * (2 + (2 * x.cp if x.cp_gather else 0))


def gdn_conv_saved(x: Dims) -> int:
    """causal_conv over the 3-token halo and the slice [b, s+3, 3 width] (e): its input, the three shifted
    copies (each padded by its lag) and its output (SiLU's input)."""
    rows = x.b * (x.s + GDN_HALO)
    return x.e * x.gdn_conv * (5 * rows + x.b * (1 + 2 + 3))


def gdn_backward_live(x: Dims) -> int:
    """What a GDN block holds while ChunkGDNFunction's backward runs: norm1, proj_in's input and output, the
    convolution's and the normalisations' saved tensors, the residual's gradient (e), and the chunked
    reference backward's fp32 working set (ops/gdn_chunked.py: the recomputed T, W, U, states and v_new,
    their gradients, dq dk dv), in units of one [b, s, width] fp32 tensor: 15.4 + 10.9 C/d + 3.4 d/C, fitted
    to LiveBytes at (d, C) = (16..64, 16..64) (C/d from 1/4 to 2: within 0.3 units); under CP the same (the
    operator of context_parallel/delta_rule.py runs that backward at the entering state) and `gdn_cp_saved`."""
    bs, (wk, wv), C, d = x.b * x.s, x.gdn_width, x.chunk, x.gdn_k
    w = (wk + wv) / 2  # the fit's width (K = V there): the mean of the key and value widths
    kept = norm_saved(x) + linear_input(x) + x.e * bs * (x.h + x.linear_proj)
    kept += gdn_conv_saved(x) + x.e * bs * (x.gdn_conv + 2 * wk) + bs * 40 * x.gdn_heads + gdn_cp_saved(x)
    return kept + int(4 * bs * w * (15.4 + 10.9 * C / d + 3.4 * d / C))


def kda_layer(x: Dims, selective: bool) -> int:
    """One Kimi Delta Attention block (model/kda.py): GDN's (`gdn_layer`: the projections, the convolution, the
    normalised q, k, the operator's output, the head norm and output gate) and, as the core keeps them, the decay's
    fp32 logits, their softplus and the gate g itself, one value per channel where GDN has one per head (3 fp32
    width; the low-rank gates' down-projections are proj_in's outputs, `linear_proj`)."""
    extra = 0 if selective else x.b * x.s * 12 * x.width
    return gdn_layer(x, selective) + extra


def kda_backward_live(x: Dims) -> int:
    """While chunk_kda's backward runs: GDN's (`gdn_backward_live`) and what the chunked form's per-channel decays
    change (ops/kda_chunked.py: its pair decays' factors, log2 C levels of [b, s, width] each, and [C, C] matrices
    fewer than GDN's fit counts), 19.5 - 4.2 C/d fp32 [b, s, width] tensors, fitted to LiveBytes at C = 16..64,
    d = 16 and 32 (C/d from 1/2 to 4, within 1.4 units; the PyTorch reference, not the kernels)."""
    w = sum(x.gdn_width) / 2
    return gdn_backward_live(x) + int(4 * x.b * x.s * w * (19.5 - 4.2 * x.chunk / x.gdn_k))


def dropout_saved(x: Dims) -> int:
    return 2 * x.b * x.s_norm * x.h if x.dropout else 0  # two bool masks per block


def cp_kv_saved(x: Dims, cp_rank: int) -> int:
    """Softmax under CP, on top of softmax_layer: SDPA keeps the gathered K|V up to this rank's slice
    end [b, kv, (r+1) s, 2d] and the bool mask [s, (r+1) s]; under RoPE not the qkv output nor the
    rotated k (without RoPE q is a view that keeps the qkv output)."""
    keys = (cp_rank + 1) * x.s
    unkept = x.e * x.b * x.s * (x.heads + 3 * x.kv) * x.d if x.rope else 0
    return x.e * x.b * x.kv * keys * 2 * x.d + x.s * keys - unkept


def _moe(cfg: Config, x: Dims) -> MoEDims:
    return moe_dims(cfg, x.b, x.s, x.s_norm, x.e, x.moe_imbalance)


def ffn_saved(cfg: Config, x: Dims, layer: int) -> int:
    """What the block's FFN keeps: a dense MLP (`mlp_saved`) or a mixture of experts (moe_memory.moe_saved;
    with --moe-layer-recompute only its input, the norm's output (e), which the rerun starts from)."""
    if cfg.model.ffn(layer).kind != "moe":
        return mlp_saved(x)
    return x.e * x.b * x.s_norm * x.h if cfg.model.moe_layer_recompute else moe_saved(_moe(cfg, x))


def ffn_backward_transient(cfg: Config, x: Dims, layer: int) -> int:
    """Above what the block keeps, in its FFN's backward: the residual's gradient [b, s, h] (e) and the FFN's
    own (`mlp_backward_transient`, or moe_memory.moe_backward_transient plus that gradient, and under
    --moe-layer-recompute what the rerun rebuilds)."""
    if cfg.model.ffn(layer).kind != "moe":
        return mlp_backward_transient(x)
    d, grad = _moe(cfg, x), x.e * x.b * x.s_norm * x.h
    rerun = moe_saved(d) - grad if cfg.model.moe_layer_recompute else 0
    return grad + rerun + moe_backward_transient(d)


def layer_bytes(cfg: Config, x: Dims, layer: int, selective: bool, cp_rank: int = 0) -> int:
    mixer = cfg.model.mixer(layer)
    out = MIXERS[mixer.kind].kept(x, selective) + ffn_saved(cfg, x, layer)
    if not mixer.linear and cfg.parallel.context_parallel_size > 1:
        out += cp_kv_saved(x, cp_rank)
    return out


def layer_table(cfg: Config, micro_batch: int | None = None, moe_imbalance: float = 1.0) -> dict[str, int]:
    """Bytes one micro-batch keeps per layer, by kind (mixer, and +moe for a mixture of experts) and recompute
    mode (full: the group's input, shared by the layers of a uniform group)."""
    x = dims(cfg, micro_batch, moe_imbalance)
    m = cfg.model
    kinds = {(m.layer_kind(i), m.ffn(i).kind): i for i in range(m.num_layers)}  # one layer of each kind
    out = {}
    for (kind, ffn), i in sorted(kinds.items()):
        name = kind if ffn == "dense" else f"{kind}+moe"
        for mode, selective in (("none", False), ("selective", True)):
            out[f"{name} {mode}"] = MIXERS[kind].kept(x, selective) + ffn_saved(cfg, x, i)
    out["full (per recomputed group)"] = x.e * x.b * x.s_norm * x.h
    return out


def head_saved(x: Dims) -> int:
    """Final norm, the output layer's input (`linear_input`), the logits [b, s, V/TP] (e) that
    the cross-entropy keeps, its fp32 log-sum-exp, int64 local labels and the ignore mask."""
    rows = x.b * x.s
    return norm_saved(x) + linear_input(x) + x.e * rows * x.vocab + rows * (4 + 8 + 1)


def head_backward_transient(x: Dims) -> int:
    """The cross-entropy backward: the logits' gradient (e) and one fp32 row chunk (two for bf16:
    the upcast and exp(x - lse))."""
    rows = x.b * x.s
    chunk_rows = min(rows, max(1, CE_CHUNK_ELEMENTS // max(1, x.vocab)))
    return x.e * rows * x.vocab + (1 if x.e == 4 else 2) * 4 * chunk_rows * x.vocab


def mlp_backward_transient(x: Dims) -> int:
    """In a block's MLP backward: the gradient flowing down the residual [b, s, h] and fc2's input
    gradient with the two SwiGLU factor gradients while only fc2's input has been freed: 2f more
    than the layer keeps (e bytes)."""
    return x.e * x.b * x.s * ((2 if x.swiglu else 1) * x.ffn + x.h)


def gla_backward_live(x: Dims) -> int:
    """What a GLA block holds while ChunkGLAFunction's backward runs (its MLP, norm2 and the core's
    tensors after the operator are freed by then): norm1, proj_in's input and output, the gate's
    fp32 copy, logsigmoid's buffer and g, the residual's gradient (e), and the operator's fp32
    working set at its peak (ops/gla.py, while _intra_score_grads forms dk), in units of one
    [b, s, w] fp32 tensor: q, k, v, g, do and the scaled do as [B, H, N, C, D] blocks (6), the chunk
    decays q_in, k_out (2), the sub-block decays (c - 1)/2 + 2 (c = sub_block(C), M = C / c sub-blocks
    per chunk), keys_between and queries_between (M each), dA (C / d), dq, the decayed q and the
    product forming dk (3), the entering states and their gradient (2 d / C)."""
    bs, w, C = x.b * x.s, x.width, x.chunk
    c = sub_block(C)
    kept = norm_saved(x) + linear_input(x) + x.e * bs * (x.h + x.linear_proj)
    kept += bs * ((4 * w if (x.low_rank or x.e != 4) else 0) + 8 * w)
    units = 6 + 2 + (c - 1) / 2 + 2 + 2 * (C // c) + C / x.d + 3 + 2 * x.d / C
    return kept + int(4 * bs * w * units)


def chunk_activations(cfg: Config, x: Dims, layer_ids: list[int], cp_rank: int = 0) -> tuple[int, int, int]:
    """(bytes one micro-batch keeps in a model chunk, the largest recomputed group's activations,
    how far above the kept bytes the micro-batch's backward rises). The backward visits the layers
    in reverse: at layer L the groups before L's group keep what they keep, the layers of L's group
    before L hold their activations (recomputed, or kept), the later ones are freed, and L itself
    peaks in its MLP's backward or (GLA) its operator's. A recomputed group keeps only its input
    [b, s_norm, h] (e)."""
    selective = cfg.model.recompute_granularity == "selective"
    full = [layer_bytes(cfg, x, i, False, cp_rank) for i in layer_ids]  # what a rerun rebuilds
    per_layer = [layer_bytes(cfg, x, i, selective, cp_rank) for i in layer_ids]
    kept, largest, live = 0, 0, [0]
    for start, stop, again in recompute.layer_groups(cfg.model, len(layer_ids)):
        acts = full if again else per_layer
        held = kept
        for j in range(start, stop):
            peak = acts[j] + ffn_backward_transient(cfg, x, layer_ids[j])
            mixer = MIXERS[cfg.model.layer_kind(layer_ids[j])]
            if mixer.backward_live:  # a linear mixer's operator backward may peak above its FFN's
                rerun = selective and not again  # selective: the core reruns in the backward
                core = per_layer[j] - mixer.kept(x, True) - ffn_saved(cfg, x, layer_ids[j])
                during = mixer.backward_live(replace(x, key_slices=cp_rank + 1))  # a softmax query's keys
                peak = max(peak, during + (core if rerun else 0))
            live.append(held + peak)
            held += acts[j]
        group = sum(per_layer[start:stop])
        if again:
            kept += x.e * x.b * x.s_norm * x.h
            largest = max(largest, sum(full[start:stop]))
        else:
            kept += group
    return kept, largest, max(live) - kept


class MixerBytes(NamedTuple):
    kept: Callable[[Dims, bool], int]  # what a block of this mixer keeps for the backward (selective or not)
    backward_live: Callable[[Dims], int] | None  # what it holds while its operator's backward runs


# every mixer kind's closed forms: the one table a new kind joins
MIXERS = {
    "softmax": MixerBytes(softmax_layer, softmax_backward_live),
    "gla": MixerBytes(gla_layer, gla_backward_live),
    "gdn": MixerBytes(gdn_layer, gdn_backward_live),
    "kda": MixerBytes(kda_layer, kda_backward_live),
}
