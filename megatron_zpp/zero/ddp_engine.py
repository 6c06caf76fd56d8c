"""Plain data parallelism (ZeRO stage 0): every rank holds the whole model chunk and its
optimizer state; full fp32 gradients are all-reduced over DP x CP in buckets, during the
backward of the step's last micro-batch with --overlap-grad-reduce (grad_buffer.py).

The finalize syncs (optim/finalize.py: TP-partial norm gradients, the tied embedding)
run after the data-parallel mean, on either path, so overlap on and off compute the
same sums in the same order.

State dict ("model"): {"chunk{c}.{param name}": weight} and, for bf16, {"master.{i}":
fp32 master} (i: the parameter's index in this rank's chunks, in order): the keys of
`chunk_key` and `master_key`, which `DDPEngine.slots` describes too."""

from __future__ import annotations

import warnings

import torch

from ..model.init import materialize
from ..optim import MixedPrecisionAdamW, check_step, clip_by_global_norm, counted_once, finalize_model_grads
from ..optim.optimizer import decoupled_lr_params, qk_norm_params
from ..tensor_parallel.layers import is_expert
from ..topology import ProcessGroups
from .engine import (
    DataParallelEngine,
    RankLayout,
    check_keys,
    copy_checked,
    model_has_experts,
    numbered_layout,
    param_slot,
)
from .grad_buffer import GradBuffer


def default_bucket_numel(group_size: int) -> int:
    """Megatron's default bucket: max(40M, 1M x DP) elements (larger groups need larger
    buckets to stay bandwidth-bound)."""
    return max(40_000_000, 1_000_000 * group_size)


def chunk_key(chunk: int, name: str) -> str:
    """The state dict key of parameter `name` of model chunk `chunk` (its training-dtype weight)."""
    return f"chunk{chunk}.{name}"


def master_key(index: int) -> str:
    """The state dict key of the fp32 master of this rank's parameter number `index` (16-bit training)."""
    return f"master.{index}"


