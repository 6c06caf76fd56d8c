"""Read a sharded checkpoint as full single-rank tensors, and rebuild any rank's file of
another layout from it: the base of resharding on load and of consolidation.

    saved = SavedCheckpoint(path, meta)
    saved.full("layers.1.mlp.fc1.weight")   # {"param": fp32, "exp_avg": ..., "exp_avg_sq": ...}
    state = rank_state_for(saved, cfg, vocab, rank)   # what `rank` of `cfg` would have saved

Any layout can be read: TP, PP (virtual stages too), CP, DP and the ZeRO stage may all
differ between the saving and the loading run. A parameter is reassembled from the spans
of one replica (plain DP: the ranks with DP = CP = 0, and for routed experts those of expert-data-
parallel rank 0; ZeRO: the DP x CP group's shards, the experts' over the expert-data-parallel group;
the first pipeline stage holding it, for a tied embedding) and cut again with the new
layout's TP (experts: expert-TP) split and ZeRO shard. Experts are named by their global index,
so EP and expert TP may differ too; the expert count, MoE pattern and expert width may not
(check_same_experts). The persistent buffers (the routers' expert bias) are read whole from any
rank of their stage. Each file is opened once its sha256 is checked, and a
rank reads only the tensors of the parameters it needs, one parameter at a time.

What carries over: fp32 master weights, both AdamW moments and its step count, the expert
bias, the iteration and the consumed samples (so the data order continues). What does not: RNG
states belong to ranks, so a resharded run keeps its fresh per-rank seeds (dropout masks
differ from an unchanged run). When a TP change changes the vocabulary padding, padding
rows are cut, or added as copies of the last one (as Megatron's converter does): they are
never a target, but their logits are in the softmax, so the loss moves slightly.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config.moe import moe_layer_pattern
from ..progress import progress
from ..tensor_parallel.layers import shard, unshard
from ..zero import Slot, engine_class
from .files import DCP_FORMAT, CheckpointError, RankFile, open_rank_file, rank_file
from .layout import RankLayout, config_from_dict, model_shapes, rank_layout, topology_of

FIELDS = ("param", "exp_avg", "exp_avg_sq")
VOCAB_ROWS = ("embedding.weight", "output.weight")  # their dim 0 is the padded vocabulary


class SavedCheckpoint:
    """One checkpoint directory of any layout, readable parameter by parameter."""

    def __init__(self, path: str, meta: dict):
        if meta["format"] == DCP_FORMAT:
            raise CheckpointError(
                f"{path} is a --ckpt-format torch_dist checkpoint: load it with --load (DCP reshards it to any "
                "layout), or read it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save"
            )
        self.path, self.meta = path, meta
        self.cfg = config_from_dict(meta["config"])
        self.vocab = meta["padded_vocab_size"]
        topo = topology_of(self.cfg)
        # one replica of every parameter: a replicating engine's DP = CP = 0 ranks (routed experts: the ranks of
        # expert-data-parallel rank 0), else the whole DP x CP group (the experts: the expert-data-parallel one)
        whole = engine_class(self.cfg).replicated
        dense = [not whole or topo.coords(r)["dp"] == topo.coords(r)["cp"] == 0 for r in range(meta["world_size"])]
        expert = [not whole or topo.expert_coords(r)["edp"] == 0 for r in range(meta["world_size"])]
        sources = [r for r in range(meta["world_size"]) if dense[r] or expert[r]]
        chunks: dict = {}
        self.layouts: dict[int, RankLayout] = {r: rank_layout(self.cfg, self.vocab, r, topo, chunks) for r in sources}
        self.index: dict[str, list[tuple[int, Slot]]] = {}  # name -> [(rank, slot)] of its first stage
        self.buffer_rank: dict[str, int] = {}  # persistent buffer -> a rank that saved it (replicated on its stage)
        stage_of: dict[str, int] = {}
        for r in sources:
            pp = topo.coords(r)["pp"]
            for s in self.layouts[r].slots:
                if not (expert if s.expert else dense)[r] or (s.tp_split is None and s.tp_rank > 0):
                    continue  # another replica's copy (DP, expert DP; replicated over TP: TP rank 0's is read)
                if stage_of.setdefault(s.name, pp) == pp:
                    self.index.setdefault(s.name, []).append((r, s))
            for name in self.layouts[r].buffers:
                self.buffer_rank.setdefault(name, r)
        self._files: dict[int, RankFile] = {}
        self.step = self._step()

    def names(self) -> list[str]:
        return list(self.index)

    def buffer_names(self) -> list[str]:
        """The persistent buffers this checkpoint's model has (a file saved before buffers holds none: `buffer`)."""
        return sorted(self.buffer_rank)

    def files_read(self) -> tuple[str, ...]:
        """The rank files opened so far (each once its sha256 was checked)."""
        return tuple(rank_file(r) for r in sorted(self._files))

    def _file(self, rank: int) -> RankFile:
        if rank not in self._files:  # opened once, read one tensor at a time
            self._files[rank] = open_rank_file(self.path, self.meta, rank)
        return self._files[rank]

    def _step(self):
        """AdamW's step count (shared by every parameter), or None for a weights-only checkpoint."""
        f = self._file(next(iter(self.layouts)))
        steps = sorted(k for k in f.keys if k.startswith("/optimizer/state/") and k.endswith("/step"))
        return f.tensor(steps[0]).clone() if steps else None

    def buffer(self, name: str) -> torch.Tensor | None:
        """A persistent buffer as saved (None: the checkpoint has none of that name: saved without it)."""
        if name not in self.buffer_rank:
            return None
        f, key = self._file(self.buffer_rank[name]), f"/buffers/{name}"
        return f.tensor(key).clone() if key in f.keys else None

    def full(self, name: str, moments: bool = True) -> dict[str, torch.Tensor]:
        """The single-rank fp32 weight of `name` and (if saved and asked for) its AdamW moments."""
        fields = FIELDS if moments and self.step is not None else FIELDS[:1]
        pieces: dict[int, dict[str, torch.Tensor]] = {}  # TP rank -> field -> flat TP piece
        split = None
        for rank, s in self.index[name]:
            f = self._file(rank)
            if s.tp_rank not in pieces:
                pieces[s.tp_rank] = {k: torch.zeros(s.shape).view(-1) for k in fields}
            split = s.tp_split
            src = f.tensor("/model/" + (s.master_key or s.key))  # the fp32 weight
            dst = pieces[s.tp_rank]
            dst["param"][s.start : s.start + s.hi - s.lo] = src.reshape(-1)[s.lo : s.hi]
            for k in fields[1:]:
                dst[k][s.start : s.start + s.hi - s.lo] = f.tensor(f"/optimizer/state/{s.opt}/{k}").reshape(-1)
        shape = self.index[name][0][1].shape
        return {k: unshard([pieces[t][k].view(shape) for t in sorted(pieces)], split) for k in fields}


