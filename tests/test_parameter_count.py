"""The memory estimator and the simulator count every parameter the model builds (Megatron's
learned positions and linear biases included), against the count written out here from the layer
shapes, and the built model's numel. The 8-layer case is a reference run's: Megatron builds 436,864
parameters for these flags, where RoPE without biases has 428,160."""

import pytest

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT
from megatron_zpp.planning import memory
from megatron_zpp.planning.simulator.collectives import rank_step
from megatron_zpp.validation import validate

ISSUE = "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"


def expected_count(cfg) -> int:
    """Embedding V h (+ positions P h); per layer: two norms, qkv (+ its output gate, + bias), the q/k norms
    (--qk-layernorm: a [d] weight each), the output projection (+ bias), fc1 (x2 for SwiGLU, + bias), fc2
    (+ bias); the final norm; an untied output layer V h (no bias)."""
    m = cfg.model
    V, h, L = memory.dims(cfg).vocab, m.hidden_size, m.num_layers
    d, n, g = m.hidden_size // m.num_attention_heads, m.num_attention_heads, m.kv_heads
    norm = (1 if m.normalization == "RMSNorm" else 2) * h
    ffn = m.ffn_size * (2 if m.activation == "swiglu" else 1)
    qkv_out = (n + 2 * g) * d + (
        n * d if m.attention_output_gate else 0
    )  # --attention-output-gate: a gate per q channel
    bias = m.add_bias_linear
    layer = 2 * norm + h * qkv_out + (qkv_out if (bias or m.add_qkv_bias) else 0)
    layer += 2 * (norm // h) * d if m.qk_layernorm else 0
    layer += n * d * h + (h if bias else 0) + h * ffn + (ffn if bias else 0) + m.ffn_size * h + (h if bias else 0)
    total = V * h + L * layer + norm
    total += (m.max_position_embeddings * h) if m.position_embedding_type == "learned_absolute" else 0
    return total + (V * h if m.untie_embeddings_and_output_weights else 0)


CASES = {
    "issue_megatron_defaults": (ISSUE, 1, 436_864),
    "issue_rope_no_bias": (ISSUE + " --position-embedding-type rope --disable-bias-linear", 1, 428_160),
    "gqa_swiglu_qkv_bias_pp2": (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
        "--swiglu --normalization RMSNorm --disable-bias-linear --add-qkv-bias --seq-length 32 "
        "--pipeline-model-parallel-size 2",
        2,
        None,
    ),
    "output_gate_qk_norm_pp2": (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
        "--swiglu --normalization RMSNorm --disable-bias-linear --add-qkv-bias --seq-length 32 "
        "--attention-output-gate --qk-layernorm --pipeline-model-parallel-size 2",
        2,
        None,
    ),
    "untied_none_pp2": (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --position-embedding-type none "
        "--untie-embeddings-and-output-weights --pipeline-model-parallel-size 2",
        2,
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimator_and_simulator_count_every_parameter(case):
    flags, world, issue_count = CASES[case]
    cfg = validate(parse_args(["--mock-data", *flags.split()]), world)
    want = expected_count(cfg)
    if issue_count is not None:
        assert want == issue_count
    built = GPT(cfg.model, memory.dims(cfg).vocab)  # the single-rank model
    assert sum(p.numel() for p in built.parameters()) == want
    pp = cfg.parallel.pipeline_model_parallel_size
    tied_copy = memory.dims(cfg).vocab * cfg.model.hidden_size if pp > 1 and built.tied else 0  # the last stage's
    estimated = sum(r.terms["parameters"] for r in memory.estimate(cfg)) // 4  # fp32, ZeRO-0: whole weights
    assert estimated == want + tied_copy
    zero1 = validate(parse_args(["--mock-data", *flags.split(), "--zero-stage", "1"]), world)
    simulated = sum(sum(u.numels) for stage in range(pp) for u in rank_step(zero1, stage).units)
    assert simulated == want + tied_copy
