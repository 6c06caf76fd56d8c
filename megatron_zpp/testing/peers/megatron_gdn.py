"""megatron-core's `GatedDeltaNet` (megatron/core/ssm/gated_delta_net) on CPU, one rank, as the tests' peer for our
layer: its own projections (local ColumnParallelLinear / RowParallelLinear), its split of q | k | v | z | beta | alpha,
its depthwise conv1d (the deterministic path: F.conv1d), its q/k L2 norm and repeat_interleave to the value heads,
its gates and its output norm and gate, loaded with one of our layers' weights (checkpoint/formats/mcore_gdn.py).
Its out_norm is built as megatron-core builds it from the config (--normalization, --apply-layernorm-1p as
layernorm_zero_centered_gamma): Transformer Engine's norm (TENorm) on Megatron-LM's spec, torch's (WrappedTorchNorm)
without it, which refuses zero_centered_gamma; TE needs a GPU, so `TENorm` stands in for it by its formula.

Shims (`mcore_gdn_cpu`), none of its layer arithmetic touched:
- `torch.cuda.current_device()` -> 'cpu' (where it allocates);
- the TP and CP groups are groups of one (its collectives and all-to-alls pass through), handed to its TP
  mappings as given (`get_tensor_model_parallel_group_if_none` would ask megatron's global parallel state);
- `Tensor.float()` keeps an fp64 tensor fp64 (its casts of alpha and the output gate to fp32 would round them in an
  fp64 check; for bf16 models both layers compute those in fp32);
- torch.compile (its jit_fuser on the norm, the input preparation and the gates) runs eagerly (dynamo disabled);
- fla's Triton kernels, which need a GPU, give way to references of what they compute: its l2norm is
  x / sqrt(sum x^2 + eps) with fla's default eps 1e-6 (fla/modules/norm/l2norm.py), and the delta rule is the
  token loop `delta_rule` passed in (the caller's reference of the op, in the inputs' dtype: fla's naive loop and
  megatron-core's torch chunk both compute in fp32)."""

from __future__ import annotations

import contextlib
import importlib
import types
from unittest import mock

import torch
import torch.nn.functional as F

from ...checkpoint.formats.mcore_gdn import gdn_to_mcore


class TENorm:
    """Transformer Engine's RMSNorm / LayerNorm as megatron-core's TENorm builds it (the config's normalization,
    zero_centered_gamma=config.layernorm_zero_centered_gamma), by TE's documented formula: torch's norm (what
    WrappedTorchNorm builds), its gamma applied as 1 + gamma when zero-centred (TE: "the LayerNorm formula changes
    to y = (x - E[x]) / sqrt(Var[x] + eps) * (1 + gamma) + beta", RMSNorm alike) and initialised to 0. A class, as
    megatron-core's (build_module returns a plain function unbuilt)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        layer = config.normalization == "LayerNorm"
        norm = (torch.nn.LayerNorm if layer else torch.nn.RMSNorm)(hidden_size, eps=eps)
        if config.layernorm_zero_centered_gamma:
            torch.nn.init.zeros_(norm.weight)
            shape = norm.normalized_shape
            if layer:
                norm.forward = lambda x: F.layer_norm(x, shape, norm.weight + 1, norm.bias, norm.eps)
            else:
                norm.forward = lambda x: F.rms_norm(x, shape, norm.weight + 1, norm.eps)
        return norm


class _GroupOfOne:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def fla_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """fla's l2norm (its kernels: y = x / sqrt(sum x^2 + eps)) in the input's dtype."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


_FLOAT = torch.Tensor.float


def _float_keeps_fp64(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Tensor.float(), but an fp64 tensor stays fp64: its gates and output gate go through .float() (fp32 math for
    bf16 inputs), which in an fp64 check would round alpha and z to fp32 (a 1e-8 difference)."""
    return self if self.dtype == torch.float64 else _FLOAT(self, *args, **kwargs)


@contextlib.contextmanager
def mcore_gdn_cpu():
    """Inside: megatron-core's GatedDeltaNet builds and runs on CPU tensors (see the module docstring)."""
    from megatron.core.ssm.gated_delta_net import common

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(torch._dynamo.config, "disable", True))
        stack.enter_context(mock.patch.object(common, "l2norm", fla_l2norm))
        stack.enter_context(mock.patch.object(torch.Tensor, "float", _float_keeps_fp64))
        for name in ("mappings", "layers"):  # without megatron's global parallel state: the group given
            module = importlib.import_module(f"megatron.core.tensor_parallel.{name}")
            passthrough = mock.patch.object(module, "get_tensor_model_parallel_group_if_none", lambda g, *a, **k: g)
            stack.enter_context(passthrough)
        yield


def mcore_gdn_layer(m, delta_rule, dtype: torch.dtype = torch.float64):
    """megatron-core's GatedDeltaNet for our ModelConfig `m` (its heads: m.gdn_heads), its output norm of
    m.normalization (zero-centred with m.apply_layernorm_1p: `TENorm`) and eps m.norm_epsilon, the op
    `delta_rule(q, k, v, g, beta)` -> o in place of fla's kernel. Call inside `mcore_gdn_cpu()`."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    g = m.gdn_heads
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=dtype, perform_initialization=False, normalization=m.normalization,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p, layernorm_epsilon=m.norm_epsilon, deterministic_mode=True,
        activation_func=F.silu,
        linear_conv_kernel_dim=4, linear_key_head_dim=g.key_dim, linear_value_head_dim=g.value_dim,
        linear_num_key_heads=g.key_heads, linear_num_value_heads=g.value_heads,
    )  # fmt: skip
    one = _GroupOfOne()
    subs = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=TENorm, out_proj=RowParallelLinear)
    layer = GatedDeltaNet(tcfg, subs, layer_number=1, pg_collection=types.SimpleNamespace(tp=one, cp=one))

    def rule(q, k, v, g, beta, **kw):  # megatron-core's call: keywords it passes fla's kernel besides
        return delta_rule(q, k, v, g, beta), None

    layer.gated_delta_rule = rule
    return layer.to(dtype)  # its out_norm (torch's norm) is built in the default dtype


def load_from_ours(ref, ours, m) -> None:
    """Copy our (single-rank) GatedDeltaNet's weights into megatron-core's layer `ref`, through the one map."""
    state = {
        "proj_in.weight": ours.proj_in.weight, "conv": ours.conv, "A_log": ours.A_log, "dt_bias": ours.dt_bias,
        "head_norm": ours.head_norm, "proj_out.weight": ours.proj_out.weight,
    }  # fmt: skip
    if ours.head_norm_bias is not None:
        state["head_norm_bias"] = ours.head_norm_bias
    theirs = gdn_to_mcore({k: v.detach() for k, v in state.items()}, m)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(theirs[name])
