"""The peers' collectives on gloo: their reduce-scatter at the real-fabric volume, and a trace.

gloo runs torch's reduce-scatter as an all-reduce, twice the bytes a ring reduce-scatter moves on
a real fabric (NCCL), while ours sends a SUM reduce-scatter as an all-to-all + local sum
(megatron_zpp/comm.py). install_gloo_collectives() (each peer calls it before its framework is set
up) gives the peers the same: every reduce-scatter entry point of torch.distributed runs on a gloo
group as all_to_all_single + a local sum (in fp32 for bf16, rounded once; SUM, AVG and premul_sum;
async handles), so every system's reduce-scatter moves the real-fabric volume, (n-1)/n of its
input per rank. ZPP_GLOO_NATIVE_RS=1 keeps gloo's own."""

from __future__ import annotations

import os

# torch.distributed's entry points the peers' frameworks call (found by reading their source; the trace below
# counts the calls): FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) calls
# dist.reduce_scatter_single and dist.all_gather_single; DeepSpeed's deepspeed.comm (TorchBackend, the one
# it runs on CPU/gloo) binds torch.distributed.reduce_scatter_tensor and all_gather_into_tensor at
# init_distributed (ZeRO-3's reduce_scatter_coalesced -> reduce_scatter_fn -> reduce_scatter_tensor) and
# calls torch.distributed.reduce_scatter (a list: partition_parameters' per-parameter path), all_gather
# (a list) and all_reduce. torch's own reduce_scatter_tensor and _reduce_scatter_base are shims over the
# module's reduce_scatter_single, and all_gather_into_tensor / _all_gather_base over all_gather_single.
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter")
TRACED = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather", "all_reduce")
TRACED += ("all_to_all_single", "broadcast")
OP_OF = {name: "reduce_scatter" for name in REDUCE_SCATTERS}
OP_OF.update({n: "all_gather" for n in TRACED[:4]} | {"all_reduce": "all_reduce", "all_to_all_single": "all_to_all"})
OP_OF["broadcast"] = "broadcast"


