"""The Gated DeltaNet layer against a token-by-token fp64 reference of the whole layer
(convolution with document resets, the delta-rule recurrence, norm, gate)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import ParallelContext, init_weights
from megatron_zpp.model.documents import Documents
from megatron_zpp.model.gated_deltanet import GatedDeltaNet
from megatron_zpp.model.init import RankInit, materialize
from megatron_zpp.pipeline_parallel import build_rank_chunks, stand_in_context
from megatron_zpp.tensor_parallel.layers import unshard
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.model import assert_matches_with_grads
from tests.old_defaults import OLD_DEFAULTS, old_model


def token_loop_gdn(layer: GatedDeltaNet, x: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """The layer token by token in the input's dtype, from the paper and megatron-core's head layout: value head j
    reads key head j // (H / Hk); q, k normalised as fla's l2norm, x / sqrt(sum x^2 + 1e-6)."""
    B, T, _ = x.shape
    Hk, H, K, V = layer.key_heads, layer.heads, layer.key_dim, layer.head_dim
    h = x @ layer.proj_in.weight.T
    qkv, gate, a, b = h.split([2 * Hk * K + H * V, H * V, H, H], dim=-1)
    out = torch.zeros_like(qkv)
    kernel = layer.conv.shape[1]
    for t in range(T):  # the conv: taps over earlier tokens of the same document only
        for j in range(kernel):
            s = t - j
            if s >= 0 and bool((doc[:, s] == doc[:, t]).all()):
                out[:, t] += qkv[:, s] * layer.conv[:, kernel - 1 - j]
    q, k, v = F.silu(out).split([Hk * K, Hk * K, H * V], dim=-1)
    q, k = (t.view(B, T, Hk, K) / (t.view(B, T, Hk, K).square().sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))
    group = torch.arange(H) // (H // Hk)  # the key head of each value head
    q, k, v = q[:, :, group], k[:, :, group], v.view(B, T, H, V)
    decay = (-layer.A_log.exp() * F.softplus(a + layer.dt_bias)).exp()
    beta = b.sigmoid()
    S = torch.zeros(B, H, K, V, dtype=x.dtype)
    eye = torch.eye(K, dtype=x.dtype)
    outs = []
    for t in range(T):
        if t > 0 and bool((doc[:, t] != doc[:, t - 1]).all()):
            S = torch.zeros_like(S)
        kt, bt = k[:, t], beta[:, t, :, None, None]
        P = eye - bt * kt[..., :, None] * kt[..., None, :]
        S = decay[:, t, :, None, None] * (P @ S) + bt * kt[..., :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * K**-0.5)
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.head_norm  # one [V] weight, every head
    return (o.reshape(B, T, H * V) * F.silu(gate)) @ layer.proj_out.weight.T


@pytest.mark.parametrize("heads", [(2, 2, 16, 16), (2, 4, 8, 12)], ids=["plain", "grouped_k_ne_v"])
def test_gdn_layer_matches_token_loop(heads):
    """One value head per key head at K = V, and Megatron's layout scaled down: 2 key heads of K = 8, 4 value heads
    of V = 12."""
    Hk, H, K, V = heads
    cfg = old_model(hidden_size=32, num_attention_heads=2, linear_chunk_size=8, attention_type="gdn")
    cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim = heads
    layer = GatedDeltaNet(cfg, ParallelContext(), out_std=0.02)
    assert (layer.key_heads, layer.heads, layer.key_dim, layer.head_dim) == heads
    assert tuple(layer.head_norm.shape) == (V,)
    init_weights(layer, seed=3)
    layer = layer.double()
    with torch.no_grad():  # other values than the init's, so that every parameter matters
        layer.head_norm.uniform_(0.5, 1.5)
        layer.A_log.uniform_(-1, 1)
        layer.dt_bias.uniform_(-1, 1)
        layer.conv.normal_(0, 0.5)
    T = 21  # not a multiple of the chunk: the padded tail
    doc = torch.tensor([[0] * 10 + [1] * 9 + [2] * 2])
    x = torch.randn(1, T, 32, dtype=torch.float64, requires_grad=True)
    out, ref = layer(x, documents=Documents(doc_ids=doc)), token_loop_gdn(layer, x, doc)
    assert_matches_with_grads(layer, x, out, ref, (1e-9, 1e-11), (1e-8, 1e-11))


