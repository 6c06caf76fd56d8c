"""The only door to the wire: every collective and p2p call, and the byte ledger.

Each call records the bytes this rank sends, keyed by (group role, phase, op, link
class), twice:

* ``bytes``: what the algorithm sends on a real fabric (NCCL) under a stated model:
  ring all-reduce 2(n-1)/n·B, ring all-gather (n-1)·shard, ring reduce-scatter
  (n-1)/n·B, pairwise all-to-all (n-1)/n·B, pipelined broadcast (n-1)/n·B, p2p B.
* ``gloo_bytes``: what gloo moved for it here. gloo's own reduce-scatter runs as an
  all-reduce (twice the bytes), so a SUM reduce-scatter on gloo is done here as an
  all-to-all and a local sum, which moves what a ring reduce-scatter moves: the two
  columns then agree for every op (a MAX/MIN reduce-scatter keeps gloo's all-reduce).

B is the size of the full (unsharded) buffer in bytes. A collective's link class is
the slowest link its group spans (see topology.py): the papers count a flat collective
over several nodes as cross-node traffic, and a hierarchical one hop by hop.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .topology import Group

# ---------------------------------------------------------------- ledger

BYTE_MODEL = (
    "bytes each rank sends on a real fabric: ring all-reduce 2(n-1)/n*B, ring all-gather (n-1)/n*B_out, "
    "ring reduce-scatter (n-1)/n*B_in, pairwise all-to-all (n-1)/n*B, pipelined broadcast (n-1)/n*B, "
    "p2p B; link = slowest link the group spans"
)


def model_bytes(op: str, n: int, nbytes: int) -> float:
    """Bytes one rank sends for `op` over n ranks; nbytes = full buffer (all_gather: the
    gathered output; reduce_scatter: the unreduced input; p2p: the message)."""
    if n <= 1:
        return 0.0
    return {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": (n - 1) / n,
        "send": 1.0,
    }[op] * nbytes


@dataclass
class Record:
    bytes: float = 0.0
    gloo_bytes: float = 0.0
    calls: int = 0


class CommLedger:
    def __init__(self):
        self.records: dict[tuple[str, str, str, str], Record] = defaultdict(Record)
        self.steps = 0
        self.phase_suffix = ""  # ":recompute" while an activation-recompute rerun communicates

    def add(self, role: str, phase: str, op: str, link: str, n: int, nbytes: int, gloo_op: str | None = None):
        """gloo_op: the collective gloo runs for `op` here, when it is another one."""
        rec = self.records[(role, phase + self.phase_suffix, op, link)]
        rec.bytes += model_bytes(op, n, nbytes)
        rec.gloo_bytes += model_bytes(gloo_op or op, n, nbytes)
        rec.calls += 1

    def add_sent(self, role: str, phase: str, op: str, link: str, sent: float):
        """A call whose bytes sent are known exactly (an uneven all-to-all: the rows for the other ranks);
        gloo moves the same."""
        rec = self.records[(role, phase + self.phase_suffix, op, link)]
        rec.bytes += sent
        rec.gloo_bytes += sent
        rec.calls += 1

    def step(self):
        self.steps += 1

    def reset(self):
        self.records.clear()
        self.steps = 0

    def total(self, **match) -> float:
        """Sum of `bytes` over records whose fields equal `match` (role, phase, op, link)."""
        keys = ("role", "phase", "op", "link")
        return sum(
            r.bytes for k, r in self.records.items() if all(dict(zip(keys, k))[f] == v for f, v in match.items())
        )

    def local_rows(self) -> list[dict]:
        steps = max(self.steps, 1)
        return [
            {
                "role": k[0],
                "phase": k[1],
                "op": k[2],
                "link": k[3],
                "bytes": r.bytes / steps,
                "gloo_bytes": r.gloo_bytes / steps,
                "calls": r.calls / steps,
            }
            for k, r in sorted(self.records.items())
        ]


LEDGER = CommLedger()


class CollectiveOrder:
    """--check-collective-order: each group's sequence of collectives (op, phase, elements,
    dtype) since the last check, on this rank. `keep` (a dry run, megatron_zpp/planning/dry_run.py):
    record whatever the flag says, collectives in `seq` and point-to-point messages in `p2p`
    ("send"/"recv", group peer, elements, dtype, tag), for the dry run to compare across ranks."""

    def __init__(self):
        self.enabled = False
        self.keep = False
        self.seq: dict[tuple[str, tuple[int, ...]], list[str]] = defaultdict(list)
        self.p2p: dict[tuple[str, tuple[int, ...]], list[tuple]] = defaultdict(list)

    def record(self, group: Group, op: str, phase: str, tensor: torch.Tensor, rows_vary: bool = False) -> None:
        """rows_vary: the number of rows (dim 0) depends on the data (the MoE token all-to-all): recorded
        as `v` rows of the fixed row size."""
        if self.enabled or self.keep:
            size = f"v*{math.prod(tensor.shape[1:])}" if rows_vary else tensor.numel()
            desc = f"{op} {phase}{LEDGER.phase_suffix} {size} x {str(tensor.dtype).removeprefix('torch.')}"
            self.seq[(group.role, group.ranks)].append(desc)

    def record_p2p(self, group: Group, op: str, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        if self.keep:
            dtype = str(tensor.dtype).removeprefix("torch.")
            self.p2p[(group.role, group.ranks)].append((op, peer, tensor.numel(), dtype, tag))


ORDER = CollectiveOrder()


def check_collective_order(groups) -> None:
    """Compare each group's sequence of collectives since the last check across its members
    (a hash each, then the sequences where the hashes differ) and raise RuntimeError naming
    the first divergence; then start afresh. Collective on every group of `groups` (a
    ProcessGroups), in the order of their roles, which every rank shares; not recorded."""
    import hashlib

    for role, group in sorted(groups.by_role().items()):
        seq = ORDER.seq.pop((role, group.ranks), [])
        if _skip(group):
            continue
        digest = hashlib.sha256("\n".join(seq).encode()).hexdigest()
        digests = [None] * group.size
        dist.all_gather_object(digests, digest, group=group.handle)
        if len(set(digests)) == 1:
            continue
        seqs = [None] * group.size
        dist.all_gather_object(seqs, seq, group=group.handle)
        i = 0
        while all(i < len(s) for s in seqs) and len({s[i] for s in seqs}) == 1:
            i += 1
        what = "; ".join(f"rank {r}: {s[i] if i < len(s) else '(nothing)'}" for r, s in zip(group.ranks, seqs))
        ORDER.seq.clear()
        raise RuntimeError(
            f"--check-collective-order: group {role} {list(group.ranks)} diverged at collective #{i} "
            f"(after {i} identical ones): {what}"
        )


@contextlib.contextmanager
def recompute_phase(on: bool = True):
    """Record the calls of the body under phase + ":recompute" (recompute.py: a region's rerun)."""
    before = LEDGER.phase_suffix
    LEDGER.phase_suffix = ":recompute" if on else before
    try:
        yield
    finally:
        LEDGER.phase_suffix = before


def gather_report(world_size: int) -> dict:
    """Collect every rank's ledger (collective on the default group; not itself recorded).
    bytes_per_rank_per_step is the mean over all ranks; max_* the busiest rank."""
    rows = LEDGER.local_rows()
    all_rows = [None] * world_size
    if dist.is_initialized() and world_size > 1:
        dist.all_gather_object(all_rows, rows)
    else:
        all_rows = [rows]
    merged: dict[tuple, dict] = {}
    for rank_rows in all_rows:
        for row in rank_rows:
            key = (row["role"], row["phase"], row["op"], row["link"])
            m = merged.setdefault(
                key,
                dict(
                    zip(("role", "phase", "op", "link"), key),
                    bytes_per_rank_per_step=0.0,
                    gloo_bytes_per_rank_per_step=0.0,
                    max_rank_bytes_per_step=0.0,
                    calls_per_step=0.0,
                ),
            )
            m["bytes_per_rank_per_step"] += row["bytes"] / world_size
            m["gloo_bytes_per_rank_per_step"] += row["gloo_bytes"] / world_size
            m["max_rank_bytes_per_step"] = max(m["max_rank_bytes_per_step"], row["bytes"])
            m["calls_per_step"] = max(m["calls_per_step"], row["calls"])
    return {"world_size": world_size, "steps": LEDGER.steps, "byte_model": BYTE_MODEL, "records": list(merged.values())}


def write_report(path: str, world_size: int, rank: int):
    report = gather_report(world_size)
    if rank == 0:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)


