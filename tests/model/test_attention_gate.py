"""Softmax attention with --attention-output-gate, partial RoPE (--rotary-percent), zero-centred norms
(--apply-layernorm-1p) and q/k norms (--qk-layernorm) against transformers' own `Qwen3NextAttention` on the same
weights (fp32), and against megatron-core's `SelfAttention` with `attention_output_gate` run on CPU.

Row layouts: ours q | k | v | gate; Qwen3-Next's q_proj [q_h | gate_h] per head; megatron-core's linear_qkv
[q heads | gate heads | k | v] per query group."""

import contextlib
import importlib
import types
from dataclasses import replace
from unittest import mock

import pytest
import torch
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

from megatron_zpp.config import ModelConfig
from megatron_zpp.model import ParallelContext
from megatron_zpp.model.attention import SelfAttention
from megatron_zpp.model.rope import rope_tables
from tests.dist import run_distributed
from tests.test_parity import BASE, assert_matches_reference, train_and_collect

H, HEADS, KV, B, T = 64, 4, 2, 2, 11
D = H // HEADS


def _ours(rotary_percent: float, gate: bool = True, **kw) -> SelfAttention:
    settings = dict(
        hidden_size=H,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=KV,
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        position_embedding_type="rope",
        rotary_percent=rotary_percent,
        rotary_base=10000.0,
        qk_layernorm=True,
        apply_layernorm_1p=True,
        add_bias_linear=False,
        attention_output_gate=gate,
        attention_dropout=0.0,
        seq_length=T,
    )
    cfg = ModelConfig(**{**settings, **kw})
    layer = SelfAttention(cfg, ParallelContext(), out_std=0.02)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight away from its init: 1p norms start at 0, which hides 1 + w vs w
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return layer.eval()


def _split(layer: SelfAttention) -> tuple[torch.Tensor, ...]:
    """Our qkv rows as (q, k, v, gate), each [heads, D, H]."""
    q, k, v, g = layer.qkv.weight.detach().split([HEADS * D, KV * D, KV * D, HEADS * D])
    return q.view(HEADS, D, H), k.view(KV, D, H), v.view(KV, D, H), g.view(HEADS, D, H)


def _qwen3_next(layer: SelfAttention, rotary_percent: float) -> tuple[Qwen3NextAttention, Qwen3NextConfig]:
    config = Qwen3NextConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=D,
        rms_norm_eps=1e-6,
        attention_bias=False,
        attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary_percent},
    )
    config._attn_implementation = "eager"
    ref = Qwen3NextAttention(config, layer_idx=0).eval()
    q, k, v, g = _split(layer)
    with torch.no_grad():
        ref.q_proj.weight.copy_(torch.cat([q, g], 1).reshape(-1, H))  # per head: query then gate
        ref.k_proj.weight.copy_(k.reshape(-1, H))
        ref.v_proj.weight.copy_(v.reshape(-1, H))
        ref.o_proj.weight.copy_(layer.proj.weight)
        ref.q_norm.weight.copy_(layer.q_norm.weight)  # both store w and scale by 1 + w
        ref.k_norm.weight.copy_(layer.k_norm.weight)
    return ref, config


@pytest.mark.parametrize("rotary_percent", [1.0, 0.25, 0.5])
def test_matches_transformers_qwen3_next_attention(rotary_percent):
    """Output and every weight's gradient equal Qwen3-Next's (fp32, 1e-6), partial rotary included."""
    layer = _ours(rotary_percent)
    ref, config = _qwen3_next(layer, rotary_percent)
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(T)
    ours = layer(x, rope_tables(layer.rotary_dim, positions, 10000.0))
    cos, sin = Qwen3NextRotaryEmbedding(config)(x, positions[None].expand(B, T))
    assert cos.shape[-1] == int(D * rotary_percent)  # their partial width is ours
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    theirs, _ = ref(x, (cos, sin), causal)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)

    (ours * theirs.detach().cos()).sum().backward()
    (theirs * theirs.detach().cos()).sum().backward()
    gq, gk, gv, gg = (t.grad for t in (ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight, ref.o_proj.weight))
    q_and_gate = gq.view(HEADS, 2, D, H)
    theirs_qkv = torch.cat([q_and_gate[:, 0].reshape(-1, H), gk, gv, q_and_gate[:, 1].reshape(-1, H)])
    pairs = [(layer.qkv, theirs_qkv), (layer.proj, gg), (layer.q_norm, ref.q_norm.weight.grad)]
    for ours_grad, theirs_grad in [(m.weight.grad, t) for m, t in pairs] + [
        (layer.k_norm.weight.grad, ref.k_norm.weight.grad)
    ]:
        _close(ours_grad, theirs_grad)