def test_conv_init_is_conv1ds_default():
    """The depthwise convolution starts as nn.Conv1d's default (kaiming_uniform, a = sqrt(5)): U(+-1/sqrt(kernel)),
    as megatron-core's and fla's; over 4096 x 4 draws: the range, mean and variance (kernel / 3 ... 1/12 of 1)."""
    with torch.device("meta"):
        layer = GatedDeltaNet(old_model(hidden_size=2048, num_attention_heads=2), ParallelContext(), 0.02)
    conv = torch.empty(layer.conv.shape)
    RankInit([layer], 5, 0, 1, torch.device("cpu")).fill(layer.conv, conv.view(-1))
    ref = torch.nn.Conv1d(8, 8, kernel_size=4, groups=8).weight  # [8, 1, 4]: the bound torch draws from
    bound = 1 / math.sqrt(4)
    assert ref.abs().max() <= bound and conv.abs().max() <= bound and conv.abs().max() > 0.99 * bound
    assert abs(conv.mean().item()) < 0.01 and abs(conv.var().item() - bound**2 / 3) < 0.003  # sd of var ~ 9e-4


def test_gate_init_draws_megatrons_A_range_and_flas_dt():
    """A = exp(A_log) ~ U(1, 16) (megatron-core's A_init_range) and softplus(dt_bias) = dt with
    log dt ~ U(log 1e-3, log 0.1) (fla's GatedDeltaNet), over 4096 heads; seeded by name."""
    heads = 4096
    with torch.device("meta"):  # shapes only: the projections of 4096 heads are not allocated
        layer = GatedDeltaNet(old_model(hidden_size=2 * heads, num_attention_heads=heads), ParallelContext(), 0.02)

    def drawn(seed):
        init = RankInit([layer], seed, 0, 1, torch.device("cpu"))
        out = {}
        for name in ("A_log", "dt_bias"):
            out[name] = torch.empty(heads)
            init.fill(getattr(layer, name), out[name])
        return out

    got = drawn(seed=5)
    A = got["A_log"].double().exp()
    assert 1 <= A.min() < 1.05 and 15.95 < A.max() <= 16 and abs(A.mean().item() - 8.5) < 0.3  # sd of mean 0.07
    assert abs((A < 4.75).double().mean().item() - 0.25) < 0.03  # uniform: a quarter below the first quartile
    log_dt = F.softplus(got["dt_bias"].double()).log()  # the forward's softplus undoes the init's inverse
    lo, hi = math.log(1e-3), math.log(0.1)
    assert lo - 1e-5 <= log_dt.min() < lo + 0.05 and hi - 0.05 < log_dt.max() <= hi + 1e-5
    assert abs(log_dt.mean().item() - (lo + hi) / 2) < 0.1  # log-uniform (sd of the mean 0.02)
    assert abs((log_dt < lo + (hi - lo) / 4).double().mean().item() - 0.25) < 0.03
    again, other = drawn(seed=5), drawn(seed=6)
    assert all(torch.equal(got[n], again[n]) and not torch.equal(got[n], other[n]) for n in got)
    assert not torch.equal(got["A_log"], got["dt_bias"])  # each parameter has its own generator


GROUPED = "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 8 --linear-value-head-dim 12"