# ---------------------------------------------------------------- collectives


class _Done:
    """Handle of a call that needed no communication."""

    def wait(self):
        return True

    def is_completed(self):
        return True


class _Then:
    """Handle of a call that finishes locally once its wire transfer is done."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self):
        self.work.wait()
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True

    def is_completed(self):
        return self.work.is_completed()


def _on_gloo(group: Group) -> bool:
    return dist.get_backend(group.handle) == "gloo"


def _skip(group: Group | None) -> bool:
    return group is None or group.size == 1


def all_reduce(tensor: torch.Tensor, group: Group, phase: str, op=dist.ReduceOp.SUM, async_op: bool = False):
    if _skip(group):
        return _Done() if async_op else None
    LEDGER.add(group.role, phase, "all_reduce", group.link, group.size, tensor.numel() * tensor.element_size())
    ORDER.record(group, "all_reduce", phase, tensor)
    return dist.all_reduce(tensor, op=op, group=group.handle, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, phase: str, async_op: bool = False):
    """Concatenate every rank's `input` along dim 0 into `output` (group-rank order)."""
    if _skip(group):
        output.copy_(input.reshape(output.shape))
        return _Done() if async_op else None
    LEDGER.add(group.role, phase, "all_gather", group.link, group.size, output.numel() * output.element_size())
    ORDER.record(group, "all_gather", phase, output)
    return dist.all_gather_single(output, input, group=group.handle, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: Group, phase: str, op=dist.ReduceOp.SUM, async_op: bool = False
):
    """Reduce `input` over the group; group rank i keeps slice i (dim 0) in `output`."""
    if _skip(group):
        output.copy_(input.reshape(output.shape))
        return _Done() if async_op else None
    nbytes = input.numel() * input.element_size()
    ORDER.record(group, "reduce_scatter", phase, input)
    if op != dist.ReduceOp.SUM or not _on_gloo(group):
        LEDGER.add(
            group.role,
            phase,
            "reduce_scatter",
            group.link,
            group.size,
            nbytes,
            gloo_op="all_reduce" if op != dist.ReduceOp.SUM else None,
        )
        return dist.reduce_scatter_single(output, input, op=op, group=group.handle, async_op=async_op)
    LEDGER.add(group.role, phase, "reduce_scatter", group.link, group.size, nbytes)
    received = torch.empty_like(input)  # slice j: rank j's copy of my slice

    def reduce():  # in fp32 for low-precision inputs, rounded once
        out = received.view(group.size, *output.shape).sum(0, dtype=torch.promote_types(input.dtype, torch.float32))
        output.copy_(out)

    work = _Then(dist.all_to_all_single(received, input.contiguous(), group=group.handle, async_op=True), reduce)
    if async_op:
        return work
    work.wait()
    return None


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    phase: str,
    async_op: bool = False,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
):
    """Slice i (dim 0) of `input` goes to group rank i; slice j of `output` comes from j. With split sizes
    (rows of dim 0 per group rank; both or neither) the slices are uneven (the MoE token exchange): the ledger
    then records the rows this rank actually sends to the other members (its own slice stays), and the
    collective order check records their sizes as `v` (data-dependent, legitimately different per rank; the
    counts exchanged before it, of fixed size, are checked as usual)."""
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("all_to_all: give both output_split_sizes and input_split_sizes, or neither")
    if _skip(group):
        output.copy_(input)
        return _Done() if async_op else None
    if input_split_sizes is None:
        LEDGER.add(group.role, phase, "all_to_all", group.link, group.size, input.numel() * input.element_size())
        ORDER.record(group, "all_to_all", phase, input)
        return dist.all_to_all_single(output, input, group=group.handle, async_op=async_op)
    row_bytes = math.prod(input.shape[1:]) * input.element_size()
    sent = (sum(input_split_sizes) - input_split_sizes[group.rank]) * row_bytes
    LEDGER.add_sent(group.role, phase, "all_to_all", group.link, sent)
    ORDER.record(group, "all_to_all", phase, input, rows_vary=True)
    return dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group.handle, async_op=async_op
    )


