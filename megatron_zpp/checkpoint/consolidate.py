"""Consolidate a sharded checkpoint into full single-rank weights (any saved layout).

    state, config = consolidate("ckpt")   # state: {param name: fp32 tensor}, as GPT(cfg.model, V) names them

Every rank's file is read (sha256 checked against meta.json, `weights_only=True`). The
parameter shapes and names of each rank's model chunks are rebuilt on the meta device
from the saved config and layout (no process groups: a stand-in TP group with .rank and
.size), exactly as `training.build_model` places layers on pipeline stages. Then:

* ZeRO (stages 1-3): each unit's flat buffer is the concatenation of the fp32 master
  shards of its ZeRO group (DP x CP, in group-rank order); it is cut at the unit's
  parameter offsets (`model_units` order) and the padding dropped;
* plain DP: the rank file holds the parameters (and, for bf16, fp32 masters: used);
* TP pieces are reassembled with each parameter's `tp_split` (`unshard`);
* pipeline stages are merged by global name (layers keep their global index); a tied
  embedding is taken from the first stage.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..config import Config
from ..data.tokenizer import build_tokenizer, pad_vocab_size
from ..model import GPT
from ..pipeline_parallel.stages import stage_layers, virtual_stage_layers
from ..tensor_parallel.layers import unshard
from ..topology import Topology
from ..zero.optimizer import model_units
from .sharded import FORMAT, CheckpointError, read_meta, read_rank_file


@dataclass(frozen=True)
class FakeGroup:
    """Stands in for a process group where only .rank and .size are read (construction)."""
    rank: int
    size: int


def config_from_dict(d: dict) -> Config:
    """The Config a checkpoint's meta["config"] (Config.to_dict()) describes."""
    cfg = Config()
    for section, values in d.items():
        obj = getattr(cfg, section, None)
        if obj is None:
            raise CheckpointError(f"checkpoint config has an unknown section {section!r}")
        for name, value in values.items():
            if not hasattr(obj, name):
                raise CheckpointError(f"checkpoint config has an unknown setting {section}.{name}")
            setattr(obj, name, value)
    return cfg


def build_chunks(cfg: Config, vocab: int, tp_rank: int, pp_rank: int) -> list[GPT]:
    """This (TP rank, PP stage)'s model chunks on the meta device (shapes and names only)."""
    p, m = cfg.parallel, cfg.model
    pp = p.pipeline_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage:
        layer_sets = virtual_stage_layers(m.num_layers, pp, p.num_layers_per_virtual_pipeline_stage, pp_rank)
    else:
        layer_sets = [stage_layers(m.num_layers, pp, pp_rank, p.decoder_first_pipeline_num_layers,
                                   p.decoder_last_pipeline_num_layers)]
    tp = FakeGroup(tp_rank, p.tensor_model_parallel_size)
    with torch.device("meta"):
        return [GPT(m, vocab, tp=tp, sequence_parallel=p.sequence_parallel, layer_ids=layers,
                    pre_process=pp_rank == 0 and v == 0,
                    post_process=pp_rank == pp - 1 and v == len(layer_sets) - 1)
                for v, layers in enumerate(layer_sets)]


def _load_rank_files(path: str, meta: dict) -> list[dict]:
    return [read_rank_file(path, meta, r)["model"] for r in range(meta["world_size"])]


def _padded_vocab(cfg: Config, states: list[dict], zero: bool) -> int:
    """The padded vocabulary the run trained with: from its tokenizer when it can be
    built here, else from the saved embedding's shape (plain DP)."""
    m, d = cfg.model, cfg.data
    tp = cfg.parallel.tensor_model_parallel_size
    try:
        tok = build_tokenizer(d.tokenizer_type, d.tokenizer_model, m.vocab_size, m.make_vocab_size_divisible_by, tp)
        return tok.padded_vocab_size
    except (OSError, ValueError, ImportError):
        pass
    if not zero and "chunk0.embedding.weight" in states[0]:
        return states[0]["chunk0.embedding.weight"].shape[0] * tp
    raise CheckpointError(f"cannot tell the vocabulary size: the tokenizer {d.tokenizer_model!r} of the run is not "
                          f"available here; pass its path (tokenizer_model=...)")


