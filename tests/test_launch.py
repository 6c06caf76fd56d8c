"""The launch recipes run as a cluster would run them, on 2 emulated nodes of 1 CPU rank each
(gloo): the SLURM batch script under a fake `srun`/`scontrol` (tasks started with the variables
SLURM gives them; SIGUSR1 as `#SBATCH --signal=USR1@120` delivers it), then the plain
multi-node torchrun recipe (one torchrun per node, c10d rendezvous); a refused command line under
torchrun, said once. Ctrl-C (SIGINT) as torchrun
forwards it to every rank: each finishes the step, the run saves when --save is given, one line
per rank, exit 130; a second Ctrl-C stops at once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from megatron_zpp.training import loop
from tests.dist import free_port, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the recipes' GPT-1.3B shrunk through the size flags only (flags after the script win over its config)
TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --vocab-size 128 "
    "--make-vocab-size-divisible-by 32 --micro-batch-size 1 --global-batch-size 2 --lr-warmup-iters 1 "
    "--log-interval 1 --eval-interval 0 --num-workers 0 --device cpu --peak-tflops 1"
).split()

# srun as SLURM runs a job step: SLURM_NNODES x SLURM_NTASKS_PER_NODE tasks, each with its own
# SLURM_PROCID/LOCALID/NODEID (here all on this host); the exit status is the worst task's.
# The task pids go to $FAKE_SLURM_DIR/pids (the test signals tasks as SLURM does: not srun).
FAKE_SRUN = r"""#!/usr/bin/env bash
while [[ "$1" == -* ]]; do shift; done   # srun's own options
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  for ((local = 0; local < SLURM_NTASKS_PER_NODE; local++)); do
    SLURM_PROCID=$((node * SLURM_NTASKS_PER_NODE + local)) SLURM_LOCALID=$local SLURM_NODEID=$node \
      SLURM_NTASKS=$((SLURM_NNODES * SLURM_NTASKS_PER_NODE)) SLURMD_NODENAME=node$node SLURM_STEP_ID=0 "$@" &
    pids+=($!)
  done
