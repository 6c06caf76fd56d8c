"""One Gated DeltaNet layer's tensors, ours <-> megatron-core's `GatedDeltaNet` (megatron/core/ssm/gated_delta_net),
at full (single-rank) shapes: the one place the two layouts meet (the megatron-core converter, formats/mcore.py,
and the tests that run its class on CPU read it).

    ours (model/gated_deltanet.py)              megatron-core (under its layer's `self_attention.`)
    proj_in.weight   q | k | v | gate | a | b     in_proj.weight   q | k | v | z | beta | alpha
    conv             [2 Hk K + H V, kernel]       conv1d.weight    [2 Hk K + H V, 1, kernel]
    A_log, dt_bias   [H]                          A_log, dt_bias   [H]
    head_norm        [V]                          out_norm.weight  [V]
    head_norm_bias   [V]                          out_norm.bias    [V]     (LayerNorm only)
    proj_out.weight  [hidden, H V]                out_proj.weight  [hidden, H V]

(Hk key heads of K channels, H value heads of V.) The rows of both projections are the same sections but for
the last two, a (ours: the decay's input, megatron-core's alpha) and b (beta), which trade places. Both
convolutions put the current token's tap last, and neither has a bias (megatron-core's conv_bias and bias
default False). Under TP megatron-core's in_proj holds each rank's sections side by side; its sharded state dict
(in_proj_split_sections) and this map see the full sections. The layer's input norm is megatron-core's
in_proj.layer_norm_weight (a fused norm + linear, its hybrid spec): the converter maps that with the block.
Both output norms follow --normalization and --apply-layernorm-1p alike (model/gated_deltanet.py), so the norm's
tensors map as stored (zero-centred under 1p on both sides); formats/mcore.py refuses --gdn-out-norm rmsnorm
where megatron-core's out_norm would be another function.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import ModelConfig

# our tensor -> megatron-core's, within one layer
NAMES = {
    "proj_in.weight": "in_proj.weight",
    "conv": "conv1d.weight",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "head_norm": "out_norm.weight",
    "proj_out.weight": "out_proj.weight",
}
BIAS = {"head_norm_bias": "out_norm.bias"}  # the output norm's bias: a LayerNorm's (ModelConfig.gdn_norm)


def names(m: ModelConfig) -> dict[str, str]:
    """NAMES of the GDN layer of `m`: with the LayerNorm output norm's bias where it has one."""
    return NAMES | (BIAS if m.gdn_norm[0] == "LayerNorm" else {})


def _swap_gates(proj_in: Tensor, m: ModelConfig) -> Tensor:
    """The input projection's rows with the last two sections (one row per value head each) traded: its own
    inverse, so it maps both ways."""
    *rest, first, second = proj_in.split(list(m.mixer_of_kind("gdn").sections), dim=0)
    return torch.cat([*rest, second, first], dim=0)


def gdn_to_mcore(ours: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """Our GDN layer's full tensors (names as in NAMES, without the layer prefix) -> megatron-core's."""
    out = {names(m)[k]: t for k, t in ours.items()}
    out["in_proj.weight"] = _swap_gates(ours["proj_in.weight"], m)
    out["conv1d.weight"] = ours["conv"].unsqueeze(1)
    return out


def gdn_from_mcore(theirs: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """megatron-core's GatedDeltaNet tensors (its names, without the layer prefix) -> ours: the inverse."""
    back = {v: k for k, v in names(m).items()}
    out = {back[k]: t for k, t in theirs.items() if k in back}
    out["proj_in.weight"] = _swap_gates(theirs["in_proj.weight"], m)
    out["conv"] = theirs["conv1d.weight"].squeeze(1)
    return out
