"""Faults with real processes: a run that loses a rank ends instead of hanging, and
resuming from what it left gives what an uninterrupted run gives.

* kill -9 mid-run: torchrun with 2 ranks saving every 2 steps; once a checkpoint exists,
  rank 1 is SIGKILLed. torchrun exits non-zero, naming the SIGKILL, within the collective
  timeout plus a margin (no hang); relaunching with --load gives bitwise the losses and
  the final state (weights, AdamW, every RNG stream) of a run never interrupted.
* kill during a save: rank 1 writes half of its file of the second save and SIGKILLs
  itself. The survivor fails at the save's barrier with one line naming the lost peer;
  `latest` still names the first save, and loading it and training on gives bitwise the
  losses of the uninterrupted run.
* SIGTERM with --exit-signal-handler: one rank is signalled mid-step; every rank stops
  after that step with a checkpoint of it, and resuming gives the uninterrupted run's losses.
* hung peer: a rank that stays alive but stops taking part makes the other fail after
  --distributed-timeout-minutes (gloo's own message quotes the wait) with a line saying so.
* full disk during a synchronous save (both formats): ENOSPC as safetensors and DCP's zip writer report
  it, and the real writers under RLIMIT_FSIZE in a process of their own: one line naming the cause and
  the file, the failed save's .tmp removed, the previous checkpoint and `latest` as they were.
"""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import pretrain_gpt
from megatron_zpp import training
from megatron_zpp.checkpoint import files, guard, save
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.training import loop
from megatron_zpp.validation import validate
from tests.dist import RankFailure, run_distributed
from tests.old_defaults import OLD_DEFAULTS_WITH_DROPOUT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = (
    OLD_DEFAULTS_WITH_DROPOUT  # Megatron's default dropout: the resumed runs are bitwise all the same
    + (
        "--mock-data --device cpu --hidden-size 32 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 "
        "--seq-length 32 --vocab-size 128 --make-vocab-size-divisible-by 32 --num-layers 2 "
        "--attention-type gla --softmax-attention-every 2 --gla-chunk-size 8 --global-batch-size "
        "4 --micro-batch-size 1 --lr 3e-3 --lr-warmup-iters 2 --clip-grad 0.5 --seed 11 "
        "--peak-tflops 1 --distributed-timeout-minutes 1"
    ).split()
)
NO_HANG_S = 60 + 60  # the collective timeout above, plus a margin for a loaded machine


# ---- kill -9 of a rank mid-run, under torchrun ------------------------------------------
ITERS = 20  # long enough after the first checkpoint that rank 1 is caught mid-run


class Launch:
    """pretrain_gpt.py on 2 ranks under torchrun, its output in DIR/NAME.log."""

    def __init__(self, directory, name: str, args: list[str]):
        self.log = directory / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "pretrain_gpt.py",
            *args,
            "--metrics-file",
            str(directory / f"{name}.jsonl"),
        ]
        # to a file: a pipe nobody reads while the test polls could fill and block the run
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait(self) -> str:
        """The output once torchrun has exited; a hang is an error (killed, not waited for)."""
        try:
            self.proc.wait(timeout=NO_HANG_S)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"torchrun hung:\n{self.log.read_text()[-3000:]}") from None
        return self.log.read_text()

    def workers(self) -> dict[int, int]:
        """{rank: pid} of torchrun's workers alive now (its children, each with RANK set)."""
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:  # gone meanwhile
                continue
            if ppid == self.proc.pid and b"RANK" in env:
                found[int(env[b"RANK"])] = int(pid)
        return found

    def close(self) -> None:
        """Kill what is left: workers run in their own sessions and outlive a killed torchrun."""
        if self.proc.poll() is None:
            for pid in self.workers().values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def launch(tmp_path):
    started = []

    def start(name: str, args: list[str]) -> Launch:
        started.append(Launch(tmp_path, name, args))
        return started[-1]

    yield start
    for run in started:
        run.close()


