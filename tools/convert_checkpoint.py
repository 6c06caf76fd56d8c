"""Convert a sharded megatron_zpp checkpoint (any parallel layout) to one file or to HF, and back.

    python tools/convert_checkpoint.py --load ckpt --to consolidated --output model.pt
        one file {"config": the run's config dict, "model": {name: fp32 tensor}}, loadable
        with torch.load(..., weights_only=True); the names are those of a single-rank GPT
    python tools/convert_checkpoint.py --load ckpt --to hf --output hf_dir [--tokenizer-model tok.model]
        Megatron's default GPT (softmax attention, LayerNorm, gelu, learned absolute positions, linear
        biases, no GQA): a GPT2LMHeadModel directory (megatron_zpp/checkpoint/hf_gpt2.py);
        softmax-attention models with RMSNorm, SwiGLU and RoPE, no biases: a LlamaForCausalLM directory,
        config.json + model.safetensors (+ tokenizer.model); every other model (GLA, hybrid,
        LayerNorm, GeLU; RoPE or no positions, no biases): the same files plus our remote code (megatron_zpp/hf_remote/:
        configuration_megatron_zpp_gla.py, modeling_megatron_zpp_gla.py, plain PyTorch; with a
        tokenizer, tokenizer_config.json naming Llama's), loaded with
        AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)
    python tools/convert_checkpoint.py --from hf --load hf_dir --to sharded --output ckpt
        a HF directory of any of these kinds (model.safetensors or its sharded index) -> a weights-only
        checkpoint of ours (iteration 0, no optimizer state); pretrain_gpt.py --load ckpt
        reshards it to any layout (pass the model flags that match; a mismatch is named)

    python tools/convert_checkpoint.py --from megatron --load mlm_ckpt --to sharded --save ckpt [--no-optim]
        a megatron-core torch_dist checkpoint (Megatron-LM's --ckpt-format torch_dist, any TP/PP; Adam's
        state of the non-distributed optimizer, or of --use-distributed-optimizer in either format:
        fully_reshardable and dp_reshardable, any TP/PP/DP with the layers split evenly) -> our --ckpt-format
        torch_dist checkpoint: weights (the fp32 masters in bf16/fp16 runs), Adam's moments and step (the
        checkpoint's own), iteration and consumed samples (the LR schedule's position); the model
        settings are read from the checkpoint's args
    python tools/convert_checkpoint.py --load ckpt --to megatron --save mlm_ckpt [--no-optim]
                                       [--use-distributed-optimizer]
        ours (any format and layout) -> a megatron-core torch_dist checkpoint that Megatron-LM's
        --load (any TP/PP) and megatron-core's dist_checkpointing.load read: weights, Adam's moments and
        step, the scheduler's state, iteration and args (megatron_zpp/checkpoint/mcore.py); with
        --use-distributed-optimizer, Adam's state as megatron-core's DistributedOptimizer keeps it
        (fully_reshardable: any TP/PP/DP of a run with --use-distributed-optimizer loads it)

The output is never overwritten or mixed with another format: an --output that is --load, holds it, lies
in an iteration directory, exists (a file, a non-empty HF directory) or, as a checkpoint root, holds the
iteration written, a newer `latest` or the other format is refused before any tensor is read; the result
is written under a fresh .tmp and renamed into place at the end (megatron_zpp/checkpoint/convert_output.py).

RoPE needs no permutation of the q/k rows: we rotate the pairs (x[i], x[i + d/2]) as HF
Llama's rotate_half does. The vocabulary is the padded one (the rows past the tokenizer's
vocabulary are never predicted in training; HF sees them as ordinary tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import types
import typing

import torch

from megatron_zpp import hf_remote
from megatron_zpp.checkpoint import CheckpointError, hf_files, hf_gpt2, mcore
from megatron_zpp.checkpoint import hf_remote_export as hf_gla
from megatron_zpp.checkpoint.consolidate import config_from_dict, consolidate
from megatron_zpp.checkpoint.convert_output import check_output, staged
from megatron_zpp.checkpoint.files import find_checkpoint, os_error_line
from megatron_zpp.data.tokenizer import SENTENCEPIECE_TYPES
from megatron_zpp.progress import progress


class ConversionError(ValueError):
    """A model this export cannot represent; the message says why."""


def hf_unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as Llama (empty when it can)."""
    m = cfg.model
    why = []
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    if kinds != {"softmax"}:
        why.append(
            f"its layers are {'/'.join(sorted(kinds))} (gated linear attention or a hybrid); Llama has only "
            f"softmax attention"
        )
    if m.normalization != "RMSNorm":
        why.append(f"it uses {m.normalization}; Llama uses RMSNorm")
    if m.activation != "swiglu":
        why.append(f"its MLP uses {m.activation}; Llama uses SwiGLU")
    if m.position_embedding_type != "rope":
        why.append(f"its positions are {m.position_embedding_type}; Llama uses RoPE")
    if m.add_bias_linear or m.add_qkv_bias:
        why.append("it has linear biases; the Llama export holds none")
    if m.rotary_percent != 1.0:
        why.append(f"its RoPE rotates {m.rotary_dim} of {m.head_dim} head channels; the Llama export rotates all")
    return why


