"""Configuration of a megatron_zpp GLA / hybrid causal LM (transformers remote code).

Written by megatron_zpp's tools/convert_checkpoint.py --to hf next to the weights; loaded with
`AutoConfig.from_pretrained(dir, trust_remote_code=True)`. Self-contained: imports only transformers.

layer_types holds one entry per layer: "linear_attention" (gated linear attention, GLA, or Gated
DeltaNet, by linear_attention_type) or "full_attention" (causal softmax attention with RoPE and
grouped-query heads); transformers' DynamicCache reads it to keep a recurrent state for the first kind
and keys/values for the second.
"""

from __future__ import annotations

from transformers import PretrainedConfig

LAYER_TYPES = ("linear_attention", "full_attention")
LINEAR_ATTENTION_TYPES = ("gla", "gdn", "kda")


class MegatronZppGLAConfig(PretrainedConfig):
    model_type = "megatron_zpp_gla"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 128,
        intermediate_size: int = 384,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        layer_types: list[str] | None = None,
        normalization: str = "RMSNorm",
        norm_eps: float = 1e-5,
        activation: str = "swiglu",
        gelu_approximate: str = "tanh",
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 256,
        gla_gate_low_rank: int = 0,
        gla_gate_normalizer: float = 16.0,
        gla_chunk_size: int = 16,
        linear_attention_type: str = "gla",
        linear_conv_kernel: int = 4,
        linear_num_key_heads: int | None = None,
        linear_num_value_heads: int | None = None,
        linear_key_head_dim: int | None = None,
        linear_value_head_dim: int | None = None,
        gdn_head_norm: str = "per_head",
        gdn_out_norm: str = "rmsnorm",
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.layer_types = list(layer_types) if layer_types is not None else ["linear_attention"] * num_hidden_layers
        self.normalization, self.norm_eps, self.activation = normalization, norm_eps, activation
        self.gelu_approximate = gelu_approximate  # F.gelu's: "tanh" or "none" (exact erf)
        self.rope_theta, self.max_position_embeddings = rope_theta, max_position_embeddings
        self.gla_gate_low_rank, self.gla_gate_normalizer = gla_gate_low_rank, gla_gate_normalizer
        self.gla_chunk_size, self.initializer_range, self.use_cache = gla_chunk_size, initializer_range, use_cache
        self.linear_attention_type, self.linear_conv_kernel = linear_attention_type, linear_conv_kernel
        # GDN's heads (megatron-core's and Qwen3-Next's layout): key heads of K channels, value heads of V, value
        # head j reading key head j // (value heads / key heads); default one value head per key head of head_dim
        self.linear_num_key_heads = linear_num_key_heads or num_attention_heads
        self.linear_num_value_heads = linear_num_value_heads or self.linear_num_key_heads
        self.linear_key_head_dim = linear_key_head_dim or self.head_dim
        self.linear_value_head_dim = linear_value_head_dim or self.head_dim
        # GDN's output norm weight: "shared" [V] for every head, or "per_head" [heads x V] (exports before the
        # shared weight carry no key: theirs is per head)
        self.gdn_head_norm = gdn_head_norm
        # GDN's output norm: "rmsnorm", or "layernorm" with a bias too (megatron-core's out_norm under LayerNorm)
        self.gdn_out_norm = gdn_out_norm
        self._check()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _check(self) -> None:
        bad = [
            why
            for why, wrong in [
                (
                    f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
                    len(self.layer_types) != self.num_hidden_layers,
                ),
                (f"layer_types may hold only {LAYER_TYPES}", not set(self.layer_types) <= set(LAYER_TYPES)),
                (
                    f"linear_attention_type {self.linear_attention_type!r} is not one of {LINEAR_ATTENTION_TYPES}",
                    self.linear_attention_type not in LINEAR_ATTENTION_TYPES,
                ),
                (f"linear_conv_kernel {self.linear_conv_kernel!r} is not >= 1", not self.linear_conv_kernel >= 1),
                (
                    f"normalization {self.normalization!r} is not RMSNorm or LayerNorm",
                    self.normalization not in ("RMSNorm", "LayerNorm"),
                ),
                (f"activation {self.activation!r} is not swiglu or gelu", self.activation not in ("swiglu", "gelu")),
                (
                    f"gelu_approximate {self.gelu_approximate!r} is not tanh or none",
                    self.gelu_approximate not in ("tanh", "none"),
                ),
                (
                    "linear_num_value_heads is not a multiple of linear_num_key_heads",
                    self.linear_num_value_heads % self.linear_num_key_heads != 0,
                ),
                (
                    f"gdn_head_norm {self.gdn_head_norm!r} is not shared or per_head",
                    self.gdn_head_norm not in ("shared", "per_head"),
                ),  # fmt: skip
                (
                    f"gdn_out_norm {self.gdn_out_norm!r} is not rmsnorm or layernorm",
                    self.gdn_out_norm not in ("rmsnorm", "layernorm"),
                ),
                (
                    "num_attention_heads is not a multiple of num_key_value_heads",
                    self.num_attention_heads % self.num_key_value_heads != 0,
                ),
            ]
            if wrong
        ]
        if bad:
            raise ValueError("MegatronZppGLAConfig: " + "; ".join(bad))


__all__ = ["MegatronZppGLAConfig"]
