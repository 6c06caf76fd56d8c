"""--torch-compile with --kernels triton. Every kernel launch is a custom op (ops/dispatch.kernel_op): an
opaque node of the compiled graph, and shapes only under FakeTensorMode.

- A tiny hybrid GPT compiled as --torch-compile compiles it (training/builders.compile_model: each block
  and the cross-entropy), the kernels running in the interpreter inside the compiled code, equals the
  same model eager on the kernels: loss and every gradient.
- Each custom op passes torch.library.opcheck: its schema (what it mutates), and its fake against the
  real kernel (shapes, dtypes, devices, strides), also traced by AOTAutograd with dynamic shapes.
- A model step runs under FakeTensorMode on the kernel path (a scale dry run's need).
- --torch-compile --kernels triton passes validation.

Cost: about 60 s of CPU for the file, 45 s of it inductor's first compile of the step's 3 graphs (cold
cache; about 6 s when /tmp/torchinductor_* holds them).
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.kernels import cross_entropy, gla, norm, quantize, rope, swiglu
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.ops import dispatch
from megatron_zpp.ops import quantize as qz
from megatron_zpp.training.builders import compile_model
from megatron_zpp.validation import validate
from tests.old_defaults import old_model
from tests.test_training import TINY

CFG = old_model(
    num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=32, vocab_size=64,
    attention_type="gla", softmax_attention_every=2, linear_chunk_size=16,
)  # fmt: skip
VOCAB = 64
# the launch wrappers the model step calls (the quantizers belong to the ZeRO engines, outside the model)
MODEL_LAUNCHES = {
    gla: ("fwd_states", "fwd_output", "bwd"),
    norm: ("norm_fwd", "norm_bwd"),
    rope: ("rope",),
    swiglu: ("swiglu_fwd", "swiglu_bwd"),
    cross_entropy: ("ce_fwd_stats", "ce_bwd"),
}


def batch():
    data = torch.randint(0, VOCAB, (2, CFG.seq_length + 1), generator=torch.Generator().manual_seed(0))
    return data[:, :-1], data[:, 1:]


def loss_and_grads(compiled: bool):
    model = GPT(CFG, VOCAB)
    init_weights(model, seed=3)
    if compiled:
        compile_model([model], CFG.seq_length)
    loss = model(*batch()).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def count_launches(monkeypatch) -> dict[str, int]:
    """Counts each launch wrapper's calls (the custom ops look them up at call time)."""
    calls = {}
    for module, names in MODEL_LAUNCHES.items():
        for name in names:
            launch = getattr(module, name)

            def counted(*args, key=f"{module.__name__}.{name}", launch=launch, **kw):
                calls[key] = calls.get(key, 0) + 1
                return launch(*args, **kw)

            monkeypatch.setattr(module, name, counted)
    return calls


def test_compiled_step_on_kernels_equals_eager_on_kernels(monkeypatch):
    loss_e, grads_e = loss_and_grads(compiled=False)
    counters.clear()
    calls = count_launches(monkeypatch)
    loss_c, grads_c = loss_and_grads(compiled=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    expected = {f"{m.__name__}.{n}" for m, names in MODEL_LAUNCHES.items() for n in names}
    assert set(calls) == expected, f"launches not run in the compiled step: {expected - set(calls)}"
    assert torch.allclose(loss_c, loss_e, rtol=1e-6, atol=0), (loss_c, loss_e)  # measured: bitwise
    for name, g in grads_e.items():  # measured: at most 2.1e-7 (inductor reorders the fp32 torch code around)
        err = ((grads_c[name] - g).norm() / g.norm()).item()
        assert err < 2e-6, f"{name}: compiled vs eager relative gradient difference {err:.1e}"


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN, dtype=dtype)


GEN = torch.Generator().manual_seed(1)


