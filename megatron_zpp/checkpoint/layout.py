"""What a rank file holds, in terms of the single-rank model: the map behind resharding,
consolidation and DCP.

The engine a run uses says it (`zero.engine_class(cfg).slots`, a `zero.RankLayout`): each
tensor of a rank file's "model" dict and its *slots*, flat spans of it that hold a flat range
of one parameter's TP piece, with where their AdamW moments are. The slots of any rank follow
from the run's config alone: its model chunks are rebuilt on the meta device
(`pipeline_parallel.build_rank_chunks`, the builder training uses, with stand-in groups) and
its place in the DP x CP group comes from the rank grid. With routed experts the chunks are
those of the rank's expert-parallel and expert-TP coordinates (Megatron's expert grid,
`Topology.expert_coords`), and ZeRO's expert units are cut over its expert-data-parallel group.
"""

from __future__ import annotations

from ..config import Config, former_names
from ..model.init import full_shape
from ..pipeline_parallel import build_rank_chunks, stand_in_context
from ..topology import Topology, topology_from_config
from ..zero import RankLayout, Slot, engine_class, persistent_buffers
from .files import CheckpointError

__all__ = [
    "RankLayout", "Slot", "buffer_shapes", "config_from_dict", "layout_changes", "layout_of", "model_shapes",
    "rank_layout", "topology_of",
]  # fmt: skip


def config_from_dict(d: dict) -> Config:
    """The Config a checkpoint's meta["config"] (Config.to_dict()) describes."""
    cfg = Config()
    for section, values in d.items():
        obj = getattr(cfg, section, None)
        if obj is None:
            raise CheckpointError(f"checkpoint config has an unknown section {section!r}")
        renamed = former_names(section)  # configs saved before a rename
        for name, value in values.items():
            name = renamed.get(name, name)
            if not hasattr(obj, name):
                raise CheckpointError(f"checkpoint config has an unknown setting {section}.{name}")
            setattr(obj, name, value)
    _upgrade_old_config(d, cfg)
    return cfg


