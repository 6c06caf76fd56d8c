"""Our pretrain_gpt.py, unchanged, with the bench's probe around each train_step (step time,
peak RSS of the timed steps, veth tx bytes at step boundaries; see probe.py). Each rank
also writes its own comm-ledger rows (bytes per step by group, phase, op and link): the
--comm-report gives means over all ranks, the bench sums a node's ranks.

    torchrun ... megatron_zpp/testing/peers/ours.py --warmup 1 -- <pretrain_gpt.py flags>
"""

from __future__ import annotations

import runpy

from megatron_zpp.testing.cluster import PRETRAIN_GPT
from megatron_zpp.testing.peers.probe import Probe, peer_args


def main() -> None:
    a, pretrain_argv = peer_args()
    probe = Probe(a.warmup, a.gate_every)
    from megatron_zpp import comm
    from megatron_zpp.training import loop

    inner = loop.train_step

    def train_step(*args, **kwargs):  # whatever the loop passes (the run, its timers)
        probe.step_begin()
        out = inner(*args, **kwargs)
        probe.step_end(out[0] if isinstance(out, tuple) else None)
        return out

    loop.train_step = train_step  # the loop looks its module's name up at every step
    runpy.run_path(PRETRAIN_GPT, run_name="pretrain_gpt")["main"](pretrain_argv)  # the script, not a module
    if not probe.step_times:
        raise SystemExit("error: the probe timed no step (megatron_zpp.training.loop no longer calls train_step?)")
    probe.finish(system="ours", ledger_rows=comm.LEDGER.local_rows())


if __name__ == "__main__":
    main()
