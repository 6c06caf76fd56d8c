"""Megatron's default GPT exports as HF GPT2LMHeadModel and imports back: HF's logits equal
ours (fp32), the import returns our weights bitwise, --apply-layernorm-1p is folded in, and what GPT-2
cannot hold goes to the other paths or is refused by name."""

import importlib.util
import json
import os

import pytest
import torch
import transformers

from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = (
    "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 24 --vocab-size 100 --make-vocab-size-divisible-by 32 "
    "--position-embedding-type learned_absolute --add-bias-linear"  # Megatron's defaults, said explicitly
)


def _convert():
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(ROOT, "tools/convert_checkpoint.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(extra: str = ""):
    """(cfg, our fp32 model with every weight moved off its init: biases and 1p weights start at 0)."""
    cfg = validate(parse_args((FLAGS + " " + extra).split()), 1)
    model = GPT(cfg.model, 128)
    init_weights(model, 3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return cfg, model.eval()


@pytest.mark.parametrize(
    "extra", ["", "--untie-embeddings-and-output-weights --apply-layernorm-1p", "--no-bias-gelu-fusion"]
)
def test_gpt2_export_matches_logits_and_imports_back(extra, tmp_path):
    conv = _convert()
    cfg, model = _model(extra)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = str(tmp_path / "hf")
    assert conv.export_hf(state, cfg.to_dict(), out) == "GPT2LMHeadModel"
    with open(os.path.join(out, "config.json")) as f:
        # Megatron's fused bias-gelu is the tanh form; without the fusion it is the exact erf one
        assert json.load(f)["activation_function"] == ("gelu" if "gelu-fusion" in extra else "gelu_new")
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(tokens).logits
        ours = model(tokens=tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    back, ckpt = conv.import_hf(out, str(tmp_path / "ckpt"))
    assert set(back) == set(state)
    for name, w in state.items():  # 1p comes back as plain LayerNorm weights 1 + w
        want = w + 1 if "1p" in extra and name.endswith(("norm1.weight", "norm2.weight", "final_norm.weight")) else w
        torch.testing.assert_close(back[name], want, rtol=0, atol=1e-7, msg=name)
    weights, config = consolidate(ckpt)
    m = config["model"]
    assert m["position_embedding_type"] == "learned_absolute" and m["add_bias_linear"] and not m["apply_layernorm_1p"]
    assert m["bias_gelu_fusion"] == ("gelu-fusion" not in extra)


def test_what_gpt2_cannot_hold_takes_another_path_or_is_refused(tmp_path):
    conv = _convert()
    for extra, kind in [
        ("--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear", "LlamaForCausalLM"),
        ("--attention-type gla --position-embedding-type rope --disable-bias-linear", "MegatronZppGLAForCausalLM"),
    ]:
        cfg, model = _model(extra)
        state = {n: p.detach() for n, p in model.named_parameters()}
        assert conv.export_hf(state, cfg.to_dict(), str(tmp_path / kind)) == kind
    cfg, model = _model("--attention-type gla --softmax-attention-every 2")  # biases and learned positions
    state = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(conv.ConversionError, match="GPT-2 has only softmax attention.*it has linear biases"):
        conv.export_hf(state, cfg.to_dict(), str(tmp_path / "refused"))
    hf = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 16}
    os.makedirs(tmp_path / "exact")
    with open(tmp_path / "exact" / "config.json", "w") as f:
        json.dump({**hf, "activation_function": "gelu_fast"}, f)
    with pytest.raises(conv.ConversionError, match="'gelu_fast' is not one of"):
        conv.import_hf(str(tmp_path / "exact"), str(tmp_path / "ckpt"))
