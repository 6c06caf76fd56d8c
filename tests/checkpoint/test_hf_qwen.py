"""HF export and import of the Qwen3-Next and Qwen3.5 hybrids against transformers' (5.25) own classes
(`Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`; no remote code), fp32 on CPU.

- ours -> `tools/convert_checkpoint.py --to hf` -> `from_pretrained`: logits within 1e-4 uncached and cached (a
  prefill, then one token at a time through their recurrent and key/value cache), greedy `generate` (cached and
  not) equal to ours (megatron_zpp.generation), every norm zero-centred (--apply-layernorm-1p), the GDN output
  norm too, which goes out as Qwen's plain gain 1 + w; `--from hf` brings every tensor back bitwise (that one
  as the gain 1 + w: an import takes Qwen's plain gain as it is, `--gdn-out-norm rmsnorm`).
- transformers' gated attention (Qwen3NextAttention: the q|gate interleave, partial RoPE, zero-centred q/k norms)
  on the same weights as ours: a model of softmax layers only.
- a tiny model transformers builds from its own config (random init, perturbed) imports here with its logits and
  exports back to the same tensors; Qwen3-Next's is then trained here at TP2 x PP2 (4 gloo ranks) and exported
  back: transformers loads it with the logits of our consolidated model.
- what the classes cannot hold is refused by name.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_zpp import generation
from megatron_zpp.checkpoint.consolidate import config_from_dict, consolidate
from megatron_zpp.checkpoint.formats import hf as hf_formats
from megatron_zpp.checkpoint.formats.base import ConversionError
from megatron_zpp.checkpoint.save import save_weights
from megatron_zpp.model import GPT, init_weights
from tests.checkpoint.test_convert import _train_rank
from tests.checkpoint.test_mcore import _cfg, _convert
from tests.dist import run_distributed

ROWS, TOL = 128, 1e-4
BASE = (
    "--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --kv-channels 16 --seq-length 16 "
    "--vocab-size 100 --make-vocab-size-divisible-by 32 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
    "--ffn-hidden-size 48 "
    "--position-embedding-type rope --rotary-percent 0.5 --group-query-attention --num-query-groups 2 "
    "--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
    "--attention-output-gate --qk-layernorm --apply-layernorm-1p "
)
HYBRID = BASE + (  # grouped value heads (2 query/key heads of 8 channels, 4 value heads of 16), K != V
    "--attention-type gdn --softmax-attention-every 4 --linear-num-key-heads 2 --linear-num-value-heads 4 "
    "--linear-key-head-dim 8 --linear-value-head-dim 16 "
)
MOE = (
    "--num-experts 4 --moe-ffn-hidden-size 24 --moe-router-topk 2 --moe-shared-expert-intermediate-size 16 "
    "--moe-shared-expert-gate "
)
EXPORTS = {  # name: (our flags, the transformers class it becomes)
    "qwen3_next": (HYBRID + MOE + "--moe-layer-freq [1,0,1,1]", "Qwen3NextForCausalLM"),
    "qwen3_5": (HYBRID, "Qwen3_5ForCausalLM"),
}


def _tokens(n: int = 16):
    return torch.randint(0, 100, (2, n), generator=torch.Generator().manual_seed(5))


def _perturb(params, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms, gates and routers off their init, so that each mapping shows in the logits
        for p in params:
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _our_weights(cfg) -> dict[str, torch.Tensor]:
    model = GPT(cfg.model, ROWS)
    init_weights(model, 3)
    _perturb(model.parameters(), 4)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _our_model(cfg, weights):
    model = GPT(cfg.model, ROWS)
    model.load_state_dict(weights)
    return model.eval()


def _load(hf_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(EXPORTS))
def exported(request, tmp_path_factory):
    """(name, cfg, our weights, the HF directory of their export)."""
    flags, _ = EXPORTS[request.param]
    cfg, root = _cfg(flags), tmp_path_factory.mktemp(request.param)
    weights = _our_weights(cfg)
    save_weights(str(root / "ours"), cfg, weights)
    assert _convert(["--load", str(root / "ours"), "--to", "hf", "--output", str(root / "hf")]) == 0
    return request.param, cfg, weights, str(root / "hf")


def test_export_logits_cached_and_uncached(exported):
    name, cfg, weights, hf_dir = exported
    hf = _load(hf_dir)
    assert type(hf).__name__ == EXPORTS[name][1]
    tokens = _tokens(19)
    with torch.no_grad():
        want = _our_model(cfg, weights)(tokens)
        got = hf(tokens, use_cache=False).logits
        step = hf(tokens[:, :5], use_cache=True)
        cached = [step.logits]
        for t in range(5, tokens.shape[1]):
            step = hf(tokens[:, t : t + 1], cache=step.cache, use_cache=True)
            cached.append(step.logits)
    assert got.shape == want.shape == (2, 19, ROWS)
    uncached, cached = (got - want).abs().max().item(), (torch.cat(cached, dim=1) - want).abs().max().item()
    print(f"{EXPORTS[name][1]}: max |logit difference| uncached {uncached:.2e}, cached {cached:.2e}")  # docs' figures
    assert uncached < TOL and cached < TOL


def test_export_greedy_generation_equals_ours(exported):
    _, cfg, weights, hf_dir = exported
    model, hf, prompt = _our_model(cfg, weights), _load(hf_dir), [5, 6, 7]

    def next_logits(ids):
        return model(torch.tensor([ids]))[0, -1]

    ours = generation.generate(next_logits, prompt, 8, greedy=True)
    with torch.no_grad():
        for use_cache in (True, False):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, use_cache=use_cache)
            assert out[0, 3:].tolist() == ours, f"use_cache={use_cache}"


def test_export_imports_back_bitwise(exported, tmp_path):
    _, cfg, weights, hf_dir = exported
    back = ["--from", "hf", "--load", hf_dir, "--to", "sharded", "--output", str(tmp_path / "back")]
    assert _convert(back) == 0
    got, config = consolidate(str(tmp_path / "back"))
    assert got.keys() == weights.keys()
    # the GDN output norm's zero-centred w goes out as Qwen's plain gain 1 + w and comes back as that gain, held
    # as it is (--gdn-out-norm rmsnorm); every other tensor bitwise
    gain = {n for n in weights if n.endswith("mixer.head_norm")}
    assert len(gain) == 3 and all(torch.equal(got[n], w) for n, w in weights.items() if n not in gain)
    assert all(torch.equal(got[n], weights[n] + 1) for n in gain)
    m = config_from_dict(config).model
    assert m.gdn_out_norm == "rmsnorm"
    assert (m.attention_output_gate, m.qk_layernorm, m.apply_layernorm_1p, m.rotary_percent) == (True, True, True, 0.5)
    assert (m.attention_type, m.softmax_attention_every) == ("gdn", 4)
    assert m.moe_layer_freq == cfg.model.moe_layer_freq.replace(",", ", ")


def _transformers_model(kind: str, layer_types=None):
    """A tiny model of transformers' class `kind`, from its own config (its init, then perturbed)."""
    import transformers

    torch.manual_seed(0)  # their init draws from the global generator
    common = _text_config(layer_types)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16)
    if kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**common, **moe, intermediate_size=48, mlp_only_layers=[1])
        model = transformers.Qwen3NextForCausalLM(cfg)
    elif kind.startswith("qwen3_5_tied"):  # the output layer is the embedding, as the small Qwen3.5 models
        common["tie_word_embeddings"] = True
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**common, intermediate_size=48))
    elif kind == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**common, intermediate_size=48))
    else:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**common, **moe))
    _perturb(model.parameters(), 6)
    return model.eval()


