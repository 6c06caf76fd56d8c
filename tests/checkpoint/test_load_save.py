"""--load means one thing and --save never goes backwards silently: a checkpoint root and an
iteration directory in it both load (logged by the path they resolve to); a --load that names
nothing starts from scratch with a warning, as Megatron-LM's (an error with --exit-on-missing-checkpoint);
a --save holding checkpoints this run did not load from is refused without --override-checkpoint; a second
live writer is refused by the lock."""

import contextlib
import io
import os

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, files, guard
from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS, OLD_DEFAULTS_WITH_DROPOUT

TINY = (
    OLD_DEFAULTS
    + (
        "--mock-data --device cpu --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--vocab-size 128 --make-vocab-size-divisible-by 32 --global-batch-size 2 --micro-batch-size 1 "
        "--save-interval 2 --seed 5 --peak-tflops 1"
    ).split()
)


def _run(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            run = training.setup(validate(parse_args(TINY + argv), world))
            first = run.state.iteration
            training.train(run)
        except (CheckpointError, ConfigError) as e:
            return f"error: {e}", None, out.getvalue()
    return None, (first, run.state.iteration), out.getvalue()


def run(*argv):
    return run_distributed(_run, 1, list(argv))[0]


def latest(directory):
    return open(os.path.join(directory, "latest")).read().strip()


def test_load_root_or_iteration_dir_and_refusals(tmp_path):
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    assert run("--save", root, "--train-iters", "4")[:2] == (None, (0, 4))
    assert latest(root) == "iter_0000004"

    error, span, log = run("--load", f"{root}/iter_0000002", "--save", other, "--train-iters", "3")
    assert error is None and span == (2, 3), (error, log)  # used to start from scratch
    assert f"loaded {root}/iter_0000002: iteration 2" in log
    error, span, log = run("--load", root, "--save", str(tmp_path / "third"), "--train-iters", "5")
    assert span == (4, 5) and f"loaded {root}/iter_0000004: iteration 4" in log

    nope = str(tmp_path / "nope")  # as Megatron-LM (its CI passes --load on every first run): a warning
    error, span, log = run("--load", nope, "--save", str(tmp_path / "x"), "--train-iters", "2")
    assert span == (0, 2) and f"warning: --load {nope}: does not exist: starting from scratch" in log, (error, log)
    error, _, _ = run("--load", nope, "--save", nope, "--train-iters", "2", "--exit-on-missing-checkpoint")
    assert error == f"error: --load {nope}: does not exist (--exit-on-missing-checkpoint)", error
    fresh = str(tmp_path / "fresh")  # a requeued job's first start: --load is --save, nothing there yet
    error, span, log = run("--load", fresh, "--save", fresh, "--train-iters", "2")
    assert span == (0, 2) and "(it is also --save: a requeued job's first start): starting from scratch" in log

    # a run that did not load from `root` may not write over it ...
    error, _, _ = run("--save", root, "--train-iters", "2")
    assert error.startswith(f"error: --save {root} already holds checkpoints up to iteration 4 and this run did not")
    assert latest(root) == "iter_0000004" and files.saved_iterations(root) == [2, 4]
    # ... unless told to, which it says
    error, span, log = run("--save", root, "--train-iters", "2", "--override-checkpoint")
    assert span == (0, 2) and "--override-checkpoint: " in log and latest(root) == "iter_0000002"


def test_second_live_writer_is_refused(tmp_path):
    busy = str(tmp_path / "busy")
    assert guard.lock_save_dir(busy) is None  # this process is the live writer
    try:
        error, _, _ = run("--save", busy, "--train-iters", "2")
        assert error.startswith(f"error: --save {busy}: another run is saving into it (pid {os.getpid()} on "), error
        assert not os.path.exists(os.path.join(busy, "latest"))
    finally:
        guard.release_save_dirs()
    assert run("--save", busy, "--train-iters", "2")[0] is None  # free again


def _disk_full_on_last_rank(rank, world, argv):
    """The last rank's second save finds the disk full."""
    from megatron_zpp.checkpoint import save

    write = save.write_rank_file

    def full(tmp, r, state):
        if r == world - 1 and state["iteration"] == 4:
            raise OSError(28, "No space left on device", f"{tmp}/rank_{r:05d}.safetensors")
        return write(tmp, r, state)

    save.write_rank_file = full
    return _run(rank, world, argv)[0]


def test_full_disk_during_a_save_fails_every_rank_and_keeps_latest(tmp_path):
    ck = str(tmp_path / "ck")
    errors = run_distributed(_disk_full_on_last_rank, 2, ["--save", ck, "--train-iters", "4"])
    kept = f"{ck}/latest still names iter_0000002"
    assert errors[1].startswith(
        f"error: cannot save iteration 4 to {ck}: no space left on device writing {ck}/iter_0000004.tmp"
    )
    assert errors[1].endswith(f"free space or give another --save; {kept}"), errors[1]
    assert errors[0] == f"error: rank(s) [1] could not write their files; {kept}"
    assert latest(ck) == "iter_0000002" and sorted(os.listdir(ck)) == [".lock", "iter_0000002", "latest"]


def test_resume_at_a_smaller_global_batch_size(tmp_path):
    """Megatron allows it: the dataset holds the samples consumed plus the steps left (was StopIteration)."""
    ck = str(tmp_path / "ck")
    assert run("--save", ck, "--train-iters", "2")[0] is None
    error, span, log = run("--load", ck, "--save", ck, "--global-batch-size", "1", "--train-iters", "4")
    assert error is None and span == (2, 4), (error, log[-2000:])


# Megatron's default dropout, and no --peak-tflops: the MFU peak is measured with matmuls of random
# inputs, drawn after a resumed run restored its RNG streams (the losses differed by ~3e-4 relative)
DROPOUT_ON_MEASURED_PEAK = OLD_DEFAULTS_WITH_DROPOUT + TINY[len(OLD_DEFAULTS) : -2]


def _losses(rank, world, argv):
    run = training.setup(validate(parse_args(DROPOUT_ON_MEASURED_PEAK + argv), world))
    return [h["loss"] for h in training.train(run)]


def test_resume_with_dropout_is_bitwise_after_the_peak_probe(tmp_path):
    ck = str(tmp_path / "ck")
    full = run_distributed(_losses, 1, ["--save", ck, "--train-iters", "4"])[0]
    resumed = run_distributed(_losses, 1, ["--load", f"{ck}/iter_0000002", "--save", ck + "2", "--train-iters", "4"])[0]
    assert resumed == full[2:]


def test_unwritable_save_is_refused_before_any_step(tmp_path):
    (tmp_path / "file").write_text("")
    error, _, log = run("--save", f"{tmp_path}/file/ck", "--train-iters", "2")
    assert error == f"error: --save {tmp_path}/file/ck: cannot be written (Not a directory): give a writable --save"
    assert "consumed samples:" not in log  # no step's work lost