def latest_iteration(ckpt) -> int:
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return int(f.read().strip().removeprefix("iter_"))
    except (FileNotFoundError, ValueError):
        return 0


def kill_rank_after_first_checkpoint(run: Launch, ckpt, rank: int) -> int:
    """SIGKILL `rank` as soon as a checkpoint exists and the run has not ended; returns the
    iteration `latest` names at the kill. The check is made while the rank is stopped
    (SIGSTOP), so the run cannot end between the check and the kill."""
    pid = None
    while run.proc.poll() is None:
        pid = pid or run.workers().get(rank)
        try:
            if pid:
                os.kill(pid, signal.SIGSTOP)
                saved = latest_iteration(ckpt)
                if saved >= 2:
                    os.kill(pid, signal.SIGKILL)
                    return saved
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # the rank ended by itself
            break
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} ended before it could be killed:\n{run.wait()[-3000:]}")


def metrics(path) -> dict[int, dict]:
    return {row["iteration"]: row for row in map(json.loads, open(path).read().splitlines())}


def assert_same_state(a, b, where="state"):
    """Bitwise equality of two loaded rank files (nested dicts/lists of tensors and numbers)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_kill_9_mid_run_then_resume(tmp_path, launch):
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    args = TINY + ["--train-iters", str(ITERS), "--save-interval", "2"]
    plain = launch("plain", args + ["--save", str(ref)])  # the uninterrupted run, alongside
    killed = launch("killed", args + ["--save", str(ckpt)])
    killed_at = kill_rank_after_first_checkpoint(killed, ckpt, rank=1)
    out = killed.wait()
    assert killed.proc.returncode != 0, out[-3000:]
    # torchrun's report names the rank and the signal (its survivor may be stopped before saying anything)
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\n\s*exitcode\s*: -9 .*SIGKILL", out), out[-3000:]
    resume_from = latest_iteration(ckpt)  # the kill may have landed during a later save: never after the last
    assert 2 <= killed_at <= resume_from < ITERS

    resumed = launch("resumed", args + ["--save", str(ckpt), "--load", str(ckpt)])
    out = resumed.wait()
    assert resumed.proc.returncode == 0, out[-3000:]
    out = plain.wait()
    assert plain.proc.returncode == 0, out[-3000:]

    got, want = metrics(tmp_path / "resumed.jsonl"), metrics(tmp_path / "plain.jsonl")
    assert sorted(got) == list(range(resume_from + 1, ITERS + 1))  # it went on from the last checkpoint
    assert [got[i]["loss"] for i in got] == [want[i]["loss"] for i in got]
    assert [got[i]["grad_norm"] for i in got] == [want[i]["grad_norm"] for i in got]
    final = f"iter_{ITERS:07d}"
    for rank in range(2):
        name = files.rank_file(rank)
        got, want = (files.RankFile(str(d / final / name)).state() for d in (ckpt, ref))
        assert_same_state(got, want, name)


# ---- kill during a save, and a hung peer (tests/dist.py ranks running pretrain_gpt.main) ----
SAVE_ITERS = 6


def _die_in_second_save(rank, world_size, argv):
    """Rank 1 writes half of its file of the second save (iteration 4), then SIGKILLs itself."""
    if rank == 1:
        write = save.write_rank_file

        def write_half_then_die(tmp, rank_, state):
            if files.iter_name(4) in tmp:
                buf = io.BytesIO()
                torch.save(state, buf)
                with open(os.path.join(tmp, files.rank_file(rank_)), "wb") as f:
                    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return write(tmp, rank_, state)

        save.write_rank_file = write_half_then_die
    pretrain_gpt.main(argv)


def _resume_and_plain(rank, world_size, argv, ckpt):
    run = training.setup(validate(parse_args(argv + ["--load", ckpt]), world_size))
    start = (run.state.iteration, run.state.consumed_samples)
    resumed = [h["loss"] for h in training.train(run)]
    plain = [h["loss"] for h in training.train(training.setup(validate(parse_args(argv), world_size)))]
    return start, resumed, plain


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, capfd):
    ckpt = str(tmp_path / "ckpt")
    argv = TINY + ["--train-iters", str(SAVE_ITERS)]
    survivor, dead = run_distributed(
        _die_in_second_save,
        2,
        argv + ["--save", ckpt, "--save-interval", "2"],
        init_group=False,
        keep_failures=True,
        timeout=NO_HANG_S,
    )
    assert isinstance(dead, RankFailure) and "exited with code -9" in dead.message
    assert isinstance(survivor, RankFailure) and "SystemExit: 1" in survivor.message  # pretrain_gpt's exit
    err = capfd.readouterr().err
    # gloo says "Connection closed by peer" or "Read error [...]: Connection reset by peer"
    assert re.search(
        r"^error: rank 0: lost a peer in (save_checkpoint|_complete_save) \(.*\): .*Connection (closed|reset) by peer.*"
        rf"resume from the last checkpoint with --load {re.escape(ckpt)}$",
        err,
        re.M,
    ), err[-3000:]
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000002"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000004"))
    partial = os.path.join(ckpt, "iter_0000004.tmp", files.rank_file(1))
    assert os.path.getsize(partial) > 0  # the dying write did happen, and is ignored

    for start, resumed, plain in run_distributed(_resume_and_plain, 2, argv, ckpt, timeout=NO_HANG_S):
        assert start == (2, 2 * 4)  # iteration and consumed samples of the first save
        assert resumed == plain[2:]


def _sigterm_at_step_3(rank, world_size, argv):
    """Rank 1 gets SIGTERM (as from a preempting scheduler) during its third step."""
    if rank == 1:
        step = loop.train_step  # what the loop calls

        def step_then_signal(run, *timers):
            out = step(run, *timers)
            if run.state.iteration == 2:  # the third step (the counter moves after it returns)
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        loop.train_step = step_then_signal
    run = training.setup(validate(parse_args(argv), world_size))
    return len(training.train(run)), run.state.stopped_by_signal


def test_sigterm_saves_at_the_step_boundary_and_stops(tmp_path):
    """--exit-signal-handler: a SIGTERM that reaches one rank stops every rank after the same
    step, with a checkpoint of it; resuming gives the uninterrupted run's losses bitwise."""
    ckpt = str(tmp_path / "ckpt")
    argv = TINY + ["--train-iters", str(SAVE_ITERS)]
    out = run_distributed(_sigterm_at_step_3, 2, argv + ["--save", ckpt, "--exit-signal-handler"], timeout=NO_HANG_S)
    assert out == [(3, True), (3, True)]
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000003"
    for start, resumed, plain in run_distributed(_resume_and_plain, 2, argv, ckpt, timeout=NO_HANG_S):
        assert start == (3, 3 * 4)
        assert resumed == plain[3:]