def all_gather_v(input: torch.Tensor, counts: list[int], group: Group, phase: str) -> torch.Tensor:
    """Every rank's `input` (counts[i] rows on group rank i, dim 0) concatenated in group-rank order: padded
    to the largest count, all-gathered (what the ledger records), the padding dropped. Counts must be the
    same list on every rank (exchanged before, with a fixed-size collective)."""
    if _skip(group):
        return input
    most = max(counts)
    padded = input.new_zeros(most, *input.shape[1:])
    padded[: input.shape[0]] = input
    out = input.new_empty(group.size * most, *input.shape[1:])
    all_gather(out, padded, group, phase)
    return torch.cat([out[i * most : i * most + c] for i, c in enumerate(counts)])


def reduce_scatter_v(input: torch.Tensor, counts: list[int], group: Group, phase: str) -> torch.Tensor:
    """The sum over the group of `input` (sum(counts) rows, group rank i's block of counts[i] rows after the
    blocks of the ranks before it), of which this rank keeps its block: each block padded to the largest
    count, reduce-scattered (what the ledger records), the padding dropped."""
    if _skip(group):
        return input
    most = max(counts)
    padded = input.new_zeros(group.size, most, *input.shape[1:])
    for i, block in enumerate(torch.split(input, counts)):
        padded[i, : counts[i]] = block
    out = input.new_empty(most, *input.shape[1:])
    reduce_scatter(out, padded.view(group.size * most, *input.shape[1:]), group, phase)
    return out[: counts[group.rank]]