def test_tp2_weights_are_slices_of_the_tp1_weights():
    """Every parameter of a GDN hybrid (2 key heads, 4 value heads, K != V) built for TP rank 0 and 1 of TP2
    reassembles to the TP1 model's, the per-value-head gate parameters are the TP1 heads' halves, and the shared
    norm weight is whole on each rank."""
    flags = "--mock-data --attention-type gdn --softmax-attention-every 2 --num-layers 2 --hidden-size 32"
    flags += " --num-attention-heads 4 --vocab-size 64 --make-vocab-size-divisible-by 1 " + GROUPED

    def weights(tp, tp_rank):
        cfg = parse_args([*flags.split(), "--tensor-model-parallel-size", str(tp)])
        chunks = build_rank_chunks(cfg, 64, 0, stand_in_context(cfg, tp_rank))
        materialize(chunks, RankInit(chunks, 9, tp_rank, tp, torch.device("cpu")))
        return dict(chunks[0].named_parameters())

    full, pieces = weights(1, 0), [weights(2, r) for r in range(2)]
    assert full["layers.0.mixer.A_log"].abs().min() > 0  # the gate init is drawn, not zeros
    for name, p in full.items():
        if p.tp_split is None:  # replicated: each rank holds the whole
            assert all(torch.equal(r[name], p) for r in pieces), name
        else:
            assert torch.equal(unshard([r[name] for r in pieces], p.tp_split), p), name
    for name in ("layers.0.mixer.A_log", "layers.0.mixer.dt_bias"):
        assert torch.equal(pieces[1][name], full[name][2:]) and torch.equal(pieces[0][name], full[name][:2])
    assert full["layers.0.mixer.head_norm"].shape == (12,) and pieces[1]["layers.0.mixer.head_norm"].shape == (12,)
    conv = full["layers.0.mixer.conv"]  # q | k (2 key heads of 8) | v (4 value heads of 12): rank 1's halves of each
    want = torch.cat([conv[8:16], conv[24:32], conv[56:80]])
    assert torch.equal(pieces[1]["layers.0.mixer.conv"], want)


def _losses(rank, world, argv):
    return [h["loss"] for h in training.train(training.setup(validate(parse_args(argv), world)))]


def test_grouped_heads_any_length_under_tp_and_cp_equal_one_rank():
    """A GDN hybrid with grouped value heads and K != V, at a sequence that is no multiple of the chunk (40 tokens
    in chunks of 16; CP2: slices of 20): TP2 x SP and CP2 train 2 steps to the single rank's losses. Its norms are
    Megatron's default LayerNorm with 1p, the GDN output norm too (megatron-core's out_norm: a zero-centred [V]
    weight and a [V] bias, replicated over TP, their gradients partial sums per TP rank); test_parity runs the
    plain RMSNorm one under every layout."""
    argv = (
        OLD_DEFAULTS
        + (
            "--mock-data --hidden-size 32 --num-attention-heads 4 --seq-length 40 --vocab-size 128 --num-layers 2 "
            "--make-vocab-size-divisible-by 32 --attention-type gdn --softmax-attention-every 2 --linear-chunk-size 16 "
            "--global-batch-size 2 --micro-batch-size 1 --seed 7 --device cpu --train-iters 2 --lr 1e-2 "
            "--init-method-std 0.2 --normalization LayerNorm --apply-layernorm-1p " + GROUPED
        ).split()
    )
    one = run_distributed(_losses, 1, argv)[0]
    for layout in ("--context-parallel-size 2", "--tensor-model-parallel-size 2 --sequence-parallel"):
        got = run_distributed(_losses, 2, argv + layout.split())[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=1e-5, atol=0, msg=layout)


MEGATRON_LAYOUT, K_NE_V = (2, 4, 16, 16), (2, 4, 8, 12)