def _hang_one_rank(rank, world_size, argv, flag):
    # start together: the short timeout also bounds the wait for a peer at init
    open(f"{flag}.ready{rank}", "w").close()
    while not all(os.path.exists(f"{flag}.ready{r}") for r in range(world_size)):
        time.sleep(0.05)
    if rank == 1:  # alive but silent: set up, then take part in nothing until rank 0 gave up
        training.setup(validate(parse_args(argv), world_size))
        while not os.path.exists(flag):
            time.sleep(0.05)
        return "waited"
    try:
        pretrain_gpt.main(argv)
    finally:
        open(flag, "w").close()


def test_hung_peer_times_out(tmp_path, capfd):
    argv = TINY + ["--train-iters", "4", "--distributed-timeout-minutes", "0.1"]
    survivor, _ = run_distributed(
        _hang_one_rank, 2, argv, str(tmp_path / "gave_up"), init_group=False, keep_failures=True, timeout=NO_HANG_S
    )
    assert isinstance(survivor, RankFailure) and "SystemExit: 1" in survivor.message
    err = capfd.readouterr().err
    # 0.1 minutes = 6000 ms, gloo's own count, in the step's first collective (the gradient all-reduce of
    # the data-parallel group, overlapped: the loss report queued behind it finds its pair closed), within
    # NO_HANG_S: the flag reaches the groups build_groups makes, not only the default one
    assert re.search(
        r"^error: rank 0: a collective timed out in .*: (Timed out waiting 6000ms|Application timeout caused "
        r"pair closure).*"
        r"--distributed-timeout-minutes 0.1 behind; rerun it \(no --save",
        err,
        re.M,
    ), err[-3000:]


