"""Consolidation, HF export and generation from sharded checkpoints.

A tiny softmax GPT trains for a few steps on 2 gloo ranks (TP2; ZeRO-3 over DP2 with an
untied output layer; PP2 with the tied embedding on both stages) and saves; consolidating that
checkpoint must give the weights of a single-rank run trained identically (parity holds: 1e-5 relative per tensor). The
consolidated file, greedy generation and the HF Llama export (logits against
transformers' LlamaForCausalLM, when transformers is installed) are checked on them.

A tiny GLA model (low-rank decay gate, RMSNorm, SwiGLU, tied) and a tiny hybrid (softmax attention
every 2nd layer, GQA, full-rank gate, LayerNorm, GeLU, untied) train 3 steps on one rank; their HF
export is our remote code (megatron_zpp/hf_remote), loaded by AutoModelForCausalLM with
trust_remote_code: its logits, its cached token-by-token logits and its greedy `generate` are checked
against our GPT and tools/generate.py, and the import back against the weights, bitwise.
"""

import importlib.util
import json
import os

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint.consolidate import config_from_dict, consolidate
from megatron_zpp.config import Config
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = (
    OLD_DEFAULTS
    + (
        "--mock-data --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--seq-length "
        "32 --vocab-size 128 --make-vocab-size-divisible-by 32 --num-layers 2 --train-iters 3 "
        "--global-batch-size 4 --micro-batch-size 1 --lr 3e-3 --lr-warmup-iters 1 --clip-grad 0.5 "
        "--seed 5 --peak-tflops 1"
    ).split()
)
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "zero3_untied": ["--zero-stage", "3", "--untie-embeddings-and-output-weights"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}
UNTIE = {"tp2": [], "zero3_untied": ["--untie-embeddings-and-output-weights"], "pp2": []}


def rope_config() -> Config:
    """Config() with RoPE and no linear biases (the old defaults): what Llama and our remote code hold."""
    cfg = Config()
    cfg.model.position_embedding_type, cfg.model.add_bias_linear = "rope", False
    return cfg


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(argv: list[str], world_size: int) -> None:
    training.train(training.setup(validate(parse_args(argv), world_size)))


def _train_rank(rank, world_size, argv):
    _train(argv, world_size)


