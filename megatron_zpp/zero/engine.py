"""The data-parallel engine interface: what the training loop and the checkpoint code use.

An engine owns the gradients (their buffers, the data-parallel reduction, the finalize
syncs), the fp32 master weights and AdamW, and the state dict of both, as torchtitan's
ModelWrapper / OptimizersContainer own theirs:

    engine.zero_grad();  <forward/backward>;  check = engine.step(rates, loss=loss)
    (rates: optim.Rates, the step's learning rates and weight decay, or one float lr)
    (the schedule calls engine.set_last_micro_batch(chunk, last) before each backward)
    state = engine.state_dict()          # {"model": {key: tensor}, "optimizer": AdamW state}
    engine.load_state_dict(state)        # "optimizer" may be absent/empty (weights only) or
                                         # lack "param_groups" (resharded: this run's are kept)
    with engine.full_parameters():       # every weight readable in full (ZeRO-3 gathers)
        ...

What a rank holds is known without building the engine: `Engine.slots(cfg, chunks, group_rank,
group_size, edp)` describes the "model" tensors of any rank of the DP x CP group (RankLayout), from
its model chunks on the meta device (a model with routed experts: the chunks of the rank's expert-parallel
rank, and its place (rank, size) in the expert-data-parallel group, over which ZeRO shards the experts);
the checkpoint code reshards and writes DCP boxes from it. Each engine writes its key strings once, in the
functions its state dict and its slots share.

The model's persistent buffers (the routers' expert bias, --moe-router-enable-expert-bias) are state too:
`state_dict()["buffers"]` holds them by their single-rank names, whole on every rank that holds their layer
(they are replicated over the stage), whatever the engine.

`build_engine` picks plain data parallelism (ZeRO stage 0, ddp_engine.py) or ZeRO-1/2/3
with ZeRO++ (zero_engine.py) from the config.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import torch

from ..model.init import full_shape
from ..optim import adamw_order


@dataclass(frozen=True)
class Slot:
    """A flat span of one tensor of a rank's "model" dict that holds a flat range of one
    parameter's TP piece, and where its AdamW moments are."""

    key: str  # the "model" tensor whose flat span [lo, hi) holds the weight (16-bit when master_key is set)
    lo: int
    hi: int
    opt: int  # the optimizer parameter whose AdamW state is the span's (same length)
    name: str  # the single-rank parameter name
    tp_split: tuple | None  # how the full parameter is cut over TP (tensor_parallel.layers.shard)
    tp_rank: int
    tp_size: int
    full_shape: tuple  # the single-rank parameter's shape
    shape: tuple  # this TP rank's piece of it
    start: int  # flat offset of the span in this rank's TP piece
    master_key: str | None = None  # plain DP in 16 bits: the tensor holding `key`'s fp32 master (same shape)
    expert: bool = False  # a routed expert's weight: tp_rank / tp_size are over expert TP, replicas over edp


@dataclass
class RankLayout:
    """Every tensor of one rank's "model" dict, its optimizer state shapes, and its slots."""

    tensors: dict[str, tuple[tuple, bool]] = field(default_factory=dict)  # key -> (shape, fp32 master?)
    opt_shapes: list[tuple] = field(default_factory=list)  # by AdamW's numbering
    slots: list[Slot] = field(default_factory=list)
    buffers: dict[str, tuple] = field(default_factory=dict)  # persistent buffer (single-rank name) -> shape


def persistent_buffers(chunks) -> dict[str, torch.Tensor]:
    """{single-rank name: tensor} of the chunks' persistent buffers (what torch's state_dict keeps beside the
    parameters: the routers' expert bias), the live tensors."""
    out = {}
    for chunk in chunks:
        for prefix, module in chunk.named_modules():
            for name, t in module._buffers.items():
                if t is not None and name not in module._non_persistent_buffers_set:
                    out[f"{prefix}.{name}" if prefix else name] = t
    return out


def param_slot(chunk, key: str, lo: int, hi: int, name: str, p, start: int, master_key: str | None = None) -> Slot:
    """The slot of parameter `p` (named `name` in its model chunk), its AdamW index still unset. A routed
    expert's tp_split cuts it over expert TP."""
    expert = bool(getattr(p, "expert_parallel", False))
    tp = chunk.ctx.etp if expert else chunk.ctx.tp
    tp_size = 1 if tp is None else tp.size
    return Slot(
        key=key,
        lo=lo,
        hi=hi,
        opt=-1,
        name=name,
        tp_split=p.tp_split,
        tp_rank=0 if tp is None else tp.rank,
        tp_size=tp_size,
        full_shape=tuple(full_shape(p, tp_size)),
        shape=tuple(p.shape),
        start=start,
        master_key=master_key,
        expert=expert,
    )


def numbered_layout(tensors: dict[str, tuple[tuple, bool]], spans: list[tuple[Slot, tuple, int]]) -> RankLayout:
    """The RankLayout of `tensors` and `spans` ((slot, its optimizer state's shape, its parameter's
    ndim), in the engine's parameter order), each span given its index in AdamW's state (the one
    numbering rule, optim.adamw_order)."""
    out = RankLayout(tensors=tensors, opt_shapes=[()] * len(spans))
    order = adamw_order([ndim for *_, ndim in spans])
    index = [0] * len(spans)
    for j, i in enumerate(order):
        index[i] = j
    for (slot, shape, _), j in zip(spans, index):
        out.slots.append(replace(slot, opt=j))
        out.opt_shapes[j] = shape
    return out


