"""What every training script of bench/zero.py shares: the probe that measures a rank, and
for the peers the model, weights, data and optimizer settings identical to ours.

Probe (ours and the peers alike, so that the figures are measured the same way):
* step time: perf_counter around one optimizer step, which ends with the loss all-reduced
  over the ranks (our train_step does that; the peers do it too);
* peak memory: the rank's peak RSS (VmHWM) over the timed steps of each rate: reset through
  /proc/self/clear_refs after the warmup steps, read after the last one;
* rate gates: before the first step of each rate after the first, every rank writes
  gate<k>.rank<r> and waits (outside the timed step) for gate<k>.open, which bench/zero.py
  creates once it has reshaped the link (no traffic is in flight then);
* wire bytes: the first rank of each node reads its veth's tx_bytes (env ZPP_VETH) at every
  step boundary, so bench/zero.py can sum what both nodes put on the shaped link;
* peers: the trace of install_gloo_collectives (calls, bytes and modelled cross-node bytes per
  torch.distributed entry point), snapshotted at every step boundary too.
Each rank writes $ZPP_PROBE_DIR/rank<r>.json at the end.

Peers' reduce-scatter: gloo runs torch's reduce-scatter as an all-reduce, twice the bytes a ring
reduce-scatter moves on a real fabric (NCCL), while ours sends a SUM reduce-scatter as an
all-to-all + local sum (megatron_zpp/comm.py). install_gloo_collectives() (each peer calls it
before its framework is set up) gives the peers the same: every reduce-scatter entry point of
torch.distributed runs on a gloo group as all_to_all_single + a local sum (in fp32 for bf16,
rounded once; SUM, AVG and premul_sum; async handles), so every system's reduce-scatter moves the
real-fabric volume, (n-1)/n of its input per rank. ZPP_GLOO_NATIVE_RS=1 keeps gloo's own.

Peers: `PeerGPT` of bench/single_rank.py (checked there to give our loss and gradients),
loaded with OUR initialized weights (megatron_zpp.model.init_weights of the same seed), fed
the token stream of megatron_zpp.data.mock.MockGPTDataset in our sample order, trained with
AdamW of our hyperparameters (no decay on 1-D weights), our LR schedule and clipping.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, os.path.join(ROOT, "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


def _tx_bytes(iface: str | None) -> int | None:
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


class Probe:
    """Per-rank measurements. With gate_every = S (timed steps per rate) the rank also waits
    before steps warmup + S, warmup + 2S, ... until bench/zero.py has reshaped the link for
    the next rate (files in $ZPP_PROBE_DIR); only the first rate has warmup steps."""

    def __init__(self, warmup: int, gate_every: int = 0):
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.node = int(os.environ.get("ZPP_NODE", os.environ.get("GROUP_RANK", 0)))
        self.warmup, self.gate_every = warmup, gate_every
        self.iface = os.environ.get("ZPP_VETH") if self.local_rank == 0 else None
        self.out_dir = os.environ.get("ZPP_PROBE_DIR")
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.tx_begin: list[int | None] = []  # veth tx_bytes at the start of step i
        self.tx_end: list[int | None] = []  # and at its end
        self.comm_begin: list[dict] = []  # the peers' CommTrace totals at the start of step i
        self.comm_end: list[dict] = []  # and at its end
        self.peak_rss_by_rate: list[int | None] = []  # VmHWM over the timed steps of each rate
        self.hwm_reset = False
        self.rss_start = _vm("VmRSS")
        self._t0 = 0.0

    def _close_rate(self) -> None:
        self.peak_rss_by_rate.append(_vm("VmHWM") if self.hwm_reset else None)
        self.hwm_reset = False

    def _gate(self, k: int) -> None:
        if not self.out_dir:
            return
        with open(os.path.join(self.out_dir, f"gate{k}.rank{self.rank}"), "w"):
            pass
        while not os.path.exists(os.path.join(self.out_dir, f"gate{k}.open")):
            time.sleep(0.02)

    def step_begin(self) -> None:
        s = len(self.step_times)
        rel = s - self.warmup
        gate = bool(self.gate_every) and rel > 0 and rel % self.gate_every == 0
        if gate:
            self._close_rate()
            self._gate(rel // self.gate_every)
        if s == self.warmup or gate:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
                self.hwm_reset = True
            except OSError:
                pass
        self.tx_begin.append(_tx_bytes(self.iface))
        if TRACE is not None:
            self.comm_begin.append(TRACE.snapshot())
        self._t0 = time.perf_counter()

    def step_end(self, loss: float | None = None) -> float:
        dt = time.perf_counter() - self._t0
        self.tx_end.append(_tx_bytes(self.iface))
        if TRACE is not None:
            self.comm_end.append(TRACE.snapshot())
        self.step_times.append(dt)
        if loss is not None:
            self.losses.append(float(loss))
        return dt

    def finish(self, **extra) -> None:
        self._close_rate()
        res = {
            "rank": self.rank,
            "node": self.node,
            "local_rank": self.local_rank,
            "iface": self.iface,
            "warmup": self.warmup,
            "step_times": self.step_times,
            "losses": self.losses,
            "tx_begin": self.tx_begin,
            "tx_end": self.tx_end,
            "peak_rss_by_rate": self.peak_rss_by_rate,
            **(
                {"comm_begin": self.comm_begin, "comm_end": self.comm_end, "native_rs": TRACE.native_rs}
                if TRACE is not None
                else {}
            ),
            "rss_start": self.rss_start,
            "rss_end": _vm("VmRSS"),
            **extra,
        }
        try:
            import resource

            res["maxrss_lifetime"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except Exception:  # noqa: BLE001
            pass
        if self.out_dir:
            with open(os.path.join(self.out_dir, f"rank{self.rank}.json"), "w") as f:
                json.dump(res, f)


# ---------------------------------------------------------------- peers: model, data, optimizer


def peer_args(add_own=None) -> tuple[argparse.Namespace, list[str]]:
    """(this runner's flags, the flags after `--`): every runner takes --warmup and
    --gate-every; `add_own(parser)` adds its own."""
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gate-every", type=int, default=0, help="timed steps per link rate (bench/zero.py)")
    if add_own:
        add_own(ap)
    return ap.parse_args(argv[:split]), argv[split + 1 :]


def parse_model_args(argv: list[str]):
    """Our Config from the same flags pretrain_gpt.py gets (ZeRO flags left out)."""
    from megatron_zpp.arguments import parse_args
    from megatron_zpp.validation import validate

    return validate(parse_args(argv), int(os.environ.get("WORLD_SIZE", 1)))


def build_peer_model(cfg):
    """PeerGPT holding exactly the weights our pretrain_gpt.py starts from."""
    import torch
    from single_rank import PeerGPT, to_peer_names

    from megatron_zpp.data.tokenizer import pad_vocab_size
    from megatron_zpp.model import GPT, init_weights

    m = cfg.model
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    assert m.attention_type == "softmax" and m.activation == "swiglu" and m.normalization == "RMSNorm", (
        "the peers implement softmax attention + SwiGLU + RMSNorm only"
    )
    assert not m.untie_embeddings_and_output_weights and m.kv_heads == m.num_attention_heads, (
        "the peers implement tied embeddings and no GQA only"
    )
    ours = GPT(m, vocab)
    init_weights(ours, cfg.train.seed)
    peer = PeerGPT(m, vocab)
    peer.load_state_dict(to_peer_names(ours.state_dict(), m.num_layers), strict=False)  # lm_head tied to wte
    del ours
    return peer.to(torch.bfloat16 if cfg.train.bf16 else torch.float32), vocab


class PeerBatches:
    """This rank's micro-batches in our order (megatron_zpp.data.loader): a global batch of
    G is taken in rounds of micro x DP; in each round DP rank d takes the d-th micro-batch."""

    def __init__(self, cfg, rank: int, world: int):
        from megatron_zpp.data.mock import MockGPTDataset

        t = cfg.train
        self.data = MockGPTDataset(
            t.train_iters * t.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size, t.seed
        )
        self.mbs, self.rank, self.world, self.G = t.micro_batch_size, rank, world, t.global_batch_size
        self.num_micro = t.global_batch_size // (t.micro_batch_size * world)

    def micro_batch(self, step: int, k: int):
        import numpy as np
        import torch

        first = step * self.G + k * self.mbs * self.world + self.rank * self.mbs
        data = torch.from_numpy(np.stack([self.data[i] for i in range(first, first + self.mbs)]))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def adamw_param_groups(model, cfg) -> list[dict]:
    """Our MixedPrecisionAdamW's groups: weight decay on >= 2-D weights only."""
    params = list(model.parameters())  # a tied weight is listed once
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def adamw_kwargs(cfg) -> dict:
    o = cfg.optim
    return {"lr": o.lr, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps}


def lr_at(cfg, iteration: int) -> float:
    from megatron_zpp.optim.schedules import learning_rate

    return learning_rate(cfg.optim, iteration, cfg.train.train_iters, cfg.train.global_batch_size)


# ---------------------------------------------------------------- peers: gloo's reduce-scatter, and a trace

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
