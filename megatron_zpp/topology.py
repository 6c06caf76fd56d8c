"""The 4D rank grid: coordinates, every process group, node layout and link classes.

Ranks are laid out by an order string such as Megatron's ``tp-cp-dp-pp``: the first
axis varies fastest, so TP peers are neighbours (and share a node) while PP stages are
farthest apart. All membership is plain arithmetic (`Topology`, testable without
processes); `build_groups` then creates the torch process groups once, on every rank in
the same order, and layers receive the `Group` objects they need, never building their
own.

Link classes name the slowest link a group spans: the innermost physical domain that
holds all its members ("intra_node" for a node), else "inter_node". Sub-node tiers
(e.g. GCD pairs on Frontier) add inner domains named "tier0", "tier1", ...
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field

from .config import Config, ConfigError

AXES = ("tp", "cp", "dp", "pp")

# Groups spanning several axes, named as Megatron names them.
COMPOSITE = {
    "dp_cp": ("dp", "cp"),  # weights replicated over DP and CP reduce their grads here
    "tp_cp": ("tp", "cp"),
    "mp": ("tp", "pp"),  # model-parallel: one model replica's shards (per CP rank)
    "tp_pp_cp": ("tp", "cp", "pp"),
    "tp_dp_cp": ("tp", "cp", "dp"),  # a whole pipeline stage: the expert-bias token counts are summed here
}

# The expert grid (Megatron's): within a pipeline stage, the stage's ranks in increasing global-rank order,
# index i -> etp = i % ETP, ep = (i // ETP) % EP, edp = i // (ETP * EP); megatron-core's expert
# RankGenerator (order tp-ep-dp-pp) when pp is the outermost axis. Its groups, as Megatron names them:
EXPERT_AXES = ("etp", "ep", "edp", "pp")  # first fastest
EXPERT_KINDS = {
    "ep": ("ep",),  # expert model parallel: the experts are split over it, the token all-to-all runs in it
    "etp": ("etp",),  # expert tensor parallel: each expert's width is split over it
    "edp": ("edp",),  # expert data parallel: the ranks holding the same expert shard reduce its grads here
    "etp_ep": ("etp", "ep"),  # expert tensor-and-model parallel: the allgather dispatcher's group
    "expert_mp": ("etp", "ep", "pp"),  # every expert piece of the model once: the grad norm's expert squares
}


@dataclass(frozen=True)
class Group:
    """One process group as a layer sees it."""

    role: str  # tp, cp, dp, pp, dp_cp, embedding, dp_intra, ...
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this process's index in `ranks`
    link: str  # slowest link class inside the group
    peer_links: tuple[str, ...] = ()  # link class from this rank to each member (for p2p)
    hop_links: tuple[str, ...] = ()  # link class of each hop member i -> i + 1 (a chain over the group: CP scans)
    handle: object = field(default=None, compare=False, repr=False)  # torch ProcessGroup; None if size 1

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ParallelContext:
    """The one object through which a model layer knows how it is split over ranks (re-exported by
    model/context.py; it lives here, beside Group, so that the MoE layers in moe/ can take it without
    importing the model package that builds them).

    tp: the tensor-parallel group (None or size 1: no TP); sequence_parallel: Megatron's norm/dropout
    regions sharded on the sequence over TP; cp: the context-parallel group (each rank holds a contiguous
    slice of every sequence) with the GLA state-passing algorithm and its All-Scan block count.
    Mixture of experts: ep (expert model parallel: the experts are split over it), etp (expert tensor
    parallel: each expert's width is split over it), etp_ep (both: the allgather dispatcher's group),
    tp_cp (the router's balancing losses are summed over it). The default is a single rank."""

    tp: Group | None = None
    sequence_parallel: bool = False
    cp: Group | None = None
    cp_algo: str = "all-scan"
    all_scan_blocks: int = 0  # 0: chosen from the state size and the link
    ep: Group | None = None
    etp: Group | None = None
    etp_ep: Group | None = None
    tp_cp: Group | None = None

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.size

    @property
    def cp_rank(self) -> int:
        """This rank's slice of the sequence: slices are contiguous and equal, in CP-rank order."""
        return 0 if self.cp is None else self.cp.rank


class Topology:
    """Arithmetic of the grid; no torch.distributed here."""

    def __init__(
        self,
        world_size: int,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        order: str = "tp-cp-dp-pp",
        ranks_per_node: int | None = None,
        sub_node_tiers: tuple[int, ...] = (),
        ep: int = 1,
        etp: int = 1,
    ):
        for name, v in [
            ("world size", world_size),
            ("tp", tp),
            ("cp", cp),
            ("pp", pp),
            ("--expert-model-parallel-size", ep),
            ("--expert-tensor-parallel-size", etp),
            ("ranks per node", 1 if ranks_per_node is None else ranks_per_node),
        ] + [("tier", t) for t in sub_node_tiers]:
            if v < 1:
                raise ValueError(f"{name} must be >= 1 (got {v})")
        if world_size % (tp * cp * pp):
            raise ValueError(f"world size {world_size} not divisible by tp*cp*pp={tp * cp * pp}")
        self.world_size = world_size
        self.sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": world_size // (tp * cp * pp)}
        self.order = tuple(order.split("-"))
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"order {order!r} must name each of {AXES} once")
        self.ranks_per_node = (
            ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        )
        if world_size % self.ranks_per_node:
            raise ValueError(f"world size {world_size} is not a multiple of ranks per node {self.ranks_per_node}")
        # physical domains, innermost first: (name, span in consecutive global ranks)
        self.levels = [(f"tier{i}", s) for i, s in enumerate(sub_node_tiers)] + [("intra_node", self.ranks_per_node)]
        for (_, inner), (name, outer) in zip(self.levels, self.levels[1:]):
            if outer % inner:
                raise ValueError(f"tier of {inner} ranks does not nest in {name} of {outer} ranks")
        self.strides = {}
        stride = 1
        for axis in self.order:
            self.strides[axis] = stride
            stride *= self.sizes[axis]
        stage = world_size // pp
        if stage % (ep * etp):
            raise ValueError(
                f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} does not "
                f"divide the {stage} ranks of a pipeline stage (TP {tp} x CP {cp} x DP {self.sizes['dp']})"
            )
        self.expert_sizes = {"etp": etp, "ep": ep, "edp": stage // (ep * etp), "pp": pp}
        seen = [0] * pp
        self._stage_index = []  # each rank's place among its stage's ranks in increasing global-rank order
        for r in range(world_size):
            self._stage_index.append(seen[self.coords(r)["pp"]])
            seen[self.coords(r)["pp"]] += 1

    # --- coordinates ---
    def coords(self, rank: int) -> dict[str, int]:
        return {a: (rank // self.strides[a]) % self.sizes[a] for a in AXES}

    def rank_of(self, **coords: int) -> int:
        return sum(coords.get(a, 0) * self.strides[a] for a in AXES)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def expert_coords(self, rank: int) -> dict[str, int]:
        """(etp, ep, edp, pp) of `rank` in the expert grid (see EXPERT_AXES)."""
        pp, i = self.coords(rank)["pp"], self._stage_index[rank]
        etp, ep = self.expert_sizes["etp"], self.expert_sizes["ep"]
        return {"etp": i % etp, "ep": (i // etp) % ep, "edp": i // (etp * ep), "pp": pp}

    def expert_groups(self, axes) -> list[list[int]]:
        """All groups of the expert grid whose members vary along `axes` (others fixed), each ordered
        with the first axis of EXPERT_AXES fastest."""
        buckets: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
        for r in range(self.world_size):
            c = self.expert_coords(r)
            fixed = tuple(c[a] for a in EXPERT_AXES if a not in axes)
            buckets.setdefault(fixed, []).append((tuple(c[a] for a in reversed(EXPERT_AXES)), r))
        return sorted([r for _, r in sorted(members)] for members in buckets.values())

    # --- links ---
    def link_class(self, ranks) -> str:
        """Slowest link among `ranks`: the innermost domain holding all of them."""
        ranks = list(ranks)
        for name, span in self.levels:
            if len({r // span for r in ranks}) == 1:
                return name
        return "inter_node"

    def hop_links(self, ranks) -> tuple[str, ...]:
        """The link class of each hop of a chain over `ranks` (rank i to rank i + 1)."""
        ranks = list(ranks)
        return tuple(self.link_class(pair) for pair in zip(ranks, ranks[1:]))

    # --- membership ---
    def groups(self, axes) -> list[list[int]]:
        """All groups whose members vary along `axes` (others fixed), each ordered with
        the first axis of the order string fastest."""
        axes = [a for a in self.order if a in axes]
        fixed = [a for a in self.order if a not in axes]
        out = []
        for fixed_vals in itertools.product(*(range(self.sizes[a]) for a in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_vals))
            members = []
            for vals in itertools.product(*(range(self.sizes[a]) for a in reversed(axes))):
                members.append(self.rank_of(**base, **dict(zip(reversed(axes), vals))))
            out.append(members)
        return sorted(out)

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline: they hold the tied embedding."""
        return [sorted({g[0], g[-1]}) for g in self.groups(["pp"])]

    def dp_node_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Hierarchical DP subgroups from the real node layout (not rank arithmetic):
        intra = the members of a DP group on one node; inter = members with the same
        position on their node, one per node. Raises if nodes hold unequal shares."""
        intra, inter = [], []
        for dp_group in self.groups(["dp"]):
            by_node: dict[int, list[int]] = {}
            for r in dp_group:
                by_node.setdefault(self.node_of(r), []).append(r)
            counts = {len(v) for v in by_node.values()}
            if len(counts) != 1:
                raise ValueError(
                    f"DP group {dp_group} is spread unevenly over nodes ({by_node}); "
                    "hierarchical DP needs the same number of its ranks on every node"
                )
            nodes = sorted(by_node)
            intra += [by_node[n] for n in nodes]
            inter += [[by_node[n][i] for n in nodes] for i in range(counts.pop())]
        return sorted(intra), sorted(inter)

    def dp_tier_groups(self, tier_sizes: list[int], zero_groups=None) -> list[list[list[int]]]:
        """Multi-level hierarchy over each ZeRO group (DP x CP: the ranks that share
        weights; or `zero_groups`, e.g. the expert-data-parallel groups), innermost first.
        tier_sizes are its ranks per tier domain (e.g. [2, 4]:
        pairs, then 4-rank domains, then all). Hop i groups vary one digit of the
        mixed-radix index in the ZeRO group: the members of one tier-i domain at the same
        position within their tier-(i-1) domains."""
        zero_groups = self.groups(["dp", "cp"]) if zero_groups is None else zero_groups
        n = len(zero_groups[0])
        spans = list(tier_sizes) + [n]
        radices, prev = [], 1
        for s in spans:
            if s < 1 or s % prev or n % s:
                raise ValueError(f"tier sizes {tier_sizes} must each divide the next and the ZeRO group size {n}")
            radices.append(s // prev)
            prev = s
        hops: list[list[list[int]]] = [[] for _ in spans]
        for zero_group in zero_groups:
            lower = 1
            for i, radix in enumerate(radices):
                for idx in range(n):
                    if (idx // lower) % radix == 0:  # first member of its hop group
                        hops[i].append([zero_group[idx + j * lower] for j in range(radix)])
                lower *= radix
        return [sorted(h) for h in hops]

    def zero_ranks_per_node(self) -> int:
        """Members of a ZeRO group (DP x CP) on one node; raises if nodes hold unequal shares."""
        counts = {
            sum(1 for r in g if self.node_of(r) == node)
            for g in self.groups(["dp", "cp"])
            for node in {self.node_of(r) for r in g}
        }
        if len(counts) != 1:
            raise ValueError(
                "the ZeRO group (DP x CP) is spread unevenly over nodes; hierarchical ZeRO++ needs "
                "the same number of its ranks on every node (check --ranks-per-node and the order)"
            )
        return counts.pop()

    def all_group_kinds(self, dp_tiers: list[int] | None = None, hpz: int = 1) -> dict[str, list[list[int]]]:
        kinds = {a: self.groups([a]) for a in AXES}
        kinds.update({name: self.groups(axes) for name, axes in COMPOSITE.items()})
        kinds.update({name: self.expert_groups(axes) for name, axes in EXPERT_KINDS.items()})
        kinds["embedding"] = self.embedding_groups()
        kinds["world"] = [list(range(self.world_size))]  # control plane: checkpoint digests
        try:
            kinds["dp_intra"], kinds["dp_inter"] = self.dp_node_groups()
        except ValueError:
            pass  # uneven layout: only hierarchical DP features need these, and they check
        for i, hop in enumerate(self.dp_tier_groups(dp_tiers) if dp_tiers else []):
            kinds[f"dp_tier{i}"] = hop
        if hpz > 1:  # hpZ: the secondary weight shard lives in consecutive ZeRO-group ranks
            kinds["dp_hpz"] = self.dp_tier_groups([hpz])[0]
        kinds.update(self.expert_zero_kinds(bool(dp_tiers), hpz > 1))
        return kinds

    def edp_ranks_per_node(self) -> int:
        """Members of an expert-data-parallel group on one node; raises if nodes hold unequal shares."""
        counts = {
            sum(1 for r in g if self.node_of(r) == node)
            for g in self.expert_groups(("edp",))
            for node in {self.node_of(r) for r in g}
        }
        if len(counts) != 1:
            raise ValueError("the expert-data-parallel group is spread unevenly over nodes")
        return counts.pop()

    def expert_zero_kinds(self, qgz: bool, hpz: bool) -> dict[str, list[list[int]]]:
        """ZeRO++ over the expert-data-parallel groups, by the node boundary: qgZ's hops (`edp_tier{i}`: the
        members on one node, then across nodes; one hop when the group fits a node) and hpZ's secondary shard
        (`edp_hpz`: the members on one node, when the group spans nodes with more than one member on each)."""
        edp = self.expert_groups(("edp",))
        if self.expert_sizes["edp"] == 1 or not (qgz or hpz):
            return {}
        try:
            per_node = self.edp_ranks_per_node()
        except ValueError:
            return {}  # validation refuses hpZ/qgZ on such a layout
        inner = [per_node] if 1 < per_node < len(edp[0]) else []
        kinds = {f"edp_tier{i}": hop for i, hop in enumerate(self.dp_tier_groups(inner, edp))} if qgz else {}
        if hpz and inner:
            kinds["edp_hpz"] = self.dp_tier_groups(inner, edp)[0]
        return kinds


@dataclass
class ProcessGroups:
    """This rank's Group of every kind, created collectively on all ranks (build_groups). One field per
    kind: the four axes, the composites of COMPOSITE, the expert grid's EXPERT_KINDS, the world; the kinds
    not every rank or layout has are None (embedding: the first and last pipeline stages; dp_intra/dp_inter:
    the ZeRO group spread evenly over nodes; dp_hpz: --zero-hpz-partition-size > 1) or empty (dp_tiers:
    qgZ's hops)."""

    topo: Topology
    rank: int
    tp: Group
    cp: Group
    dp: Group
    pp: Group
    dp_cp: Group  # COMPOSITE's, as Megatron names them
    tp_cp: Group
    mp: Group
    tp_pp_cp: Group
    tp_dp_cp: Group
    ep: Group  # EXPERT_KINDS' (size 1 without expert parallelism)
    etp: Group
    edp: Group
    etp_ep: Group
    expert_mp: Group
    world: Group  # control plane: checkpoint digests
    embedding: Group | None = None
    dp_intra: Group | None = None
    dp_inter: Group | None = None
    dp_hpz: Group | None = None
    dp_tiers: tuple[Group, ...] = ()  # the hierarchical reduce's hops, innermost first (roles dp_tier0, ...)
    edp_hpz: Group | None = None  # hpZ's secondary shard of the routed experts (Topology.expert_zero_kinds)
    edp_tiers: tuple[Group, ...] = ()  # qgZ's hops over the expert-data-parallel group (roles edp_tier0, ...)
    tp_rank: int = field(init=False)
    cp_rank: int = field(init=False)
    dp_rank: int = field(init=False)
    pp_rank: int = field(init=False)
    ep_rank: int = field(init=False)
    etp_rank: int = field(init=False)
    edp_rank: int = field(init=False)

    def __post_init__(self):
        c = self.topo.coords(self.rank)
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = c["tp"], c["cp"], c["dp"], c["pp"]
        e = self.topo.expert_coords(self.rank)
        self.ep_rank, self.etp_rank, self.edp_rank = e["ep"], e["etp"], e["edp"]

    @classmethod
    def from_kinds(cls, topo: Topology, rank: int, groups: dict[str, Group]) -> ProcessGroups:
        """From kind -> Group (Topology.all_group_kinds' names; dp_tier0, dp_tier1, ... become dp_tiers)."""
        tiers: dict[str, list[Group]] = {"dp": [], "edp": []}
        for prefix, hops in tiers.items():
            while f"{prefix}_tier{len(hops)}" in groups:
                hops.append(groups[f"{prefix}_tier{len(hops)}"])
        roles = {f.name for f in dataclasses.fields(cls) if f.init} - {"topo", "rank", "dp_tiers", "edp_tiers"}
        named = {k: v for k, v in groups.items() if k in roles}
        hop_kinds = {f"{prefix}_tier{i}" for prefix, hops in tiers.items() for i in range(len(hops))}
        unknown = set(groups) - set(named) - hop_kinds
        if unknown:
            raise ValueError(f"no field of ProcessGroups for the group kinds {sorted(unknown)}")
        return cls(topo, rank, dp_tiers=tuple(tiers["dp"]), edp_tiers=tuple(tiers["edp"]), **named)

    def by_role(self) -> dict[str, Group]:
        """Every group this rank is in, by role (the dp_tiers as dp_tier0, dp_tier1, ...)."""
        out = {f.name: g for f in dataclasses.fields(self) if isinstance(g := getattr(self, f.name), Group)}
        out.update({f"dp_tier{i}": g for i, g in enumerate(self.dp_tiers)})
        out.update({f"edp_tier{i}": g for i, g in enumerate(self.edp_tiers)})
        return out

    def __contains__(self, kind: str) -> bool:
        return kind in self.by_role()

    def dp_tier_hops(self) -> list[Group]:
        """This rank's qgZ hop groups, innermost first (dp_tier0, dp_tier1, ...)."""
        return list(self.dp_tiers)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.topo.sizes["pp"] - 1


def build_groups(
    topo: Topology, rank: int, dp_tiers: list[int] | None = None, hpz: int = 1, backend: str | None = None, timeout=None
) -> ProcessGroups:
    """Create every process group (collective: all ranks call this identically). `timeout`
    (a timedelta) bounds each collective's wait; None is torch's default (30 min on gloo)."""
    import torch.distributed as dist

    created: dict[tuple[int, ...], object] = {}
    mine: dict[str, Group] = {}
    for kind, groups in topo.all_group_kinds(dp_tiers, hpz).items():
        for members in groups:
            key = tuple(members)
            if len(key) > 1 and key not in created and dist.is_initialized():
                created[key] = dist.new_group(list(key), backend=backend, timeout=timeout)
            if rank in key:
                mine[kind] = Group(
                    kind,
                    key,
                    key.index(rank),
                    topo.link_class(key),
                    tuple(topo.link_class([rank, r]) for r in key),
                    topo.hop_links(key),
                    created.get(key),
                )
    return ProcessGroups.from_kinds(topo, rank, mine)


# ---------------------------------------------------------------- from a config


def topology_from_config(cfg: Config, world_size: int | None = None, ranks_per_node: int | None = None) -> Topology:
    """The Topology of a run of `cfg` as arithmetic (no processes). Nodes: `ranks_per_node`,
    else --ranks-per-node, else LOCAL_WORLD_SIZE; the sub-node tiers of --zero-hierarchy
    become inner link domains named tier0, tier1, ... for the ledger."""
    p = cfg.parallel
    world = world_size or p.world_size
    rpn = ranks_per_node or p.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    stride = p.tensor_model_parallel_size if p.order.startswith("tp-") else 1  # global ranks between ZeRO peers
    sub_node = tuple(t * stride for t in cfg.zero.zero_hierarchy if t * stride < rpn and rpn % (t * stride) == 0)
    return Topology(
        world,
        tp=p.tensor_model_parallel_size,
        cp=p.context_parallel_size,
        pp=p.pipeline_model_parallel_size,
        order=p.order,
        ranks_per_node=rpn,
        sub_node_tiers=sub_node,
        ep=getattr(p, "expert_model_parallel_size", 1),
        etp=p.expert_tp_size,
    )


def zero_reduce_tiers(cfg: Config, topo: Topology) -> list[int]:
    """ZeRO-group ranks per tier of the hierarchical gradient reduce, innermost first:
    --zero-hierarchy with the node boundary added (a hop must not mix links), else one
    node. Raises ValueError when the tiers do not nest with the node boundary."""
    group, per_node = topo.sizes["dp"] * topo.sizes["cp"], topo.zero_ranks_per_node()
    tiers = sorted({t for t in cfg.zero.zero_hierarchy if t < group} | ({per_node} if per_node < group else set()))
    if any(b % a for a, b in zip(tiers, tiers[1:])):
        raise ValueError(
            f"--zero-hierarchy {' '.join(map(str, cfg.zero.zero_hierarchy))} does not nest with the node boundary "
            f"({per_node} ZeRO-group ranks per node): each tier must divide the next, and a node is one of them"
        )
    return tiers or [per_node]


def build_groups_from_config(cfg: Config, rank: int, timeout=None) -> ProcessGroups:
    """Every process group a run of `cfg` needs (collective: all ranks call it alike)."""
    z = cfg.zero
    topo = topology_from_config(cfg)
    tiers = zero_reduce_tiers(cfg, topo) if (z.zero_quantized_gradients or z.zero_hierarchy) else None
    return build_groups(topo, rank, dp_tiers=tiers, hpz=z.zero_hpz_partition_size, timeout=timeout)


def check_node_layout(cfg: Config) -> None:
    """The settings that depend on how ranks sit on nodes (a validated `cfg`); raises
    ConfigError naming the flag to change."""
    z = cfg.zero
    if not (z.zero_hpz_partition_size > 1 or z.zero_quantized_gradients or z.zero_hierarchy):
        return
    try:
        topo = topology_from_config(cfg)
        per_node = topo.zero_ranks_per_node()
        zero_reduce_tiers(cfg, topo)
    except ValueError as e:
        raise ConfigError(f"ZeRO++ layout: {e}") from None
    if z.zero_hpz_partition_size > 1:
        spans = {topo.link_class(g) for g in topo.dp_tier_groups([z.zero_hpz_partition_size])[0]}
        if "inter_node" in spans:
            raise ConfigError(
                f"--zero-hpz-partition-size {z.zero_hpz_partition_size} spans nodes: the ZeRO group "
                f"has {per_node} ranks per node; use a size that divides {per_node}"
            )
