"""Deterministic, layout-independent weight init, and the sharded start-up that writes it.

Every parameter is drawn from its own generator, seeded by (seed, parameter name), at
its full single-rank shape, and then cut to this rank's TP shard. Names carry global
layer indices, so any TP/PP layout starts from exactly the single-rank weights, and a
tied embedding copy on the last pipeline stage equals the first stage's.

Start-up builds the model on the meta device (shapes, names, TP splits, init rules; no
memory) and then writes only what the rank holds (`RankInit.fill`): its whole (TP, PP)
slice (`materialize`, ZeRO-0), or the pieces a ZeRO engine keeps (zero/sharded_params.py).
Each full parameter is drawn on the CPU (the generator is the CPU's, so the values do not
depend on the device), the rank's piece is copied from it straight into its storage, and
it is dropped before the next: start-up holds the rank's final state plus one full
parameter (fp32; on a GPU run that one lives in host memory)."""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake


def full_shape(p: nn.Parameter, tp_size: int) -> list[int]:
    shape = list(p.shape)
    if getattr(p, "tp_split", None) is not None and tp_size > 1:
        shape[p.tp_split[0]] *= tp_size
    return shape


def full_init(name: str, shape: list[int], rule: tuple, seed: int) -> torch.Tensor:
    """The full single-rank fp32 weight (on the CPU) of a parameter of that name under its random
    init rule (one of DRAWS, with its arguments)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    kind, *args = rule
    return DRAWS[kind](shape, gen, *args)


def _normal(shape: list[int], gen: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std)  # in place: one full tensor at a time


def _uniform(shape: list[int], gen: torch.Generator, low: float, high: float) -> torch.Tensor:
    """U(low, high): e.g. nn.Conv1d's default kaiming_uniform(a=sqrt(5)), U(+-1/sqrt(fan_in))."""
    return torch.empty(shape, dtype=torch.float32).uniform_(low, high, generator=gen)


def _log_of_uniform(shape: list[int], gen: torch.Generator, low: float, high: float) -> torch.Tensor:
    """log A for A ~ U(low, high): a decay rate stored as its log (Mamba2's and GDN's A_log)."""
    return torch.empty(shape, dtype=torch.float32).uniform_(low, high, generator=gen).log_()


def _softplus_inverse_of_log_uniform(
    shape: list[int], gen: torch.Generator, low: float, high: float, floor: float
) -> torch.Tensor:
    """softplus^-1(dt) for dt = exp(U(log low, log high)) clamped at `floor`: a bias whose softplus
    is a log-uniform time step at a zero input (Mamba2's and GDN's dt_bias)."""
    dt = torch.empty(shape, dtype=torch.float32).uniform_(math.log(low), math.log(high), generator=gen)
    dt = dt.exp_().clamp_(min=floor)
    return dt + torch.log(-torch.expm1(-dt))  # log(exp(dt) - 1) without overflow, exact for small dt


# the random init rules: ("normal", std), ("uniform", low, high), ("log_of_uniform", low, high),
# ("softplus_inverse_of_log_uniform", low, high, floor); "ones" and "zeros" are filled without drawing
DRAWS = {
    "normal": _normal,
    "uniform": _uniform,
    "log_of_uniform": _log_of_uniform,
    "softplus_inverse_of_log_uniform": _softplus_inverse_of_log_uniform,
}


def copy_tp_range(dest: torch.Tensor, full: torch.Tensor, tp_split, tp_rank: int, tp_size: int, start: int) -> None:
    """dest (1-D) <- elements [start, start + len(dest)) of `shard(full, tp_split, tp_rank, tp_size)`
    flattened, without forming the shard: copies from views of `full` (converted to dest's dtype
    and device by copy_, so the rounding is that of `shard(...).to(dtype)`).

    The local tensor is seen as [A, B, C] with B the split dimension: for each outer index a, its
    B x C elements are the TP pieces' n_i x C contiguous blocks one after the other, and each
    block is contiguous in `full` too. Whole outer rows are copied as one strided copy per piece,
    the partial first and last rows piece by piece."""
    n = dest.numel()
    if n == 0:
        return
    if tp_split is None or tp_size == 1:
        dest.copy_(full.reshape(-1)[start : start + n])
        return
    dim, sections = tp_split
    shape = list(full.shape)
    A = 1
    for s in shape[:dim]:
        A *= s
    C = 1
    for s in shape[dim + 1 :]:
        C *= s
    full3 = full.reshape(A, shape[dim], C)
    pieces, src_off, local_off = [], 0, 0  # (start in full's dim, start in the local dim, size)
    for sec in sections:
        k = sec // tp_size
        pieces.append((src_off + tp_rank * k, local_off, k))
        src_off, local_off = src_off + sec, local_off + k
    B = local_off
    row = B * C
    end = start + n
    a_first, a_last = start // row, (end - 1) // row
    whole_lo = a_first if start % row == 0 else a_first + 1  # outer rows wholly inside [start, end)
    whole_hi = a_last + 1 if end % row == 0 else a_last
    if whole_lo < whole_hi:
        out = dest[whole_lo * row - start : whole_hi * row - start].view(whole_hi - whole_lo, B, C)
        for s, o, k in pieces:
            out[:, o : o + k].copy_(full3[whole_lo:whole_hi, s : s + k])
    for a in sorted(a for a in {a_first, a_last} if not whole_lo <= a < whole_hi):  # partial rows
        for s, o, k in pieces:
            lo, hi = a * row + o * C, a * row + (o + k) * C  # the piece's block in the local flat order
            x, y = max(lo, start), min(hi, end)
            if x < y:
                dest[x - start : y - start].copy_(full3[a, s : s + k].reshape(-1)[x - lo : y - lo])