class DDPEngine(DataParallelEngine):
    replicated = True  # every rank of DP x CP holds the whole (TP, PP) slice

    def __init__(self, chunks: list[torch.nn.Module], groups: ProcessGroups, optim_cfg, zero_cfg, init=None):
        """`chunks` built on the meta device come with `init` (model/init.RankInit): this rank holds
        them whole, so every parameter is allocated and filled here, one at a time."""
        self.chunks, self.groups = chunks, groups
        if init is not None:
            materialize(chunks, init)
        chunk_params = [[p for p in c.parameters() if p.requires_grad] for c in chunks]
        self.params = [p for ps in chunk_params for p in ps]
        self.moe = model_has_experts(chunks)  # alike on every rank: the norm's collectives
        self.overlap = zero_cfg.overlap_grad_reduce and groups.dp_cp.size > 1
        bucket = (zero_cfg.ddp_bucket_size or default_bucket_numel(groups.dp_cp.size)) if self.overlap else None
        wire = torch.bfloat16 if zero_cfg.grad_reduce_in_bf16 else torch.float32
        dense = [[p for p in ps if not is_expert(p)] for ps in chunk_params]
        self.grads = GradBuffer(dense, groups.dp_cp, bucket, wire)
        # routed experts: summed over the ranks holding the same experts, averaged over the model replicas
        experts = [[p for p in ps if is_expert(p)] for ps in chunk_params]
        self.expert_grads = GradBuffer(experts, groups.edp, bucket, wire, groups.dp_cp.size) if self.moe else None
        if self.overlap:
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            for c, chunk in enumerate(chunks):
                chunk.register_full_backward_pre_hook(self._backward_hook(c))
        decoupled = set().union(*(decoupled_lr_params(c) for c in chunks))
        qk_norms = set().union(*(qk_norm_params(c) for c in chunks))
        self.optimizer = MixedPrecisionAdamW(self.params, optim_cfg, decoupled, qk_norms)
        self.optimizer_name = self.optimizer.name
        self.clip = optim_cfg.clip_grad

    def describe(self) -> str:
        g = self.groups.dp_cp
        how = (
            f"{len(self.grads.buckets)} buckets started during the last micro-batch's backward (--overlap-grad-reduce)"
            if self.overlap
            else f"{len(self.grads.buckets)} bucket(s) after the backward"
        )
        wire = str(self.grads.wire).removeprefix("torch.")
        experts = ""
        if self.expert_grads is not None:
            e = self.groups.edp
            experts = f"; routed experts' gradients over the expert-data-parallel group ({e.size} ranks, {e.link})"
        return (
            f"data parallel: plain, fp32 gradients all-reduced in {wire} over DP x CP ({g.size} ranks, {g.link}): {how}"
            + experts
        )

    def _backward_hook(self, c: int):
        def hook(module, grad_output):
            if self.grads.last[c]:  # the step's last backward of the chunk: start its buckets at its end
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._flush(c))

        return hook

    def _buffers(self) -> list[GradBuffer]:
        return [self.grads] + ([self.expert_grads] if self.expert_grads is not None else [])

    def _flush(self, c: int) -> None:
        for buffer in self._buffers():
            buffer.flush(c)

    def zero_grad(self) -> None:
        for buffer in self._buffers():
            buffer.zero()

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        if self.overlap:
            for buffer in self._buffers():
                buffer.set_last_micro_batch(chunk, last)

    def step(self, lr, loss_scale: float | None = None, loss: float = 0.0, skip_nonfinite: bool = True):
        g = self.groups
        for buffer in self._buffers():
            buffer.finish()
        tied_embeddings = [part.tied_embedding for part in (c.parts() for c in self.chunks)]
        tied = [e.weight.main_grad for e in tied_embeddings if e is not None and e.weight.requires_grad]
        finalize_model_grads([p.main_grad for p in self.params if getattr(p, "tp_partial_grad", False)], tied, g)
        parts = self.counted_parts("grads")
        norm = clip_by_global_norm(parts, [p.main_grad for p in self.params], self.clip, loss_scale)
        check = check_step(loss, norm, g.world, self.params[0].device, loss_scale, skip_nonfinite)
        if check.applied:
            self.optimizer.step(lr)
        return check

    def counted_parts(self, kind: str) -> list[tuple[list[torch.Tensor], list]]:
        g = self.groups
        pairs = zip(self.optimizer.params, self.optimizer.masters)
        once = [(p, m) for p, m in pairs if counted_once(p, g.tp_rank, g.is_first_stage)]
        dense = [m if kind == "params" else p.main_grad for p, m in once if not is_expert(p)]
        if not self.moe:
            return [(dense, [g.mp])]
        experts = [m if kind == "params" else p.main_grad for p, m in once if is_expert(p)]
        return [(dense, [g.mp]), (experts, [g.expert_mp])]

    # ---- state -------------------------------------------------------------------------
    @staticmethod
    def layout_key(cfg) -> dict:
        return {"zero_stage": 0, "zero_quantization_block_size": None}

    @classmethod
    def slots(cls, cfg, chunks, group_rank: int, group_size: int, edp: tuple[int, int] | None = None) -> RankLayout:
        """Every parameter whole (whatever the rank of the group or of the expert-data-parallel one); with
        16-bit weights each has its fp32 master; AdamW over the chunks' parameters in order."""
        sixteen_bit = cfg.train.bf16 or cfg.train.fp16
        tensors, spans = {}, []
        params = [(c, chunk, n, p) for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()]
        for i, (c, chunk, name, p) in enumerate(params):
            key, master = chunk_key(c, name), (master_key(i) if sixteen_bit else None)
            tensors[key] = (tuple(p.shape), False)
            if master:
                tensors[master] = (tuple(p.shape), True)
            spans.append((param_slot(chunk, key, 0, p.numel(), name, p, 0, master), tuple(p.shape), p.ndim))
        return numbered_layout(tensors, spans)

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {chunk_key(c, n): p for c, chunk in enumerate(self.chunks) for n, p in chunk.named_parameters()}
        for i, (p, m) in enumerate(zip(self.optimizer.params, self.optimizer.masters)):
            if m is not p:  # bf16: the fp32 master is the real weight
                out[master_key(i)] = m
        return out

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: t.detach() for k, t in self._tensors().items()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = self._tensors()
        check_keys(set(state), set(mine))
        for name, t in mine.items():
            copy_checked(name, t.data, state[name])
