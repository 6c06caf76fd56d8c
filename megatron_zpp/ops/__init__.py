"""Pure-PyTorch operators."""

from megatron_zpp.ops.gdn import chunk_gdn
from megatron_zpp.ops.gdn_naive import naive_recurrent_gdn
from megatron_zpp.ops.gla import chunk_gla, chunk_gla_local, gla_state_correction
from megatron_zpp.ops.gla_naive import naive_recurrent_gla
from megatron_zpp.ops.grouped_gemm import grouped_mm
from megatron_zpp.ops.kda import chunk_kda
from megatron_zpp.ops.kda_naive import naive_recurrent_kda

__all__ = [
    "naive_recurrent_gla",
    "chunk_gla",
    "chunk_gla_local",
    "gla_state_correction",
    "naive_recurrent_gdn",
    "chunk_gdn",
    "grouped_mm",
    "naive_recurrent_kda",
    "chunk_kda",
]
