"""OLMo Hybrid both ways, against transformers' (5.25) own `OlmoHybridForCausalLM` (no remote code), fp32 on CPU.

- ours (--reordered-norms softmax, --qk-layernorm-full-width, --linear-allow-neg-eigval, --linear-norm-epsilon
  1e-5) -> `tools/convert_checkpoint.py --to hf` -> `from_pretrained`: its logits, uncached and cached (a prefill
  then one token at a time), equal our GPT's within 1e-4, its greedy `generate` (with and without its cache) gives
  our greedy tokens, and `--from hf` brings every tensor back bitwise; with RoPE, untied and grouped GDN value
  heads of another width than the keys (2 key heads of 8, 4 value heads of 16), and without positions (NoPE:
  rope_theta null), tied, GDN heads as the attention's.
- a tiny model transformers builds from its own OlmoHybridConfig (its GDN head dims by default: keys 0.75 x
  hidden / heads = 6, values 12) imports here with its logits (its save_pretrained splits the fused convolution
  in equal thirds, not q | k | v: read either way), and exports back
  to the very tensors it saved; trained here on 4 gloo ranks (TP2 x SP x CP2) it equals a single-rank run of the
  same import (the full-width q/k norm's sum of squares over TP, the GDN's state over CP), and its export loads in
  transformers with our logits.
- what the class cannot hold is refused by name, before a file is written.
- --reordered-norms all with the full-width q/k norm on a softmax model is transformers' Olmo2ForCausalLM.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file as load_safetensors

from megatron_zpp import training
from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.checkpoint.formats import hf as hf_formats
from megatron_zpp.checkpoint.formats.base import ConversionError
from megatron_zpp.checkpoint.layout import config_from_dict
from megatron_zpp.checkpoint.save import save_weights
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.generation import generate
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.validation import validate
from tests.checkpoint.test_mcore import _cfg, _convert
from tests.dist import run_distributed

ROWS, TOL = 128, 1e-4
PAD = list(range(100, ROWS))  # the vocabulary (100) padded to 128 rows
OLMO = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 48 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear "
    "--attention-type gdn --softmax-attention-every 2 --reordered-norms softmax --qk-layernorm "
    "--qk-layernorm-full-width --linear-allow-neg-eigval --linear-norm-epsilon 1e-5 --hidden-dropout 0 "
    "--attention-dropout 0 --vocab-size 100 --make-vocab-size-divisible-by 32 --seq-length 32 --mock-data "
)
EXPORTS = {
    "rope_untied": "--position-embedding-type rope --rotary-base 20000 --untie-embeddings-and-output-weights "
    "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 8 --linear-value-head-dim 16",
    "nope_tied": "--position-embedding-type none",
}


def _tokens(n: int = 27):  # 27: a partial last GDN chunk
    return torch.randint(0, 100, (2, n), generator=torch.Generator().manual_seed(5))


def _perturb(params, seed: int) -> None:
    """Every weight off its init (norms, A_log, dt_bias too), so that each mapping shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _ours(cfg, weights=None):
    model = GPT(cfg.model, ROWS)
    if weights is None:
        init_weights(model, 3)
        _perturb(model.parameters(), 4)
    else:
        model.load_state_dict(weights)
    return model.eval()


def _load_hf(hf_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _hf_logits(hf, tokens):
    """(uncached logits, cached logits: a 5-token prefill then one token at a time)."""
    with torch.no_grad():
        full = hf(input_ids=tokens, use_cache=False).logits
        step = hf(input_ids=tokens[:, :5], use_cache=True)
        cached = [step.logits]
        for t in range(5, tokens.shape[1]):
            step = hf(input_ids=tokens[:, t : t + 1], cache=step.cache, use_cache=True)
            cached.append(step.logits)
    return full, torch.cat(cached, dim=1)


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_loads_in_transformers_with_our_logits_and_imports_back_bitwise(name, tmp_path):
    cfg = _cfg(OLMO + EXPORTS[name])
    model = _ours(cfg)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_weights(str(tmp_path / "ours"), cfg, weights)
    assert _convert(["--load", str(tmp_path / "ours"), "--to", "hf", "--output", str(tmp_path / "hf")]) == 0
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]  # no remote code
    hf = _load_hf(str(tmp_path / "hf"))
    assert type(hf).__name__ == "OlmoHybridForCausalLM"
    assert (hf.model.rotary_emb is None) == (name == "nope_tied")
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens=tokens)
    full, cached = _hf_logits(hf, tokens)
    assert (full - want).abs().max().item() < TOL and (cached - want).abs().max().item() < TOL
    prompt = [5, 6, 7]
    with torch.no_grad():
        greedy = generate(lambda ids: model(tokens=torch.tensor([ids]))[0, -1, :100], prompt, 8, greedy=True)
        for use_cache in (True, False):
            out = hf.generate(  # the padding rows (100-127) never sampled, as ours
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, use_cache=use_cache, suppress_tokens=PAD
            )
            assert out[0, 3:].tolist() == greedy, f"use_cache={use_cache}"
    back = ["--from", "hf", "--load", str(tmp_path / "hf"), "--to", "sharded", "--output", str(tmp_path / "back")]
    assert _convert(back) == 0
    got, config = consolidate(str(tmp_path / "back"))
    assert got.keys() == weights.keys() and all(torch.equal(got[n], w) for n, w in weights.items())
    m = config["model"]
    assert (m["reordered_norms"], m["qk_layernorm_full_width"], m["linear_allow_neg_eigval"]) == ("softmax", 1, 1)
    assert m["position_embedding_type"] == ("none" if name == "nope_tied" else "rope")


