"""The CP GLA Function runs the state scan while the local work runs (forward and
backward), shown without timing: a stand-in scan that cannot finish until the local pass
has started would deadlock a sequential implementation. (All-Scan's block rule: test_chain.py.)"""

import threading

import torch

from megatron_zpp.context_parallel import gla
from megatron_zpp.ops import gla as gla_ops

WAIT_S = 20  # only reached when the two are not concurrent


class BlockedScan:
    """Returns a zero state, but only once the local pass has signalled that it runs."""

    def __init__(self):
        self.local_started = threading.Event()

    def forward(self, S_loc, log_gamma, head):
        assert self.local_started.wait(WAIT_S), "the forward scan waited for the local pass: no overlap"
        return torch.zeros_like(S_loc)

    def backward(self, dS_corr):
        assert self.local_started.wait(WAIT_S), "the backward scan waited for the local gradients: no overlap"
        return torch.zeros_like(dS_corr)


def test_scan_runs_during_the_local_work(monkeypatch):
    scan = BlockedScan()

    class SignallingForward(gla_ops.ChunkGLAForward):
        def intra(self):  # the intra-chunk output (the bulk of the forward)
            scan.local_started.set()
            return super().intra()

    class SignallingBackward(gla_ops.ChunkGLABackward):
        def output_grads(self):  # the local gradients (the bulk of the backward)
            scan.local_started.set()
            return super().output_grads()

    monkeypatch.setattr(gla, "ChunkGLAForward", SignallingForward)
    monkeypatch.setattr(gla, "ChunkGLABackward", SignallingBackward)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = (-torch.rand(1, 16, 2, 8, generator=gen, dtype=torch.float64)).requires_grad_()
    o = gla.ContextParallelGLA.apply(q, k, v, g, None, scan, 8**-0.5, 8)
    scan.local_started.clear()
    o.sum().backward()
    # a zero incoming state and no gradient from the next rank: the single-slice result
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    o_ref = gla_ops.chunk_gla(*ref, chunk_size=8)[0]
    o_ref.sum().backward()
    torch.testing.assert_close(o, o_ref)
    for got, want in zip((q, k, v, g), ref):
        torch.testing.assert_close(got.grad, want.grad)