def _close(ours: torch.Tensor, theirs: torch.Tensor, tol: float = 1e-6) -> None:
    """Within `tol` of the reference's largest entry (fp32 sums of a few hundred terms)."""
    err = (ours - theirs).abs().max().item()
    assert err <= tol * theirs.abs().max().item(), (err, theirs.abs().max().item())


def test_gate_off_is_the_ungated_layer_and_the_gate_acts():
    """Without the flag qkv has no gate rows; with it, the output is the ungated one times sigmoid(gate)
    before the output projection (a gate of +inf is the ungated layer), and a changed gate changes it."""
    gated, plain = _ours(0.5), _ours(0.5, gate=False)
    assert gated.qkv.weight.shape[0] == plain.qkv.weight.shape[0] + HEADS * D
    with torch.no_grad():
        plain.load_state_dict(
            {**gated.state_dict(), "qkv.weight": gated.qkv.weight[: plain.qkv.weight.shape[0]]}, strict=True
        )
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(2))
    rope = rope_tables(gated.rotary_dim, torch.arange(T), 10000.0)
    assert (gated(x, rope) - plain(x, rope)).abs().max() > 1e-2
    with torch.no_grad():
        gated.qkv.weight[-HEADS * D :] = 0.0
    # a zero gate row is sigmoid(0) = 1/2 on every channel: half the ungated output before proj (no bias)
    torch.testing.assert_close(gated(x, rope), 0.5 * plain(x, rope), rtol=1e-6, atol=1e-7)


class _GroupOfOne:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@contextlib.contextmanager
def _mcore_on_cpu():
    """megatron-core's attention on CPU: its buffers ask torch.cuda.current_device() (-> 'cpu'), and its
    unfused core attention takes its scores buffer from the global memory buffer (one of its own, set here) and
    forks the CUDA RNG tracker around its dropout (p = 0 here: no fork)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.utils import GlobalMemoryBuffer

    no_fork = types.SimpleNamespace(fork=contextlib.nullcontext)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(parallel_state, "_GLOBAL_MEMORY_BUFFER", GlobalMemoryBuffer()))
        stack.enter_context(mock.patch.object(tensor_parallel, "get_cuda_rng_tracker", lambda: no_fork))
        for name in ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers"):
            module = importlib.import_module(name)  # its groups are stand-ins of size one: passed through
            stack.enter_context(mock.patch.object(module, "get_tensor_model_parallel_group_if_none", lambda g, **k: g))
        yield


def _mcore_attention(rotary_percent: float):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=HEADS, num_query_groups=KV, kv_channels=D,
        add_bias_linear=False, use_cpu_initialization=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
        qk_layernorm=True, attention_output_gate=True, attention_dropout=0.0,
        hidden_dropout=0.0, rotary_interleaved=False, apply_rope_fusion=False,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules.self_attention
    group = _GroupOfOne()
    pgs = types.SimpleNamespace(**{k: group for k in ("tp", "cp", "tp_cp", "dp", "pp")})
    from megatron.core.transformer.spec_utils import build_module

    return build_module(spec, config=tcfg, layer_number=1, pg_collection=pgs), tcfg


def test_matches_megatron_core_self_attention_with_output_gate():
    """megatron-core 0.19.2's SelfAttention (local spec: q/k RMSNorm, unfused core attention) with
    attention_output_gate and rotary_percent 0.5, on our weights: output and gradients (fp32). Its torch norms
    hold no zero-centred gamma, so 1p is off here (Qwen3-Next's test above covers it)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    layer = _ours(0.5, apply_layernorm_1p=False)
    q, k, v, g = _split(layer)
    per = HEADS // KV
    with _mcore_on_cpu():
        ref, _ = _mcore_attention(0.5)
        with torch.no_grad():  # per query group: its q heads, their gate heads, its k head, its v head
            ref.linear_qkv.weight.copy_(
                torch.cat([q.view(KV, per * D, H), g.view(KV, per * D, H), k, v], 1).flatten(0, 1)
            )
            ref.linear_proj.weight.copy_(layer.proj.weight)
            ref.q_layernorm.weight.copy_(layer.q_norm.weight)
            ref.k_layernorm.weight.copy_(layer.k_norm.weight)
        x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(3))
        emb = RotaryEmbedding(kv_channels=D, rotary_percent=0.5, rotary_base=10000, use_cpu_initialization=True)(T)
        causal = torch.ones(1, 1, T, T, dtype=torch.bool).triu(1)  # True: masked
        theirs, _ = ref(x.transpose(0, 1).contiguous(), attention_mask=causal, rotary_pos_emb=emb)
        theirs = theirs.transpose(0, 1)
        ours = layer(x, rope_tables(layer.rotary_dim, torch.arange(T), 10000.0))
        _close(ours, theirs)
        (ours * theirs.detach().cos()).sum().backward()
        (theirs * theirs.detach().cos()).sum().backward()
    wq, wg, wk, wv = ref.linear_qkv.weight.grad.view(KV, 2 * per + 2, D, H).split([per, per, 1, 1], 1)
    theirs_qkv = torch.cat([t.reshape(-1, H) for t in (wq, wk, wv, wg)])
    _close(layer.qkv.weight.grad, theirs_qkv)
    _close(layer.proj.weight.grad, ref.linear_proj.weight.grad)
    _close(layer.q_norm.weight.grad, ref.q_layernorm.weight.grad)
    _close(layer.k_norm.weight.grad, ref.k_layernorm.weight.grad)