class DataParallelEngine(ABC):
    chunks: list[torch.nn.Module]  # this rank's model chunks
    optimizer: torch.optim.Optimizer  # or anything with state_dict / load_state_dict
    optimizer_name: str = "AdamW"  # which AdamW steps the masters (optim.new_adamw), for the log
    # True: every rank of the DP x CP group holds the same tensors (one rank's file is a whole replica);
    # False: the group's files together are one replica
    replicated: bool = False

    @classmethod
    @abstractmethod
    def slots(
        cls, cfg, chunks: list[torch.nn.Module], group_rank: int, group_size: int, edp: tuple[int, int] | None = None
    ) -> RankLayout:
        """What rank `group_rank` of a DP x CP group of `group_size` holds in a run of `cfg` whose
        (TP, PP) slice is `chunks` (on the meta device: shapes and names only; with routed experts, those
        of the rank's expert-parallel and expert-TP ranks): the keys and shapes of its model_state_dict and
        where each parameter's pieces are in it. `edp`: the rank's (rank, size) in the expert-data-parallel
        group (None: the DP x CP group's, as without experts)."""

    @staticmethod
    @abstractmethod
    def layout_key(cfg) -> dict:
        """The engine's entries of a checkpoint's "layout" (what decides which tensor a rank
        holds with which shape): a load at another value of them reshards."""

    @abstractmethod
    def describe(self) -> str:
        """One log line: the engine, its group and what it costs."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        """Called by the schedule before each backward of model chunk `chunk`: whether it is
        the chunk's last micro-batch of the step. Its gradients are then final as the backward
        produces them, so an engine may start reducing them (--overlap-grad-reduce); without
        this call everything is reduced in `step`."""

    @abstractmethod
    def step(self, lr, loss_scale: float | None = None, loss: float = 0.0, skip_nonfinite: bool = True):
        """Reduce and finalize the gradients, clip by the global norm, check the step
        (optim.check_step: `loss` and the norm, agreed by every rank), step AdamW at `lr` (optim.Rates,
        or a float for every group) when the check allows; returns the optim.StepCheck (the norm
        before clipping, what was finite, whether AdamW stepped). With `loss_scale` (--fp16) the
        gradients are first divided by it."""

    def counted_parts(self, kind: str) -> list[tuple[list[torch.Tensor], list]]:
        """("params" | "grads"): this rank's fp32 master weights or gradients (after `step`, before the
        next `zero_grad`), each parameter counted once over TP/PP and DP shards as the gradient norm
        counts it, with the groups to sum over: one part for the dense parameters and, in a model with
        routed experts, one for them (--log-params-norm, --log-num-zeros-in-grad, the clipping)."""
        raise NotImplementedError(type(self).__name__)

    @abstractmethod
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights as saved: live tensors, keyed as the checkpoint format says."""

    @abstractmethod
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy `state` (the keys and shapes of model_state_dict) into the live weights;
        ValueError names what does not match."""

    def gather_parameters(self) -> None:
        """Make every weight readable in full (ZeRO-3 gathers; the others hold them)."""

    def release_parameters(self) -> None:
        """Undo gather_parameters (ZeRO-3 frees the full weights again)."""

    @contextlib.contextmanager
    def full_parameters(self):
        """Every weight readable in full inside the block. Copy what you keep: ZeRO-3 frees
        the storage after it (and a numpy view of a weight would pin it: PyTorch refuses)."""
        self.gather_parameters()
        try:
            yield
        finally:
            self.release_parameters()

    def state_dict(self) -> dict:
        return {
            "model": self.model_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "buffers": {k: t.detach() for k, t in persistent_buffers(self.chunks).items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.load_model_state_dict(state["model"])
        self.load_buffers(state.get("buffers") or {})
        optimizer = state.get("optimizer")
        if optimizer:  # the moments, by AdamW's numbering (adamw_order); the param groups stay this run's:
            # their rates are set every step, and --decoupled-lr may cut the same numbering into other groups
            self.optimizer.load_state_dict({**optimizer, "param_groups": self.optimizer.state_dict()["param_groups"]})

    @torch.no_grad()
    def load_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Copy the given persistent buffers (single-rank names) into the model; those not given stay as
        they are; ValueError names one the model does not have."""
        mine = persistent_buffers(self.chunks)
        unknown = sorted(set(buffers) - set(mine))
        if unknown:
            raise ValueError(f"checkpoint buffers not in this model: {unknown[:3]}")
        for name, t in buffers.items():
            copy_checked(name, mine[name], t)


def model_has_experts(chunks) -> bool:
    """Whether the model (not just this rank's chunks) has routed experts: alike on every rank, so the
    collectives that depend on it (the norm's expert part, the expert-data-parallel reductions) agree."""
    return any(getattr(getattr(c, "cfg", None), "num_experts", None) for c in chunks)


def copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (converted to dst's dtype and device), refusing another shape."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch for {name}: checkpoint has {tuple(src.shape)}, the model has {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def check_keys(got: set, want: set) -> None:
    if got != want:
        raise ValueError(
            f"checkpoint tensors do not match the model: missing {sorted(want - got)[:5]}, "
            f"unexpected {sorted(got - want)[:5]}"
        )
