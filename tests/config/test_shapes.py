"""The mixer and FFN shapes (config/shapes.py) against what the layers build: every reader outside the layer
(perf, memory, simulator, validation, exporters) trusts them, so they are checked against the built modules'
parameters at TP 1 and 2, and the per-kind numbers against the papers' forms written out here."""

import pytest
import torch

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT
from megatron_zpp.pipeline_parallel.stages import stand_in_context
from megatron_zpp.validation import validate

BASE = "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128 --swiglu "
KINDS = {
    "softmax": BASE + "--group-query-attention --num-query-groups 2",
    "gla": BASE + "--attention-type gla --softmax-attention-every 3",
    "gla_low_rank": BASE + "--attention-type gla --gla-gate-low-rank 8 --softmax-attention-every 3",
    "gdn": BASE + "--attention-type gdn --softmax-attention-every 3",
    "gdn_gated_softmax": BASE + "--attention-type gdn --softmax-attention-every 3 --attention-output-gate",
    "kda": BASE + "--attention-type kda --softmax-attention-every 3",
}


def _built(flags: str, tp: int):
    cfg = parse_args((flags + f" --tensor-model-parallel-size {tp} --mock-data").split())
    validate(cfg, tp)
    with torch.device("meta"):
        model = GPT(cfg.model, 128 // tp, stand_in_context(cfg))
    return cfg, model


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(KINDS))
def test_shapes_are_what_the_layers_build(name, tp):
    cfg, model = _built(KINDS[name], tp)
    m = cfg.model
    for key, block in model.layers.items():
        shape, ffn = m.mixer(int(key)), m.ffn(int(key))
        proj = block.mixer.qkv if shape.kind == "softmax" else block.mixer.proj_in
        assert proj.weight.shape[0] * tp == sum(shape.sections)
        out = block.mixer.proj if shape.kind == "softmax" else block.mixer.proj_out
        assert out.weight.shape[1] * tp == shape.out_width
        if shape.replicated:
            assert block.mixer.gate_down.shape[0] == shape.replicated  # whole on every TP rank
        if shape.conv_channels:
            assert tuple(block.mixer.conv.shape) == (shape.conv_channels // tp, shape.conv_kernel)
        assert block.mlp.fc1.weight.shape[0] * tp == sum(ffn.sections)


def test_per_kind_numbers_written_out():
    """State, transition and halo per head, and the forward FLOPs of one token, from the papers' forms."""
    h, seq, C, d, heads = 64, 32, 16, 16, 4
    w = heads * d
    shapes = {k: parse_args((v + " --gla-chunk-size 16 --mock-data").split()).model.mixer(0) for k, v in KINDS.items()}
    sm, gla, low, gdn = shapes["softmax"], shapes["gla"], shapes["gla_low_rank"], shapes["gdn"]
    assert (sm.state_per_head, gla.state_per_head, gdn.state_per_head) == (0, d * d, d * d)
    assert (gla.transition_per_head, gdn.transition_per_head) == (d, d * d)  # diagonal decay, dense M
    assert (sm.halo_tokens, gla.halo_tokens, gdn.halo_tokens) == (0, 0, 3)
    assert gdn.scan_waits_for_local_pass and not gla.scan_waits_for_local_pass
    kv = 2 * d
    assert sm.forward_flops_per_token(h, seq) == 2 * (h * (w + 2 * kv) + w * h) + 2 * seq * w
    assert gla.forward_flops_per_token(h, seq) == 2 * (5 * h * w + w * h) + 2 * w * (C + 2 * d)
    r = 8  # low rank: W_down [r, h] and W_up [w, r] in place of the fifth section
    assert low.forward_flops_per_token(h, seq) == 2 * (4 * h * w + h * r + r * w + w * h) + 2 * w * (C + 2 * d)
    assert gdn.forward_flops_per_token(h, seq) == 2 * (h * (4 * w + 2 * heads) + w * h) + 2 * w * (2 * C + 3 * d)
    assert low.projection_width(tp=2) == 4 * w + 2 * r
    # KDA: q | k | v | b split, f_a | g_a (rank d each) replicated, f_b and g_b [d] -> w; GDN's operator products
    kda = shapes["kda"]
    assert (kda.sections, kda.replicated, kda.transition_per_head, kda.halo_tokens) == (
        (w, w, w, heads),
        2 * d,
        d * d,
        3,
    )
    flops = 2 * (h * (3 * w + heads + 2 * d) + w * h) + 2 * 2 * d * w + 2 * w * (2 * C + 3 * d)
    assert kda.forward_flops_per_token(h, seq) == flops and kda.scan_waits_for_local_pass
    gated = parse_args((KINDS["gdn_gated_softmax"] + " --mock-data").split()).model.mixer(2)  # q | k | v | gate
    assert gated.kind == "softmax" and gated.sections == (w, w, w, w)  # one kv head per head here
    assert gated.forward_flops_per_token(h, seq) == 2 * (4 * h * w + w * h) + 2 * seq * w