def broadcast(tensor: torch.Tensor, src: int, group: Group, phase: str, async_op: bool = False):
    """Broadcast from group rank `src`."""
    if _skip(group):
        return _Done() if async_op else None
    LEDGER.add(group.role, phase, "broadcast", group.link, group.size, tensor.numel() * tensor.element_size())
    ORDER.record(group, "broadcast", phase, tensor)
    return dist.broadcast(tensor, group=group.handle, group_src=src, async_op=async_op)


@dataclass
class Send:
    """A point-to-point send to group rank `peer` (`phase` overrides the call's in the ledger)."""

    tensor: torch.Tensor
    peer: int
    tag: int = 0
    phase: str | None = None


@dataclass
class Recv:
    """A point-to-point receive from group rank `peer` into `tensor`."""

    tensor: torch.Tensor
    peer: int
    tag: int = 0


def p2p(ops: list[Send | Recv], group: Group, phase: str) -> list:
    """Batched point-to-point; `tag` separates streams between the same pair. Receives are
    posted before sends so that chains cannot deadlock. Returns the handles."""
    if not ops:
        return []
    p2p_ops = []
    for op in sorted(ops, key=lambda o: isinstance(o, Send)):
        if isinstance(op, Send):
            LEDGER.add(
                group.role,
                op.phase or phase,
                "send",
                group.peer_links[op.peer],
                2,
                op.tensor.numel() * op.tensor.element_size(),
            )
        fn = dist.isend if isinstance(op, Send) else dist.irecv
        ORDER.record_p2p(group, "send" if isinstance(op, Send) else "recv", op.peer, op.tensor, op.tag)
        p2p_ops.append(dist.P2POp(fn, op.tensor, group=group.handle, tag=op.tag, group_peer=op.peer))
    return dist.batch_isend_irecv(p2p_ops)


def send(tensor: torch.Tensor, peer: int, group: Group, phase: str):
    """Asynchronous send to group rank `peer`; returns a handle."""
    LEDGER.add(group.role, phase, "send", group.peer_links[peer], 2, tensor.numel() * tensor.element_size())
    ORDER.record_p2p(group, "send", peer, tensor)
    return dist.isend(tensor, group=group.handle, group_dst=peer)


def recv(tensor: torch.Tensor, peer: int, group: Group):
    """Asynchronous receive from group rank `peer`; returns a handle."""
    ORDER.record_p2p(group, "recv", peer, tensor)
    return dist.irecv(tensor, group=group.handle, group_src=peer)


def barrier(group: Group | None = None):
    if group is None:
        if dist.is_initialized():
            dist.barrier()
    elif not _skip(group):
        dist.barrier(group=group.handle)