def _fit(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`t` at `shape`: as it is, a GDN output-norm weight saved per head and now shared (`_shared_head_norm`),
    or a vocabulary padded differently: padding rows cut, or added as copies of the last (padding) row, as
    Megatron's converter does; `check_same_model` has refused any other difference."""
    if tuple(t.shape) == shape:
        return t
    if _per_head_to_shared(name, tuple(t.shape), shape):
        return _shared_head_norm(name, t, shape[0])
    if shape[0] <= t.shape[0]:
        return t[: shape[0]]
    return torch.cat([t, t[-1:].expand(shape[0] - t.shape[0], *shape[1:])])


HEAD_NORM_FLAG = "--gdn-head-norm per_head"


def _per_head_to_shared(name: str, saved: tuple, now: tuple) -> bool:
    """A GDN output-norm weight saved per head [H x V] (--gdn-head-norm per_head, or before the shared weight) where
    this run shares one [V]."""
    return name.endswith("mixer.head_norm") and len(saved) == len(now) == 1 and saved[0] % now[0] == 0 < now[0]


def _shared_head_norm(name: str, t: torch.Tensor, V: int) -> torch.Tensor:
    """The one [V] weight of a per-head [H x V] one whose heads are all equal; else the load is refused."""
    heads = t.view(-1, V)
    if not bool((heads == heads[0]).all()):
        raise CheckpointError(
            f"{name} holds one GDN output-norm weight per head ({heads.shape[0]} x {V}) and they differ (or their "
            f"AdamW moments do); this run shares one [{V}] weight: load it with {HEAD_NORM_FLAG}"
        )
    return heads[0].clone()


def _vocab_padding_only(name: str, a: tuple, b: tuple) -> bool:
    return name in VOCAB_ROWS and a[1:] == b[1:]


def model_differences(saved_cfg, cfg) -> str:
    """': a (checkpoint) vs b (this run); ...' over the model settings, or ''."""
    a, b = saved_cfg.model, cfg.model
    diff = [
        f"{k} {getattr(a, k)} (checkpoint) vs {getattr(b, k)} (this run)"
        for k in vars(b)
        if getattr(a, k, None) != getattr(b, k)
    ]
    return (": " + "; ".join(diff)) if diff else ""


def _moe_shape(m) -> dict[str, tuple[str, object]]:
    """What fixes a model's routed experts and where they are: {flag: (its words, value)}."""
    if not m.num_experts:
        return {"--num-experts": ("none (a dense model)", None)}
    pattern = "".join(map(str, moe_layer_pattern(m.moe_layer_freq, m.num_layers)))
    return {
        "--num-experts": (str(m.num_experts), m.num_experts),
        "--moe-layer-freq": (f"{m.moe_layer_freq} (MoE layers {pattern})", pattern),
        "--moe-ffn-hidden-size": (str(m.expert_ffn_size), m.expert_ffn_size),
        "--moe-shared-expert-intermediate-size": (
            str(m.moe_shared_expert_intermediate_size),
            m.moe_shared_expert_intermediate_size,
        ),
        "--moe-shared-expert-gate": (str(m.moe_shared_expert_gate), m.moe_shared_expert_gate),
    }


WHAT = {
    "--num-experts": "expert count",
    "--moe-layer-freq": "MoE layer pattern",
    "--moe-ffn-hidden-size": "expert width",
    "--moe-shared-expert-intermediate-size": "shared expert width",
    "--moe-shared-expert-gate": "shared expert without (or with) its gate",
}


def check_same_experts(path: str, saved_cfg, cfg) -> None:
    """Refuse, in one line naming the flag and both values, a checkpoint of another expert count, MoE
    layer pattern or expert width: experts reshard across EP and expert TP, not across those."""
    saved, now = _moe_shape(saved_cfg.model), _moe_shape(cfg.model)
    for flag in now:  # --num-experts first: with another count the rest does not matter
        was, value = saved.get(flag, ("", None))
        if value != now[flag][1]:
            raise CheckpointError(
                f"{path} was saved with {flag} {was}, this run has {flag} {now[flag][0]}: experts reshard across "
                f"--expert-model-parallel-size and --expert-tensor-parallel-size, not to another {WHAT[flag]}"
            )


def head_norm_change(meta: dict, cfg) -> list[str]:
    """The GDN output-norm weight saved per head and shared in this run (a change the reshard path maps), or []."""
    saved = config_from_dict(meta["config"]).model.gdn_head_norm
    if cfg.model.attention_type != "gdn" or saved == cfg.model.gdn_head_norm:
        return []
    return [f"GDN output-norm weight {saved} -> {cfg.model.gdn_head_norm}"]


_MIXER_NAMES = {"softmax": "softmax attention", "gla": "GLA", "gdn": "Gated DeltaNet", "kda": "Kimi Delta Attention"}


def check_same_mixers(path: str, saved_cfg, cfg) -> None:
    """Refuse in one line a checkpoint whose linear layers are another mixer (a KDA checkpoint into a GDN model, or
    the other way round): their parameters are not each other's, whatever their names and shapes."""
    a, b = saved_cfg.model.attention_type, cfg.model.attention_type
    if a != b and "softmax" not in (a, b):
        raise CheckpointError(
            f"{path} was saved with --attention-type {a} ({_MIXER_NAMES[a]}), this run has --attention-type {b} "
            f"({_MIXER_NAMES[b]}): another token mixer's weights do not load; train with --attention-type {a}"
        )


def _gdn_norm(m) -> str:
    kind, one_plus = m.gdn_norm
    return kind + (", zero-centred: 1 + w" if one_plus else "")


def check_same_gdn_norm(path: str, saved_cfg, cfg) -> None:
    """Refuse in one line a GDN checkpoint whose output norm (--gdn-out-norm) computes another function than this
    run's with the same tensors (a plain RMSNorm saved before the flag, resumed under --apply-layernorm-1p)."""
    saved, now = saved_cfg.model, cfg.model
    if now.attention_type != "gdn" or saved.gdn_out_norm == now.gdn_out_norm or saved.gdn_norm == now.gdn_norm:
        return
    raise CheckpointError(
        f"{path} was saved with --gdn-out-norm {saved.gdn_out_norm} (GDN output norm: {_gdn_norm(saved)}), this run "
        f"has --gdn-out-norm {now.gdn_out_norm} ({_gdn_norm(now)}): give --gdn-out-norm {saved.gdn_out_norm}"
    )


# Model settings that change what the same tensors compute, not their names or shapes: a load that changes one goes
# on (a longer context's --rotary-base is a deliberate change) and says so in one warning (function_changes).
SAME_TENSORS_OTHER_FUNCTION = (
    "apply_layernorm_1p",
    "norm_epsilon",
    "activation",
    "openai_gelu",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "gla_gate_normalizer",
    "linear_allow_neg_eigval",
    "linear_norm_epsilon",
)


def function_changes(meta: dict, cfg) -> str | None:
    """'--flag a -> b, ...: ...' for the settings of SAME_TENSORS_OTHER_FUNCTION this run changes, or None."""
    saved, now = config_from_dict(meta["config"]).model, cfg.model
    flags = {f.name: f.metadata["flag"] for f in dataclasses.fields(now)}
    changed = [
        f"{flags[k]} {getattr(saved, k)} -> {getattr(now, k)}"
        for k in SAME_TENSORS_OTHER_FUNCTION
        if getattr(saved, k) != getattr(now, k)
    ]
    if not changed:
        return None
    return f"this run changes {', '.join(changed)} from the checkpoint's: its tensors load and compute another function"


def check_same_model(path: str, meta: dict, cfg, vocab: int) -> None:
    """Refuse, before loading anything, a checkpoint whose parameters differ from this
    model's (names or shapes; a vocabulary padded for another TP size is fine); another linear mixer kind
    (check_same_mixers), expert count, MoE pattern or expert width first, in one line (check_same_experts), and
    a GDN output norm of another function (check_same_gdn_norm)."""
    saved_cfg = config_from_dict(meta["config"])
    check_same_mixers(path, saved_cfg, cfg)
    check_same_experts(path, saved_cfg, cfg)
    check_same_gdn_norm(path, saved_cfg, cfg)
    mine, theirs = model_shapes(cfg, vocab), model_shapes(saved_cfg, meta["padded_vocab_size"])
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    shapes = [
        f"{n} {theirs[n]} (checkpoint) vs {mine[n]} (this run)"
        for n in sorted(set(mine) & set(theirs))
        if theirs[n] != mine[n]
        and not _vocab_padding_only(n, theirs[n], mine[n])
        and not (meta["format"] != DCP_FORMAT and _per_head_to_shared(n, theirs[n], mine[n]))
    ]
    if missing or extra or shapes:
        what = (
            ([f"missing in the checkpoint: {missing[:4]}"] if missing else [])
            + ([f"not in this model: {extra[:4]}"] if extra else [])
            + shapes[:4]
        )
        raise CheckpointError(f"{path} holds another model ({'; '.join(what)}){model_differences(saved_cfg, cfg)}")


def rank_state_for(saved: SavedCheckpoint, cfg, vocab: int, rank: int, dtype: torch.dtype) -> dict:
    """The "model" and "optimizer" entries `rank` of a run of `cfg` would have saved, built
    from `saved` (any layout). `dtype` is the run's training dtype."""
    lay = rank_layout(cfg, vocab, rank)
    model = {
        k: torch.zeros(shape, dtype=torch.float32 if master else dtype) for k, (shape, master) in lay.tensors.items()
    }
    moments = saved.step is not None
    state = (
        {
            j: {"step": saved.step.clone(), "exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
            for j, shape in enumerate(lay.opt_shapes)
        }
        if moments
        else {}
    )
    by_name: dict[str, list] = {}
    for s in lay.slots:
        by_name.setdefault(s.name, []).append(s)
    for name, slots in progress(by_name.items(), "resharding", unit=" tensors"):  # memory: one parameter's
        try:
            full = {k: _fit(name, t, slots[0].full_shape) for k, t in saved.full(name).items()}
        except CheckpointError as e:
            raise CheckpointError(f"{saved.path}: {e}") from None
        for s in slots:
            n = s.hi - s.lo
            piece = {
                k: shard(t, s.tp_split, s.tp_rank, s.tp_size).reshape(-1)[s.start : s.start + n]
                for k, t in full.items()
            }
            for key in (s.key, s.master_key) if s.master_key else (s.key,):
                model[key].view(-1)[s.lo : s.hi] = piece["param"]
            if moments:
                state[s.opt]["exp_avg"].view(-1).copy_(piece["exp_avg"])
                state[s.opt]["exp_avg_sq"].view(-1).copy_(piece["exp_avg_sq"])
    buffers = {n: b for n in lay.buffers if (b := saved.buffer(n)) is not None}
    return {"model": model, "optimizer_state": state, "buffers": buffers}