@pytest.mark.parametrize(
    "heads,norm",
    [
        (MEGATRON_LAYOUT, "RMSNorm"),
        (K_NE_V, "RMSNorm"),
        (K_NE_V, "RMSNorm 1p"),
        (K_NE_V, "LayerNorm"),
        (K_NE_V, "LayerNorm 1p"),
    ],
    ids=["megatron_layout", "k_ne_v", "rmsnorm_1p", "layernorm", "layernorm_1p"],
)
def test_gdn_layer_equals_megatron_cores(heads, norm):
    """megatron-core 0.19.2's GatedDeltaNet, run on CPU with our weights (checkpoint/formats/mcore_gdn.py's map),
    gives our layer's output and every gradient in fp64 to 1e-12: at Megatron's default layout scaled down (2 key
    heads, 4 value heads: its 16/32) with K = V and with K != V, and its out_norm under each --normalization with
    and without --apply-layernorm-1p (a LayerNorm with a bias; the weight applied as 1 + w, initialised 0). Its
    delta rule is our token loop in fp64 (fla's kernels need a GPU; see testing/peers/megatron_gdn.py, also for
    Transformer Engine's zero-centred norm); our layer runs the chunked op."""
    from megatron_zpp.ops.gdn_naive import naive_recurrent_gdn
    from megatron_zpp.testing.peers.megatron_gdn import load_from_ours, mcore_gdn_cpu, mcore_gdn_layer

    cfg = old_model(hidden_size=32, num_attention_heads=2, linear_chunk_size=8, attention_type="gdn")
    cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim = heads
    cfg.normalization, one_p = norm.split()[0], norm.endswith("1p")
    cfg.apply_layernorm_1p = one_p
    ours = GatedDeltaNet(cfg, ParallelContext(), out_std=0.02)
    init_weights(ours, seed=4)
    assert bool((ours.head_norm == (0 if one_p else 1)).all())  # megatron-core's init: the gain starts at 1
    assert (ours.head_norm_bias is not None) == (cfg.normalization == "LayerNorm")
    ours = ours.double()
    with torch.no_grad():  # away from the init's ones and narrow ranges: every parameter matters
        ours.head_norm.uniform_(0.5, 1.5)
        if ours.head_norm_bias is not None:
            ours.head_norm_bias.normal_(0, 0.5)
        ours.A_log.uniform_(-1, 1)
        ours.dt_bias.uniform_(-1, 1)
        ours.proj_in.weight.normal_(0, 0.3)
    with mcore_gdn_cpu():
        ref = mcore_gdn_layer(cfg, lambda q, k, v, g, beta: naive_recurrent_gdn(q, k, v, g, beta)[0])
        load_from_ours(ref, ours, cfg)
        x = torch.randn(2, 24, 32, dtype=torch.float64, requires_grad=True)
        out = ours(x)
        theirs, bias = ref(x.transpose(0, 1), attention_mask=None)  # megatron-core: [T, B, hidden]
        theirs = theirs.transpose(0, 1)
        assert bias is None
        torch.testing.assert_close(out, theirs, rtol=1e-12, atol=1e-12)
        mine = torch.autograd.grad(out.square().sum(), [x, *(p for _, p in ours.named_parameters())])
        peer = dict(zip(["x", *(n for n, _ in ref.named_parameters())],
                        torch.autograd.grad(theirs.square().sum(), [x, *ref.parameters()])))  # fmt: skip
    from megatron_zpp.checkpoint.formats.mcore_gdn import gdn_from_mcore

    back = gdn_from_mcore({k: v for k, v in peer.items() if k != "x"}, cfg)  # their gradients in our layout
    torch.testing.assert_close(mine[0], peer["x"], rtol=1e-12, atol=1e-12)
    for (name, _), got in zip(ours.named_parameters(), mine[1:]):
        torch.testing.assert_close(got, back[name], rtol=1e-12, atol=1e-12, msg=name)


def test_init_branch_reaches_the_head_norm_above_its_eps():
    """At init (hidden 1024, 8 heads of 128, 256 tokens of unit-RMS input) the op's output reaches the head RMSNorm
    at a mean square above its eps 1e-5: norm gain sqrt(ms / (ms + eps)) about 0.74, megatron-core's 0.743 (its
    nn.Conv1d init); with the convolution drawn N(0, init std), as before, about 0.07 (ms 5e-8: the mixers started
    10x weaker)."""
    cfg = old_model(hidden_size=1024, num_attention_heads=8, attention_type="gdn", linear_chunk_size=64)
    x = torch.randn(2, 256, 1024, generator=torch.Generator().manual_seed(0))
    gains = {}
    for conv in ("uniform", "normal"):
        layer = GatedDeltaNet(cfg, ParallelContext(), out_std=0.02)
        if conv == "normal":
            layer.conv.init = ("normal", cfg.init_method_std)
        init_weights(layer, seed=1234)
        mix, seen = layer._mix, []

        def recording(*a, mix=mix, seen=seen):
            seen.append(mix(*a))
            return seen[-1]

        layer._mix = recording
        with torch.no_grad():
            layer(x)
        ms = seen[0].square().mean().item()
        gains[conv] = (ms / (ms + cfg.norm_epsilon)) ** 0.5
    print(f"head-norm gain at init: {gains['uniform']:.3f} (nn.Conv1d's init), {gains['normal']:.3f} (N(0, 0.02))")
    assert 0.6 < gains["uniform"] < 0.9 and gains["normal"] < 0.1
