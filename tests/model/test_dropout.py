"""Layout-invariant dropout masks (model/dropout.py): the hash against a pure-Python reference, the keep rate,
independence across sites and samples, and the explicit attention path against SDPA. That every layout drops
the single rank's elements is tests/test_parity.py's `test_dropout_on_layouts_match_single_rank`."""

import torch
import torch.nn.functional as F

from megatron_zpp.context_parallel.attention import explicit_attention
from megatron_zpp.model.dropout import keep_mask
from megatron_zpp.tensor_parallel import random as tp_random

M32 = 0xFFFFFFFF


def py_mix(h: int) -> int:
    """The 32-bit avalanche in Python's unbounded ints: no int64 wrap or sign to hide a bug."""
    h ^= h >> 16
    h = (h * 0x21F0AAAD) & M32
    h ^= h >> 15
    h = (h * 0x735A2D97) & M32
    return h ^ (h >> 15)


def py_keep(p: float, seed: int, site: int, sample: int, coords: list[int]) -> bool:
    h = py_mix((sample & M32) ^ py_mix((seed * 1000003 + site) & M32))
    for n, c in enumerate(coords, start=1):
        h = py_mix(h ^ py_mix((c + n * 0x9E3779B1) & M32))
    return h >= int(p * 2**32)


def _seeded(seed: int):
    tp_random.seed_parallel_rng(seed, 0, 0, 0, torch.device("cpu"))


def test_mask_equals_python_reference_at_large_coordinates():
    _seeded(4321)
    samples = torch.tensor([0, 7, 2**31 + 5, 10**12])  # positions past 2^32 wrap as the reference does
    tokens, channels = torch.tensor([0, 1, 4095, 131071]), torch.tensor([0, 3, 8191])
    keep = keep_mask(0.3, 17, samples, [tokens, channels])
    want = torch.tensor(
        [
            [[py_keep(0.3, 4321, 17, s, [t, c]) for c in channels.tolist()] for t in tokens.tolist()]
            for s in samples.tolist()
        ]
    )
    assert torch.equal(keep, want)


def test_keep_rate_and_independence():
    _seeded(1)
    p, samples = 0.1, torch.arange(4)
    axes = [torch.arange(256), torch.arange(256)]
    a, b = keep_mask(p, 1, samples, axes), keep_mask(p, 2, samples, axes)
    n = a.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(a.float().mean().item() - (1 - p)) < 5 * sigma
    # two sites, and two samples of one site, agree as independent draws do: p^2 + (1-p)^2
    agree = p * p + (1 - p) ** 2
    assert abs((a == b).float().mean().item() - agree) < 0.01
    assert abs((a[0] == a[1]).float().mean().item() - agree) < 0.01
    # neighbouring channels and tokens are not correlated either
    assert abs((a[..., 1:] == a[..., :-1]).float().mean().item() - agree) < 0.01
    _seeded(2)  # another --seed, other masks
    assert abs((keep_mask(p, 1, samples, axes) == a).float().mean().item() - agree) < 0.01


def test_explicit_attention_equals_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 6, 8, dtype=torch.float64)
    keep_all = lambda probs, first: probs  # noqa: E731
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(explicit_attention(q, k, v, None, keep_all, 0), want, rtol=1e-12, atol=1e-12)
    mask = torch.rand(2, 1, 6, 6) > 0.5
    mask |= torch.eye(6, dtype=torch.bool)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(explicit_attention(q, k, v, mask, keep_all, 0), want, rtol=1e-12, atol=1e-12)


def test_large_masks_are_hashed_in_blocks_alike(monkeypatch):
    """Blocks of the leading axes (bounded int64 temporaries) give the mask of one pass."""
    from megatron_zpp.model import dropout

    _seeded(3)
    axes = [torch.arange(5), torch.arange(7), torch.arange(11)]
    whole = keep_mask(0.2, 9, torch.arange(3), axes)
    monkeypatch.setattr(dropout, "HASH_SLICE", 13)
    assert torch.equal(keep_mask(0.2, 9, torch.arange(3), axes), whole)
