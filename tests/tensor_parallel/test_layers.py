"""TP layers, the vocab-parallel loss and dropout RNG streams on 2 gloo ranks, against
their single-rank equivalents."""

import contextlib

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
from megatron_zpp.tensor_parallel.layers import TokenIdError, column_parallel_linear
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


# ---- sequence parallel: what the column-parallel product keeps, and its backward gather -------


def _product_worker(rank, world):
    """A column-parallel product under SP with a second, replicated weight sharing its input (GLA's
    low-rank gate) against one fp64 rank; the ledger: per product one all-gather forward, one again in
    the backward (the shard was kept) and one reduce-scatter of the input gradient."""
    from megatron_zpp import comm

    tp = build_groups(Topology(world, tp=world), rank).tp
    torch.manual_seed(0)
    B, S, H, N, R = 2, 8, 16, 24, 4
    x, w, down = torch.randn(B, S, H), torch.randn(N, H), torch.randn(R, H)
    x, w, down = x.double(), w.double(), down.double()
    xr, wr, dr = (t.clone().requires_grad_() for t in (x, w, down))
    gy, gd = torch.randn(B, S, N, dtype=torch.float64), torch.randn(B, S, R, dtype=torch.float64)
    y_ref, d_ref = F.linear(xr, wr), F.linear(xr, dr)
    ((y_ref * gy).sum() + (d_ref * gd).sum()).backward()

    col = ColumnParallelLinear(H, N, tp, 0.02, sequence_parallel=True).double()
    with torch.no_grad():
        col.weight.copy_(shard(w, col.weight.tp_split, tp.rank, tp.size))
    dp = down.clone().requires_grad_()
    xs = x.chunk(tp.size, dim=1)[tp.rank].clone().requires_grad_()
    comm.LEDGER.reset()
    y, d = col(xs, dp)
    loss = (y * gy.chunk(tp.size, dim=-1)[tp.rank]).sum() + (d * gd).sum() / tp.size
    with _backward_order() as order:
        loss.backward()
    torch.testing.assert_close(y, y_ref.chunk(tp.size, dim=-1)[tp.rank], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d, d_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs.grad, xr.grad.chunk(tp.size, dim=1)[tp.rank], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(col.weight.grad, shard(wr.grad, col.weight.tp_split, tp.rank, tp.size))
    partial = [torch.empty_like(dp.grad) for _ in range(tp.size)]  # the replicated weight: a partial sum
    torch.distributed.all_gather(partial, dp.grad, group=tp.handle)
    torch.testing.assert_close(sum(partial), dr.grad, rtol=1e-12, atol=1e-12)
    return {(k[1], k[2]): (r.bytes, r.calls) for k, r in comm.LEDGER.records.items()}, order


@contextlib.contextmanager
def _backward_order():
    """The matmuls and the starts and ends of comm.all_gather / reduce_scatter, in the order they ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_zpp import comm

    events = []

    class Ended:
        def __init__(self, handle, phase):
            self.handle, self.phase = handle, phase

        def wait(self):
            self.handle.wait()
            events.append(f"end {self.phase}")

    def logged(fn):
        def call(output, input, group, phase, **kw):
            events.append(f"start {phase}")
            handle = fn(output, input, group, phase, **kw)
            return Ended(handle, phase) if kw.get("async_op") else handle

        return call

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "bmm", "addmm"):
                events.append("mm")
            return func(*args, **(kwargs or {}))

    real = comm.all_gather, comm.reduce_scatter
    comm.all_gather, comm.reduce_scatter = logged(real[0]), logged(real[1])
    try:
        with Matmuls():
            yield events
    finally:
        comm.all_gather, comm.reduce_scatter = real


def test_sp_product_shares_one_input_and_gathers_it_again_in_the_backward():
    full = 2 * 8 * 16 * 8  # the gathered input [B, S, H] in fp64
    for ledger, order in run_distributed(_product_worker, 2):
        assert ledger == {
            ("sp_fwd_allgather", "all_gather"): (full / 2, 1),  # ring: (n - 1) / n of the gathered tensor
            ("sp_bwd_regather", "all_gather"): (full / 2, 1),
            ("sp_bwd_reducescatter", "reduce_scatter"): (full / 2, 1),
        }
        # the re-gather runs behind the input gradient's two matmuls, the reduce-scatter behind the weights'
        assert order == ["start sp_bwd_regather", "mm", "mm", "end sp_bwd_regather"] + [
            "start sp_bwd_reducescatter",
            "mm",
            "mm",
            "end sp_bwd_reducescatter",
        ]


def _saved(fn, skip):
    """Every tensor autograd saves while fn() runs, by storage (those in `skip` left out)."""
    out = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            out.setdefault(s.data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn()
    y.sum().backward()
    return out


def _block_worker(rank, world, kind, low_rank):
    """Bytes a transformer block saves for its backward, one rank against TP2 + SP; which storages the
    column-parallel products kept."""
    from megatron_zpp.model.context import ParallelContext
    from megatron_zpp.model.gpt import Block
    from megatron_zpp.model.rope import rope_tables
    from tests.old_defaults import old_model

    tp = build_groups(Topology(world, tp=world), rank).tp
    cfg = old_model(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        ffn_hidden_size=128,
        attention_type=kind,
        linear_chunk_size=8,
        gla_gate_low_rank=low_rank,
    )
    B, S, H = 2, 32, 64
    rope = rope_tables(cfg.head_dim, torch.arange(S), cfg.rotary_base)
    out = {}
    for name, ctx in (("tp1", ParallelContext()), ("tp2_sp", ParallelContext(tp=tp, sequence_parallel=True))):
        block = Block(cfg, 0, ctx)
        inputs = []
        for module in block.modules():
            if isinstance(module, ColumnParallelLinear):
                module.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
        skip |= {t.untyped_storage().data_ptr() for t in rope}  # the block's rope tables: given, not kept by it
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
        x = torch.randn(B, S // ctx.tp_size, H, requires_grad=True)
        saved = _saved(lambda: block(x, rope), skip)
        total = sum(t.untyped_storage().nbytes() for t in saved.values())
        kept = [saved.get(i.untyped_storage().data_ptr()) for i in inputs]
        gathered = []
        if name == "tp2_sp":  # no saved tensor holds a gathered input
            for i in inputs:
                parts = [torch.empty_like(i) for _ in range(world)]
                torch.distributed.all_gather(parts, i.contiguous(), group=tp.handle)
                full = torch.cat(parts, dim=1)
                same = [t for t in saved.values() if t.numel() == full.numel()]
                gathered += [t for t in same if torch.equal(t.reshape(full.shape), full)]
        nbytes = [t is not None and t.untyped_storage().nbytes() for t in kept]
        out[name] = {"total": total, "kept_inputs": nbytes, "gathered": len(gathered)}
    return out


@pytest.mark.parametrize("kind, low_rank", [("softmax", 0), ("gla", 4)], ids=["softmax", "gla_low_rank_gate"])
def test_sp_block_keeps_half_of_one_rank(kind, low_rank):
    """Under TP2 + SP every activation a block keeps is split over the 2 ranks: the norms' and the
    residual's on the sequence, the column-parallel products' inputs on the sequence too (the shard,
    gathered again in the backward), the rest on heads / the MLP width. So a rank keeps exactly half
    of what one rank keeps, but for the low-rank gate's down-projection output [B, S, R], which every
    TP rank computes whole. Saving the gathered inputs instead (as before) kept 2 x B (S/2) H e more."""
    B, S, H, e = 2, 32, 64, 4
    replicated = B * S * low_rank * e
    for r in run_distributed(_block_worker, 2, kind, low_rank):
        one, sp = r["tp1"], r["tp2_sp"]
        assert one["kept_inputs"] == [B * S * H * e] * 2  # qkv / proj_in and fc1 keep their inputs
        assert sp["kept_inputs"] == [B * (S // 2) * H * e] * 2  # ... as the sequence shard: half
        assert sp["gathered"] == 0
        assert sp["total"] == (one["total"] - replicated) // 2 + replicated


def _head_worker(rank, world):
    tp = build_groups(Topology(world, tp=world), rank).tp
    x = torch.randn(2, 8, 16, requires_grad=True)  # this rank's sequence shard
    weight = torch.nn.Parameter(torch.randn(32, 16))  # this rank's vocabulary rows
    saved = _saved(lambda: column_parallel_linear(x, weight, tp, True), {weight.untyped_storage().data_ptr()})
    return [(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), t.shape) for t in saved.values()]


def test_sp_output_layer_keeps_only_the_shard():
    """The tied output layer's product (the largest input kept: the logits' rows) keeps the shard alone."""
    for saved in run_distributed(_head_worker, 2):
        assert saved == [(True, torch.Size([2, 8, 16]))]
