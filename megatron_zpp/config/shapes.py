"""What a block's token mixer and FFN are, as numbers: one torch-free description of each kind.

`ModelConfig.mixer(layer)` and `ModelConfig.ffn(layer)` return them; the layers build their projections
from them, and perf (FLOPs), the memory estimator, the simulator (TP widths, CP scan, transition and halo
bytes), validation and the exporters read the same object. A new mixer kind is one more branch of
`mixer_shape` (its sections, state, transition, halo, FLOPs), its layer, its op and its tests.

Widths are the full (unsplit) ones: every section of an input projection is split by heads over TP,
except `replicated`, which each TP rank holds whole (GLA's low-rank gate's down-projection).
Imports nothing of ours: config/model.py builds these from its fields."""

from __future__ import annotations

from dataclasses import dataclass, replace

GDN_CONV_KERNEL = 4  # fla's and Qwen3-Next's short convolution
# Megatron's GDN shape flags when not given with --experimental-attention-variant gated_delta_net (megatron-core's
# TransformerConfig defaults); --attention-type gdn alone: --num-attention-heads heads of the head dim
MEGATRON_GDN_DEFAULTS = {
    "linear_conv_kernel_dim": GDN_CONV_KERNEL,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}


@dataclass(frozen=True)
class MixerShape:
    """One block's token mixer. `heads` are the heads split over TP (query heads of softmax attention,
    the state's heads of a linear mixer: GDN's value heads); `key_dim` x `value_dim` the per-head state (linear
    mixers); `key_heads` GDN's query/key heads, each read by heads / key_heads consecutive value heads."""

    kind: str  # "softmax", "gla", "gdn"
    sections: tuple[int, ...]  # the input projection's output sections, in order
    out_width: int  # the output projection's input width
    heads: int
    key_dim: int
    value_dim: int
    kv_heads: int = 0  # softmax attention's key/value heads (GQA)
    key_heads: int = 0  # GDN's query/key heads (grouped value heads: fewer than `heads`); 0: one per head
    replicated: int = 0  # an input projection every TP rank holds whole (rows of W_down), 0: none
    conv_channels: int = 0  # a short causal depthwise convolution's channels (GDN: q | k | v), 0: none
    conv_kernel: int = 0
    transition: str = ""  # a CP slice's state transition: "decay" (diagonal, [K]), "dense" ([K, K]), "" none
    chunk: int | None = None  # the chunked form's chunk length (linear mixers)

    @property
    def linear(self) -> bool:
        """A recurrent state (chunked form, CP state scan) rather than softmax attention."""
        return bool(self.transition)

    @property
    def halo_tokens(self) -> int:
        """Tokens of the previous CP slice the convolution reads (0: none)."""
        return self.conv_kernel - 1 if self.conv_kernel else 0

    @property
    def state_per_head(self) -> int:
        return self.key_dim * self.value_dim if self.linear else 0

    @property
    def transition_per_head(self) -> int:
        return {"decay": self.key_dim, "dense": self.key_dim * self.key_dim}.get(self.transition, 0)

    @property
    def scan_extent(self) -> int:
        """The state dimension All-Scan's blocks cut: K under a diagonal decay (GLA), V under a dense transition
        (GDN: M mixes the K rows)."""
        return self.value_dim if self.transition == "dense" else self.key_dim

    @property
    def scan_waits_for_local_pass(self) -> bool:
        """GLA's CP scan hides behind its intra-chunk work; a dense transition (GDN) comes out of the local
        pass, so the scan waits for it."""
        return self.transition == "dense"

    def projection_width(self, tp: int) -> int:
        """The input projection's full output width as the simulator sees TP's products: the split sections
        plus each rank's whole replicated one."""
        return sum(self.sections) + tp * self.replicated

    def forward_flops_per_token(self, hidden: int, seq: int) -> float:
        """Model FLOPs of one token's forward (perf.py's rule: 2 per weight, causal softmax 2*T*width)."""
        width = self.heads * self.key_dim
        proj = 2 * (hidden * (sum(self.sections) + self.replicated) + self.out_width * hidden)
        if self.kind == "softmax":
            return proj + 2 * seq * width
        assert self.chunk is not None, "a linear mixer's FLOPs need its chunk (validation derives it)"
        if self.kind == "gla":  # the chunked form: C per key width, the state's two d x d products
            low_up = 2 * self.replicated * width  # W_up: [r] -> width
            return proj + low_up + 2 * width * (self.chunk + 2 * self.key_dim)
        # Gated DeltaNet's WY form on every value head (q, k repeated over a group): the intra-chunk products
        # (C per key and per value channel); the state's three K x V products
        return proj + 2 * self.heads * (
            self.chunk * (self.key_dim + self.value_dim) + 3 * self.key_dim * self.value_dim
        )