# ---- --async-save: the write runs behind the training, and a kill during it loses nothing sealed ----
def _async_behind_training(rank, world_size, argv):
    """The writes of the save at iteration 2 wait until step 3 has run: training went on meanwhile."""
    stepped, waited = threading.Event(), []
    write, step = save.write_rank_file, loop.train_step

    def write_after_next_step(tmp, rank_, state):
        if files.iter_name(2) in tmp:
            waited.append(stepped.wait(timeout=NO_HANG_S))  # a synchronous save would time out here
        return write(tmp, rank_, state)

    def step_and_tell(run, *timers):
        out = step(run, *timers)
        if run.state.iteration == 3:
            stepped.set()
        return out

    save.write_rank_file, loop.train_step = write_after_next_step, step_and_tell
    try:
        run = training.setup(validate(parse_args(argv), world_size))
        losses = [h["loss"] for h in training.train(run)]
    finally:
        save.write_rank_file, loop.train_step = write, step
    return waited, losses


def _plain(rank, world_size, argv):
    return [h["loss"] for h in training.train(training.setup(validate(parse_args(argv), world_size)))]


def test_async_save_writes_behind_training_and_saves_the_same(tmp_path):
    sync, background = str(tmp_path / "sync"), str(tmp_path / "async")
    argv = TINY + ["--train-iters", "4", "--save-interval", "2"]
    waited, losses = run_distributed(_async_behind_training, 1, argv + ["--save", background, "--async-save"])[0]
    assert waited == [True]
    assert losses == run_distributed(_plain, 1, argv + ["--save", sync])[0]
    assert open(os.path.join(background, "latest")).read().strip() == "iter_0000004"
    for it in ("iter_0000002", "iter_0000004"):
        got, want = (files.RankFile(os.path.join(d, it, files.rank_file(0))).state() for d in (background, sync))
        assert_same_state(got, want, it)


def _die_in_second_async_write(rank, world_size, argv):
    """Rank 1's writer thread writes half of its file of the second save (iteration 4), then SIGKILLs
    the process, training having gone on meanwhile."""
    if rank == 1:
        write = save.write_rank_file

        def write_half_then_die(tmp, rank_, state):
            if files.iter_name(4) in tmp:
                with open(os.path.join(tmp, files.rank_file(rank_)), "wb") as f:
                    f.write(b"\0" * 1000)
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return write(tmp, rank_, state)

        save.write_rank_file = write_half_then_die
    pretrain_gpt.main(argv)


def test_kill_during_async_write_keeps_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = TINY + ["--train-iters", str(SAVE_ITERS)]
    survivor, dead = run_distributed(
        _die_in_second_async_write,
        2,
        argv + ["--save", ckpt, "--save-interval", "2", "--async-save"],
        init_group=False,
        keep_failures=True,
        timeout=NO_HANG_S,
    )
    assert isinstance(dead, RankFailure) and "exited with code -9" in dead.message
    assert isinstance(survivor, RankFailure) and "SystemExit: 1" in survivor.message
    # the save of iteration 2 was sealed when the next one began; that of iteration 4 never was
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000002"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000004"))
    for start, resumed, plain in run_distributed(_resume_and_plain, 2, argv, ckpt, timeout=NO_HANG_S):
        assert start == (2, 2 * 4)
        assert resumed == plain[2:]