class RankInit:
    """The values a rank's parameters start from, written into storage it allocates itself.

    `chunks` name the parameters (named_parameters: global layer indices, so every layout seeds
    alike); `fill(p, dest, start)` writes elements [start, start + len(dest)) of this TP rank's
    flattened shard of p's init into the 1-D `dest`, drawing p's full weight for the call only.
    Routed experts' weights are split over expert TP (`expert_tp`: this rank's (rank, size) in it)."""

    def __init__(
        self, chunks, seed: int, tp_rank: int, tp_size: int, device: torch.device, expert_tp: tuple[int, int] = (0, 1)
    ):
        self.seed, self.device = seed, torch.device(device)
        self.tp, self.expert_tp = (tp_rank, tp_size), expert_tp
        # by parameter, read now: a unit empties its parameters' data once it owns their values
        self.names = {id(p): n for c in chunks for n, p in c.named_parameters()}
        self.full_shapes = {id(p): full_shape(p, self.split(p)[1]) for c in chunks for p in c.parameters()}

    def split(self, p: nn.Parameter) -> tuple[int, int]:
        """(rank, size) of the group `p`'s tp_split cuts it over: expert TP for a routed expert, else TP."""
        return self.expert_tp if getattr(p, "expert_parallel", False) else self.tp

    @torch.no_grad()
    def fill(self, p: nn.Parameter, dest: torch.Tensor, start: int = 0) -> None:
        rule = getattr(p, "init", ("normal", 0.02))
        if rule[0] == "ones":
            dest.fill_(1.0)
        elif rule[0] == "zeros":
            dest.zero_()
        else:
            full = full_init(self.names[id(p)], self.full_shapes[id(p)], rule, self.seed)
            copy_tp_range(dest, full, getattr(p, "tp_split", None), *self.split(p), start)


def swap_in(p: nn.Parameter, data: torch.Tensor) -> None:
    """Give the parameter object `p` (e.g. on the meta device) the storage `data`, on any device,
    keeping its identity (modules, hooks and references see the same object) and its attributes
    (init rule, TP split: torch.utils.swap_tensors swaps the __dict__ too)."""
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, _unmemoized(nn.Parameter(data, requires_grad=p.requires_grad)))
    p.__dict__.update(attrs)


def _unmemoized(t: torch.Tensor) -> torch.Tensor:
    """`t`, no longer in its FakeTensorMode's memo when it is a fake tensor (a dry run): the memo
    holds a weak reference, and swap_tensors refuses a tensor that has one."""
    if is_fake(t):
        memo = t.fake_mode.fake_tensor_converter.tensor_memo
        for key in [k for k, v in memo.items() if v is t]:
            del memo[key]
    return t


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers of a meta-built module on `device`: a module that has meta buffers computes them in
    `reset_buffers(device)` (ours have none: the RoPE tables are computed in the forward)."""
    for name, module in model.named_modules():
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "reset_buffers"):
                raise NotImplementedError(
                    f"{name or type(module).__name__} has buffers on the meta device and no reset_buffers(device) "
                    "to compute them: a sharded start-up cannot materialize it"
                )
            module.reset_buffers(device)


@torch.no_grad()
def materialize(chunks, init: RankInit) -> None:
    """Allocate every parameter of meta-built `chunks` on init.device (their dtype) and fill it,
    one parameter at a time: the rank's whole (TP, PP) slice, bitwise `init_weights`' values."""
    done = set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in done or not p.is_meta:
                continue
            done.add(id(p))
            data = torch.empty(p.shape, dtype=p.dtype, device=init.device)
            init.fill(p, data.view(-1))
            swap_in(p, data)
        materialize_buffers(chunk, init.device)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Fill an already allocated model in place (what the sharded start-up writes, for a model built
    on a real device)."""
    init = RankInit([model], seed, tp_rank, tp_size, torch.device("cpu"))
    for p in model.parameters():
        if p.is_contiguous():
            init.fill(p, p.view(-1))
        else:
            tmp = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            init.fill(p, tmp.view(-1))
            p.copy_(tmp)


def count_parameters(model: nn.Module, tp_size: int = 1) -> int:
    """Parameters of the full (unsharded) model part held here."""
    total = 0
    for p in model.parameters():
        n = 1
        for s in full_shape(p, tp_size):
            n *= s
        total += n
    return total