def export_kind(cfg) -> str:
    """gpt2, llama or remote (our remote code): the first that holds the model; refuses by name when none does."""
    if not hf_gpt2.gpt2_unsupported(cfg):
        return "gpt2"
    if not hf_unsupported(cfg):
        return "llama"
    why = hf_gla.remote_unsupported(cfg)
    if why:
        raise ConversionError(
            "cannot export to HF: as GPT-2 "
            + "; ".join(hf_gpt2.gpt2_unsupported(cfg))
            + "; as Llama "
            + "; ".join(hf_unsupported(cfg))
            + "; with our remote code "
            + "; ".join(why)
        )
    return "remote"


def hf_config(cfg, vocab: int, tokenizer=None) -> dict:
    m = cfg.model
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base,
        "vocab_size": vocab,
        "max_position_embeddings": m.max_position_embeddings or m.seq_length,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": m.init_method_std,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    return out | hf_gla.special_token_ids(tokenizer)


def to_hf_state(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> HF Llama names (q, k, v and gate, up split out of the fused rows)."""
    m = cfg.model
    q_rows, kv_rows, ffn = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_size
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["final_norm.weight"]}
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    for i in progress(range(m.num_layers), "HF export", unit=" layers"):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[src + "mixer.qkv.weight"].split([q_rows, kv_rows, kv_rows], dim=0)
        gate, up = state[src + "mlp.fc1.weight"].split([ffn, ffn], dim=0)
        out.update(
            {
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[src + "mixer.proj.weight"],
                dst + "mlp.gate_proj.weight": gate,
                dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": state[src + "mlp.fc2.weight"],
                dst + "input_layernorm.weight": state[src + "norm1.weight"],
                dst + "post_attention_layernorm.weight": state[src + "norm2.weight"],
            }
        )
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def from_hf_state(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF Llama names -> our single-rank names: the inverse of `to_hf_state`."""
    out = {"embedding.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"]}
    if cfg.model.untie_embeddings_and_output_weights:
        out["output.weight"] = hf["lm_head.weight"]
    for i in progress(range(cfg.model.num_layers), "HF import", unit=" layers"):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out.update(
            {
                dst + "mixer.qkv.weight": torch.cat(
                    [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]]
                ),
                dst + "mixer.proj.weight": hf[attn + "o_proj.weight"],
                dst + "mlp.fc1.weight": torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]),
                dst + "mlp.fc2.weight": hf[mlp + "down_proj.weight"],
                dst + "norm1.weight": hf[src + "input_layernorm.weight"],
                dst + "norm2.weight": hf[src + "post_attention_layernorm.weight"],
            }
        )
    return {k: v.float().contiguous() for k, v in out.items()}