def _transformers_model():
    import transformers

    cfg = transformers.OlmoHybridConfig(
        vocab_size=ROWS, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["linear_attention", "full_attention"] * 2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=None, eos_token_id=None, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    )  # fmt: skip
    model = transformers.OlmoHybridForCausalLM(cfg)
    _perturb(model.parameters(), 6)
    with torch.no_grad():  # one o_norm weight shared by the heads, as OLMo Hybrid's; A_log off 0 (A = 1)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.clamp_(min=-2.0)
    return model.eval()


ARGV = (  # the imported model's flags, and a short run
    OLMO.replace("--vocab-size 100", "--vocab-size 128")
    + "--position-embedding-type rope --rotary-base 20000 --untie-embeddings-and-output-weights "
    "--linear-key-head-dim 6 --linear-value-head-dim 12 --max-position-embeddings 64 --train-iters 3 "
    "--global-batch-size 2 --micro-batch-size 1 --lr 3e-3 "
    "--lr-warmup-iters 1 --seed 5 --init-method-std 0.02 --peak-tflops 1"
).split()
LAYOUT = "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2".split()


def _train_rank(rank, world_size, argv):
    training.train(training.setup(validate(parse_args(argv), world_size)))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers' model, its save_pretrained dir, our import's checkpoint dir)."""
    root = tmp_path_factory.mktemp("olmo")
    model = _transformers_model()
    model.save_pretrained(str(root / "hf"))
    hf_formats.import_hf(str(root / "hf"), str(root / "ours"))
    return model, str(root / "hf"), str(root / "ours"), root


def test_transformers_model_imports_with_its_logits_and_exports_back_bitwise(imported):
    model, hf_dir, ours_dir, root = imported
    weights, config = consolidate(ours_dir)
    cfg = config_from_dict(config)
    tokens = _tokens()
    with torch.no_grad():
        theirs = model(input_ids=tokens, use_cache=False).logits
    assert (_ours(cfg, weights)(tokens=tokens) - theirs).abs().max().item() < TOL
    hf_formats.export_hf(weights, config, str(root / "again"))
    saved, again = (
        _fused_convs(load_safetensors(os.path.join(d, "model.safetensors"))) for d in (hf_dir, root / "again")
    )
    assert again.keys() == saved.keys() and all(torch.equal(again[n], t) for n, t in saved.items())
    assert _load_hf(str(root / "again")).model.layers[0].linear_attn.conv1d.weight.shape == (96, 1, 4)


def _fused_convs(state: dict) -> dict:
    """`state` with each layer's q/k/v_conv1d as their concatenation: transformers' save_pretrained splits the fused
    convolution in equal thirds (32 channels each here), the hub's files and our export as q | k | v (24, 24, 48);
    both concatenate to the one weight from_pretrained builds."""
    out = {n: t for n, t in state.items() if "_conv1d" not in n}
    for n in [n for n in state if n.endswith("q_conv1d.weight")]:
        out[n.replace("q_conv1d", "conv1d")] = torch.cat([state[n.replace("q_conv1d", f"{p}_conv1d")] for p in "qkv"])
    return out


def test_trained_at_tp2_sp_cp2_equals_one_rank_and_loads_in_transformers(imported):
    """4 gloo ranks from the import equal one rank (weights within 1e-5 relative), and the export loads."""
    _, _, ours_dir, root = imported
    ckpt = str(root / "trained")
    run_distributed(_train_rank, 4, ARGV + LAYOUT + ["--load", ours_dir, "--save", ckpt])
    run = training.setup(validate(parse_args(ARGV + ["--load", ours_dir]), 1))
    training.train(run)
    ref = {n: p.detach().float() for n, p in run.chunks[0].named_parameters()}
    state, config = consolidate(ckpt)
    assert sorted(state) == sorted(ref)
    for n, w in ref.items():
        assert ((state[n] - w).norm() / w.norm()).item() < 1e-5, n
    assert not all(torch.equal(state[n], w) for n, w in consolidate(ours_dir)[0].items())  # it trained
    hf_formats.export_hf(state, config, str(root / "trained_hf"))
    tokens = _tokens()
    with torch.no_grad():
        want = _ours(config_from_dict(config), state)(tokens=tokens)
    full, cached = _hf_logits(_load_hf(str(root / "trained_hf")), tokens)
    assert (full - want).abs().max().item() < TOL and (cached - want).abs().max().item() < TOL


REFUSALS = [  # (flags replaced, what the export line must name)
    (("--reordered-norms softmax", ""), "OLMo Hybrid normalizes its attention layers' outputs"),
    (("--qk-layernorm-full-width", ""), "OLMo Hybrid normalizes the whole q and k projections"),
    (("--linear-norm-epsilon 1e-5", ""), "OLMo Hybrid's is 1e-05 (--linear-norm-epsilon 1e-05)"),
]


@pytest.mark.parametrize("change,named", REFUSALS, ids=[r[0][0] for r in REFUSALS])
def test_export_refuses_what_the_class_cannot_hold_by_name(change, named, tmp_path, capsys):
    cfg = _cfg(OLMO.replace(*change) + "--position-embedding-type rope")
    model = GPT(cfg.model, ROWS)
    save_weights(str(tmp_path / "ours"), cfg, {n: p.detach() for n, p in model.named_parameters()})
    assert _convert(["--load", str(tmp_path / "ours"), "--to", "hf", "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot export to HF: "), err
    assert named in err and "with our remote code" in err, err
    assert not os.path.exists(tmp_path / "hf")


def test_import_refuses_what_we_cannot_hold_by_name(imported, tmp_path):
    _, hf_dir, _, _ = imported
    for change, named in [
        ({"layer_types": ["full_attention", "linear_attention"] * 2}, "is not softmax attention at every K-th"),
        ({"linear_conv_kernel_dim": 3}, "linear_conv_kernel_dim 3 is not our GDN's 4"),
    ]:
        bad = tmp_path / "bad"
        os.makedirs(bad, exist_ok=True)
        for f in os.listdir(hf_dir):
            if f != "config.json":
                os.symlink(os.path.join(hf_dir, f), bad / f) if not (bad / f).exists() else None
        with open(os.path.join(hf_dir, "config.json")) as f:
            (bad / "config.json").write_text(json.dumps(json.load(f) | change))
        with pytest.raises(ConversionError, match=named):
            hf_formats.import_hf(str(bad), str(tmp_path / "ours"))
        assert not os.path.exists(tmp_path / "ours")


def test_reordered_norms_all_is_transformers_olmo2():
    """--reordered-norms all with --qk-layernorm-full-width on a softmax model is OLMo 2's block: our GPT on the
    weights of transformers' own Olmo2ForCausalLM (mapped here, name by name) gives its logits."""
    import transformers

    cfg = _cfg(
        OLMO.replace(
            "--attention-type gdn --softmax-attention-every 2 --reordered-norms softmax", "--reordered-norms all"
        )
        .replace("--linear-allow-neg-eigval --linear-norm-epsilon 1e-5", "")
        .replace("--vocab-size 100", "--vocab-size 128")
        + "--position-embedding-type rope --rotary-base 20000 --untie-embeddings-and-output-weights"
    )
    hf = transformers.Olmo2ForCausalLM(
        transformers.Olmo2Config(
            vocab_size=ROWS, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        )
    )  # fmt: skip
    _perturb(hf.parameters(), 7)
    t = hf.state_dict()
    ours = {"embedding.weight": t["model.embed_tokens.weight"], "final_norm.weight": t["model.norm.weight"]}
    ours["output.weight"] = t["lm_head.weight"]
    for i in range(4):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        ours[dst + "mixer.qkv.weight"] = torch.cat([t[src + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        ours[dst + "mixer.proj.weight"] = t[src + "self_attn.o_proj.weight"]
        for n in ("q_norm", "k_norm"):
            ours[dst + f"mixer.{n}.weight"] = t[src + f"self_attn.{n}.weight"]
        ours[dst + "norm1.weight"] = t[src + "post_attention_layernorm.weight"]
        ours[dst + "norm2.weight"] = t[src + "post_feedforward_layernorm.weight"]
        ours[dst + "mlp.fc1.weight"] = torch.cat([t[src + "mlp.gate_proj.weight"], t[src + "mlp.up_proj.weight"]])
        ours[dst + "mlp.fc2.weight"] = t[src + "mlp.down_proj.weight"]
    tokens = _tokens()
    with torch.no_grad():
        want = hf.eval()(input_ids=tokens, use_cache=False).logits
        assert (_ours(cfg, ours)(tokens=tokens) - want).abs().max().item() < TOL
