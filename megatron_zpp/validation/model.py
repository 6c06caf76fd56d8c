"""The model: shapes against TP/CP, recompute, and Megatron-LM model flags whose other values
are not built here."""

from __future__ import annotations

from ..config import Config
from ..config.megatron_flags import check_megatron_gdn, check_megatron_noops
from .common import derived, failed
from .parallel import chunk_layer_counts


def check_gdn_heads(cfg: Config, world_size: int) -> list[str]:
    """Gated DeltaNet's heads (ModelConfig.gdn_heads): value heads in whole groups per key head, key heads split
    over TP, so that each rank holds whole groups (the value heads then divide by TP too)."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if m.attention_type != "gdn":
        return []
    g = m.gdn_heads
    keys, values = f"--linear-num-key-heads {g.key_heads}", f"--linear-num-value-heads {g.value_heads}"
    return failed(
        [
            (
                min(g.key_heads, g.value_heads, g.key_dim, g.value_dim) >= 1,
                f"Gated DeltaNet heads {keys}, {values}, --linear-key-head-dim {g.key_dim}, --linear-value-head-dim "
                f"{g.value_dim}: each must be >= 1",
            ),
            (
                g.key_heads < 1 or g.value_heads % g.key_heads == 0,
                f"{values} is not a multiple of {keys} (each key head is read by a whole group of value heads)",
            ),
            (g.key_heads % tp == 0, f"{keys} is not divisible by --tensor-model-parallel-size {tp}"),
        ]
    )


def check_model(cfg: Config, world_size: int) -> list[str]:
    m, p = cfg.model, cfg.parallel
    tp, cp, s = p.tensor_model_parallel_size, p.context_parallel_size, m.seq_length // p.context_parallel_size
    mixer = m.mixer_of_kind(m.attention_type)
    halo = mixer.halo_tokens  # the previous CP slice's tokens a convolution reads
    seq = f"sequence per CP rank {s}" if cp > 1 else f"--seq-length {s}"
    return failed(
        [
            (
                m.hidden_size % m.num_attention_heads == 0,
                f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
            ),
            (
                m.num_attention_heads % m.kv_heads == 0,
                f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.kv_heads}",
            ),
            (
                m.num_attention_heads % tp == 0,
                f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}",
            ),
            (
                m.kv_heads % tp == 0,
                f"--num-query-groups {m.kv_heads} is not divisible by --tensor-model-parallel-size {tp}",
            ),
            (
                m.head_dim % 2 == 0,
                f"head dim {m.head_dim} (--hidden-size / --num-attention-heads) must be even for RoPE",
            ),
            (
                m.ffn_size % tp == 0,
                f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}",
            ),
            (m.softmax_attention_every >= 0, "--softmax-attention-every must be >= 0"),
            (
                not (m.softmax_attention_every and m.attention_type == "softmax"),
                "--softmax-attention-every needs --attention-type gla, gdn or kda (the other layers are linear "
                "attention)",
            ),
            (m.gla_gate_low_rank >= 0, f"--gla-gate-low-rank must be >= 0 (got {m.gla_gate_low_rank})"),
            (
                m.seq_length <= derived(m.max_position_embeddings),
                f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_position_embeddings}",
            ),
            (m.seq_length % cp == 0, f"--seq-length {m.seq_length} is not divisible by --context-parallel-size {cp}"),
            (
                p.all_scan_blocks == 0 or (p.all_scan_blocks >= 1 and mixer.scan_extent % p.all_scan_blocks == 0),
                f"--all-scan-blocks {p.all_scan_blocks} must divide the state dimension its blocks cut, "
                f"{mixer.scan_extent} (or be 0: auto)",
            ),
            (
                # GDN's and KDA's ops pad the last chunk, and so does their CP operator
                m.attention_type != "gla" or s % derived(m.linear_chunk_size) == 0,
                f"{seq} is not divisible by --linear-chunk-size {m.linear_chunk_size} ({m.attention_type.upper()})",
            ),
            (
                cp == 1 or m.seq_length // cp >= halo,
                f"--attention-type {m.attention_type}: sequence per CP rank {m.seq_length // cp} is shorter than the "
                f"convolution's {halo} tokens it reads from the previous rank",
            ),
            (
                not p.sequence_parallel or (m.seq_length // cp) % tp == 0,
                f"--sequence-parallel: sequence per CP rank {m.seq_length // cp} is not divisible by TP {tp}",
            ),
        ]
    ) + check_block_variants(m)


def check_block_variants(m) -> list[str]:
    """OLMo's block flags (--reordered-norms, --qk-layernorm-full-width) and the GDN ones (--linear-allow-neg-eigval,
    --linear-norm-epsilon) where the model has the layers they change."""
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    spelled = f"--attention-type {m.attention_type}, --softmax-attention-every {m.softmax_attention_every}"
    return failed(
        [
            (
                not m.qk_layernorm_full_width or (m.qk_layernorm and m.normalization == "RMSNorm"),
                "--qk-layernorm-full-width normalizes q and k over all their heads with RMSNorm: it needs "
                f"--qk-layernorm and --normalization RMSNorm (got qk-layernorm {m.qk_layernorm}, {m.normalization})",
            ),
            (
                m.reordered_norms != "softmax" or "softmax" in kinds,
                f"--reordered-norms softmax: this model has no softmax attention layer ({spelled}): drop it",
            ),
            (
                not (m.linear_allow_neg_eigval or m.linear_norm_epsilon is not None) or "gdn" in kinds,
                f"--linear-allow-neg-eigval and --linear-norm-epsilon change Gated DeltaNet layers, and this model "
                f"has none ({spelled}): drop them",
            ),
            (
                m.linear_norm_epsilon is None or m.linear_norm_epsilon > 0,
                f"--linear-norm-epsilon must be > 0 (got {m.linear_norm_epsilon})",
            ),
        ]
    )


def check_recompute(cfg: Config, world_size: int) -> list[str]:
    m = cfg.model
    gran, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    if gran != "full":
        return failed(
            [
                (method is None, "--recompute-method needs --recompute-granularity full"),
                (n is None, "--recompute-num-layers needs --recompute-granularity full"),
            ]
        )
    if method is None or n is None:
        return [
            "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
            "(or use --recompute-granularity selective)"
        ]
    most = max(chunk_layer_counts(cfg), default=m.num_layers)
    return failed(
        [
            (n >= 1, f"--recompute-num-layers must be >= 1 (got {n})"),
            (
                method != "block" or n <= most,
                f"--recompute-num-layers {n} exceeds the {most} layers of a (virtual) pipeline stage: with "
                f"--recompute-method block use at most {most}",
            ),
        ]
    )


_UNBUILT_POSITIONS = {
    "yarn": "YaRN's RoPE scaling (for context extension) is not built",
    "mrope": "multimodal RoPE (sections per image axis) is not built: this is a text-only GPT",
    "relative": "T5-style relative position buckets are not built (a GPT-2/Llama codebase)",
}


def check_megatron_model(cfg: Config, world_size: int) -> list[str]:
    """Megatron-LM model flags whose other values are not built here."""
    m = cfg.model
    megatron = check_megatron_gdn(m) + check_megatron_noops(m, getattr(cfg, "megatron_noops", []))
    return megatron + failed(
        [
            (
                m.position_embedding_type in ("learned_absolute", "rope", "none"),
                f"--position-embedding-type {m.position_embedding_type}: "
                f"{_UNBUILT_POSITIONS.get(m.position_embedding_type)}; use learned_absolute (Megatron's default), "
                "rope or none",
            ),
            (
                m.kv_channels is None or m.kv_channels >= 1,
                f"--kv-channels {m.kv_channels}: the head dim must be at least 1 (or drop it: --hidden-size / "
                "--num-attention-heads)",
            ),
            (
                0 < m.rotary_percent <= 1 and m.rotary_dim >= 2 and m.rotary_dim % 2 == 0,
                f"--rotary-percent {m.rotary_percent}: rotates {m.rotary_dim} of the {m.head_dim} channels of a head; "
                "give a fraction in (0, 1] that makes an even number of at least 2",
            ),
            (
                m.attention_backend not in ("flash", "fused")
                or cfg.train.bf16
                or cfg.train.fp16
                or cfg.train.device == "cpu",
                f"--attention-backend {m.attention_backend}: SDPA's flash and fused kernels take 16-bit inputs: add "
                "--bf16 or --fp16, or use --attention-backend auto/unfused",
            ),
            (
                m.num_query_groups is None or m.group_query_attention,
                f"--num-query-groups {m.num_query_groups} needs --group-query-attention (Megatron ignores it "
                "without, and uses one key/value head per query head): add it, or drop --num-query-groups",
            ),
            (
                m.num_query_groups is None or m.num_query_groups >= 1,
                f"--num-query-groups must be >= 1 (got {m.num_query_groups})",
            ),
            (
                not m.attention_output_gate or any(m.layer_kind(i) == "softmax" for i in range(m.num_layers)),
                f"--attention-output-gate gates softmax attention's output, and this model has none (--attention-type "
                f"{m.attention_type}, --softmax-attention-every {m.softmax_attention_every}): drop it, or give "
                "softmax layers",
            ),
            (
                m.ffn_size >= 1,
                f"--swiglu: Megatron's default MLP width int(8/3 x {m.hidden_size} / 64) x 64 is 0 at --hidden-size "
                f"{m.hidden_size}: give --ffn-hidden-size",
            ),
        ]
    )


def model_warnings(cfg: Config) -> list[str]:
    """What Megatron-LM accepts without a word but likely is a slip: one start-up line each (the run goes on,
    as Megatron's would). A hybrid period of 1 leaves no linear-attention layer, one past --num-layers no
    softmax layer (megatron-core's own pattern: layer i is softmax attention where (i + 1) % N == 0)."""
    m = cfg.model
    k, kind = m.softmax_attention_every, m.attention_type.upper()
    if m.attention_type == "softmax" or not k or 1 < k <= m.num_layers:
        return []
    spelled = f"--softmax-attention-every {k} (Megatron's --linear-attention-freq {k})"
    if k == 1:
        return [
            f"{spelled}: every layer is softmax attention, no {kind} layer is left (--attention-type {kind.lower()})"
        ]
    return [f"{spelled} is past --num-layers {m.num_layers}: no layer is softmax attention, all are {kind}"]
