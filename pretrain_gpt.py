"""Pretrain a GPT.  Launch with torchrun (or SLURM's srun setting the same variables):

    torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --mock-data --train-iters 50

`--help` lists every flag. The configuration is checked before any process group is
created: an invalid layout costs one clear error, not a failed job. A rank whose peer
died or hung (past --distributed-timeout-minutes), or whose checkpoint cannot be loaded,
or whose input files are missing or malformed (checked before the model is built),
exits non-zero with one line naming the cause; any other exception is a bug and keeps
its traceback. Ctrl-C (SIGINT, which torchrun forwards to every rank) finishes the step, saves
when --save is given and exits 130 with one line per rank; a second Ctrl-C stops at once.
"""

import os
import re
import sys
import time
import traceback

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_config
from megatron_zpp.data.inputs import check_inputs
from megatron_zpp.logging_utils import fail, log
from megatron_zpp.validation import launch_env

# what gloo says when the other end of a collective is gone (NCCL raises DistBackendError); a
# collective queued behind an async one that timed out (an overlapped gradient bucket) finds
# its pair closed: "Application timeout caused pair closure", with no "gloo" in the text
FROM_GLOO = re.compile(r"gloo|pair closure", re.IGNORECASE)
LOST_PEER = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def main(argv=None):
    try:
        _main(argv)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training: nothing saved
        print(f"rank {os.environ.get('RANK', '0')}: interrupted by SIGINT: stopped at once, not saved", flush=True)
        sys.exit(130)


# a rank other than 0 that refuses a command line waits this long for rank 0 to say it (torchrun then stops it)
PEER_WAIT_S = 10.0


def refuse(e: ConfigError, rank: int) -> None:
    """A refused command line (every line of it), said once: by rank 0, which exits 2. The other ranks
    refuse the same line, so they wait quietly for the launcher to stop them once rank 0 has exited
    (torchrun does at once); one still running after PEER_WAIT_S (rank 0 saw no problem: a file that differs
    between nodes, or a launcher that waits for every task) says its own lines, prefixed with its rank."""
    if rank != 0:
        time.sleep(PEER_WAIT_S)
    fail(str(e).replace("\n", "\nerror: "))


def _main(argv):
    try:
        rank, world = launch_env(os.environ)
    except ConfigError as e:  # this rank's own environment: it says so itself
        fail(str(e))
    try:
        cfg = parse_config(argv, world, inputs=check_inputs)  # and the data files and tokenizer, in one pass
    except ConfigError as e:
        refuse(e, rank)

    from megatron_zpp import training
    from megatron_zpp.checkpoint import CheckpointError
    from megatron_zpp.data.indexed_dataset import IndexedDatasetError
    from megatron_zpp.tensor_parallel.layers import TokenIdError

    if cfg.megatron_noops:  # one line: docs/megatron_compat.md says why each is one
        log(
            f"Megatron-LM flags accepted as no-ops (what they ask for always happens): {', '.join(cfg.megatron_noops)}",
            rank,
        )
    try:
        run = training.setup(cfg)
        training.train(run, final_evaluation=True)  # then the validation and test sets, as Megatron
        if run.state.stopped_by == "interrupt":  # Ctrl-C: the step finished, saved when --save; the one line said so
            training.shutdown()
            sys.exit(130)
        if (
            cfg.train.generate_tokens and not run.state.stopped_by_signal
        ):  # every rank decodes: TP ranks must take part in each forward
            prompt = run.tokenizer.tokenize(cfg.train.generate_prompt)
            out = training.greedy_generate(run, prompt, cfg.train.generate_tokens)
            log(f"greedy sample: {cfg.train.generate_prompt!r} -> {run.tokenizer.detokenize(out)!r}", run.rank)
        training.shutdown()
        log("done", run.rank)
    except ConfigError as e:  # a setting found invalid during set-up: alike on every rank
        refuse(e, rank)
    except (training.NonFiniteStepError, TokenIdError) as e:  # each rank that finds it says it
        fail(f"rank {rank}: {e}", code=1)
    except CheckpointError as e:
        fail(f"rank {rank}: {e}", code=1)
    except IndexedDatasetError as e:  # the dataset indices (a cache missing on this rank's file system)
        fail(f"rank {rank}: {e}", code=2)
    except RuntimeError as e:
        cause = distributed_failure(e, cfg)
        if cause is None:
            raise
        fail(f"rank {rank}: {cause}", code=1)


def distributed_failure(e: RuntimeError, cfg) -> str | None:
    """What a failed collective means for the user, or None when `e` is no such failure."""
    import torch.distributed as dist

    text = str(e)
    if not (isinstance(e, dist.DistError) or FROM_GLOO.search(text)):
        return None
    if LOST_PEER.search(text):
        what, why = "lost a peer", "Another rank died or was killed (its log or the launcher's summary says why)"
    elif TIMED_OUT.search(text):
        what, why = (
            "a collective timed out",
            (
                f"Another rank hung or fell more than --distributed-timeout-minutes "
                f"{cfg.parallel.distributed_timeout_minutes} behind"
            ),
        )
    elif isinstance(e, dist.DistError):
        what, why = "a collective failed", "The communication backend reported an error"
    else:  # gloo refusing mismatched tensors and the like: a bug, keep the traceback
        return None
    # gloo's text: "[.../pair.cc:553] Connection closed by peer [ip]:port. This is typically ..."
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0]).split(". ")[0].rstrip(".")
    return f"{what}{_where(e)}: {detail}. {why}; {_resume_hint(cfg)}"


def _resume_hint(cfg) -> str:
    """Where a failed run resumes: the last checkpoint of --save (or --load) when one exists."""
    t = cfg.train
    for ckpt in (t.save, t.load):
        if ckpt and os.path.exists(os.path.join(ckpt, "latest")):
            return f"resume from the last checkpoint with --load {ckpt}"
    if t.load and os.path.exists(os.path.join(t.load, "meta.json")):
        return f"rerun it with --load {t.load} (no later checkpoint was saved)"
    return "rerun it (no checkpoint was saved)" if t.save else "rerun it (no --save: no checkpoint)"


def _where(e: BaseException) -> str:
    """' in fn (file:line)' of the innermost frame of ours that called the collective
    (every collective goes through comm.py, which says nothing about where)."""
    ours = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if "megatron_zpp" in f.filename and os.path.basename(f.filename) != "comm.py"
    ]
    if not ours:
        return ""
    f = ours[-1]
    return f" in {f.name} ({os.path.relpath(f.filename, os.path.dirname(os.path.abspath(__file__)))}:{f.lineno})"


if __name__ == "__main__":
    main(sys.argv[1:])
