"""HF directories (config.json + model.safetensors): our checkpoint's weights out, and back in.

    export_hf(state, config, output, tokenizer_model)   # the first format of HF_FORMATS that holds the model
    import_hf(hf_dir, output)                           # config.json's model_type picks the format

GPT-2 (gpt2.py) holds Megatron's default GPT, Llama (llama.py) softmax/RMSNorm/SwiGLU/RoPE models without
biases, transformers' OLMo Hybrid (olmo_hybrid.py) GDN/softmax hybrids built as OLMo's (--reordered-norms softmax,
--qk-layernorm-full-width), transformers' Qwen3-Next and Qwen3.5 (qwen3_next.py, qwen3_5.py: GDN hybrids with gated
attention, zero-centred norms, partial RoPE; Qwen3-Next with experts, Qwen3.5 dense or every layer sparse), our
remote code (remote.py) every other dense model without biases or learned positions; models with
experts go to transformers' own Qwen3-MoE (qwen3_moe.py: with --qk-layernorm, dense layers allowed) or Mixtral
(mixtral.py: every layer sparse, no query/key norm). A HF directory is
read by its content (hf_files.py): names, shapes and dtypes checked against the model config.json describes
before any data is read, every tensor read finite.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import types
import typing

import torch

from ... import hf_remote
from ...data.tokenizer import SENTENCEPIECE_TYPES
from ..files import save_safetensors
from ..layout import config_from_dict
from . import gpt2, hf_files, llama, mixtral, olmo_hybrid, qwen3_5, qwen3_moe, qwen3_next, remote
from .base import ConversionError, HFFormat

# the export's order of preference (a GDN model our remote code holds as it is, norms included, goes there, unless
# it is built as OLMo Hybrid)
HF_FORMATS: tuple[HFFormat, ...] = (gpt2, llama, olmo_hybrid, remote, qwen3_moe, mixtral, qwen3_next, qwen3_5)
BY_MODEL_TYPE: dict[str, HFFormat] = {  # else llama (it names the rest)
    hf_remote.MODEL_TYPE: remote,
    "gpt2": gpt2,
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
    "olmo_hybrid": olmo_hybrid,
    "qwen3_next": qwen3_next,
    **{kind: qwen3_5 for kind in (*qwen3_5.MODEL_TYPES, *qwen3_5.IMAGE_TEXT)},
}


def architectures() -> list[str]:
    """Every transformers class an export can write (config.json's architectures[0])."""
    return [a for fmt in HF_FORMATS for a in getattr(fmt, "ARCHITECTURES", (fmt.ARCHITECTURE,))]


def export_format(cfg, architecture: str | None = None) -> HFFormat:
    """The first HF format that holds the model (or the one writing `architecture`, e.g. Qwen3_5MoeForCausalLM for
    a model Qwen3-Next holds too); refuses by name, with the reasons, when none does."""
    if architecture is not None:
        fmt = next(f for f in HF_FORMATS if architecture in getattr(f, "ARCHITECTURES", (f.ARCHITECTURE,)))
        why = fmt.unsupported(cfg)
        if not why and (writes := fmt.config(cfg, 1)["architectures"][0]) != architecture:
            why = [f"this model is a {writes} (with or without experts)"]
        if why:
            raise ConversionError(f"cannot export to HF as {architecture}: " + "; ".join(why))
        return fmt
    for fmt in HF_FORMATS:
        if not fmt.unsupported(cfg):
            return fmt
    named = {
        "gpt2": "as GPT-2",
        "llama": "as Llama",
        "olmo_hybrid": "as OLMo Hybrid",
        "remote": "with our remote code",
        "qwen3_moe": "as Qwen3-MoE",
        "mixtral": "as Mixtral",
        "qwen3_next": "as Qwen3-Next",
        "qwen3_5": "as Qwen3.5",
    }
    raise ConversionError(
        "cannot export to HF: " + "; ".join(f"{named[f.NAME]} " + "; ".join(f.unsupported(cfg)) for f in HF_FORMATS)
    )


def _tokenizer(cfg, tokenizer_model: str | None):
    """(our sentencepiece tokenizer or None, its .model path): the one passed, else the run's."""
    tok_model = tokenizer_model or cfg.data.tokenizer_model
    if cfg.data.tokenizer_type in SENTENCEPIECE_TYPES and tok_model and os.path.isfile(tok_model):
        from ...data.tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(tok_model), tok_model
    return None, tok_model


def export_hf(
    state: dict, config: dict, output: str, tokenizer_model: str | None = None, architecture: str | None = None
) -> str:
    """Write the HF directory `output`; returns its architecture (GPT2LMHeadModel, LlamaForCausalLM,
    OlmoHybridForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM or
    MixtralForCausalLM when one of them holds the model, else our remote-code MegatronZppGLAForCausalLM;
    `architecture`: that class)."""
    cfg: typing.Any = config_from_dict(config)
    fmt = export_format(cfg, architecture)
    if not getattr(fmt, "ZERO_CENTRED", False):  # HF norms scale by w itself (Qwen3-Next's and Qwen3.5's by 1 + w)
        state, cfg = gpt2.fold_layernorm_1p(state, cfg)
    tokenizer, tok_model = _tokenizer(cfg, tokenizer_model)
    vocab = state["embedding.weight"].shape[0]
    try:
        weights = fmt.to_theirs(state, cfg)
    except ConversionError as e:
        raise ConversionError(f"cannot export to HF: {e}") from None
    hf = fmt.config(cfg, vocab, tokenizer)
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_safetensors(weights, os.path.join(output, "model.safetensors"), {"format": "pt"})
    if fmt is remote:
        remote.write_remote_code(output)
    if tokenizer_model and not os.path.isfile(tokenizer_model):
        raise ConversionError(f"--tokenizer-model {tokenizer_model}: no such file")
    if tokenizer is not None:  # the run's sentencepiece model (or the one passed) goes along
        shutil.copyfile(tok_model, os.path.join(output, "tokenizer.model"))
        if fmt is not llama:  # Llama's own tokenizer class reads tokenizer.model; the others name it
            remote.write_tokenizer_config(output)
    return hf["architectures"][0]


def import_hf(hf_dir: str, output: str) -> tuple[dict, str]:
    """(our weights, checkpoint dir) of a HF Llama, GPT-2, OLMo Hybrid, Qwen3-MoE, Mixtral or remote-code GLA/hybrid
    directory, saved as a weights-only checkpoint. Every fault is one line: "cannot import <hf_dir>: <what>"."""
    from ..save import save_weights

    try:
        hf_cfg = hf_files.read_config(hf_dir)
        fmt, cfg = _config_of(hf_cfg, hf_dir)
        entries = their_entries(fmt, hf_cfg, hf_files.read_headers(hf_dir))
        if isinstance(cfg.model.num_layers, int) and cfg.model.num_layers > len(entries):  # before building it
            raise ConversionError(
                f"config.json says {cfg.model.num_layers} layers but the files hold {len(entries)} tensors in all"
            )
        expected = _expected_shapes(fmt, cfg)
        if hasattr(fmt, "saved_shapes"):  # fused tensors whose split into the files is the writer's (olmo_hybrid)
            expected = fmt.saved_shapes(expected, {n: e.shape for n, e in entries.items()})
        hf_files.check_tensors(entries, expected, hf_cfg)
        hf = hf_files.read_tensors(hf_dir, entries, expected)
    except ConversionError as e:
        raise ConversionError(f"cannot import {hf_dir}: {e}") from None
    state = fmt.from_theirs(hf, cfg)
    return state, save_weights(output, cfg, state)


def their_entries(fmt: HFFormat, hf_cfg: dict, entries: dict) -> dict:
    """The files' tensors under the names the format reads: those it skips by prefix left out (Qwen's multi-token
    prediction layers, an image-text model's vision tower), its renamed prefixes renamed (that model's language
    model: model.language_model.* -> model.*); nothing for the other formats."""
    skipped: tuple[str, ...] = getattr(fmt, "SKIPPED", ())
    renamed: dict[str, str] = getattr(fmt, "renamed_prefixes", lambda hf: {})(hf_cfg)
    out = {}
    for name, e in entries.items():
        if name.startswith(skipped):
            continue
        old = next((p for p in renamed if name.startswith(p)), None)
        if old is not None:
            name, e = renamed[old] + name[len(old) :], dataclasses.replace(e, stored=name)
        out[name] = e
    return out


def _with_tokenizer(cfg, hf_dir: str):
    """cfg, with the directory's sentencepiece tokenizer.model as its tokenizer when there is one."""
    tok = os.path.join(hf_dir, "tokenizer.model")
    if os.path.isfile(tok):
        cfg.data.tokenizer_type, cfg.data.tokenizer_model = "SentencePieceTokenizer", os.path.abspath(tok)
    return cfg


def _config_of(hf_cfg: dict, hf_dir: str) -> tuple[HFFormat, typing.Any]:
    """(format, our Config) of a config.json: its refusals, missing keys and ill-typed values one line each."""
    fmt = BY_MODEL_TYPE.get(hf_cfg.get("model_type"), llama)  # type: ignore[arg-type]
    try:
        cfg = _with_tokenizer(fmt.config_from(hf_cfg), hf_dir)
    except ConversionError:  # the format's refusal: already one line
        raise
    except KeyError as e:
        raise ConversionError(f"config.json has no {e}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(f"config.json: a value of the wrong type or size ({e})") from None
    if bad := _ill_typed(cfg.model):
        raise ConversionError(f"config.json: {bad}")
    return fmt, cfg


def _ill_typed(model) -> str | None:
    """The first model setting a config.json gave with the wrong JSON type (None when all fit)."""
    hints = typing.get_type_hints(type(model))
    for f in dataclasses.fields(model):
        value, tp = getattr(model, f.name), hints[f.name]
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        allowed = tuple(typing.get_origin(a) or a for a in (typing.get_args(tp) if union else (tp,)))
        allowed = tuple(a for a in allowed if isinstance(a, type))  # Literal and the like: not checked here
        if not allowed:
            continue
        if isinstance(value, bool) and bool not in allowed:
            ok = False  # true where a number belongs
        else:
            ok = isinstance(value, allowed) or (float in allowed and isinstance(value, int))
        if not ok:
            names = " or ".join(a.__name__ for a in allowed if a is not type(None))
            return f"{f.name} = {value!r}, expected {names}"
    return None


def _expected_shapes(fmt: HFFormat, cfg) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of the model `cfg` describes: the format's own mapping applied to meta tensors
    of our model's shapes (one rule for both directions). A config we cannot build is refused here."""
    from ...config import ConfigError
    from ...validation import validate
    from ..layout import model_shapes

    vocab = cfg.model.vocab_size
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ConversionError(f"config.json: vocab_size {vocab!r} is not a positive integer")
    try:
        built = validate(copy.deepcopy(cfg), 1, run=False)
    except ConfigError as e:
        raise ConversionError(f"config.json describes a model we cannot build: {str(e).splitlines()[0]}") from None
    ours = {n: torch.empty(shape, device="meta") for n, shape in model_shapes(built, vocab).items()}
    return {n: tuple(t.shape) for n, t in fmt.to_theirs(ours, built).items()}