def _single_rank_weights(argv: list[str]) -> dict:
    run = training.setup(validate(parse_args(argv), 1))
    training.train(run)
    return {n: p.detach().float().clone() for n, p in run.chunks[0].named_parameters()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """layout -> (checkpoint dir of the 2-rank run, single-rank reference weights)."""
    out = {}
    for name, extra in LAYOUTS.items():
        ckpt = str(tmp_path_factory.mktemp(name) / "ckpt")
        run_distributed(_train_rank, 2, BASE + extra + ["--save", ckpt])
        out[name] = (ckpt, _single_rank_weights(BASE + UNTIE[name]))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_consolidated_equals_single_rank(trained, layout):
    ckpt, ref = trained[layout]
    state, config = consolidate(ckpt)
    assert config["parallel"]["world_size"] == 2
    assert sorted(state) == sorted(ref)
    assert ("output.weight" in state) == (layout == "zero3_untied")
    for name, w in ref.items():
        got = state[name]
        assert got.dtype == torch.float32 and got.shape == w.shape, name
        rel = (got - w).norm() / w.norm()
        assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"


def test_consolidated_file_and_generation(trained, tmp_path, capsys):
    ckpt, ref = trained["tp2"]
    out = str(tmp_path / "model.pt")
    assert _tool("convert_checkpoint").main(["--load", ckpt, "--to", "consolidated", "--output", out]) == 0
    saved = torch.load(out, weights_only=True)
    assert saved["config"]["model"]["hidden_size"] == 32
    state, _ = consolidate(ckpt)
    assert sorted(saved["model"]) == sorted(ref)
    for name, w in state.items():
        assert torch.equal(saved["model"][name], w), name

    gen = _tool("generate")
    texts = []
    for _ in range(2):
        capsys.readouterr()
        assert gen.main(["--load", ckpt, "--prompt", "1 2 3", "--max-new-tokens", "6", "--greedy"]) == 0
        texts.append(capsys.readouterr().out.strip().splitlines()[-1])
    ids = texts[0].split()
    assert texts[0] == texts[1], "greedy decoding is not deterministic"
    assert ids[:3] == ["1", "2", "3"] and len(ids) == 9 and all(0 <= int(i) < 128 for i in ids)
    # sampling draws from the real vocabulary and is reproducible with its seed
    sampled = gen.main(["--load", ckpt, "--max-new-tokens", "4", "--top-k", "5", "--top-p", "0.9", "--seed", "1"])
    assert sampled == 0


def test_generate_matches_our_forward(trained):
    """The greedy tokens are the argmax of our single-rank model's logits."""
    ckpt, _ = trained["zero3_untied"]
    gen = _tool("generate")
    model, cfg = gen.load_model(*consolidate(ckpt))
    new = gen.generate(model, [5, 6, 7], 3, cfg.model.seq_length, 128, greedy=True)
    ids = [5, 6, 7]
    for tok in new:
        with torch.no_grad():
            assert tok == int(model(tokens=torch.tensor([ids]))[0, -1, :128].argmax())
        ids.append(tok)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_export_matches_logits(trained, layout, tmp_path):
    import transformers  # a test dependency (the dev extra)

    ckpt, _ = trained[layout]
    hf_dir = str(tmp_path / "hf")
    assert _tool("convert_checkpoint").main(["--load", ckpt, "--to", "hf", "--output", hf_dir]) == 0
    assert sorted(os.listdir(hf_dir)) == ["config.json", "model.safetensors"]
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).float().eval()
    ours, _ = _tool("generate").load_model(*consolidate(ckpt))
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens=tokens)
        got = hf(input_ids=tokens).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["tp2", "zero3_untied"])
def test_hf_import_round_trip(trained, layout, tmp_path):
    """HF -> ours gives back the exported weights bitwise, as a weights-only checkpoint that
    loads at its own layout and, resharded, under ZeRO-3 (fresh optimizer, iteration 0)."""
    ckpt, _ = trained[layout]
    conv = _tool("convert_checkpoint")
    hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "back")
    assert conv.main(["--load", ckpt, "--to", "hf", "--output", hf_dir]) == 0
    assert conv.main(["--from", "hf", "--load", hf_dir, "--to", "sharded", "--output", back]) == 0
    original, imported = consolidate(ckpt)[0], consolidate(back)[0]
    assert sorted(imported) == sorted(original)
    for name, w in original.items():
        assert torch.equal(imported[name], w), name
    argv = BASE + UNTIE[layout] + ["--load", back]
    first_losses = []
    for extra in ([], ["--zero-stage", "3"]):
        run = training.setup(validate(parse_args(argv + extra), 1))
        run.dp.gather_parameters()  # ZeRO-3: read the full weights
        assert run.state.iteration == 0 and bool(run.resharded_from) == bool(extra)
        for name, p in run.chunks[0].named_parameters():
            assert torch.equal(p.detach(), original[name]), name
        first_losses.append([training.train_step(run)[0] for _ in range(2)])
    torch.testing.assert_close(first_losses[0], first_losses[1], rtol=1e-5, atol=0)  # both start fresh from it


def test_hf_import_refuses_what_we_cannot_hold(tmp_path):
    conv = _tool("convert_checkpoint")
    hf = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "vocab_size": 128,
        "rope_scaling": {"rope_type": "llama3"},
        "mlp_bias": True,
    }
    with pytest.raises(conv.ConversionError, match="rope_scaling; it has attention or MLP biases"):
        conv.config_from_hf(hf, str(tmp_path))