@dataclass(frozen=True)
class FfnShape:
    """One block's feed-forward network: a dense MLP, or a mixture of experts (each token through `topk` of
    `num_experts` experts of width `hidden`, plus a dense shared expert of width `shared_hidden` if nonzero)."""

    kind: str  # "dense" or "moe"
    hidden: int  # the inner width (per expert for a mixture)
    gated: bool  # SwiGLU: fc1 has gate | up sections
    num_experts: int = 0
    topk: int = 0
    shared_hidden: int = 0

    @property
    def sections(self) -> tuple[int, ...]:
        return (self.hidden, self.hidden) if self.gated else (self.hidden,)

    def forward_flops_per_token(self, model_hidden: int) -> float:
        """Matmul FLOPs of one token's forward: the MLP it passes through (top-k experts and the shared one,
        and the router's logits for a mixture)."""
        per_mlp = 2 * model_hidden * (sum(self.sections) + self.hidden)
        if self.kind == "dense":
            return per_mlp
        shared = 2 * model_hidden * (self.shared_hidden * (3 if self.gated else 2))
        return self.topk * per_mlp + shared + 2 * model_hidden * self.num_experts


@dataclass(frozen=True)
class GdnHeads:
    """Gated DeltaNet's heads: `key_heads` query/key heads of `key_dim` channels and `value_heads` value (and
    output gate) heads of `value_dim`; value head j reads key head j // (value_heads / key_heads), as
    megatron-core's repeat_interleave. Megatron's --linear-num-key-heads, --linear-num-value-heads,
    --linear-key-head-dim, --linear-value-head-dim."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int


def mixer_shape(
    kind: str,
    heads: int,
    head_dim: int,
    kv_heads: int,
    gla_gate_low_rank: int,
    chunk: int | None,
    output_gate: bool = False,
    gdn: GdnHeads | None = None,
) -> MixerShape:
    """The shape of a `kind` mixer of `heads` heads of `head_dim` channels (`output_gate`: softmax attention's
    element-wise sigmoid gate on its output, --attention-output-gate; `gdn`: GDN's heads, default `heads` key
    and value heads of `head_dim`)."""
    width = heads * head_dim
    if kind == "softmax":  # q | k | v (| output gate, one per query channel)
        sections: tuple[int, ...] = (width, kv_heads * head_dim, kv_heads * head_dim) + (
            (width,) if output_gate else ()
        )
        return MixerShape(kind, sections, width, heads, head_dim, head_dim, kv_heads=kv_heads)
    # a linear mixer: a K x V state per head (K = V = head dim), run in chunks
    linear = MixerShape(kind, (), width, heads, head_dim, head_dim, chunk=chunk)
    if kind == "gla":  # q | k | v | output gate (| decay gate at full rank)
        sections = (width,) * (4 if gla_gate_low_rank else 5)
        return replace(linear, sections=sections, replicated=gla_gate_low_rank, transition="decay")
    if kind == "gdn":  # q | k | v | output gate, and a | b per value head; the convolution over q | k | v
        g = gdn or GdnHeads(heads, heads, head_dim, head_dim)
        qk, v = g.key_heads * g.key_dim, g.value_heads * g.value_dim
        sections = (qk, qk, v, v, g.value_heads, g.value_heads)
        return MixerShape(
            kind, sections, v, g.value_heads, g.key_dim, g.value_dim, key_heads=g.key_heads, chunk=chunk,
            conv_channels=2 * qk + v, conv_kernel=GDN_CONV_KERNEL, transition="dense",
        )  # fmt: skip
    raise ValueError(f"unknown mixer kind {kind!r}")
