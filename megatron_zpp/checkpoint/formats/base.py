"""What every converter of ours speaks: one protocol, one error.

A format module (formats/gpt2.py, llama.py, remote.py, qwen3_moe.py, mixtral.py, mcore.py) maps our
single-rank state (the names GPT(cfg.model, V).named_parameters() gives, full fp32 tensors: full_state.py) to
another project's names and back:

    NAME                          # "gpt2", "llama", "remote", "qwen3_moe", "mixtral", "mcore"
    unsupported(cfg) -> [why]     # what of our model it cannot hold, one reason each (empty: it holds it)
    to_theirs(state, cfg)         # our names -> theirs
    from_theirs(theirs, cfg)      # theirs -> ours, the inverse (bitwise: splits, concatenations, transposes)

The HF formats also write and read a config.json (`HFFormat`): `config(cfg, vocab, tokenizer)` and
`config_from(hf)` (our Config of one; refuses what we cannot hold). megatron-core's config is the run's
argparse Namespace (formats/mcore.py: `args_from_config`, `config_from_args`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..files import CheckpointError


class ConversionError(CheckpointError, ValueError):
    """A model, setting or tensor a conversion cannot map; the message names it (one line)."""


class Format(Protocol):
    NAME: str

    def unsupported(self, cfg) -> list[str]: ...

    def to_theirs(self, state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]: ...

    def from_theirs(self, theirs: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]: ...


class HFFormat(Format, Protocol):
    ARCHITECTURE: str  # config.json's architectures[0]

    def config(self, cfg, vocab: int, tokenizer=None) -> dict: ...

    def config_from(self, hf: dict): ...


def experts_refusal(cfg, target: str) -> list[str]:
    """A dense format's refusal of a model with experts (empty without)."""
    if not cfg.model.num_experts:
        return []
    return [f"its feed-forward networks are mixtures of experts (--num-experts); {target} has dense MLPs only"]


def block_refusals(cfg, target: str) -> list[str]:
    """OLMo's block flags (formats/olmo_hybrid.py holds them) that a format without them refuses (empty: none set)."""
    m = cfg.model
    gdn = any(m.layer_kind(i) == "gdn" for i in range(m.num_layers))
    checks = [
        (
            m.reordered_norms == "none",
            f"--reordered-norms {m.reordered_norms}: {target} normalizes each branch's input",
        ),
        (not m.qk_layernorm_full_width, f"--qk-layernorm-full-width: {target} does not normalize q, k over all heads"),
        (not m.linear_allow_neg_eigval, f"--linear-allow-neg-eigval: {target}'s GDN beta is sigmoid(b), in (0, 1)"),
        (
            not gdn or m.gdn_norm_epsilon == m.norm_epsilon,
            f"--linear-norm-epsilon {m.linear_norm_epsilon}: {target}'s GDN output norm uses --norm-epsilon",
        ),
    ]
    return [why for ok, why in checks if not ok]


def special_token_ids(tokenizer) -> dict:
    """config.json's bos/eos/pad ids from our tokenizer (EOD is HF's eos); {} without one."""
    if tokenizer is None:
        return {}
    ids = {"bos_token_id": getattr(tokenizer, "bos", None), "eos_token_id": tokenizer.eod}
    ids["pad_token_id"] = getattr(tokenizer, "pad", None)
    return {k: v for k, v in ids.items() if v is not None}


def decoder_config(hf: dict):
    """Our Config with what every HF decoder config.json we import says alike: layers, width, (GQA) heads and
    their head_dim (--kv-channels where it is not hidden_size / heads: Qwen3-0.6B's 128 at hidden 1024 and 16
    heads; null or absent: the quotient, as transformers reads it), the MLP width, vocabulary and positions;
    dropout 0 (the exports hold none; a format may set its own)."""
    from ...config import Config

    cfg = Config()
    m, heads = cfg.model, hf["num_attention_heads"]
    m.num_layers, m.hidden_size, m.num_attention_heads = hf["num_hidden_layers"], hf["hidden_size"], heads
    if (head_dim := hf.get("head_dim")) is not None and head_dim != hf["hidden_size"] // heads:
        m.kv_channels = head_dim  # validation refuses one below 1 by --kv-channels; a wrong type: hf._ill_typed
    m.group_query_attention, m.num_query_groups = True, hf.get("num_key_value_heads", heads)
    m.hidden_dropout = m.attention_dropout = 0.0
    m.ffn_hidden_size, m.vocab_size = hf["intermediate_size"], hf["vocab_size"]
    m.max_position_embeddings = m.seq_length = hf.get("max_position_embeddings", m.seq_length)
    return cfg