done
echo "${pids[@]}" > "$FAKE_SLURM_DIR/pids"
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_SLURM_DIR/scontrol.log"
if [ "$1 $2" = "show hostnames" ]; then for ((n = 0; n < SLURM_NNODES; n++)); do echo localhost; done; fi
"""


def _fake_slurm(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(tmp_path),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_SUBMIT_DIR=ROOT,
        MASTER_PORT=str(free_port()),
        PYTHON=sys.executable,
        MOCK_DATA="1",
        RUN_DIR=str(tmp_path / "run"),
        TRAIN_ITERS="12",
        PYTHONWARNINGS="ignore",
    )


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_slurm_recipe_stops_on_sigusr1_requeues_and_resumes(tmp_path):
    env = _fake_slurm(tmp_path)
    run, script = tmp_path / "run", ["bash", os.path.join(ROOT, "examples/slurm/gpt1.3b_zeropp.sbatch"), *TINY]
    job = subprocess.Popen(script, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # one signal, to one task (rank 1), once training is under way: every rank must stop at the same step
    while _lines(run / "metrics.jsonl") < 1 and job.poll() is None:
        time.sleep(0.01)
    assert job.poll() is None, job.communicate()[0][-4000:]
    rank1 = int((tmp_path / "pids").read_text().split()[1])
    os.kill(rank1, signal.SIGUSR1)
    out, _ = job.communicate(timeout=400)
    assert job.returncode == 0, out[-4000:]
    latest = (run / "ckpt" / "latest").read_text().strip()
    stopped = int(latest.removeprefix("iter_"))
    assert 1 <= stopped < 12, out[-3000:]
    assert f"SIGUSR1 or SIGTERM received: stopped after iteration {stopped}" in out
    assert "requeueing job 4242" in out
    scontrol = (tmp_path / "scontrol.log").read_text().splitlines()
    assert scontrol == ["scontrol show hostnames node[0-1]", "scontrol requeue 4242"]
    assert "2 node(s) of 1 ranks" in out  # the node layout came from SLURM's variables

    # the requeued job: the same script, SLURM_RESTART_COUNT set; it resumes and finishes
    env["SLURM_RESTART_COUNT"] = "1"
    again = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-2000:]
    assert f"loaded {run}/ckpt/iter_{stopped:07d}: iteration {stopped}" in again.stdout
    assert (run / "ckpt" / "latest").read_text().strip() == "iter_0000012"
    assert "requeue" not in again.stdout and len((tmp_path / "scontrol.log").read_text().splitlines()) == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 13))  # each step once, in order


def test_torchrun_multinode_recipe_on_two_nodes(tmp_path):
    """One torchrun per node (here both on this host), meeting at a c10d rendezvous."""
    env = dict(
        os.environ,
        NNODES="2",
        GPUS_PER_NODE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RDZV_ID="test",
        RUN_DIR=str(tmp_path / "run"),
        MOCK_DATA="1",
        TORCHRUN=os.path.join(os.path.dirname(sys.executable), "torchrun"),
        PYTHONWARNINGS="ignore",
    )
    cmd = ["bash", "examples/torchrun_multinode.sh", *TINY, "--train-iters", "2"]
    nodes = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outs = [node.communicate(timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    out = "".join(outs)
    assert "world 2 = TP 1 x CP 1 x DP 2 x PP 1" in out and "2 node(s) of 1 ranks" in out
    assert "iteration        2/       2" in out
    assert (tmp_path / "run" / "ckpt" / "latest").read_text().strip() == "iter_0000002"


def test_torchrun_refusal_is_said_once_in_one_pass(tmp_path):
    """A refused command line under torchrun with 2 ranks: every problem (a Megatron flag not built, a value,
    the --load check) in one pass, said once by rank 0 (the other rank waits quietly and torchrun stops it);
    nothing written to --load."""
    load = tmp_path / "none"
    argv = [*TINY, "--mock-data", "--train-iters", "2", "--load", str(load), "--exit-on-missing-checkpoint"]
    argv += ["--use-mup", "--seed", "-1"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py", *argv]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode != 0 and 'pretrain_gpt.py", line' not in out.stderr  # torchrun's own traceback only
    assert len(errors) == 3 and errors[0].startswith("error: rank 0: --use-mup: the muP parametrization is not built")
    assert "exitcode  : 2" in out.stderr and "(SIGTERM)" in out.stderr, out.stderr[-3000:]  # rank 1: stopped, quiet
    assert "--seed -1 must be in [0, 2^32)" in "\n".join(errors)
    assert f"--load {load}: does not exist (--exit-on-missing-checkpoint)" in errors[-1]
    assert not load.exists()


def _sigint_after_step(step: int, times: int = 1):
    """Ctrl-C on this process (times in a row) right after the loop's step `step` returned: after
    that step's check, so the run stops after the next step. Returns what to put back."""
    train_step = loop.train_step

    def step_then_interrupt(run, *timers):
        out = train_step(run, *timers)
        if run.state.iteration == step - 1:  # the counter moves after the step returns
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return out

    loop.train_step = step_then_interrupt
    return train_step


def _main_exit_code(argv) -> int:
    try:
        pretrain_gpt.main(argv)
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_in_one_process(monkeypatch, capsys, times):
    """Without --save: one line, exit 130, no traceback; the handler pytest had is back afterwards.
    A second Ctrl-C interrupts the step it lands in."""
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(loop, "train_step", loop.train_step)  # restored after the test
    _sigint_after_step(2, times)
    code = _main_exit_code([*TINY, "--mock-data", "--train-iters", "50"])
    out = capsys.readouterr()
    lines = [x for x in out.out.splitlines() if "interrupted" in x]
    if times == 1:
        assert lines == ["rank 0: interrupted by SIGINT (Ctrl-C): stopped after iteration 3, not saved (no --save)"]
        assert signal.getsignal(signal.SIGINT) is before
    else:
        assert lines == ["rank 0: interrupted by SIGINT: stopped at once, not saved"]
    assert code == 130 and "Traceback" not in out.err + out.out


def _interrupt_rank_1(rank, world_size, argv):
    if rank == 1:
        _sigint_after_step(2)
    return _main_exit_code(argv)


def test_ctrl_c_on_two_ranks_saves_once_and_each_rank_says_so(tmp_path, capfd):
    """A SIGINT (torchrun forwards one to every rank) that reached only rank 1 after its second
    step's check: both ranks finish the third step, save it, print one line each and exit 130."""
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--mock-data", "--train-iters", "50", "--save", str(ckpt)]
    codes = run_distributed(_interrupt_rank_1, 2, argv, init_group=False, timeout=300)
    out = capfd.readouterr()
    assert codes == [130, 130], out.out[-3000:] + out.err[-3000:]
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    saved = f"stopped after iteration 3, saved {ckpt}/iter_0000003; resume with --load {ckpt}"
    lines = sorted(x for x in out.out.splitlines() if "SIGINT" in x)
    assert lines == [f"rank {r}: interrupted by SIGINT (Ctrl-C): {saved}" for r in (0, 1)]
    assert "Traceback" not in out.out + out.err