def _text_config(layer_types=None) -> dict:
    return dict(
        vocab_size=ROWS, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip


def _import(model, root, mtp: bool = False):
    model.save_pretrained(str(root / "hf"))
    if mtp:  # a multi-token prediction layer, as the hub's files hold: left out by name
        path = str(root / "hf" / "model.safetensors")
        save_file(load_file(path) | {"mtp.layers.0.input_layernorm.weight": torch.zeros(32)}, path, {"format": "pt"})
    hf_formats.import_hf(str(root / "hf"), str(root / "ours"))
    weights, config = consolidate(str(root / "ours"))
    return weights, config_from_dict(config)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_tied"])
def test_transformers_model_imports_with_its_logits_and_exports_back(kind, tmp_path):
    """(qwen3_next: its file holds an MTP tensor too, which the import leaves out and the export does not write.)"""
    model = _transformers_model(kind)
    weights, cfg = _import(model, tmp_path, mtp=kind == "qwen3_next")
    assert ("output.weight" in weights) != (kind == "qwen3_5_tied")
    assert cfg.model.gdn_out_norm == "rmsnorm"  # their gated norm's plain gain, as it is (bitwise both ways)
    with torch.no_grad():
        theirs = model(_tokens(), use_cache=False).logits
        ours = _our_model(cfg, weights)(_tokens())
    print(f"{type(model).__name__} imported: max |logit difference| {(theirs - ours).abs().max().item():.2e}")
    assert (theirs - ours).abs().max().item() < TOL
    architecture = model.config.architectures[0]
    hf_formats.export_hf(weights, cfg.to_dict(), str(tmp_path / "back"), architecture=architecture)
    original, back = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(tmp_path / "back" / "model.safetensors")),
    )
    original.pop("mtp.layers.0.input_layernorm.weight", None)
    assert original.keys() == back.keys() and all(torch.equal(original[n], back[n]) for n in original)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == model.config.architectures