def test_gate_is_refused_where_no_format_holds_it_and_without_softmax_layers():
    """HF export: no format of ours holds the gate yet (GPT-2, Llama, our remote code): refused by name, not
    exported without it. Validation: the flag on a model with no softmax layer is one line naming it."""
    from megatron_zpp.checkpoint.formats.base import ConversionError
    from megatron_zpp.checkpoint.formats.hf import export_format
    from megatron_zpp.config import Config, ConfigError
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.validation import validate

    cfg = Config()
    cfg.model = ModelConfig(
        hidden_size=H, num_attention_heads=HEADS, normalization="RMSNorm", activation="swiglu",
        position_embedding_type="rope", add_bias_linear=False, attention_output_gate=True,
    )  # fmt: skip
    with pytest.raises(ConversionError) as refused:
        export_format(cfg)
    assert str(refused.value).count("--attention-output-gate") == 4  # GPT-2, Llama, OLMo Hybrid, remote
    with pytest.raises(ConfigError, match="--attention-output-gate gates softmax attention's output.*none"):
        validate(parse_args("--mock-data --attention-type gla --attention-output-gate".split()), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_is_qwen3_nexts(dtype):
    """--apply-layernorm-1p's RMSNorm equals Qwen3NextRMSNorm bitwise, in bf16 too: 1 + w formed in fp32 (in
    bf16 it rounded w to steps of 2^-7: 575 of 2048 outputs differed, by up to 1.6e-2, before the fix)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from megatron_zpp.model.norm import RMSNorm

    ours, theirs = RMSNorm(256, 1e-6, one_plus=True), Qwen3NextRMSNorm(256, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(0.01 * torch.randn(256, generator=torch.Generator().manual_seed(0)))
        theirs.weight.copy_(ours.weight)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours_y, theirs_y = ours.to(dtype)(x), theirs.to(dtype)(x)
    assert ours_y.dtype == theirs_y.dtype == dtype and torch.equal(ours_y, theirs_y)


def test_flops_equal_megatron_lms():
    """perf.flops_per_token (the MFU's) of a gated GQA model equals Megatron-LM's own
    `num_floating_point_operations` on the same command line (its parser and validate_args), gate term included."""
    import sys
    import typing

    import typing_extensions

    typing.override = getattr(typing, "override", typing_extensions.override)  # megatron.training needs 3.12's
    from megatron.training import arguments
    from megatron.training.training import num_floating_point_operations

    from megatron_zpp import perf
    from megatron_zpp.config.arguments import parse_args

    flags = (
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
        "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 2 --swiglu "
        "--position-embedding-type rope --disable-bias-linear --normalization RMSNorm --vocab-size 512 --mock-data"
    )
    for gate in ("", " --attention-output-gate"):
        argv = (flags + gate).split()
        saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv, "--tokenizer-type", "NullTokenizer"]
        try:
            with contextlib.redirect_stdout(None):
                args = arguments.parse_args()
                arguments.validate_args(args, {})
        finally:
            sys.argv = saved
        args.padded_vocab_size = 512
        ours = perf.flops_per_token(parse_args(argv).model, 512) * 2 * 128
        assert ours == num_floating_point_operations(args, 2), gate


def _saved_activation_bytes(layer: SelfAttention, dtype: torch.dtype) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward, but the input's and the
    weights'."""
    layer = layer.to(dtype).train()
    x = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in [x, *layer.parameters()]}
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, rope_tables(layer.rotary_dim, torch.arange(T), 10000.0))
    return sum(n for ptr, n in storages.items() if ptr not in skip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimator_counts_what_the_gate_keeps(dtype):
    """planning/memory.py's softmax block with the gate minus without it is what autograd keeps more."""
    from megatron_zpp.planning import memory

    e = dtype.itemsize
    x = memory.Dims(b=B, s=T, s_norm=T, h=H, heads=HEADS, kv=KV, d=D, ffn=4 * H, vocab=64, e=e, low_rank=0,
                    dropout=False, masked=False, chunk=16)  # fmt: skip
    estimated = memory.softmax_layer(replace(x, gate=True), False) - memory.softmax_layer(x, False)
    measured = _saved_activation_bytes(_ours(1.0), dtype) - _saved_activation_bytes(_ours(1.0, gate=False), dtype)
    assert estimated == measured == (2 * e + 4) * B * T * HEADS * D


# ---- through TP, SP, CP and PP: one spawn of 4 ranks, each layout against one rank (tests/test_parity.py's rule)
# Qwen3-Next's softmax layer: the output gate, partial RoPE, 1p norms, q/k norms; init std 0.2 so that a gate
# column on the wrong rank, token or head moves the losses far past their 1e-5 (the GDN layers between are
# tests/test_parity.py's; only the softmax layers are gated)
GATED = (
    "--attention-type softmax --attention-output-gate --rotary-percent 0.5 --qk-layernorm --apply-layernorm-1p "
    "--init-method-std 0.2"
).split()
GATED_LAYOUTS = [  # 4 ranks each (DP makes up the rest); recompute reruns the gate (full) or keeps it (selective)
    "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity selective",
    "--context-parallel-size 2 --pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method "
    "uniform --recompute-num-layers 1",
    "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 --reset-attention-mask "
    "--reset-position-ids",
]


def _gated_argv(layout: str) -> list[str]:
    """The single rank's flags of `layout`: the model and its data (packed documents), no layout."""
    return BASE + GATED + ["--num-layers", "2"] + [f for f in layout.split() if f.startswith("--reset-")]


def _gated_worker(rank, world_size, layouts):
    return [train_and_collect(_gated_argv(layout) + layout.split(), world_size) for layout in layouts]


def test_gated_attention_layouts_match_single_rank():
    per_rank = run_distributed(_gated_worker, 4, GATED_LAYOUTS, timeout=600)
    references = {}
    for k, layout in enumerate(GATED_LAYOUTS):
        argv = _gated_argv(layout)
        ref = references.setdefault(tuple(argv), train_and_collect(argv, 1))
        assert any(name.endswith("mixer.qkv.weight") for name in ref["weights"])
        assert_matches_reference([r[k] for r in per_rank], ref, layout)
        assert ref["losses"][-1] < ref["losses"][0]
