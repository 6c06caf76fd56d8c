"""Our pretrain_gpt.py, unchanged, with the bench's probe around each train_step (step time,
peak RSS of the timed steps, veth tx bytes at step boundaries; see common.py). Each rank
also writes its own comm-ledger rows (bytes per step by group, phase, op and link): the
--comm-report gives means over all ranks, the bench sums a node's ranks.

    torchrun ... bench/zero_peers/ours.py --warmup 1 -- <pretrain_gpt.py flags>
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, Probe, peer_args  # noqa: E402

sys.path.insert(0, ROOT)


def main() -> None:
    a, pretrain_argv = peer_args()
    probe = Probe(a.warmup, a.gate_every)
    from megatron_zpp import comm
    from megatron_zpp.training import loop

    inner = loop.train_step

    def train_step(run):
        probe.step_begin()
        out = inner(run)
        probe.step_end(out[0] if isinstance(out, tuple) else None)
        return out

    loop.train_step = train_step  # the loop looks its module's name up at every step
    import pretrain_gpt

    pretrain_gpt.main(pretrain_argv)
    if not probe.step_times:
        raise SystemExit("error: the probe timed no step (megatron_zpp.training.loop no longer calls train_step?)")
    probe.finish(system="ours", ledger_rows=comm.LEDGER.local_rows())


if __name__ == "__main__":
    main()
