"""Convert a sharded megatron_zpp checkpoint (any parallel layout) to one file or to HF Llama.

    python tools/convert_checkpoint.py --load ckpt --to consolidated --output model.pt
        one file {"config": the run's config dict, "model": {name: fp32 tensor}}, loadable
        with torch.load(..., weights_only=True); the names are those of a single-rank GPT
    python tools/convert_checkpoint.py --load ckpt --to hf --output hf_dir [--tokenizer-model tok.model]
        a LlamaForCausalLM directory: config.json + model.safetensors (+ tokenizer.model);
        only for softmax-attention models with RMSNorm, SwiGLU and RoPE

RoPE needs no permutation of the q/k rows: we rotate the pairs (x[i], x[i + d/2]) as HF
Llama's rotate_half does. The vocabulary is the padded one (the rows past the tokenizer's
vocabulary are never predicted in training; HF sees them as ordinary tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_zpp.checkpoint.consolidate import config_from_dict, consolidate  # noqa: E402


class ConversionError(ValueError):
    """A model this export cannot represent; the message says why."""


def hf_unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as Llama (empty when it can)."""
    m = cfg.model
    why = []
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    if kinds != {"softmax"}:
        why.append(f"its layers are {'/'.join(sorted(kinds))} (gated linear attention or a hybrid); Llama has only "
                   f"softmax attention")
    if m.normalization != "RMSNorm":
        why.append(f"it uses {m.normalization}; Llama uses RMSNorm")
    if m.activation != "swiglu":
        why.append(f"its MLP uses {m.activation}; Llama uses SwiGLU")
    return why


def hf_config(cfg, vocab: int, tokenizer=None) -> dict:
    m = cfg.model
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden_size,
           "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers,
           "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.kv_heads,
           "head_dim": m.head_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_epsilon,
           "rope_theta": m.rotary_base, "vocab_size": vocab,
           "max_position_embeddings": m.max_position_embeddings or m.seq_length,
           "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_bias": False,
           "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": m.init_method_std,
           "torch_dtype": "float32", "dtype": "float32", "use_cache": True}
    if tokenizer is not None:
        if getattr(tokenizer, "bos", None) is not None:
            out["bos_token_id"] = tokenizer.bos
        out["eos_token_id"] = tokenizer.eod
        if getattr(tokenizer, "pad", None) is not None:
            out["pad_token_id"] = tokenizer.pad
    return out


def to_hf_state(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> HF Llama names (q, k, v and gate, up split out of the fused rows)."""
    m = cfg.model
    q_rows, kv_rows, ffn = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_size
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["final_norm.weight"]}
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[src + "mixer.qkv.weight"].split([q_rows, kv_rows, kv_rows], dim=0)
        gate, up = state[src + "mlp.fc1.weight"].split([ffn, ffn], dim=0)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": state[src + "mixer.proj.weight"],
                    dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                    dst + "mlp.down_proj.weight": state[src + "mlp.fc2.weight"],
                    dst + "input_layernorm.weight": state[src + "norm1.weight"],
                    dst + "post_attention_layernorm.weight": state[src + "norm2.weight"]})
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def export_hf(state: dict, config: dict, output: str, tokenizer_model: str | None = None) -> None:
    cfg = config_from_dict(config)
    why = hf_unsupported(cfg)
    if why:
        raise ConversionError("cannot export to HF Llama: " + "; ".join(why) + ". Use --to consolidated instead")
    from safetensors.torch import save_file
    tokenizer = None
    tok_model = tokenizer_model or cfg.data.tokenizer_model
    if cfg.data.tokenizer_type == "SentencePieceTokenizer" and tok_model and os.path.isfile(tok_model):
        from megatron_zpp.data.tokenizer import SentencePieceTokenizer
        tokenizer = SentencePieceTokenizer(tok_model)
    vocab = state["embedding.weight"].shape[0]
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf_config(cfg, vocab, tokenizer), f, indent=2)
    save_file(to_hf_state(state, cfg), os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_model:
        if not os.path.isfile(tokenizer_model):
            raise ConversionError(f"--tokenizer-model {tokenizer_model}: no such file")
        shutil.copyfile(tokenizer_model, os.path.join(output, "tokenizer.model"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", required=True, help="checkpoint directory (with `latest`) or an iter_XXXXXXX dir")
    ap.add_argument("--to", required=True, choices=["consolidated", "hf"])
    ap.add_argument("--output", required=True, help="FILE.pt for consolidated, a directory for hf")
    ap.add_argument("--tokenizer-model", default=None,
                    help="sentencepiece .model (hf: copied as tokenizer.model; also used to size the vocabulary)")
    args = ap.parse_args(argv)
    state, config = consolidate(args.load, tokenizer_model=args.tokenizer_model)
    if args.to == "consolidated":
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        torch.save({"config": config, "model": state}, args.output)
    else:
        try:
            export_hf(state, config, args.output, args.tokenizer_model)
        except ConversionError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    n = sum(t.numel() for t in state.values())
    print(f"wrote {args.output} ({args.to}: {len(state)} tensors, {n / 1e6:.2f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
