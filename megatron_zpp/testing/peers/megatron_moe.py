"""megatron-core's `MoELayer` on CPU ranks (gloo), as bench/moe.py's peer: its router, its alltoall or allgather
token dispatcher over a real expert-parallel process group, and its SequentialMLP experts (a GEMM per local
expert: the CPU path of its local spec; its grouped GEMM needs the `grouped_gemm` package or
transformer-engine, both CUDA-only), loaded with the weights of one of our `MoELayer`s.

Shims (`mcore_cpu`, a context manager around building and running it), nothing of its arithmetic touched:
- `torch.cuda.current_device()` -> 'cpu' (where it allocates its buffers);
- `torch.cuda.Stream`, `current_stream`, `stream` -> a stand-in stream whose `record_event()` returns an event
  with a no-op `synchronize()` (the alltoall dispatcher copies its split sizes to the host on a side stream;
  torch.cpu.Stream's record_event returns None in torch 2.13);
- its `maybe_move_tensor_to_cpu` (which moves only CUDA tensors) gives the host copy it gives on a GPU: with
  `as_numpy` a numpy array, the split sizes `all_to_all_single` takes (a CPU tensor there is refused);
- its global memory buffer (megatron's parallel state makes it at initialization; the allgather dispatcher
  gathers the tokens into it) is made once, on CPU;
- `get_tensor_model_parallel_group_if_none` passes the given group through in its TP mappings and layers (it
  returns None without megatron's global parallel state);
- the groups of size one (TP, CP, expert TP, expert DP) are stand-ins that its collectives bypass; the expert
  parallel group (and tp_ep, tp_dp_cp: the same ranks when TP = 1) is the real gloo group of our `ep` group.
Call `install_gloo_collectives()` (gloo_collectives.py) in the rank before megatron.core is imported: its
allgather dispatcher's reduce-scatter then moves the real-fabric volume, as ours (gloo's own runs an
all-reduce)."""

from __future__ import annotations

import contextlib
import importlib
import types
from unittest import mock

import torch
import torch.nn.functional as F

PATCHED = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
)


class _GroupOfOne:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class _Event:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _Stream:
    """What the alltoall dispatcher asks of a CUDA stream, on CPU: ordering is program order."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


_CURRENT = _Stream()


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's moe_utils.maybe_move_tensor_to_cpu as it behaves on a GPU: numpy when asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


@contextlib.contextmanager
def mcore_cpu():
    """Inside: megatron-core's MoE modules build and run on CPU tensors (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
        stack.enter_context(mock.patch("torch.cuda.Stream", _Stream))
        stack.enter_context(mock.patch("torch.cuda.current_stream", lambda device=None: _CURRENT))
        stack.enter_context(mock.patch("torch.cuda.stream", lambda s: contextlib.nullcontext()))
        from megatron.core import parallel_state

        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
        dispatcher = "megatron.core.transformer.moe.token_dispatcher"
        stack.enter_context(mock.patch(f"{dispatcher}.maybe_move_tensor_to_cpu", _to_host))
        for name in PATCHED:
            module = importlib.import_module(name)
            if hasattr(module, "get_tensor_model_parallel_group_if_none"):
                passthrough = mock.patch.object(module, "get_tensor_model_parallel_group_if_none", lambda g, *a, **k: g)
                stack.enter_context(passthrough)
        yield


def mcore_moe_layer(cfg, dispatcher: str, ep_handle, dtype: torch.dtype = torch.float32):
    """megatron-core's MoELayer for our MoEConfig `cfg` (no shared expert, no capacity: what the bench runs),
    `dispatcher` 'alltoall' or 'allgather', expert-parallel over the torch ProcessGroup `ep_handle` (None: one
    rank). Call inside `mcore_cpu()`."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    swiglu = cfg.activation == "swiglu"
    ep = _GroupOfOne() if ep_handle is None else ep_handle
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=1, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.ffn_hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
        moe_router_topk=cfg.topk, moe_router_score_function=cfg.score_function, moe_router_dtype="fp32",
        moe_router_load_balancing_type=cfg.load_balancing_type, moe_aux_loss_coeff=cfg.aux_loss_coeff,
        moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep.size(),
    )  # fmt: skip
    one = _GroupOfOne()
    pgs = types.SimpleNamespace(
        tp=one, cp=one, tp_cp=one, expt_tp=one, expt_dp=one, ep=ep, tp_ep=ep, tp_dp_cp=ep,
    )  # fmt: skip
    spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts, moe_grouped_gemm=False)
    return spec(config=tcfg, pg_collection=pgs)


def load_from_ours(ref, ours) -> None:
    """Copy our MoELayer's router and local experts (global indices) into megatron-core's layer `ref`, whose
    local expert i is global expert ref.local_expert_indices[i]; ours x @ W [H, 2F], theirs [2F, H]."""
    with torch.no_grad():
        ref.router.weight.copy_(ours.router.weight)
        for i, e in enumerate(ref.local_expert_indices):
            ref.experts.local_experts[i].linear_fc1.weight.copy_(ours.experts.fc1[str(e)].T)
            ref.experts.local_experts[i].linear_fc2.weight.copy_(ours.experts.fc2[str(e)].T)
