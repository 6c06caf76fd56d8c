"""How a slice's entering state reaches its end: S_out = T(S_in) + S_loc, T linear, one per CP rank.

The three scans (all_scan.py, lasp2.py, ring.py) carry S [B,H,K,V] over the ranks with any such T;
they ask it only to apply itself (forward) or its transpose (backward) to a block of the state, and
along which dimension blocks may be cut without mixing (the All-Scan pipeline's blocks).

    Decay   GLA: T(S) = gamma * S, gamma [B,H,K] the slice's total decay per key row (diagonal):
            any rows or columns are independent; blocks are cut along K (ZeCO's split)
    Dense   Gated DeltaNet: T(S) = M S, M [B,H,K,K] the product of the slice's transitions
            a_t (I - b_t k_t k_t^T): M mixes the K rows, so blocks are cut along V
"""

from __future__ import annotations

import torch
from torch import Tensor


class Decay:
    """T(S) = gamma * S over the key rows; built from log gamma (<= 0: strong decays underflow to 0)."""

    dim = 2  # blocks of key rows

    def __init__(self, log_gamma: Tensor):
        self.log_gamma, self.gamma = log_gamma, log_gamma.exp()

    def apply(self, x: Tensor, rows: slice = slice(None)) -> Tensor:
        """T applied to x [B,H,k,V], the key rows `rows` of a state."""
        return self.gamma[:, :, rows, None] * x

    apply_transposed = apply  # diagonal

    def packed(self) -> Tensor:
        """What the all-gather sends of T (log gamma: the exponent is taken on arrival)."""
        return self.log_gamma

    @classmethod
    def unpacked(cls, flat: Tensor, like: Tensor) -> Decay:
        return cls(flat.view(like.shape[:3]))


class Dense:
    """T(S) = M S with M [B,H,K,K] dense."""

    dim = 3  # blocks of value columns

    def __init__(self, M: Tensor):
        self.M = M

    def apply(self, x: Tensor, cols: slice = slice(None)) -> Tensor:
        """T applied to x [B,H,K,v], the value columns `cols` of a state (M acts on every column alike)."""
        return torch.einsum("bhij,bhjv->bhiv", self.M, x)

    def apply_transposed(self, x: Tensor, cols: slice = slice(None)) -> Tensor:
        return torch.einsum("bhji,bhjv->bhiv", self.M, x)

    def packed(self) -> Tensor:
        return self.M

    @classmethod
    def unpacked(cls, flat: Tensor, like: Tensor) -> Dense:
        K = like.shape[2]
        return cls(flat.view(*like.shape[:2], K, K))