def test_hf_export_writes_remote_code_for_what_llama_cannot_hold(tmp_path):
    """What Llama cannot hold (GLA, hybrid, LayerNorm, GeLU) is named, and exported as our remote-code model."""
    conv = _tool("convert_checkpoint")
    for i, (setting, message, kinds) in enumerate(
        [
            ({"attention_type": "gla", "softmax_attention_every": 2}, "gated linear attention", ["linear", "full"]),
            ({"normalization": "LayerNorm"}, "LayerNorm; Llama uses RMSNorm", ["full", "full"]),
            ({"activation": "gelu"}, "gelu; Llama uses SwiGLU", ["full", "full"]),
        ]
    ):
        cfg = rope_config()
        cfg.model.num_layers, cfg.model.hidden_size = 2, 32
        for k, v in setting.items():
            setattr(cfg.model, k, v)
        assert config_from_dict(cfg.to_dict()).model == cfg.model
        assert any(message in why for why in conv.hf_unsupported(cfg))
        model = GPT(cfg.model, 64)
        init_weights(model, 1)
        out = str(tmp_path / f"hf{i}")
        state = {n: p.detach() for n, p in model.named_parameters()}
        assert conv.export_hf(state, cfg.to_dict(), out) == "MegatronZppGLAForCausalLM"
        with open(os.path.join(out, "config.json")) as f:
            assert json.load(f)["layer_types"] == [f"{k}_attention" for k in kinds]


REMOTE = {
    "gla": ["--attention-type", "gla", "--gla-gate-low-rank", "4"],
    "hybrid": ["--attention-type", "gla", "--softmax-attention-every", "2", "--normalization", "LayerNorm"]
    + ["--activation", "gelu", "--untie-embeddings-and-output-weights"],
    # Megatron's default LayerNorm: megatron-core's GDN output norm is then a LayerNorm with a bias (gdn_out_norm)
    "gdn": ["--attention-type", "gdn", "--normalization", "LayerNorm"],
    # grouped value heads and K != V (Megatron's layout): 2 key heads of 8 channels, 4 value heads of 12
    "gdn_hybrid": ["--attention-type", "gdn", "--softmax-attention-every", "2", "--untie-embeddings-and-output-weights"]
    + "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 8 --linear-value-head-dim 12".split(),
    "kda_hybrid": [
        "--attention-type",
        "kda",
        "--softmax-attention-every",
        "2",
        "--untie-embeddings-and-output-weights",
    ],
}
REMOTE_BASE = BASE + ["--init-method-std", "0.2"]  # larger weights: logits far apart, so greedy has no near-ties


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """kind -> (checkpoint dir of a 1-rank run, its HF export dir, our single-rank GPT with those weights)."""
    conv, out = _tool("convert_checkpoint"), {}
    for kind, extra in REMOTE.items():
        base = tmp_path_factory.mktemp(kind)
        ckpt, hf_dir = str(base / "ckpt"), str(base / "hf")
        _train(REMOTE_BASE + extra + ["--save", ckpt], 1)
        assert conv.main(["--load", ckpt, "--to", "hf", "--output", hf_dir]) == 0
        out[kind] = (ckpt, hf_dir, _tool("generate").load_model(*consolidate(ckpt))[0])
    return out


def _load_remote(hf_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).float().eval()