def test_image_text_checkpoint_imports_its_language_model(tmp_path):
    """The hub's Qwen3.5 files are Qwen3_5ForConditionalGeneration's: its text_config and model.language_model.*
    import as the text model (vision tower and MTP left out), with the image-text model's logits on text."""
    import transformers

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4)
    config = transformers.Qwen3_5Config(text_config=_text_config() | {"intermediate_size": 48}, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    _perturb(model.parameters(), 7)
    weights, cfg = _import(model.eval(), tmp_path)
    with torch.no_grad():
        theirs = model(input_ids=_tokens(), use_cache=False).logits
        ours = _our_model(cfg, weights)(_tokens())
    assert (theirs - ours).abs().max().item() < TOL


def test_gated_attention_equals_qwen3_next_attention(tmp_path):
    """Softmax layers only: transformers' Qwen3NextAttention (q|gate interleaved per head, partial RoPE over the
    first half of each head, zero-centred q/k norms) and ours on the same weights."""
    model = _transformers_model("qwen3_next", layer_types=["full_attention"] * 4)
    weights, cfg = _import(model, tmp_path)
    assert {cfg.model.layer_kind(i) for i in range(4)} == {"softmax"} and cfg.model.rotary_dim == 8
    with torch.no_grad():
        theirs = model(_tokens(), use_cache=False).logits
        ours = _our_model(cfg, weights)(_tokens())
    assert (theirs - ours).abs().max().item() < TOL


QWEN3_NEXT_FLAGS = (  # the flags of _transformers_model("qwen3_next") imported, and a short run
    HYBRID.replace("--vocab-size 100 ", "--vocab-size 128 ")
    + MOE
    + "--moe-layer-freq [1,0,1,1] --rotary-base 20000 --train-iters 2 --global-batch-size 4 --micro-batch-size 1 "
    "--lr 1e-3 --seed 3 --linear-conv-kernel-dim 4 --gdn-out-norm rmsnorm"
).split()


def test_transformers_model_trained_at_tp2_pp2_exports_back(tmp_path):
    model = _transformers_model("qwen3_next")
    imported, _ = _import(model, tmp_path)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]
    ckpt = str(tmp_path / "trained")
    run_distributed(_train_rank, 4, QWEN3_NEXT_FLAGS + layout + ["--load", str(tmp_path / "ours"), "--save", ckpt])
    trained, config = consolidate(ckpt)
    assert any(not torch.equal(trained[n], w) for n, w in imported.items())  # it trained
    assert _convert(["--load", ckpt, "--to", "hf", "--output", str(tmp_path / "hf_trained")]) == 0
    hf = _load(str(tmp_path / "hf_trained"))
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    with torch.no_grad():
        theirs = hf(_tokens(), use_cache=False).logits
        ours = _our_model(config_from_dict(config), trained)(_tokens())
    assert (theirs - ours).abs().max().item() < TOL


