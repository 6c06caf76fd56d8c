"""ModelConfig: the GPT's shape, attention, norm, activations, recompute and Megatron's model
flags. Re-exported by the config package (import it from there); imports nothing of ours but
config/fields.py and config/shapes.py."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import opt
from .moe import MoEFields
from .shapes import MEGATRON_GDN_DEFAULTS, FfnShape, GdnHeads, MixerShape, mixer_shape


def default_linear_chunk_size(device_type: str) -> int:
    """--linear-chunk-size when not given: 64 on CUDA (the Triton kernels), 16 on CPU (see its help)."""
    return 64 if device_type == "cuda" else 16


@dataclass
class ModelConfig(MoEFields):
    num_layers: int = opt(4, "--num-layers", "number of transformer layers")
    hidden_size: int = opt(128, "--hidden-size", "model width")
    num_attention_heads: int = opt(4, "--num-attention-heads", "attention heads (query heads)")
    num_query_groups: int | None = opt(
        None,
        "--num-query-groups",
        "key/value heads with --group-query-attention (default 1, as Megatron; refused without it, which Megatron "
        "would ignore)",
    )
    ffn_hidden_size: int | None = opt(
        None,
        "--ffn-hidden-size",
        "MLP inner width (default, as Megatron: 4*hidden for gelu, int(8/3*hidden / 64)*64 for swiglu)",
    )
    seq_length: int = opt(256, "--seq-length", "training sequence length in tokens")
    max_position_embeddings: int | None = opt(
        None, "--max-position-embeddings", "longest position the model supports (default: seq length)"
    )
    vocab_size: int = opt(
        512, "--vocab-size", "vocabulary size when no tokenizer model gives one (mock data, NullTokenizer)"
    )
    make_vocab_size_divisible_by: int = opt(
        128, "--make-vocab-size-divisible-by", "pad the vocabulary to a multiple of this times TP"
    )
    normalization: str = opt("LayerNorm", "--normalization", "norm layer", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "--norm-epsilon", "epsilon of the norm layers")
    activation: str = opt(
        "gelu",
        "--activation",
        "MLP activation (Megatron's --swiglu is --activation swiglu, --squared-relu is squared_relu: relu(x)^2)",
        choices=["gelu", "swiglu", "squared_relu"],
    )
    bias_gelu_fusion: bool = opt(
        True,
        "--bias-gelu-fusion",
        "as Megatron: with biases, gelu is its fused bias-gelu, the tanh approximation; --no-bias-gelu-fusion (or "
        "no biases: --disable-bias-linear) computes the exact erf gelu instead",
    )
    openai_gelu: bool = opt(False, "--openai-gelu", "as Megatron: gelu is the tanh approximation (OpenAI's) always")
    rotary_base: float = opt(10000.0, "--rotary-base", "RoPE base frequency")
    untie_embeddings_and_output_weights: bool = opt(
        False, "--untie-embeddings-and-output-weights", "separate input embedding and output layer weights"
    )
    attention_type: str = opt(
        "softmax",
        "--attention-type",
        "token mixer of every layer (gdn: Gated DeltaNet; kda: Kimi Delta Attention, Kimi Linear's per-channel-decay "
        "delta rule)",
        choices=["softmax", "gla", "gdn", "kda"],
    )
    softmax_attention_every: int = opt(
        0,
        "--softmax-attention-every",
        "hybrid model: with --attention-type gla, gdn or kda, every K-th layer (K-1, 2K-1, ...) uses softmax "
        "attention; 0 = none (1, all softmax, and K > --num-layers, none, run with a warning, as in megatron-core)",
    )
    linear_chunk_size: int | None = opt(
        None,
        "--linear-chunk-size",
        "chunk length of the chunked linear-attention forms (GLA, GDN and KDA; --gla-chunk-size, its former name, is "
        "read too); default 64 on CUDA, 16 on CPU. On a GPU 64 keeps per token "
        "and head (K = V = 128) K*V/C = 256 fp32 entering-state values and C = 64 scores, 1.3 KB, where 16 keeps "
        "1024 + 16, 4.2 KB, and the sequential state scan takes T/64 steps instead of T/16 (fla's chunk_gla uses "
        "64); on CPU 16 is the chunk bench/gla.py measures for the PyTorch reference. GLA needs a sequence (per CP "
        "rank) divisible by it; GDN takes any length (its op pads the last chunk)",
        renamed_from="gla_chunk_size",
    )
    gla_gate_low_rank: int = opt(
        0,
        "--gla-gate-low-rank",
        "rank of the GLA decay-gate projection x W_down W_up + b (the GLA paper uses 16); "
        "0 = full rank (one more head-split section of the input projection)",
    )
    gla_gate_normalizer: float = opt(16.0, "--gla-gate-normalizer", "GLA log-decay = logsigmoid(.) / normalizer")
    hidden_dropout: float = opt(
        0.1, "--hidden-dropout", "dropout on the embedding output and after the attention and MLP outputs"
    )
    attention_dropout: float = opt(0.1, "--attention-dropout", "dropout on softmax attention probabilities")
    dropout_masks: str = opt(
        "layout-invariant",
        "--dropout-masks",
        "layout-invariant: each element's dropout mask is a hash of its place in the global batch (seed, site, "
        "sample, token, channel or head and key), so every parallel layout drops the single rank's elements "
        "(attention dropout then runs the attention explicitly, not in a flash kernel); per-rank: torch's "
        "generators, as Megatron (masks differ per layout)",
        choices=["layout-invariant", "per-rank"],
    )
    init_method_std: float = opt(0.02, "--init-method-std", "std of the normal weight init")
    recompute_granularity: str | None = opt(
        None,
        "--recompute-granularity",
        "activation recompute: full = whole transformer layers (with --recompute-method and "
        "--recompute-num-layers); selective = the core of each token mixer (softmax attention's scores, softmax and "
        "weighted sum; GLA's gates, chunked operator, head norm and output gate)",
        choices=["full", "selective"],
    )
    recompute_method: str | None = opt(
        None,
        "--recompute-method",
        "with --recompute-granularity full: uniform = every group of --recompute-num-layers consecutive layers of a "
        "(virtual) pipeline stage is recomputed as one unit; block = the first --recompute-num-layers layers of each "
        "(virtual) pipeline stage are recomputed, the rest are not",
        choices=["uniform", "block"],
    )
    recompute_num_layers: int | None = opt(
        None,
        "--recompute-num-layers",
        "with --recompute-granularity full: layers per recomputed unit (uniform) or recomputed layers per (virtual) "
        "pipeline stage (block)",
    )

    # Megatron-LM compatibility: its flags with its defaults; what is not built is refused by validation
    group_query_attention: bool = opt(
        False, "--group-query-attention", "grouped-query attention with --num-query-groups key/value heads"
    )
    kv_channels: int | None = opt(
        None,
        "--kv-channels",
        "the head dim of every mixer, as Megatron (default: --hidden-size / --num-attention-heads; Qwen3-Next's "
        "head_dim 256 at hidden 2048 and 16 heads is another): the attention's projections are heads x head dim wide",
    )
    position_embedding_type: str = opt(
        "learned_absolute",
        "--position-embedding-type",
        "position embedding: learned_absolute (Megatron's default: a learned [max-position-embeddings, hidden] table "
        "added to the word embedding), rope, or none; yarn, mrope and relative are not built",
        choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
    )
    rotary_percent: float = opt(
        1.0,
        "--rotary-percent",
        "fraction of the head dim RoPE rotates, as Megatron: the first int(head dim x fraction) channels of each "
        "q/k head, with frequencies over that width; the rest pass unrotated",
    )
    rotary_interleaved: bool = opt(
        False,
        "--rotary-interleaved",
        "RoPE rotates the pairs (x[2i], x[2i+1]) (GPT-J's layout, as Megatron's flag), not (x[i], x[i + d/2])",
    )
    qk_layernorm: bool = opt(
        False,
        "--qk-layernorm",
        "normalize each query and key head (--normalization, --norm-epsilon, a [head dim] weight shared by the "
        "heads) before RoPE, as Megatron",
    )
    add_bias_linear: bool = opt(
        True,
        "--add-bias-linear",
        "biases in the linear layers (qkv, attention output, fc1, fc2; never the output layer), as Megatron's "
        "default; --disable-bias-linear (Megatron's flag) turns them off. GLA's projections take none either way",
    )
    add_qkv_bias: bool = opt(
        False, "--add-qkv-bias", "a bias on the qkv projection only (implied by --add-bias-linear), as Megatron"
    )
    attention_output_gate: bool = opt(
        False,
        "--attention-output-gate",
        "softmax attention's output gate, as Megatron and Qwen3-Next: qkv also projects a gate per query channel, and "
        "the attention output is multiplied by sigmoid(gate) (element-wise) before the output projection; needs "
        "softmax layers",
    )
    qk_layernorm_full_width: bool = opt(
        False,
        "--qk-layernorm-full-width",
        "with --qk-layernorm (RMSNorm): normalize the whole query projection and the whole key projection (all heads "
        "together, weights [heads x head dim]) instead of each head, as OLMo 2/3 and OLMo Hybrid's q_norm/k_norm; "
        "under TP each rank holds its heads' weights and the sum of squares is all-reduced over the TP ranks",
    )
    reordered_norms: str = opt(
        "none",
        "--reordered-norms",
        "OLMo 2's reordered norms: the layers named have no input norms and normalize their mixer's and MLP's "
        "outputs before the residual adds (x + norm(mixer(x)), x + norm(mlp(x))); none, softmax (OLMo Hybrid: its "
        "attention layers, the linear-attention layers stay pre-norm) or all (OLMo 2/3)",
        choices=["none", "softmax", "all"],
    )
    linear_allow_neg_eigval: bool = opt(
        False,
        "--linear-allow-neg-eigval",
        "GDN: beta = 2 sigmoid(x W_b), in (0, 2), so that the transition I - beta k k^T can have negative "
        "eigenvalues (Grazzi et al. 2025; OLMo Hybrid's linear_allow_neg_eigval)",
    )
    linear_norm_epsilon: float | None = opt(
        None,
        "--linear-norm-epsilon",
        "epsilon of the GDN output norm (default: --norm-epsilon; OLMo Hybrid's is 1e-5 whatever its rms_norm_eps)",
    )
    apply_layernorm_1p: bool = opt(
        False,
        "--apply-layernorm-1p",
        "zero-centred norm weights: stored w, initialised 0, applied as 1 + w (LayerNorm and RMSNorm, as Megatron's "
        "transformer-engine norms; the Gated DeltaNet output norm's too, as megatron-core's: --gdn-out-norm)",
    )
    attention_backend: str = opt(
        "auto",
        "--attention-backend",
        "softmax attention kernel, mapped to PyTorch SDPA's backends on CUDA: flash = flash attention, fused = "
        "cuDNN/memory-efficient, unfused/local = the math path, auto = SDPA's own choice (--use-flash-attn = flash); "
        "on CPU SDPA's CPU kernel runs whatever the choice (the log says which)",
        choices=["auto", "flash", "fused", "unfused", "local"],
    )
    experimental_attention_variant: str | None = opt(
        None,
        "--experimental-attention-variant",
        "Megatron's token-mixer variant: gated_delta_net is --attention-type gdn (its --linear-attention-freq N is "
        "--softmax-attention-every N; its --linear-* shapes, their Megatron defaults included, must be our GDN's); "
        "dsa (DeepSeek sparse attention) is not built",
        choices=["gated_delta_net", "dsa"],
    )
    linear_conv_kernel_dim: int | None = opt(
        None,
        "--linear-conv-kernel-dim",
        "Megatron's GDN convolution kernel (its default 4 with --experimental-attention-variant gated_delta_net): "
        "only our layer's kernel, 4, is built",
    )
    linear_key_head_dim: int | None = opt(
        None,
        "--linear-key-head-dim",
        "Gated DeltaNet's query/key head dim, Megatron's flag (default: the head dim, --hidden-size / "
        "--num-attention-heads; Megatron's 128 with --experimental-attention-variant gated_delta_net)",
    )
    linear_value_head_dim: int | None = opt(
        None,
        "--linear-value-head-dim",
        "Gated DeltaNet's value/output-gate head dim, Megatron's flag; the state is key x value dim per value head "
        "(default: the head dim; Megatron's 128 with its variant)",
    )
    linear_num_key_heads: int | None = opt(
        None,
        "--linear-num-key-heads",
        "Gated DeltaNet's query/key heads, Megatron's flag (default: --num-attention-heads; Megatron's 16 with its "
        "variant); divisible by --tensor-model-parallel-size",
    )
    linear_num_value_heads: int | None = opt(
        None,
        "--linear-num-value-heads",
        "Gated DeltaNet's value heads (the state's), a multiple of its key heads: value head j reads key head "
        "j // (value heads / key heads), as megatron-core (default: --num-attention-heads; Megatron's 32 with its "
        "variant); divisible by --tensor-model-parallel-size",
    )
    gdn_head_norm: str = opt(
        "shared",
        "--gdn-head-norm",
        "Gated DeltaNet's output norm weight: shared, one [value head dim] weight for every head (megatron-core, "
        "fla, Qwen3-Next), or per_head, one per channel of every head (this codebase before): a checkpoint saved "
        "with per-head weights loads into shared ones when every head's weights are equal, else give per_head",
        choices=["shared", "per_head"],
    )
    gdn_out_norm: str = opt(
        "model",
        "--gdn-out-norm",
        "Gated DeltaNet's output norm (per value head, before the silu gate): model, the model's --normalization "
        "and --apply-layernorm-1p (megatron-core's out_norm: a LayerNorm with a bias under LayerNorm, the weight "
        "zero-centred, applied as 1 + w, under 1p), or rmsnorm, a plain RMSNorm whatever they are (fla's "
        "GatedDeltaNet; GDN checkpoints saved before this flag load as rmsnorm)",
        choices=["model", "rmsnorm"],
    )

    @property
    def kv_heads(self) -> int:
        if self.group_query_attention:
            return self.num_query_groups or 1
        return self.num_attention_heads

    @property
    def gelu_approximate(self) -> str:
        """F.gelu's `approximate` for Megatron's flags: its fused bias-gelu and openai_gelu are the tanh form,
        its plain F.gelu (no biases, or --no-bias-gelu-fusion) the exact erf form."""
        return "tanh" if self.openai_gelu or (self.add_bias_linear and self.bias_gelu_fusion) else "none"

    @property
    def rotary_dim(self) -> int:
        """Channels of each q/k head that RoPE rotates (Megatron: kv_channels x rotary_percent)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def head_dim(self) -> int:
        """--kv-channels, else --hidden-size / --num-attention-heads (Megatron's rule)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.activation == "swiglu":  # Megatron's rounding: down to a multiple of 64 (5440 at hidden 2048)
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def qkv_bias(self) -> bool:
        """Whether softmax attention's qkv projection has a bias (Megatron: either flag)."""
        return self.add_bias_linear or self.add_qkv_bias

    def reordered_norm(self, layer: int) -> bool:
        """Whether global layer `layer` normalizes its branches' outputs (--reordered-norms) instead of their inputs."""
        return self.reordered_norms == "all" or (
            self.reordered_norms == "softmax" and self.layer_kind(layer) == "softmax"
        )

    @property
    def gdn_norm(self) -> tuple[str, bool]:
        """The GDN output norm: (RMSNorm or LayerNorm, zero-centred), by --gdn-out-norm."""
        if self.gdn_out_norm == "rmsnorm":
            return "RMSNorm", False
        return self.normalization, self.apply_layernorm_1p

    @property
    def gdn_norm_epsilon(self) -> float:
        """The GDN output norm's epsilon: --linear-norm-epsilon, else --norm-epsilon."""
        return self.norm_epsilon if self.linear_norm_epsilon is None else self.linear_norm_epsilon

    def layer_kind(self, layer: int) -> str:
        """'softmax', 'gla', 'gdn' or 'kda' for global layer index `layer` (0-based)."""
        if self.attention_type == "softmax":
            return "softmax"
        k = self.softmax_attention_every
        return "softmax" if k and (layer + 1) % k == 0 else self.attention_type

    def mixer(self, layer: int) -> MixerShape:
        """The token mixer of global layer `layer`: what every reader outside the layer asks of it."""
        return self.mixer_of_kind(self.layer_kind(layer))

    def mixer_of_kind(self, kind: str) -> MixerShape:
        """This model's mixer of `kind` ('softmax', 'gla', 'gdn', 'kda'): what its layer builds."""
        return mixer_shape(
            kind,
            self.num_attention_heads,
            self.head_dim,
            self.kv_heads,
            self.gla_gate_low_rank,
            self.linear_chunk_size,
            self.attention_output_gate,
            self.gdn_heads if kind == "gdn" else None,
        )

    @property
    def gdn_heads(self) -> GdnHeads:
        """Gated DeltaNet's heads: the --linear-* flags; when not given, Megatron's defaults with
        --experimental-attention-variant gated_delta_net, else --num-attention-heads heads of the head dim."""
        megatron = self.experimental_attention_variant == "gated_delta_net"

        def pick(name: str, ours: int) -> int:
            given = getattr(self, name)
            return given if given is not None else (MEGATRON_GDN_DEFAULTS[name] if megatron else ours)

        heads, dim = self.num_attention_heads, self.head_dim
        return GdnHeads(
            pick("linear_num_key_heads", heads),
            pick("linear_num_value_heads", heads),
            pick("linear_key_head_dim", dim),
            pick("linear_value_head_dim", dim),
        )

    def ffn(self, layer: int) -> FfnShape:
        """The feed-forward network of global layer `layer`: a dense MLP, or routed experts (--num-experts,
        --moe-layer-freq) with their top-k and the shared expert's width."""
        gated = self.activation == "swiglu"
        if not self.is_moe_layer(layer):
            return FfnShape("dense", self.ffn_size, gated)
        shared = self.moe_shared_expert_intermediate_size or 0
        return FfnShape("moe", self.expert_ffn_size, gated, self.num_experts or 0, self.moe_router_topk, shared)