def config_from_hf(hf: dict, hf_dir: str):
    """Our Config of the Llama model a HF config.json describes; refuses what we cannot hold."""
    from megatron_zpp.config import Config

    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    why = [
        w
        for w, bad in [
            (
                f"model_type {hf.get('model_type')!r} is none of those imported: llama, gpt2, "
                f"{hf_remote.MODEL_TYPE} (our GLA/hybrid export)",
                hf.get("model_type") != "llama",
            ),
            (f"hidden_act {hf.get('hidden_act')!r} is not silu (SwiGLU)", hf.get("hidden_act", "silu") != "silu"),
            ("it uses rope_scaling", bool(hf.get("rope_scaling"))),
            ("it has attention or MLP biases", hf.get("attention_bias") or hf.get("mlp_bias")),
            (
                f"head_dim {hf.get('head_dim')} is not hidden_size / heads",
                hf.get("head_dim", hidden // heads) != hidden // heads,
            ),
        ]
        if bad
    ]
    if why:
        raise ConversionError(f"cannot import {hf_dir}: " + "; ".join(why))
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = hf["num_hidden_layers"], hidden, heads
    m.group_query_attention, m.num_query_groups = True, hf.get("num_key_value_heads", heads)
    m.hidden_dropout, m.attention_dropout = 0.0, float(hf.get("attention_dropout", 0.0))  # Llama trains without
    m.ffn_hidden_size, m.vocab_size = hf["intermediate_size"], hf["vocab_size"]
    m.max_position_embeddings = m.seq_length = hf.get("max_position_embeddings", m.seq_length)
    m.norm_epsilon, m.rotary_base = hf.get("rms_norm_eps", 1e-6), float(hf.get("rope_theta", 10000.0))
    m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", False)
    m.normalization, m.activation, m.attention_type = "RMSNorm", "swiglu", "softmax"
    m.position_embedding_type, m.add_bias_linear = "rope", False
    m.init_method_std = hf.get("initializer_range", m.init_method_std)
    return _with_tokenizer(cfg, hf_dir)


def _with_tokenizer(cfg, hf_dir: str):
    """cfg, with the directory's sentencepiece tokenizer.model as its tokenizer when there is one."""
    tok = os.path.join(hf_dir, "tokenizer.model")
    if os.path.isfile(tok):
        cfg.data.tokenizer_type, cfg.data.tokenizer_model = "SentencePieceTokenizer", os.path.abspath(tok)
    return cfg


def import_hf(hf_dir: str, output: str) -> tuple[dict, str]:
    """(our weights, checkpoint dir) of a HF Llama, GPT-2 or remote-code GLA/hybrid directory, saved as a
    weights-only checkpoint. Every file is read by its content (megatron_zpp/checkpoint/hf_files.py):
    the tensors' names, shapes and dtypes are checked against the model config.json describes before
    any data is read, and every tensor read must be finite."""
    from megatron_zpp.checkpoint.sharded import save_weights

    try:
        hf_cfg = hf_files.read_config(hf_dir)
        kind, cfg = _config_of(hf_cfg, hf_dir)
        entries = hf_files.read_headers(hf_dir)
        if isinstance(cfg.model.num_layers, int) and cfg.model.num_layers > len(entries):  # before building it
            raise hf_files.HFImportError(
                f"config.json says {cfg.model.num_layers} layers but the files hold {len(entries)} tensors in all"
            )
        expected = _expected_hf_shapes(kind, cfg)
        hf_files.check_tensors(entries, expected, hf_cfg)
        hf = hf_files.read_tensors(hf_dir, entries, expected)
    except hf_files.HFImportError as e:
        raise ConversionError(f"cannot import {hf_dir}: {e}") from None
    convert = {"remote": hf_gla.from_remote_state, "gpt2": hf_gpt2.from_gpt2_state}.get(kind, from_hf_state)
    state = convert(hf, cfg)
    return state, save_weights(output, cfg, state)


def _config_of(hf_cfg: dict, hf_dir: str):
    """(kind, our Config) of a config.json: its refusals, missing keys and ill-typed values one line each."""
    kind = {hf_remote.MODEL_TYPE: "remote", "gpt2": "gpt2"}.get(hf_cfg.get("model_type"), "llama")
    try:
        if kind == "remote":  # our GLA/hybrid export
            cfg = _with_tokenizer(hf_gla.config_from_remote(hf_cfg), hf_dir)
        elif kind == "gpt2":
            cfg = _with_tokenizer(hf_gpt2.config_from_gpt2(hf_cfg), hf_dir)
        else:
            cfg = config_from_hf(hf_cfg, hf_dir)
    except (hf_gla.RemoteConversionError, hf_gpt2.GPT2ConversionError) as e:
        raise hf_files.HFImportError(str(e)) from None
    except ConversionError:  # config_from_hf's refusal, already one line naming the directory
        raise
    except KeyError as e:
        raise hf_files.HFImportError(f"config.json has no {e}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise hf_files.HFImportError(f"config.json: a value of the wrong type or size ({e})") from None
    if bad := _ill_typed(cfg.model):
        raise hf_files.HFImportError(f"config.json: {bad}")
    return kind, cfg


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


def _expected_hf_shapes(kind: str, cfg) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of the model `cfg` describes: the export's own mapping applied to meta tensors
    of our model's shapes (one rule for both directions). A config we cannot build is refused here."""
    import copy

    from megatron_zpp.checkpoint.layout import model_shapes
    from megatron_zpp.config import ConfigError
    from megatron_zpp.validation import validate

    vocab = cfg.model.vocab_size
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise hf_files.HFImportError(f"config.json: vocab_size {vocab!r} is not a positive integer")
    try:
        built = validate(copy.deepcopy(cfg), 1, run=False)
    except ConfigError as e:
        raise hf_files.HFImportError(
            f"config.json describes a model we cannot build: {str(e).splitlines()[0]}"
        ) from None
    ours = {n: torch.empty(shape, device="meta") for n, shape in model_shapes(built, vocab).items()}
    to_hf = {"remote": hf_gla.to_remote_state, "gpt2": hf_gpt2.to_gpt2_state}.get(kind, to_hf_state)
    return {n: tuple(t.shape) for n, t in to_hf(ours, built).items()}


def export_hf(state: dict, config: dict, output: str, tokenizer_model: str | None = None) -> str:
    """Write the HF directory `output`; returns its architecture (GPT2LMHeadModel or LlamaForCausalLM
    when one of them holds the model, else our remote-code MegatronZppGLAForCausalLM)."""
    state, cfg = hf_gpt2.fold_layernorm_1p(state, config_from_dict(config))  # HF norms scale by w itself
    kind = export_kind(cfg)
    remote = kind == "remote"
    from megatron_zpp.checkpoint.files import save_safetensors

    tokenizer = None
    tok_model = tokenizer_model or cfg.data.tokenizer_model
    if cfg.data.tokenizer_type in SENTENCEPIECE_TYPES and tok_model and os.path.isfile(tok_model):
        from megatron_zpp.data.tokenizer import SentencePieceTokenizer

        tokenizer = SentencePieceTokenizer(tok_model)
    vocab = state["embedding.weight"].shape[0]
    try:
        convert = {"remote": hf_gla.to_remote_state, "gpt2": hf_gpt2.to_gpt2_state}.get(kind, to_hf_state)
        weights = convert(state, cfg)
    except hf_gla.RemoteConversionError as e:
        raise ConversionError(f"cannot export to HF: {e}") from None
    if kind == "gpt2":
        hf = hf_gpt2.gpt2_config(cfg, vocab, hf_gla.special_token_ids(tokenizer))
    else:
        hf = hf_gla.remote_config(cfg, vocab, tokenizer) if remote else hf_config(cfg, vocab, tokenizer)
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_safetensors(weights, os.path.join(output, "model.safetensors"), {"format": "pt"})
    if remote:
        hf_gla.write_remote_code(output)
    if tokenizer_model and not os.path.isfile(tokenizer_model):
        raise ConversionError(f"--tokenizer-model {tokenizer_model}: no such file")
    if tokenizer is not None:  # the run's sentencepiece model (or the one passed) goes along
        shutil.copyfile(tok_model, os.path.join(output, "tokenizer.model"))
        if kind != "llama":  # Llama's own tokenizer class reads tokenizer.model; the others name it
            hf_gla.write_tokenizer_config(output)
    return hf["architectures"][0]


def _megatron(args, stage: str) -> str:
    """--from megatron / --to megatron: megatron-core's torch_dist checkpoints (checkpoint/mcore.py), written
    as a whole root under `stage`; the line to print."""
    if args.source == "megatron":
        out, done = mcore.import_checkpoint(args.load, stage, with_optimizer=not args.no_optim)
    else:
        out, done = mcore.export_checkpoint(
            args.load, stage, not args.no_optim, distributed_optimizer=args.use_distributed_optimizer
        )
    line = ""
    if done.get("dropped"):  # RNG streams restart from the seeds, as on any change of layout
        line = (f"dropped {len(done['dropped'])} pickled objects (_extra_state: Transformer Engine's FP8 scales, "
                f"None in the local spec; rng_state): {', '.join(done['dropped'][:2])}, ...\n")  # fmt: skip
    what = "weights and Adam state" if done["optimizer"] else "weights only"
    adam = f", Adam step {done['step']:g} ({done['optimizer_format']})" if done.get("step") is not None else ""
    final = os.path.join(args.output, os.path.basename(out))
    return line + f"wrote {final} ({what}: {done['tensors']} tensors, iteration {done['iteration']}{adam})"


def _from_hf(args, stage: str) -> str:
    state, out = import_hf(args.load, stage)
    n = sum(t.numel() for t in state.values())
    final = os.path.join(args.output, os.path.basename(out))
    return f"wrote {final} (weights-only checkpoint: {len(state)} tensors, {n / 1e6:.2f}M parameters)"


def _from_ours(args, stage: str) -> str:
    """--to consolidated or hf: the full single-rank weights of our checkpoint, written to `stage`."""
    try:
        state, config = consolidate(args.load)
    except CheckpointError as e:  # no checkpoint there, or a damaged one: one line
        raise CheckpointError(f"--load {e}") from None
    what = args.to
    if args.to == "consolidated":
        torch.save({"config": config, "model": state}, stage)
    else:
        what = f"hf {export_hf(state, config, stage, args.tokenizer_model)}"
    n = sum(t.numel() for t in state.values())
    return f"wrote {args.output} ({what}: {len(state)} tensors, {n / 1e6:.2f}M parameters)"


VALID_PAIRS = {
    ("megatron_zpp", "consolidated"): _from_ours,
    ("megatron_zpp", "hf"): _from_ours,
    ("megatron_zpp", "megatron"): _megatron,
    ("hf", "sharded"): _from_hf,
    ("megatron", "sharded"): _megatron,
}
OUTPUT_KIND = {"consolidated": "file", "hf": "hf", "sharded": "ours", "megatron": "megatron"}


def pair_error(source: str, to: str) -> str:
    """Why --from `source` --to `to` is no conversion here, with the pairs that are."""
    named = {"megatron_zpp": "our checkpoint", "hf": "a HF directory", "megatron": "a megatron-core checkpoint"}
    if source == "megatron_zpp":  # the only wrong pair from ours: --to sharded
        why = "our checkpoints are sharded already (pretrain_gpt.py --load reshards them to any layout)"
    elif to == source:
        why = f"--load is {named[source]} already"
    else:
        why = f"{named[source]} converts to our sharded checkpoint only (--to sharded; convert that one on)"
    valid = "--from megatron_zpp --to consolidated|hf|megatron, --from hf --to sharded, --from megatron --to sharded"
    return f"--from {source} --to {to}: {why}; the conversions are {valid}"


def iteration_written(args) -> int | None:
    """The iteration a conversion to a checkpoint root writes, read before any tensor (None: not a root, or
    known only once the conversion read it: a megatron-core `release` directory)."""
    if args.to == "sharded" and args.source == "hf":
        return 0
    if args.to == "sharded":
        name = os.path.basename(os.path.normpath(mcore.iteration_dir(args.load)))
        return int(name[len("iter_") :]) if name.startswith("iter_") and name[5:].isdigit() else None
    if args.to == "megatron":
        return int(find_checkpoint(args.load)[1]["iteration"])
    return None


def convert(args) -> int:
    """Check the output, convert into a fresh .tmp, put it in place (checkpoint/convert_output.py)."""
    kind = OUTPUT_KIND[args.to]
    try:
        check_output(args.load, args.output, kind, iteration_written(args))
        with staged(args.load, args.output, kind) as stage:
            line = VALID_PAIRS[(args.source, args.to)](args, stage)
    except (ConversionError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {os_error_line(e, args.output)}", file=sys.stderr)
        return 2
    print(line)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--from",
        dest="source",
        default="megatron_zpp",
        choices=["megatron_zpp", "hf", "megatron"],
        help="what --load is: our sharded checkpoint (default), a HF directory (Llama, GPT-2, or our GLA/hybrid "
        "export) or a megatron-core torch_dist checkpoint (Megatron-LM's --ckpt-format torch_dist)",
    )
    ap.add_argument(
        "--load",
        required=True,
        help="checkpoint directory (with `latest`), an iter_XXXXXXX dir, or a HF directory (--from hf)",
    )
    ap.add_argument(
        "--to",
        required=True,
        choices=["consolidated", "hf", "sharded", "megatron"],
        help="sharded: our checkpoint format (only --from hf or megatron); megatron: megatron-core's torch_dist",
    )
    ap.add_argument(
        "--output",
        "--save",
        required=True,
        help="FILE.pt for consolidated, a directory for hf, a checkpoint root for sharded and megatron; never "
        "overwritten: a new path, or a root of the same format that lacks the iteration written",
    )
    ap.add_argument(
        "--no-optim",
        action="store_true",
        help="--from megatron, --to megatron: the weights only (no Adam state; the iteration is kept)",
    )
    ap.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="--to megatron: Adam's state as megatron-core's DistributedOptimizer keeps it (fully_reshardable), "
        "for a Megatron-LM run with --use-distributed-optimizer",
    )
    ap.add_argument(
        "--tokenizer-model",
        default=None,
        help="--to hf: the sentencepiece .model to copy as tokenizer.model (default: the run's)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if (args.source, args.to) not in VALID_PAIRS:
        ap.error(pair_error(args.source, args.to))
    if args.no_optim and "megatron" not in (args.source, args.to):
        ap.error("--no-optim goes with --from megatron or --to megatron")
    if args.use_distributed_optimizer and (args.to != "megatron" or args.no_optim):
        ap.error("--use-distributed-optimizer goes with --to megatron, without --no-optim (it names Adam's format)")
    return convert(args)


if __name__ == "__main__":
    sys.exit(main())