@pytest.mark.parametrize("kind", list(REMOTE))
def test_hf_remote_export_matches_logits(remote, kind):
    """Full-sequence logits (27 tokens: a partial last GLA chunk) and the cached ones, a 5-token
    prefill then one token at a time, equal our GPT's within 1e-4 (fp32)."""
    _, hf_dir, ours = remote[kind]
    assert sorted(os.listdir(hf_dir)) == [
        "config.json",
        "configuration_megatron_zpp_gla.py",
        "model.safetensors",
        "modeling_megatron_zpp_gla.py",
    ]
    hf = _load_remote(hf_dir)
    assert type(hf).__name__ == "MegatronZppGLAForCausalLM"
    assert hasattr(hf, "lm_head") == kind.endswith("hybrid")  # tied: the logits read the embedding
    tokens = torch.randint(0, 128, (2, 27), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens=tokens)
        got = hf(input_ids=tokens, use_cache=False).logits
        step = hf(input_ids=tokens[:, :5], use_cache=True)
        cached = [step.logits]
        for t in range(5, tokens.shape[1]):
            step = hf(input_ids=tokens[:, t : t + 1], cache=step.cache, use_cache=True)
            cached.append(step.logits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(cached, dim=1), want, rtol=1e-4, atol=1e-4)
    from transformers import DynamicCache

    with pytest.raises(ValueError, match=r"GLA/GDN layer 0 needs a cache built from the model's layer types"):
        hf(input_ids=tokens, cache=DynamicCache())  # a cache of keys/values only: no room for the GLA state


@pytest.mark.parametrize("kind", list(REMOTE))
def test_hf_remote_generate_matches_tools_generate(remote, kind, capsys):
    """HF's greedy generate, with its cache (recurrent states, keys/values) and without, gives
    tools/generate.py's tokens."""
    ckpt, hf_dir, _ = remote[kind]
    capsys.readouterr()
    assert _tool("generate").main(["--load", ckpt, "--prompt", "5 6 7", "--max-new-tokens", "8", "--greedy"]) == 0
    ours = [int(t) for t in capsys.readouterr().out.strip().splitlines()[-1].split()[3:]]
    hf = _load_remote(hf_dir)
    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        for use_cache in (True, False):
            out = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=use_cache, pad_token_id=127)
            assert out[0, 3:].tolist() == ours, f"use_cache={use_cache}"
    assert len(ours) == 8


@pytest.mark.parametrize("kind", list(REMOTE))
def test_hf_remote_import_round_trip(remote, kind, tmp_path):
    """HF -> ours gives back the weights bitwise and the same model; `--load` with the run's flags takes it."""
    ckpt, hf_dir, _ = remote[kind]
    back = str(tmp_path / "back")
    assert (
        _tool("convert_checkpoint").main(["--from", "hf", "--load", hf_dir, "--to", "sharded", "--output", back]) == 0
    )
    (original, config), (imported, back_config) = consolidate(ckpt), consolidate(back)
    assert sorted(imported) == sorted(original)
    for name, w in original.items():
        assert torch.equal(imported[name], w), name
    m, b = config_from_dict(config).model, config_from_dict(back_config).model
    assert [b.layer_kind(i) for i in range(2)] == [m.layer_kind(i) for i in range(2)]
    for field in ["normalization", "activation", "gla_gate_low_rank", "untie_embeddings_and_output_weights"]:
        assert getattr(b, field) == getattr(m, field), field
    assert (b.ffn_size, b.kv_heads, b.head_dim) == (m.ffn_size, m.kv_heads, m.head_dim)
    run = training.setup(validate(parse_args(REMOTE_BASE + REMOTE[kind] + ["--load", back]), 1))
    assert run.state.iteration == 0
    for name, p in run.chunks[0].named_parameters():
        assert torch.equal(p.detach(), original[name]), name


