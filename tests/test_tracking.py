"""Experiment tracking that follows a resumed run (W&B id in the checkpoint, tensorboard's step
axis), and profiling: --profile's torch.profiler window, what needs CUDA refused on CPU."""

import gzip
import json
import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.training import profiling
from megatron_zpp.validation import validate
from tests.test_training import TINY, run_training


def test_wandb_and_tensorboard_continue_the_resumed_run_and_profile_a_window(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")  # --wandb-mode unset: W&B's own variable decides
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    inits = []  # (id asked for, resume, id of the run W&B started)
    real_init = wandb.init

    def recording_init(**kw):
        run = real_init(**kw)
        inits.append((kw.get("id"), kw.get("resume"), run.id))
        return run

    monkeypatch.setattr(wandb, "init", recording_init)
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    argv = (
        TINY + f"--train-iters 6 --tensorboard-dir {tb} --wandb-project zpp --wandb-exp-name tiny --save {ckpt}".split()
    )
    window = "--profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 4".split()
    whole, _ = run_training(argv + ["--save-interval", "3"] + window, 1)
    resumed, _ = run_training(argv + ["--load", str(ckpt), "--ckpt-step", "3"] + window, 1)  # past the window

    # W&B: the first run's id is in every checkpoint; the resumed run continues it
    (first_id, first_resume, run_id), again = inits
    assert first_id is None and first_resume is None
    assert again == (run_id, "allow", run_id)
    for it in (3, 6):
        meta = json.loads((ckpt / f"iter_{it:07d}" / "meta.json").read_text())
        assert meta["tracking"] == {"wandb_run_id": run_id}
    offline = list((ckpt / "wandb" / "wandb").glob("offline-run-*"))  # default dir, as Megatron: --save DIR/wandb
    assert offline and all(d.name.endswith(f"-{run_id}") for d in offline)

    # tensorboard: one loss per step; steps 4-6 are the resumed run's (purge_step drops the first run's)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    scalars = acc.Scalars("loss")
    assert [s.step for s in scalars] == [1, 2, 3, 4, 5, 6]
    assert [s.value for s in scalars[3:]] == pytest.approx(resumed, rel=1e-6)  # float32 in the event file
    assert resumed == whole[3:]

    # --profile: Megatron's place beside --tensorboard-dir; iterations 2 and 3 (end exclusive), once
    trace = tmp_path / "torch_profile" / "rank-0.json.gz"
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2, steps
    assert any("aten::mm" in e.get("name", "") for e in events)  # the model's matmuls are in it


def _cfg(extra: str, world: int = 1):
    return validate(parse_args(TINY + extra.split()), world)


def test_profiling_flags_are_checked_and_cuda_only_ones_refused_on_cpu():
    def error(extra, world=1):
        with pytest.raises(ConfigError) as e:
            _cfg(extra, world)
        return str(e.value)

    assert "--use-pytorch-profiler needs --profile" in error("--use-pytorch-profiler")
    assert "--profile-step-start 5 must be >= 0 and below --profile-step-end 5" in error(
        "--profile --use-pytorch-profiler --profile-step-start 5 --profile-step-end 5"
    )
    assert "--profile-ranks 2: no such rank (world size 2)" in error("--profile --profile-ranks 0 2", world=2)
    assert "--exit-signal SIGUSR1 needs --exit-signal-handler" in error("--exit-signal SIGUSR1")
    assert "--exit-signal SIGKILL: not one of SIGTERM" in error("--exit-signal-handler --save x --exit-signal SIGKILL")
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^--profile without --use-pytorch-profiler .* needs CUDA"):
        profiling.check_device(_cfg("--profile"), cpu)
    with pytest.raises(ConfigError, match=r"^--record-memory-history .* needs CUDA"):
        profiling.check_device(_cfg("--record-memory-history"), cpu)
    profiling.check_device(_cfg("--profile --use-pytorch-profiler"), cpu)  # works on CPU: no error


def test_memory_history_calls_on_cuda(tmp_path, monkeypatch):
    """Wiring only (no GPU here): what --record-memory-history asks of torch.cuda.memory, on which ranks."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    cfg = _cfg(
        f"--record-memory-history --memory-snapshot-path {tmp_path}/snap.pickle --profile-ranks 1 --device cuda", 2
    )
    cuda = torch.device("cuda", 0)
    profiling.check_device(cfg, cuda)
    profiling.MemorySnapshots(cfg, 0, cuda).dump()  # rank 0 is not in --profile-ranks
    assert calls == []
    profiling.MemorySnapshots(cfg, 1, cuda).dump()
    assert calls == [("record", {"max_entries": 100_000, "device": cuda}), ("dump", f"{tmp_path}/snap_1.pickle")]
    assert os.path.isdir(tmp_path)