class CommTrace:
    """Per entry point of torch.distributed: calls, payload bytes (all-gather: the output, reduce-scatter:
    the input, all-reduce, all-to-all, broadcast: the tensor) and what this rank sends across the nodes
    ("x_node": ring all-gathers and all-reduces (gloo's) cross where the next rank of the ring is on the
    other node, an all-to-all sends its remote parts; "x_node_real": the same with every reduce-scatter
    counted as the all-to-all of a real-fabric reduce-scatter, (n-1)/n of the input per rank).
    Cumulative; Probe snapshots it at every step boundary."""

    def __init__(self):
        self.totals: dict[str, list[float]] = {}  # entry point -> [calls, payload, x_node, x_node_real]
        self.depth = 0  # > 0 inside a traced call: torch's shims call each other
        self.per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.native_rs = os.environ.get("ZPP_GLOO_NATIVE_RS") == "1"  # bench/zero.py --gloo-native-reduce-scatter
        self._shapes: dict = {}

    def _shape(self, group) -> tuple[int, int, int] | None:
        """(group size, ranks of it on other nodes, 1 if the ring's next rank is on another node else 0);
        None if this rank is not in the group."""
        import torch.distributed as dist

        g = group if group is not None else dist.group.WORLD
        if g not in self._shapes:
            ranks = dist.get_process_group_ranks(g)
            if dist.get_rank() not in ranks:
                return None
            me = ranks.index(dist.get_rank())
            node = [r // self.per_node for r in ranks]
            remote = sum(n != node[me] for n in node)
            self._shapes[g] = (len(ranks), remote, int(node[(me + 1) % len(ranks)] != node[me]))
        return self._shapes[g]

    def add(self, name: str, group, payload: int, gloo_rs: bool) -> None:
        """gloo_rs: a reduce-scatter that gloo runs itself (as an all-reduce), not our all-to-all."""
        shape = self._shape(group)
        if shape is None:
            return
        n, remote, ring_cross = shape
        a2a = payload * remote / n
        ring = {"all_gather": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
        op = OP_OF[name]
        if op == "reduce_scatter":
            x_node, x_real = (payload * ring["all_reduce"] * ring_cross if gloo_rs else a2a), a2a
        elif op in ring:
            x_node = x_real = payload * ring[op] * ring_cross
        elif op == "all_to_all":
            x_node = x_real = a2a
        else:  # broadcast: not modelled (none in a step)
            x_node = x_real = 0.0
        t = self.totals.setdefault(name, [0, 0, 0.0, 0.0])
        t[0] += 1
        t[1] += payload
        t[2] += x_node
        t[3] += x_real

    def snapshot(self) -> dict:
        return {k: list(v) for k, v in self.totals.items()}


TRACE: CommTrace | None = None


def _reduce_kind(op):
    """(SUM | AVG | PREMUL_SUM, factor or None) of a torch ReduceOp; None for any other op."""
    import torch.distributed as dist

    R = dist.ReduceOp
    base = getattr(op, "op", op)  # a ReduceOp object (premul_sum's carries the factor) or its RedOpType
    if base == R.PREMUL_SUM:
        return "premul_sum", op.factor
    if base == R.SUM:
        return "sum", None
    if base == R.AVG:
        return "avg", None
    return None


class _A2AWork:
    """The handle of an all-to-all reduce-scatter: the local sum runs once the transfer is done."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self, timeout=None):
        self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        if self.finish is not None and self.work.is_completed():
            self.wait()  # the transfer is done: the local sum, so that the output is ready
        return self.finish is None

    def is_success(self) -> bool:
        return self.work.is_success()

    def synchronize(self) -> None:
        self.wait()


def _a2a_reduce_scatter(output, input, kind, factor, group, async_op: bool):
    """reduce_scatter_single(output, input, op, group) as all_to_all_single + a local sum: group rank i keeps
    slice i of the flattened input, summed over the ranks (floats below fp32 in fp32, rounded once into
    output), times factor (premul_sum) or / n (avg). What a ring reduce-scatter sends per rank,
    (n-1)/n of the input, where gloo's own reduce-scatter runs an all-reduce (twice that)."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    n = c10d.get_world_size(group)
    flat = input.reshape(-1)  # concatenation or stack along dim 0: slice i is the i-th n-th
    received = torch.empty_like(flat)  # part j: rank j's copy of my slice

    def finish():
        low = flat.dtype.is_floating_point and flat.dtype.itemsize < 4
        acc = received.view(n, -1).sum(0, dtype=torch.float32 if low else flat.dtype)
        if kind == "avg":
            acc.div_(n)
        elif kind == "premul_sum":
            acc.mul_(factor)
        output.copy_(acc.view(output.shape))

    work = _A2AWork(_ORIGINAL["all_to_all_single"](received, flat, group=group, async_op=True), finish)
    if async_op:
        return work
    work.wait()
    return None


def _uses_a2a(output, input, op, group) -> tuple | None:
    """(kind, factor) if this reduce-scatter runs as an all-to-all here: a gloo group, a CPU tensor, SUM /
    AVG / premul_sum, n equal slices, not under a torch function mode or a coalescing manager."""
    import torch.distributed.distributed_c10d as c10d
    from torch.overrides import has_torch_function

    if TRACE is None or TRACE.native_rs or c10d._rank_not_in_group(group) or has_torch_function((input, output)):
        return None
    g = group if group is not None else c10d._get_default_group()
    if input.device.type != "cpu" or "gloo" not in str(c10d.get_backend(g)) or g in c10d._world.pg_coalesce_state:
        return None
    kind = _reduce_kind(op)
    n = g.size()
    if kind is None or n < 2 or input.dtype != output.dtype or input.numel() != n * output.numel():
        return None
    return kind


# the argument whose bytes are a call's payload (all-gather: the output; reduce-scatter: the input)
PAYLOAD_ARG = {"all_gather": "tensor_list", "all_reduce": "tensor", "all_to_all_single": "input", "broadcast": "tensor"}
PAYLOAD_ARG.update({n: "output_tensor" for n in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")})


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if hasattr(t, "numel") else 0


def _traced(name: str, orig):
    """orig, counted in TRACE at the outermost traced call (torch's shims call each other); a reduce-scatter
    runs as _a2a_reduce_scatter where _uses_a2a says so."""
    import functools
    import inspect

    import torch

    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def call(*args, **kw):
        if TRACE is None or TRACE.depth:
            return orig(*args, **kw)
        a = sig.bind(*args, **kw)
        a.apply_defaults()
        a = a.arguments
        TRACE.depth += 1
        try:
            if OP_OF[name] != "reduce_scatter":
                TRACE.add(name, a["group"], _nbytes(a[PAYLOAD_ARG[name]]), False)
                return orig(*args, **kw)
            output, pieces, input = a["output"], a.get("input_list"), a.get("input")
            if pieces is not None:  # reduce_scatter's list: as one tensor if the pieces are the output's size
                equal = all(p.numel() == output.numel() and p.dtype == output.dtype for p in pieces)
                input = torch.cat([p.reshape(-1) for p in pieces]) if equal else None
            how = _uses_a2a(output, input, a["op"], a["group"]) if input is not None else None
            TRACE.add(name, a["group"], _nbytes(pieces if pieces is not None else input), how is None)
            if how is None:
                return orig(*args, **kw)
            return _a2a_reduce_scatter(output, input, *how, a["group"], a["async_op"])
        finally:
            TRACE.depth -= 1

    return call


_ORIGINAL: dict = {}


def install_gloo_collectives() -> CommTrace:
    """In a peer, before its framework is set up (DeepSpeed binds torch's functions at init_distributed):
    every reduce-scatter entry point of torch.distributed runs on a gloo group as an all-to-all + local
    sum (the volume a ring reduce-scatter moves on a real fabric; gloo runs its own as an all-reduce),
    anything else as before; every traced entry point is counted in TRACE."""
    global TRACE
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if TRACE is not None:
        return TRACE
    TRACE = CommTrace()
    for name in REDUCE_SCATTERS + TRACED:
        _ORIGINAL[name] = orig = getattr(c10d, name)
        wrapped = _traced(name, orig)
        setattr(c10d, name, wrapped)  # torch's shims (reduce_scatter_tensor, ...) look it up here
        setattr(dist, name, wrapped)  # what the frameworks call
    return TRACE
