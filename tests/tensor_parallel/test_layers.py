"""TP layers, the vocab-parallel loss and dropout RNG streams on 2 gloo ranks, against
their single-rank equivalents."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.ops import dispatch
from megatron_zpp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard,
    vocab_parallel_cross_entropy,
)
from megatron_zpp.tensor_parallel.layers import TokenIdError
from megatron_zpp.tensor_parallel.random import ShardedDropout, seed_parallel_rng
from megatron_zpp.topology import Topology, build_groups
from tests.dist import run_distributed


def _layers_worker(rank, world):
    tp = build_groups(Topology(world, tp=world), rank).tp
    torch.manual_seed(0)  # same full tensors on every rank
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    w1, w2 = torch.randn(24, 16, dtype=torch.float64), torch.randn(16, 24, dtype=torch.float64)
    emb, labels = torch.randn(32, 16, dtype=torch.float64), torch.randint(0, 32, (2, 8))
    ids = torch.randint(0, 32, (2, 8))

    # reference on one rank
    xr = x.clone().requires_grad_()
    ref = F.linear(F.linear(xr, w1), w2)
    ref.sum().backward()

    col, row = ColumnParallelLinear(16, 24, tp, 0.02).double(), RowParallelLinear(24, 16, tp, 0.02).double()
    with torch.no_grad():
        col.weight.copy_(shard(w1, col.weight.tp_split, tp.rank, tp.size))
        row.weight.copy_(shard(w2, row.weight.tp_split, tp.rank, tp.size))
    xp = x.clone().requires_grad_()
    out = row(col(xp))
    out.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xp.grad, xr.grad, rtol=1e-12, atol=1e-12)

    # gather_output: every rank gets the full output of a column-parallel layer
    col_full = ColumnParallelLinear(16, 24, tp, 0.02, gather_output=True).double()
    with torch.no_grad():
        col_full.weight.copy_(col.weight)
    xg = x.clone().requires_grad_()
    full = col_full(xg)
    torch.testing.assert_close(full, F.linear(x, w1), rtol=1e-12, atol=1e-12)
    full.sum().backward()
    torch.testing.assert_close(xg.grad, torch.ones(2, 8, 24, dtype=torch.float64) @ w1, rtol=1e-12, atol=1e-12)

    # sequence parallel: input and output sharded along the sequence (dim 1)
    col_sp, row_sp = (
        ColumnParallelLinear(16, 24, tp, 0.02, sequence_parallel=True).double(),
        RowParallelLinear(24, 16, tp, 0.02, sequence_parallel=True).double(),
    )
    with torch.no_grad():
        col_sp.weight.copy_(col.weight)
        row_sp.weight.copy_(row.weight)
    xs = x.chunk(tp.size, dim=1)[tp.rank].clone().requires_grad_()
    out_sp = row_sp(col_sp(xs))
    torch.testing.assert_close(out_sp, ref.chunk(tp.size, dim=1)[tp.rank], rtol=1e-12, atol=1e-12)
    out_sp.sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad.chunk(tp.size, dim=1)[tp.rank], rtol=1e-12, atol=1e-12)

    # vocab-parallel embedding and cross-entropy
    e = VocabParallelEmbedding(32, 16, tp, 0.02).double()
    with torch.no_grad():
        e.weight.copy_(shard(emb, e.weight.tp_split, tp.rank, tp.size))
    torch.testing.assert_close(e(ids), F.embedding(ids, emb), rtol=1e-12, atol=1e-12)
    for bad in (32, -1):  # every TP rank refuses it (without TP > 1 zeroing it silently), before any collective
        with pytest.raises(TokenIdError, match=f"token id {bad} in the batch is outside the embedding's 32 rows"):
            e(ids.masked_fill(ids == ids[0, 3], bad))
    logits = torch.randn(2, 8, 32, dtype=torch.float64)
    lr = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(lr.view(-1, 32), labels.view(-1), reduction="none").view(2, 8)
    (ref_loss * torch.arange(16.0, dtype=torch.float64).view(2, 8)).sum().backward()
    lp = logits.chunk(tp.size, dim=-1)[tp.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(lp, labels, tp)
    (loss * torch.arange(16.0, dtype=torch.float64).view(2, 8)).sum().backward()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)  # computed in fp32
    torch.testing.assert_close(lp.grad, lr.grad.chunk(tp.size, dim=-1)[tp.rank], rtol=1e-5, atol=1e-6)
    # the same through the Triton kernels (interpreter): fp32 logits, labels at both edges of both slices
    edge_labels = labels.clone().view(-1)
    edge_labels[:4] = torch.tensor([0, 15, 16, 31])
    lr.grad = None
    ref_loss = F.cross_entropy(lr.view(-1, 32), edge_labels, reduction="none").view(2, 8)
    (ref_loss * torch.arange(16.0, dtype=torch.float64).view(2, 8)).sum().backward()
    dispatch.set_kernels("triton", torch.device("cpu"))
    lk = logits.float().chunk(tp.size, dim=-1)[tp.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(lk, edge_labels.view(2, 8), tp)
    (loss * torch.arange(16.0).view(2, 8)).sum().backward()
    dispatch.set_kernels("auto", torch.device("cpu"))
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lk.grad.double(), lr.grad.chunk(tp.size, dim=-1)[tp.rank], rtol=1e-5, atol=1e-6)

    # dropout streams: replicated activations share masks over TP, sharded ones do not
    seed_parallel_rng(5, tp.rank, 0, 0, torch.device("cpu"))
    ones = torch.ones(4096)
    same = F.dropout(ones, 0.5)
    sharded = ShardedDropout(0.5)(ones)
    both = torch.stack([same, sharded])
    gathered = [torch.empty_like(both) for _ in range(tp.size)]
    torch.distributed.all_gather(gathered, both, group=tp.handle)
    return torch.equal(gathered[0][0], gathered[1][0]), torch.equal(gathered[0][1], gathered[1][1])


def test_tp_layers_loss_and_rng_match_single_rank():
    for same_replicated, same_sharded in run_distributed(_layers_worker, 2):
        assert same_replicated and not same_sharded