def test_hf_remote_head_dim_round_trips_as_kv_channels(tmp_path):
    """A GLA hybrid whose heads are not hidden / heads wide (--kv-channels 16 at hidden 32 and 4 heads): the remote
    code's config.json holds head_dim, its logits equal ours, and the import gives back --kv-channels and every
    weight bitwise."""
    from megatron_zpp.checkpoint.formats import hf as hf_formats

    cfg = rope_config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.attention_type, m.softmax_attention_every, m.kv_channels = 2, 32, "gla", 2, 16
    m.init_method_std, m.linear_chunk_size = 0.2, 8  # logits far apart: a head read at the wrong width shows
    model = GPT(m, 64)
    init_weights(model, 1)
    state = {n: p.detach() for n, p in model.named_parameters()}
    assert hf_formats.export_hf(state, cfg.to_dict(), str(tmp_path / "hf")) == "MegatronZppGLAForCausalLM"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["head_dim"] == 16
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(tokens=tokens)
        got = _load_remote(str(tmp_path / "hf"))(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    hf_formats.import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    imported, config = consolidate(str(tmp_path / "back"))
    assert config_from_dict(config).model.kv_channels == 16
    assert imported.keys() == state.keys() and all(torch.equal(imported[n], w) for n, w in state.items())


def test_hf_remote_import_refuses_what_we_cannot_hold(tmp_path, capsys):
    from megatron_zpp.checkpoint.formats import remote as hf_remote_export

    hf = {
        "model_type": "megatron_zpp_gla",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "layer_types": ["full_attention", "linear_attention", "linear_attention"],
    }
    with pytest.raises(hf_remote_export.RemoteConversionError, match="softmax attention at every K-th layer"):
        hf_remote_export.config_from_remote(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))  # the tool: one line, exit code 2
    args = ["--from", "hf", "--load", str(tmp_path), "--to", "sharded", "--output", str(tmp_path / "out")]
    assert _tool("convert_checkpoint").main(args) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot import {tmp_path}: layer_types")
    hf["layer_types"] = ["linear_attention"] * 3
    with pytest.raises(hf_remote_export.RemoteConversionError, match="config.json has no 'intermediate_size'"):
        hf_remote_export.config_from_remote(hf)
    cfg = rope_config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.attention_type = 1, 32, "gla"
    state = {n: p.detach() for n, p in GPT(cfg.model, 64).named_parameters()}
    assert cfg.model.linear_chunk_size is None  # unset: the device's default, not a null in config.json
    assert "gla_chunk_size" not in hf_remote_export.config(cfg, 64)
    theirs = hf_remote_export.to_remote_state(state, cfg)
    with pytest.raises(hf_remote_export.RemoteConversionError, match="does not have: model.layers.0.attn.extra"):
        hf_remote_export.from_remote_state({**theirs, "model.layers.0.attn.extra": torch.zeros(1)}, cfg)
    with pytest.raises(hf_remote_export.RemoteConversionError, match="no HF name for layers.0.mixer.extra"):
        hf_remote_export.to_remote_state({**state, "layers.0.mixer.extra": torch.zeros(1)}, cfg)


def test_hf_remote_export_carries_the_tokenizer(tmp_path):
    """A sentencepiece run's tokenizer.model goes along, with tokenizer_config.json naming Llama's
    tokenizer class (our model type has none): AutoTokenizer splits text as our tokenizer does."""
    import sentencepiece as spm
    import transformers

    from megatron_zpp.data.tokenizer import SentencePieceTokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"def f_{i}(self, x):\n    return x + {i}  # the quick brown fox" for i in range(200)))
    prefix = str(tmp_path / "tok")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=prefix, vocab_size=120, model_type="bpe", minloglevel=2
    )
    cfg = rope_config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.attention_type = 1, 32, "gla"
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = "SentencePieceTokenizer", prefix + ".model"
    state = {n: p.detach() for n, p in GPT(cfg.model, 128).named_parameters()}
    out = str(tmp_path / "hf")
    assert _tool("convert_checkpoint").export_hf(state, cfg.to_dict(), out) == "MegatronZppGLAForCausalLM"
    ours = SentencePieceTokenizer(prefix + ".model")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == ours.eod
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    prompt = "def __init__(self, x): return quick"
    assert hf_tok(prompt, add_special_tokens=False).input_ids == ours.tokenize(prompt)
    # tools/generate.py prints prompt and completion decoded as one sequence: transformers' text
    ids, new = ours.tokenize(prompt), ours.tokenize(" return x + 1  # the quick brown fox")[::-1]
    assert _tool("generate").completion_text(ours, ids, new) == hf_tok.decode(ids + new)
