"""Our pretrain_gpt.py, unchanged, with the bench's probe around each train_step (step time,
peak RSS of the timed steps, veth tx bytes at step boundaries; see common.py).

    torchrun ... bench/zero_peers/ours.py --warmup 1 -- <pretrain_gpt.py flags>
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, Probe  # noqa: E402

sys.path.insert(0, ROOT)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gate-every", type=int, default=0, help="timed steps per link rate (bench/zero.py)")
    a = ap.parse_args(argv[:split])
    pretrain_argv = argv[split + 1:]
    probe = Probe(a.warmup, a.gate_every)
    from megatron_zpp import training
    if hasattr(training, "train_step"):
        inner = training.train_step

        def train_step(run):
            probe.step_begin()
            out = inner(run)
            probe.step_end(out[0] if isinstance(out, tuple) else None)
            return out
        training.train_step = train_step  # train() looks the name up at every step
    import pretrain_gpt
    pretrain_gpt.main(pretrain_argv)
    probe.finish(system="ours")


if __name__ == "__main__":
    main()
