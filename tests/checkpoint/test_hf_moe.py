"""HF export and import of models with experts, against transformers' (5.25) own `Qwen3MoeForCausalLM` and
`MixtralForCausalLM` (no remote code), fp32 on CPU.

- ours -> `tools/convert_checkpoint.py --to hf` -> transformers' `from_pretrained`: its logits (uncached) equal
  ours within 1e-4; `--from hf` brings every tensor back bitwise. Qwen3-MoE with a dense first layer
  (mlp_only_layers) and both routers (norm_topk_prob true: our top-k softmax; false: --moe-router-pre-softmax),
  Mixtral with every layer sparse.
- a tiny model transformers builds from its own config and saves (save_pretrained: the hub's per-expert files)
  imports here with its logits; one whose head_dim is not hidden / heads (Llama, Qwen3-MoE, Mixtral) as
  --kv-channels, exported back to the same files bitwise.
- what a class cannot hold is refused by name, before a file is written.
"""

import json
import os
import re

import pytest
import torch

from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.checkpoint.formats import hf as hf_formats
from megatron_zpp.checkpoint.formats.base import ConversionError
from megatron_zpp.checkpoint.save import save_weights
from megatron_zpp.model import GPT, init_weights
from tests.checkpoint.test_mcore import _cfg, _convert

ROWS, TOL = 128, 1e-4
BASE = (
    "--mock-data --num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 100 "
    "--make-vocab-size-divisible-by 32 --normalization RMSNorm --swiglu --ffn-hidden-size 48 "
    "--position-embedding-type rope --group-query-attention --num-query-groups 2 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --num-experts 4 "
    "--moe-ffn-hidden-size 24 --moe-router-topk 2 "
)
EXPORTS = {  # name: (our flags, the transformers class it becomes)
    "qwen3_moe": (BASE + "--qk-layernorm --moe-layer-freq [0,1,1]", "Qwen3MoeForCausalLM"),
    "qwen3_moe_no_renorm": (BASE + "--qk-layernorm --moe-router-pre-softmax", "Qwen3MoeForCausalLM"),
    "mixtral": (BASE, "MixtralForCausalLM"),
    # Megatron's zero-centred norms (1 + w), the query/key head norms too: folded into the weights on the way
    "qwen3_moe_1p": (BASE + "--qk-layernorm --apply-layernorm-1p", "Qwen3MoeForCausalLM"),
}


def _tokens():
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(5))


def _our_weights(cfg) -> dict[str, torch.Tensor]:
    model = GPT(cfg.model, ROWS)
    init_weights(model, 3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # norms and routers off their init, so that each mapping shows in the logits
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _our_logits(cfg, weights):
    model = GPT(cfg.model, ROWS)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(_tokens())


def _hf_logits(hf_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens(), use_cache=False).logits, type(model).__name__


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_equals_transformers_and_imports_back_bitwise(name, tmp_path):
    flags, architecture = EXPORTS[name]
    cfg = _cfg(flags)
    weights = _our_weights(cfg)
    save_weights(str(tmp_path / "ours"), cfg, weights)
    assert _convert(["--load", str(tmp_path / "ours"), "--to", "hf", "--output", str(tmp_path / "hf")]) == 0
    theirs, cls = _hf_logits(str(tmp_path / "hf"))
    assert cls == architecture
    ours = _our_logits(cfg, weights)
    assert theirs.shape == ours.shape == (2, 16, ROWS)
    assert (theirs - ours).abs().max().item() < TOL
    back = ["--from", "hf", "--load", str(tmp_path / "hf"), "--to", "sharded", "--output", str(tmp_path / "back")]
    assert _convert(back) == 0
    got, config = consolidate(str(tmp_path / "back"))
    if cfg.model.apply_layernorm_1p:  # the import holds plain norms (1 + w written): the same model
        assert (_our_logits(_cfg_of(config), got) - ours).abs().max().item() < TOL
        return
    assert got.keys() == weights.keys() and all(torch.equal(got[n], w) for n, w in weights.items())
    m = config["model"]
    assert (m["num_experts"], m["moe_router_topk"], m["moe_ffn_hidden_size"]) == (4, 2, 24)
    assert m["moe_layer_freq"] == cfg.model.moe_layer_freq.replace(",", ", ")
    assert m["moe_router_pre_softmax"] == cfg.model.moe_router_pre_softmax


def _perturbed(model):
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _transformers_model(kind: str, head_dim: int | None = None):
    """A tiny model of transformers' own class of `kind`, off its init; `head_dim`: its heads' width (default
    hidden / heads)."""
    import transformers

    common = dict(
        vocab_size=ROWS, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    if head_dim is not None:
        common["head_dim"] = head_dim
    if kind == "llama":
        return _perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, intermediate_size=40)))
    common["num_experts_per_tok"] = 2
    qwen = dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, **qwen, mlp_only_layers=[0], norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        )  # fmt: skip
        return _perturbed(transformers.Qwen3MoeForCausalLM(cfg))
    if kind == "qwen3_moe_step2":  # layers 1 and 3 sparse (Qwen3 counts its step from layer step - 1)
        cfg = transformers.Qwen3MoeConfig(**common | {"num_hidden_layers": 4}, **qwen, decoder_sparse_step=2)
        return _perturbed(transformers.Qwen3MoeForCausalLM(cfg))
    cfg = transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=4)
    return _perturbed(transformers.MixtralForCausalLM(cfg))


