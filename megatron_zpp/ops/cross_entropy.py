"""The per-row math of cross-entropy over one rank's slice of the vocabulary; the TP all-reduces
that combine the pieces stay in tensor_parallel/cross_entropy.py.

    local_stats(x, labels)              -> per row: max, sum exp(x - max), x[label] (0 if outside)
    softmax_grad(x, labels, lse, dloss) -> (exp(x - lse) - onehot(labels)) * dloss, in x's dtype
                                           (inplace=True: over x itself)

`x` is [rows, V_local] logits, `labels` the rows' targets in this slice's numbering (outside
[0, V_local) when another rank holds them). Neither path keeps an fp32 copy of the logits: the
Triton kernels (kernels/cross_entropy.py) stream each row in tiles; the reference works on row
chunks of at most CHUNK_ELEMENTS fp32 values. Math in fp32 (fp64 stays fp64 on the reference).
"""

from __future__ import annotations

import torch

from . import dispatch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_ELEMENTS = 1 << 22  # reference: fp32 values per row chunk (16 MiB)
dispatch.register("cross_entropy", "fp32/bf16/fp16 logits, any vocab slice, rows streamed in tiles")


def _kernels():
    from ..kernels import cross_entropy  # lazily: triton is needed only once a kernel runs

    return cross_entropy


@dispatch.kernel_op("cross_entropy_stats")
def _stats_kernel(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 [3, rows]: max, sum exp, target. One tensor, as a custom op's outputs may not alias each other
    (the wrapper's three may be views of one buffer); the stack copies 3 values a row."""
    return torch.stack(_kernels().ce_fwd_stats(x, labels))


@_stats_kernel.register_fake
def _(x, labels):
    return x.new_empty(3, x.shape[0], dtype=torch.float32)


@dispatch.kernel_op("cross_entropy_grad")
def _grad_kernel(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    return _kernels().ce_bwd(x, labels, lse, dloss)


@_grad_kernel.register_fake
def _(x, labels, lse, dloss):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@dispatch.kernel_op("cross_entropy_grad_", mutates_args=("x",))
def _grad_kernel_(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor) -> None:
    """The gradient written over the logits x (a custom op may not return an alias of its input)."""
    _kernels().ce_bwd(x, labels, lse, dloss, inplace=True)


@_grad_kernel_.register_fake
def _(x, labels, lse, dloss):
    return None


def _use_kernel(x: torch.Tensor) -> bool:
    return dispatch.use_triton(x) and x.dtype in KERNEL_DTYPES and x.stride(-1) == 1


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _row_chunks(x: torch.Tensor):
    step = max(1, CHUNK_ELEMENTS // max(1, x.shape[-1]))
    for a in range(0, x.shape[0], step):
        yield a, min(x.shape[0], a + step)


def _onehot_index(labels: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(label clamped into the slice, whether it is in the slice)."""
    inside = (labels >= 0) & (labels < V)
    return labels.clamp(0, max(V - 1, 0)), inside


def local_stats_reference(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, V = x.shape
    dtype = _math_dtype(x)
    row_max = x.amax(dim=-1).to(dtype)  # exact in any dtype: no fp32 copy needed
    sum_exp = torch.empty(rows, device=x.device, dtype=dtype)
    for a, b in _row_chunks(x):
        sum_exp[a:b] = (x[a:b].to(dtype) - row_max[a:b, None]).exp_().sum(dim=-1)
    index, inside = _onehot_index(labels, V)
    target = x.gather(-1, index[:, None]).squeeze(-1).to(dtype).masked_fill_(~inside, 0.0)
    return row_max, sum_exp, target


def local_stats(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of x [rows, V]: max, sum exp(x - max) and x[label] (0 where the label is outside)."""
    if _use_kernel(x):
        return tuple(_stats_kernel(x, labels.contiguous()).unbind())
    return local_stats_reference(x, labels)


def softmax_grad_reference(
    x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    dx = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    index, inside = _onehot_index(labels, x.shape[-1])
    dtype = _math_dtype(x)
    for a, b in _row_chunks(x):
        p = (x[a:b].to(dtype) - lse[a:b, None].to(dtype)).exp_()
        p[torch.arange(b - a, device=x.device), index[a:b]] -= inside[a:b].to(dtype)
        dx[a:b] = p.mul_(dloss[a:b, None].to(dtype))
    return dx


def softmax_grad(
    x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    """(softmax - onehot(labels)) * dloss[:, None] for x [rows, V] in x's dtype, softmax = exp(x - lse)
    with lse the row's log-sum-exp over the whole vocabulary (all TP slices). inplace: the gradient is
    written over x (returned), row chunk by row chunk after it is read: no logits-sized allocation."""
    if _use_kernel(x):
        f32 = torch.float32
        lse, dloss = lse.to(f32).contiguous(), dloss.to(f32).contiguous()
        if inplace:
            _grad_kernel_(x, labels.contiguous(), lse, dloss)
            return x
        return _grad_kernel(x, labels.contiguous(), lse, dloss)
    return softmax_grad_reference(x, labels, lse, dloss, inplace=inplace)