def test_export_refusals_are_one_named_line(tmp_path, capsys):
    """Per-head GDN norms (--gdn-head-norm per_head) that differ (Qwen holds one): one line, nothing written; a
    model without the output gate or the q/k norm is not Qwen's."""
    cfg = _cfg(HYBRID + "--gdn-head-norm per_head")
    weights = _our_weights(cfg)
    with pytest.raises(ConversionError, match="layers.0's GDN head norm differs between heads"):
        hf_formats.export_hf(weights, cfg.to_dict(), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")
    flags, ours = EXPORTS["qwen3_next"][0], str(tmp_path / "ours")
    save_weights(ours, _cfg(flags), _our_weights(_cfg(flags)))
    capsys.readouterr()
    assert (
        _convert(
            [
                "--load",
                ours,
                "--to",
                "hf",
                "--output",
                str(tmp_path / "a"),
                "--hf-architecture",
                "Qwen3_5MoeForCausalLM",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        "error: cannot export to HF as Qwen3_5MoeForCausalLM: some of its layers are dense (--moe-layer-freq); every "
        "Qwen3.5-MoE layer is sparse"
    )
    with pytest.raises(SystemExit):  # argparse's one line: the flag goes with --to hf
        _convert(
            [
                "--load",
                ours,
                "--to",
                "consolidated",
                "--output",
                str(tmp_path / "c.pt"),
                "--hf-architecture",
                "Qwen3NextForCausalLM",
            ]
        )
    assert "--hf-architecture goes with --to hf" in capsys.readouterr().err
    assert not any(os.path.exists(tmp_path / n) for n in ("a", "c.pt"))
    plain = _cfg(HYBRID.replace("--attention-output-gate --qk-layernorm ", ""))
    why = hf_formats.qwen3_5.unsupported(plain)
    assert why == [
        "it does not normalize query and key heads (--qk-layernorm); Qwen3.5 does",
        "its attention output is not gated (--attention-output-gate); Qwen3.5's is",
    ]


def test_hub_config_without_layer_types_reads_full_attention_interval():
    """The hub's Qwen3-Next config.json (written by transformers 4.57) gives full_attention_interval, not layer_types;
    partial_rotary_factor and rope_theta at the top level."""
    hf = _transformers_model("qwen3_next").config.to_dict()
    del hf["layer_types"], hf["rope_parameters"]
    hf |= {"full_attention_interval": 2, "partial_rotary_factor": 0.25, "rope_theta": 1e7}
    m = hf_formats.qwen3_next.config_from(hf).model
    assert (m.attention_type, m.softmax_attention_every, m.rotary_percent, m.rotary_base) == ("gdn", 2, 0.25, 1e7)
    assert (m.kv_channels, m.moe_layer_freq, m.moe_shared_expert_gate) == (16, "[1, 0, 1, 1]", True)


IMPORT_REFUSALS = [  # (config.json change, what the line names)
    ({"layer_types": ["full_attention", "linear_attention", "linear_attention", "linear_attention"]}, "K-th layer"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not silu"),
    ({"model_type": "qwen3_5"}, "model_type 'qwen3_5' without a text_config object"),
]


@pytest.mark.parametrize("change,named", IMPORT_REFUSALS, ids=[r[1] for r in IMPORT_REFUSALS])
def test_import_refuses_what_we_cannot_hold_by_name(change, named, tmp_path):
    _transformers_model("qwen3_5").save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ConversionError, match=named):
        hf_formats.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert not os.path.exists(tmp_path / "ours")