def _gla_args():
    B, T, H, K, C = 1, 32, 2, 16, 16
    q, k, v = (_randn(B, T, H, K) for _ in range(3))
    g = -torch.rand(B, T, H, K, generator=GEN)
    h0, dS = _randn(B, H, K, K), _randn(B, H, K, K)
    states = _randn(B, H, T // C, K, K)
    return q, k, v, g, h0, dS, states, C


def _wire(r: int, m: int, block: int, bits: int):
    x = _randn(r, m)
    buf = torch.empty(r, qz.wire_bytes(m, block, bits), dtype=torch.uint8)
    quantize.quantize(x, m, 0, m, r, m, buf, block, bits, None)
    return x, buf


def sample_calls():
    """op name -> argument lists, covering its optional inputs."""
    q, k, v, g, h0, dS, states, C = _gla_args()
    x, w, b = _randn(6, 32), _randn(32), _randn(32)
    mean, rstd = _randn(6), torch.rand(6, generator=GEN) + 0.5
    x_rope, cs = _randn(2, 4, 3, 8), _randn(4, 8)
    h = _randn(6, 16)
    logits, labels = _randn(5, 12), torch.tensor([0, 11, 3, -1, 20])
    m, block, bits, rows = 64, 16, 4, 2
    x_q, buf = _wire(3, m, block, bits)
    x_g, w_g, dy_g, offsets = _randn(8, 16), _randn(3, 16, 24), _randn(8, 24), torch.tensor([0, 3, 3, 8])
    routed, probs = _randn(7, 16), torch.rand(7, generator=GEN)
    token, inv = (
        torch.tensor([0, 2, 4, 1, 3, 4, 5]),
        torch.tensor([[0, -1], [3, -1], [1, -1], [4, -1], [2, 5], [6, -1]]),
    )
    kda_gate = -torch.rand(*q.shape, generator=GEN)  # per channel
    kda_args = (q, k, v, kda_gate, g[..., 1].sigmoid())
    return {
        "moe_gather_rows": [(x_g, token, None, torch.float32), (x_g, token, probs, torch.bfloat16)],
        "moe_slot_sum": [(routed, inv, None, torch.float32), (routed, inv, probs, torch.bfloat16)],
        "kda_fwd": [(*kda_args, None, 0.25, C), (*kda_args, h0, 0.25, C)],
        "kda_bwd": [(*kda_args, h0, v, dS, 0.25, C), (*kda_args, None, None, dS, 0.25, C)],
        "grouped_mm_fwd": [(x_g, w_g, offsets, False), (dy_g, w_g, offsets, True)],
        "grouped_mm_wgrad": [(x_g, dy_g, offsets, torch.float32)],
        "gla_fwd_states": [(k, v, g, None, C), (k, v, g, h0, C)],
        "gla_fwd_output": [(q, k, v, g, states, 0.25, C)],
        "gla_bwd": [(q, k, v, g, h0, v, dS, 0.25, C, None), (q, k, v, g, None, None, dS, 0.25, C, states)],
        "gdn_fwd": [
            (q, k, v, g[..., 0], g[..., 1].sigmoid(), None, 0.25, C),
            (q, k, v, g[..., 0], g[..., 2].sigmoid(), h0, 0.25, C),
        ],
        "gdn_bwd": [
            (q, k, v, g[..., 0], g[..., 1].sigmoid(), h0, v, dS, 0.25, C),
            (q, k, v, g[..., 0], g[..., 1].sigmoid(), None, None, dS, 0.25, C),
        ],
        "norm_fwd": [(x, w, None, 1e-5), (x, w, b, 1e-5)],
        "norm_bwd": [(x, x, w, None, rstd), (x, x, w, mean, rstd)],
        "rope": [(x_rope, cs, cs, False), (x_rope, cs, cs, True)],
        "rope_": [(x_rope.clone(), cs, cs)],
        "swiglu_fwd": [(h,)],
        "swiglu_bwd": [(h[:, :8].contiguous(), h)],
        "cross_entropy_stats": [(logits, labels)],
        "cross_entropy_grad": [(logits, labels, _randn(5), _randn(5))],
        "cross_entropy_grad_": [(logits.clone(), labels, _randn(5), _randn(5))],
        "quantize_wire": [
            (x_q, torch.empty_like(buf), block, bits, None),
            (x_q, torch.empty_like(buf), block, bits, 7),
        ],
        "dequantize_wire": [(buf, torch.empty(3, m), m, block, bits)],
        "dequantize_sum_wire": [(buf, torch.zeros(m), m, block, bits, True)],
        "dequantize_sum_quantize_wire": [
            (
                buf,
                torch.empty(rows, qz.wire_bytes(m // rows, block, bits), dtype=torch.uint8),
                m,
                rows,
                block,
                block,
                bits,
                None,
            )
        ],
    }


CALLS = sample_calls()


def test_every_kernel_op_is_checked():
    assert set(CALLS) == set(dispatch.KERNEL_OPS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_kernel_op_schema_and_fake_match_the_kernel(name):
    for args in CALLS[name]:
        torch.library.opcheck(
            dispatch.KERNEL_OPS[name], args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
        )


class KernelOpsSeen(TorchDispatchMode):
    """Records which of our custom ops run (on fake tensors: their fakes)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == dispatch.LIBRARY:
            self.seen.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_model_step_under_fake_tensor_mode():
    with FakeTensorMode(), KernelOpsSeen() as ops:
        model = GPT(CFG, VOCAB)
        tokens, labels = (t.clone() for t in batch())
        loss = model(tokens, labels).mean()
        loss.backward()
    for name, p in model.named_parameters():
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
    # the quantizers are ZeRO's; the model's loss writes its logits' gradient in place (cross_entropy_grad_)
    # GDN's ops run only in a model with Gated DeltaNet layers (the test below)
    # the GPT step below runs neither the ZeRO++ wire ops, GDN, KDA nor the experts' ops (the MoE test below)
    model_ops = {
        name for name in dispatch.KERNEL_OPS if not any(s in name for s in ("wire", "gdn", "kda", "grouped_mm", "moe_"))
    }
    model_ops -= {"cross_entropy_grad"}
    assert ops.seen == model_ops, model_ops - ops.seen


def test_gdn_model_step_under_fake_tensor_mode():
    """A GDN hybrid's step on fake tensors runs Gated DeltaNet's kernel ops (their fakes), forward and backward."""
    cfg = old_model(
        num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=32, vocab_size=64,
        attention_type="gdn", softmax_attention_every=2, linear_chunk_size=16,
    )  # fmt: skip
    with FakeTensorMode(), KernelOpsSeen() as ops:
        model = GPT(cfg, VOCAB)
        tokens, labels = (t.clone() for t in batch())
        model(tokens, labels).mean().backward()
    assert all(p.grad.shape == p.shape for p in model.parameters())
    assert {"gdn_fwd", "gdn_bwd"} <= ops.seen, ops.seen


def test_moe_model_step_under_fake_tensor_mode():
    """A MoE GPT's step on fake tensors (--moe-grouped-gemm) runs the experts' grouped GEMM and the token
    permutation's kernel ops (their fakes), forward and backward: no host sync on the dropless path."""
    cfg = old_model(
        num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=32, vocab_size=64, num_experts=4,
        moe_router_topk=2, moe_grouped_gemm=True,
    )  # fmt: skip
    with FakeTensorMode(), KernelOpsSeen() as ops:
        model = GPT(cfg, VOCAB)
        tokens, labels = (t.clone() for t in batch())
        model(tokens, labels).mean().backward()
    assert all(p.grad.shape == p.shape for p in model.parameters())
    assert {"grouped_mm_fwd", "grouped_mm_wgrad", "moe_gather_rows", "moe_slot_sum"} <= ops.seen, ops.seen


def test_quantizers_under_fake_tensor_mode():
    """The wire functions as ZeRO++ calls them, shapes only; stochastic rounding draws its seed for real."""
    m, block, bits = 256, 32, 4
    gen = torch.Generator().manual_seed(0)
    with FakeTensorMode(), KernelOpsSeen() as ops:
        x = torch.randn(4, m)
        wire = qz.quantize_wire(x, block, bits, stochastic=True, generator=gen)
        assert wire.shape == (4, qz.wire_bytes(m, block, bits)) and wire.dtype == torch.uint8
        assert qz.dequantize_wire(wire, m, block, bits, torch.empty(4, m, dtype=torch.bfloat16)).shape == (4, m)
        assert qz.dequantize_sum_wire(wire, m, block, bits, torch.empty(m)).shape == (m,)
        hop = qz.dequantize_sum_quantize_wire(wire, m, block, bits, 2, block, stochastic=True, generator=gen)
        assert hop.shape == (2, qz.wire_bytes(m // 2, block, bits))
    assert ops.seen == {name for name in dispatch.KERNEL_OPS if "wire" in name}


def test_compile_with_triton_kernels_is_accepted():
    validate(parse_args(TINY + ["--attention-type", "gla", "--torch-compile", "--kernels", "triton"]), 1)