def _upgrade_old_config(d: dict, cfg: Config) -> None:
    """Checkpoints saved before the Megatron defaults have no model.group_query_attention:
    GDN models saved before the shared output-norm weight have no model.gdn_head_norm: theirs was per head;
    those saved before --gdn-out-norm have no model.gdn_out_norm: their output norm was a plain RMSNorm;
    there --num-query-groups alone meant GQA and a SwiGLU MLP width rounded up to 64; those saved before
    Megatron's gelu rule have no model.openai_gelu: their gelu was the tanh form."""
    m, saved = cfg.model, d.get("model", {})
    if "gdn_head_norm" not in saved and m.attention_type == "gdn":  # saved before the shared [V] norm weight
        m.gdn_head_norm = "per_head"
    if "gdn_out_norm" not in saved and m.attention_type == "gdn":  # saved before the norm followed the model's
        m.gdn_out_norm = "rmsnorm"
    if "openai_gelu" not in saved:  # saved before Megatron's gelu rule: gelu was always the tanh form
        m.openai_gelu = True
    if "group_query_attention" in saved:
        return
    m.group_query_attention = m.num_query_groups is not None
    if m.ffn_hidden_size is None and m.activation == "swiglu":
        m.ffn_hidden_size = 64 * ((int(8 * m.hidden_size / 3) + 63) // 64)


def topology_of(cfg: Config) -> Topology:
    """The rank grid of a config (nodes do not matter for what a rank holds)."""
    return topology_from_config(cfg, ranks_per_node=cfg.parallel.world_size)


def build_chunks(cfg: Config, vocab: int, tp_rank: int, pp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> list:
    """This (TP rank, PP stage)'s model chunks on the meta device (shapes and names only); with routed
    experts, those of expert-parallel rank `ep_rank` and expert-TP rank `etp_rank`."""
    return build_rank_chunks(cfg, vocab, pp_rank, stand_in_context(cfg, tp_rank, ep_rank=ep_rank, etp_rank=etp_rank))


def model_shapes(cfg: Config, vocab: int) -> dict[str, tuple]:
    """{single-rank parameter name: full shape} of the model `cfg` describes (every expert: each EP rank's)."""
    tp, ep = cfg.parallel.tensor_model_parallel_size, cfg.parallel.expert_model_parallel_size
    etp = cfg.parallel.expert_tp_size
    return {
        n: tuple(full_shape(p, etp if getattr(p, "expert_parallel", False) else tp))
        for stage in range(cfg.parallel.pipeline_model_parallel_size)
        for e in range(ep if cfg.model.num_experts else 1)
        for chunk in build_chunks(cfg, vocab, 0, stage, e, 0)
        for n, p in chunk.named_parameters()
    }


def buffer_shapes(cfg: Config, vocab: int) -> dict[str, tuple]:
    """{single-rank name: shape} of the model's persistent buffers (the routers' expert bias), every stage's."""
    return {
        n: tuple(t.shape)
        for stage in range(cfg.parallel.pipeline_model_parallel_size)
        for n, t in persistent_buffers(build_chunks(cfg, vocab, 0, stage)).items()
    }


def rank_layout(
    cfg: Config, vocab: int, rank: int, topo: Topology | None = None, chunk_cache: dict | None = None
) -> RankLayout:
    """What `rank`'s file holds in a run of `cfg` (padded vocabulary `vocab`), as its engine says, and the
    persistent buffers it saves. A caller describing many ranks of one run passes a `chunk_cache` dict: the
    meta-device chunks depend only on the (TP, PP) coordinates and, with routed experts, the expert-parallel
    and expert-TP ones, so replicas share them."""
    topo = topo or topology_of(cfg)
    c, e = topo.coords(rank), topo.expert_coords(rank)
    moe = bool(cfg.model.num_experts)
    where = (c["tp"], c["pp"], e["ep"], e["etp"]) if moe else (c["tp"], c["pp"], 0, 0)
    cache = chunk_cache if chunk_cache is not None else {}
    if where not in cache:
        cache[where] = build_chunks(cfg, vocab, *where[:2], *where[2:])
    members = next(g for g in topo.groups(["dp", "cp"]) if rank in g)
    edp = (e["edp"], topo.expert_sizes["edp"]) if moe else None
    lay = engine_class(cfg).slots(cfg, cache[where], members.index(rank), len(members), edp)
    lay.buffers = {n: tuple(t.shape) for n, t in persistent_buffers(cache[where]).items()}
    return lay


def layout_of(cfg) -> dict:
    """Everything that decides which tensor lives on which rank with which shape."""
    p = cfg.parallel
    layout = {
        "world_size": p.world_size,
        "tp": p.tensor_model_parallel_size,
        "pp": p.pipeline_model_parallel_size,
        "cp": p.context_parallel_size,
        "dp": p.data_parallel_size,
        "order": p.order,
        "zero_stage": None,  # these two are the engine's (layout_key); here for their place in meta.json
        "vpp": p.num_layers_per_virtual_pipeline_stage,
        "first_stage_layers": p.decoder_first_pipeline_num_layers,
        "last_stage_layers": p.decoder_last_pipeline_num_layers,
        "zero_quantization_block_size": None,
    }
    layout.update(engine_class(cfg).layout_key(cfg))
    return layout


def layout_changes(meta: dict, cfg) -> list[str]:
    """How this run's layout differs from the checkpoint's ([] when it is the same)."""
    saved, now = meta["layout"], layout_of(cfg)
    changed = [k for k in now if saved.get(k) != now[k]]
    if "zero_stage" in changed:  # the block size only matters when both sides shard: not news here
        changed = [k for k in changed if k != "zero_quantization_block_size"]
    return [f"{k} {saved.get(k)} -> {now[k]}" for k in changed]