# ---- a full disk during a synchronous save ------------------------------------------------
DISK = (
    "--mock-data --device cpu --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 "
    "--num-layers 2 --global-batch-size 2 --micro-batch-size 1 --save-interval 1 --peak-tflops 1 --eval-iters 0"
).split()
FORMATS = {"zpp": [], "torch_dist": ["--ckpt-format", "torch_dist"]}


def _pretrain(argv) -> int:
    try:
        return pretrain_gpt.main(argv) or 0
    except SystemExit as e:
        return int(e.code or 0)


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """{format: root holding iteration 1 and `latest`} and a snapshot of those files (which every test
    here checks are left as they were)."""
    base = tmp_path_factory.mktemp("disk")
    roots = {f: str(base / f) for f in FORMATS}
    for f, flags in FORMATS.items():
        assert _pretrain(DISK + flags + ["--train-iters", "1", "--save", roots[f]]) == 0
    return roots, {f: _files_of(r) for f, r in roots.items()}


def _files_of(root) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        out.update({os.path.join(d, n): open(os.path.join(d, n), "rb").read() for n in names if n != ".lock"})
    return out


def _one_line_and_kept(err: str, root: str, before: dict, cause: str) -> None:
    """One error line naming the cause and the file, the failed save's .tmp gone, iteration 1 and `latest` intact."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert re.fullmatch(
        rf"error: rank 0: cannot save iteration 2 to {re.escape(root)}: {cause} writing {re.escape(root)}/iter_0000002"
        rf"\.tmp\S*; free space or give another --save; {re.escape(root)}/latest still names iter_0000001",
        lines[0],
    ), lines[0]
    assert _files_of(root) == before and not [n for n in os.listdir(root) if n.endswith(".tmp")]


def test_full_disk_during_a_save_is_one_line_and_keeps_the_previous(saved_once, monkeypatch, capfd):
    """ENOSPC as each writer reports it: safetensors' SafetensorError ("os error 28"), and torch's zip writer
    inside DCP ("unexpected pos", the errno lost; a CheckpointException, a BaseException) on a full file system."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint import filesystem

    roots, before = saved_once
    capfd.readouterr()

    def no_space(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def short_write(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    full = os.statvfs_result((4096, 4096, 100, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(files, "save_file", no_space)
    monkeypatch.setattr(filesystem, "_write_item", short_write)
    monkeypatch.setattr(files.os, "statvfs", lambda path: full)
    for f, flags in FORMATS.items():
        try:
            assert _pretrain(DISK + flags + ["--train-iters", "2", "--load", roots[f], "--save", roots[f]]) == 1
        finally:
            guard.release_save_dirs()  # the failed run's --save lock, which only a process's end drops
        _one_line_and_kept(capfd.readouterr().err, roots[f], before[f], "no space left on device")


def test_file_size_limit_during_a_save_in_a_real_process(saved_once):
    """The real writers under RLIMIT_FSIZE (SIGXFSZ ignored, so a write past it fails with EFBIG): the
    same one line (naming the limit), nothing written kept, the previous checkpoint intact."""
    roots, before = saved_once
    limit = 64 << 10  # below a rank file of this model with its AdamW state

    def limited():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    runs = [
        DISK + flags + ["--train-iters", "2", "--load", roots[f], "--save", roots[f]] for f, flags in FORMATS.items()
    ]
    both = (  # one process, one import of torch: a run per format, each ending in SystemExit
        "import json, sys, pretrain_gpt\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    try:\n        pretrain_gpt.main(argv)\n"
        "    except SystemExit as e:\n        print(f'exit {e.code}', file=sys.stderr, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", both, json.dumps(runs)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, preexec_fn=limited,
    )  # fmt: skip
    parts = out.stderr.split("exit ")
    assert out.returncode == 0 and len(parts) == 3 and all(p.startswith("1\n") for p in parts[1:]), out.stderr[-3000:]
    for f, err in zip(FORMATS, parts[:2]):
        _one_line_and_kept(err, roots[f], before[f], r"file too large \(the file-size limit, ulimit -f\)")
