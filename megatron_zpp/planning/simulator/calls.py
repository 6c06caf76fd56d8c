"""One collective call of the simulated step (`Coll`): what the ledger records for it (`bytes()`, comm.model_bytes)
and what the timing model reads (its link, overlap class, quantizer work)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import comm
from ...topology import Group


@dataclass(frozen=True)
class Coll:
    """One collective call: bytes() is what the ledger records for it."""

    role: str
    phase: str
    op: str
    link: str
    n: int
    nbytes: float  # the full buffer, as comm.model_bytes takes it
    kind: str  # overlap class: tp, cp_attn, cp_scan, cp_halo, pp, zero_gather, grad, param_gather, misc
    quant_elems: float = 0.0  # elements quantized + dequantized for it (qwZ, qgZ)
    quant_key: str = ""  # "bits/block" of its quantizer (hardware.Cluster.quant's key)
    quant_calls: int = 0  # quantizer passes it runs (quantize + dequantize(-sum): 2), each with a fixed cost
    behind_flops: float = field(default=0.0, compare=False)  # FLOPs of the matmul it runs behind (SP backward)
    ranks: tuple[int, ...] = field(default=(), compare=False)  # the group's global ranks (node sharing)
    # an MoE token exchange on the busiest rank: its transfer takes this x the mean bytes (bytes() stays the mean)
    imbalance: float = field(default=1.0, compare=False)

    def bytes(self) -> float:
        return comm.model_bytes(self.op, self.n, self.nbytes)


def _coll(
    group: Group, phase: str, op: str, nbytes: float, kind: str, link: str | None = None, quant=0.0, qkey: str = ""
):
    calls = 2 if quant else 0  # one quantize, one dequantize (or dequantize-sum) pass per call
    return Coll(
        group.role, phase, op, link or group.link, group.size, nbytes, kind, quant, qkey, calls, ranks=group.ranks
    )