def _rank_params(cfg: Config, chunks: list[GPT], rank: int, topo: Topology, states: list[dict]) -> dict:
    """{name: this rank's piece} for one rank (ZeRO: rebuilt from its group's shards)."""
    state = states[rank]
    out = {}
    if cfg.zero.zero_stage == 0:
        params = [(c, n) for c, chunk in enumerate(chunks) for n, _ in chunk.named_parameters()]
        for i, (c, name) in enumerate(params):  # PlainDP's optimizer order: chunk by chunk
            t = state.get(f"master.{i}", state[f"chunk{c}.{name}"])
            out.setdefault(name, t)  # a tied embedding on both end chunks of one stage: the first
        return out
    members = next(g for g in topo.groups(["dp", "cp"]) if rank in g)
    u = 0
    for chunk in chunks:
        for uname, uparams, _ in model_units(chunk):
            key = f"unit{u}.{uname}"
            shards = []
            for member in members:
                s = states[member]
                if f"{key}.master" not in s:
                    raise CheckpointError(f"rank {member} has no {key}.master: the checkpoint does not match the "
                                          f"model its config describes")
                shards.append(s[f"{key}.master"])
            flat = torch.cat(shards)
            names = {id(p): n for n, p in chunk.named_parameters()}
            offset = 0
            for p in uparams:
                n = p.numel()
                if offset + n > flat.numel():
                    raise CheckpointError(f"{key}: the saved shards hold {flat.numel()} values, fewer than the "
                                          f"unit's parameters need")
                out.setdefault(names[id(p)], flat[offset:offset + n].view(p.shape))
                offset += n
            u += 1
    return out


def consolidate(ckpt_dir: str, tokenizer_model: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(full fp32 weights by single-rank parameter name, the run's config dict) of the
    checkpoint `ckpt_dir/latest` names (or of an iteration directory itself)."""
    if os.path.exists(os.path.join(ckpt_dir, "meta.json")):  # an iter_XXXXXXX directory
        with open(os.path.join(ckpt_dir, "meta.json")) as f:
            found = (ckpt_dir, json.load(f))
        if found[1].get("format") != FORMAT:
            raise CheckpointError(f"{ckpt_dir}/meta.json: unknown format {found[1].get('format')!r}")
    else:
        found = read_meta(ckpt_dir)
    if found is None:
        raise CheckpointError(f"{ckpt_dir}: no checkpoint (no 'latest' file)")
    path, meta = found
    cfg = config_from_dict(meta["config"])
    if tokenizer_model:
        cfg.data.tokenizer_model = tokenizer_model
    p = cfg.parallel
    world, tp, pp = meta["world_size"], p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    topo = Topology(world, tp=tp, cp=p.context_parallel_size, pp=pp, order=p.order, ranks_per_node=world)
    states = _load_rank_files(path, meta)
    vocab = _padded_vocab(cfg, states, cfg.zero.zero_stage > 0)

    full: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        pieces: dict[str, list] = {}
        splits: dict[str, tuple | None] = {}
        for t in range(tp):
            chunks = build_chunks(cfg, vocab, t, stage)
            for chunk in chunks:
                for n, prm in chunk.named_parameters():
                    splits.setdefault(n, prm.tp_split)
            rank = topo.rank_of(tp=t, pp=stage)  # dp = cp = 0: one replica
            for n, tensor in _rank_params(cfg, chunks, rank, topo, states).items():
                pieces.setdefault(n, []).append(tensor)
        for n, parts in pieces.items():
            if n not in full:  # the tied embedding: the first stage's copy
                full[n] = unshard([x.float() for x in parts], splits[n]).clone()
    return full, meta["config"]


def padded_vocab_of(state: dict) -> int:
    return state["embedding.weight"].shape[0]


__all__ = ["consolidate", "config_from_dict", "build_chunks", "padded_vocab_of", "pad_vocab_size"]