IMPORTS = {"qwen3_moe": "[0, 1, 1]", "qwen3_moe_step2": "[0, 1, 0, 1]", "mixtral": "1"}  # kind: --moe-layer-freq


@pytest.mark.parametrize("kind", list(IMPORTS))
def test_transformers_model_imports_with_its_logits(kind, tmp_path):
    model = _transformers_model(kind)
    model.save_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        theirs = model(_tokens(), use_cache=False).logits
    state, ckpt = hf_formats.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    weights, config = consolidate(str(tmp_path / "ours"))
    cfg = _cfg_of(config)
    ours = _our_logits(cfg, weights)
    assert (theirs - ours).abs().max().item() < TOL
    assert cfg.model.num_experts == 4 and cfg.model.qk_layernorm == kind.startswith("qwen3_moe")
    assert cfg.model.moe_layer_freq == IMPORTS[kind]
    assert cfg.model.moe_router_pre_softmax == (kind == "qwen3_moe_step2")  # norm_topk_prob false: no renorm


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "mixtral"])
def test_head_dim_other_than_hidden_over_heads_is_kv_channels(kind, tmp_path):
    """A model whose heads are not hidden / heads wide (Qwen3-0.6B's head_dim 128 at hidden 1024 and 16 heads; 16
    at 32 and 4 here), made by transformers' own class: imported as --kv-channels with its logits, exported back
    to the files save_pretrained wrote, bitwise, with the same head_dim."""
    from safetensors.torch import load_file

    model = _transformers_model(kind, head_dim=16)
    model.save_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        theirs = model(_tokens(), use_cache=False).logits
    hf_formats.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    weights, config = consolidate(str(tmp_path / "ours"))
    cfg = _cfg_of(config)
    assert (cfg.model.kv_channels, cfg.model.head_dim) == (16, 16)
    assert (theirs - _our_logits(cfg, weights)).abs().max().item() < TOL
    assert hf_formats.export_hf(weights, config, str(tmp_path / "back")) == type(model).__name__
    saved, back = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "back"))
    assert saved.keys() == back.keys() and all(torch.equal(saved[n], back[n]) for n in saved)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["head_dim"] == 16


def _cfg_of(config: dict):
    from megatron_zpp.checkpoint.layout import config_from_dict

    return config_from_dict(config)


REFUSALS = [  # (our extra flags, what the export line must name)
    ("--moe-shared-expert-intermediate-size 40", ["as Qwen3-MoE", "as Mixtral", "it has a shared expert"]),
    ("--qk-layernorm --moe-router-score-function sigmoid", ["its router scores by sigmoid"]),
    ("--moe-layer-freq [0,1,1]", ["every Mixtral layer is sparse", "does not normalize query and key heads"]),
    ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias", ["its router has an expert bias"]),
]


@pytest.mark.parametrize("extra,named", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_export_refuses_what_the_classes_cannot_hold_by_name(extra, named, tmp_path, capsys):
    cfg = _cfg(BASE + extra)
    model = GPT(cfg.model, ROWS)
    save_weights(str(tmp_path / "ours"), cfg, {n: p.detach() for n, p in model.named_parameters()})
    assert _convert(["--load", str(tmp_path / "ours"), "--to", "hf", "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot export to HF: ")
    assert "mixtures of experts (--num-experts); Llama has dense MLPs only" in err
    assert all(n in err for n in named), err
    assert not os.path.exists(tmp_path / "hf")


IMPORT_REFUSALS = [  # (kind, config.json change, what the line names)
    ("mixtral", {"sliding_window": 8}, "sliding_window 8: attention over a window is not built here"),
    # head_dim is --kv-channels: heads twice as wide as the files' are refused by the first tensor's shape
    ("qwen3_moe", {"head_dim": 16}, "q_proj.weight has shape [32, 32], config.json implies [64, 32]"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "it scales RoPE"),
]


@pytest.mark.parametrize("kind,change,named", IMPORT_REFUSALS, ids=[r[2].split(":")[0] for r in IMPORT_REFUSALS])
def test_import_refuses_what_we_cannot_hold_by_name(kind, change, named, tmp_path):
    model = _transformers_model(kind)
    model.save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ConversionError, match=re.escape(named)):
        hf_formats.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert not os.path.exists(tmp_path / "ours")


def test_export_of_partial_experts_is_one_named_line(tmp_path, capsys):
    """A checkpoint missing an expert (as one saved at EP > 1 consolidates today: only EP rank 0's share) is
    refused by the tensor's name, nothing written."""
    cfg = _cfg(EXPORTS["mixtral"][0])
    weights = _our_weights(cfg)
    del weights["layers.1.mlp.experts.fc2.3"]
    with pytest.raises(ConversionError, match="the weights hold no layers.1.mlp.experts.fc2.3, which the model"):
        hf_formats.export_hf(weights, cfg.to_dict(), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
