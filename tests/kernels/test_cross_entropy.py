"""Vocab-parallel cross-entropy: the Triton kernels (interpreter) and the chunked reference against
an fp64 F.cross_entropy on the full logits, forward and backward; TP=2 emulated by splitting the
vocabulary and combining the per-row pieces here as the all-reduces would.

Tiles of 16 columns over vocab slices of 37 and 100 (ragged tails, several tiles a row); the
reference in row chunks of 64 values (several chunks). Labels at both edges of every slice and
ignore_index rows.

Tolerances against fp64: losses 2e-6 relative + 2e-6 (fp32 math; bf16 logits are exact in
fp32, so the same bound holds for them); fp32 gradients 1e-5 relative + 1e-7; bf16 gradients
within one bf16 ulp (2^-7 relative + 1e-6): they are rounded once to bf16, and the interpreter's
bf16 store truncates (measured 0.0075 relative; a GPU rounds, half that).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.kernels import cross_entropy as kernels
from megatron_zpp.ops import cross_entropy as ce
from megatron_zpp.ops import dispatch
from megatron_zpp.tensor_parallel import vocab_parallel_cross_entropy

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["triton", "torch"])
def mode(request, monkeypatch):
    monkeypatch.setattr(kernels, "MAX_BLOCK", 16)
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 64)
    dispatch.set_kernels(request.param, torch.device("cpu"))
    yield request.param
    dispatch.set_kernels("auto", torch.device("cpu"))


def _case(rows: int, vocab: int, dtype, slices: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    per = vocab // slices
    edges = [e for s in range(slices) for e in (s * per, s * per + per - 1)]
    labels[: len(edges)] = torch.tensor(edges)  # first and last column of every slice
    labels[len(edges)] = -100  # ignored
    dloss = torch.randn(rows, generator=g)
    return logits, labels, dloss


def _fp64_reference(logits, labels, dloss):
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x, labels, reduction="none")
    (loss * dloss.double()).sum().backward()
    return loss.detach(), x.grad


def _check(loss, grad, ref_loss, ref_grad, dtype):
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-6, atol=2e-6)
    tol = dict(rtol=2**-7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), ref_grad, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [37, 100])
def test_full_vocab_matches_fp64(mode, dtype, vocab):
    logits, labels, dloss = _case(11, vocab, dtype)
    x = logits.view(1, 11, vocab).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, labels.view(1, 11), None)
    (loss * dloss.view(1, 11)).sum().backward()
    ref_loss, ref_grad = _fp64_reference(logits, labels, dloss)
    ignored = labels == -100
    assert ignored.sum() == 1 and not loss[0, ignored].any() and not x.grad[0, ignored].any()
    _check(loss.view(-1), x.grad.view(11, vocab), ref_loss, ref_grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tp2_emulated_pieces_combine_to_fp64(mode, dtype):
    """Each slice's local pieces, combined as the MAX and SUM all-reduces would, give the full loss;
    each slice's gradient from the combined log-sum-exp is that slice of the full gradient."""
    per, rows = 37, 9
    logits, labels, dloss = _case(rows, 2 * per, dtype, slices=2)
    pieces = [ce.local_stats(logits[:, r * per : (r + 1) * per], labels - r * per) for r in range(2)]
    global_max = torch.maximum(pieces[0][0], pieces[1][0])
    sum_exp = sum(s * (m - global_max).exp() for m, s, _ in pieces)
    target = sum(t for *_, t in pieces)
    lse = global_max + sum_exp.log()
    loss = (lse - target).masked_fill(labels == -100, 0.0)
    live = dloss.masked_fill(labels == -100, 0.0)
    grads = [ce.softmax_grad(logits[:, r * per : (r + 1) * per], labels - r * per, lse, live) for r in range(2)]
    ref_loss, ref_grad = _fp64_reference(logits, labels, dloss)
    _check(loss, torch.cat(grads, dim=1), ref_loss, ref_grad, dtype)


def test_the_kernel_runs_under_triton_and_not_under_torch(monkeypatch):
    """The dispatch really switches: count kernel launches through the launch wrappers."""
    calls = []
    monkeypatch.setattr(kernels, "ce_fwd_stats", lambda *a: calls.append("fwd") or ce.local_stats_reference(*a))
    x, labels, _ = _case(4, 20, torch.float32)
    for m in ("torch", "triton"):
        dispatch.set_kernels(m, torch.device("cpu"))
        ce.local_stats(x, labels)
    dispatch.set_kernels("auto", torch.device("cpu"))
    assert calls == ["fwd"]
    assert ce.local_stats(x.double(), labels)[0].dtype == torch.float64  # fp64: always the reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_backward_writes_the_gradient_over_the_logits(mode, dtype):
    """inplace_backward (the model's path): the gradient that reaches the output layer is the logits'
    own storage, equal to the fp64 reference; a leaf is never overwritten; another reader of the
    logits after the write, or a second backward, fails loudly (the version counter)."""
    logits, labels, dloss = _case(11, 37, dtype)
    leaf = logits.clone().requires_grad_()
    x = leaf * 1  # the output layer's product: a non-leaf nobody else keeps
    seen = []
    x.register_hook(seen.append)
    loss = vocab_parallel_cross_entropy(x, labels, None, inplace_backward=True)
    (loss * dloss).sum().backward()
    ref_loss, ref_grad = _fp64_reference(logits, labels, dloss)
    _check(loss, leaf.grad, ref_loss, ref_grad, dtype)
    assert seen[0].data_ptr() == x.data_ptr() and torch.equal(x.detach(), seen[0])  # no logits-sized buffer

    y = logits.clone().requires_grad_()  # a leaf: the flag is ignored, the leaf keeps its values
    vocab_parallel_cross_entropy(y, labels, None, inplace_backward=True).sum().backward()
    assert torch.equal(y.detach(), logits)

    x = leaf * 1
    other = (x**2).sum()  # PowBackward saves x
    loss = vocab_parallel_cross_entropy(x, labels, None, inplace_backward=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()  # the cross-entropy (created later) runs first and overwrites x
    x = leaf * 1
    loss = vocab_parallel_cross_entropy(x, labels, None, inplace_backward=True).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
