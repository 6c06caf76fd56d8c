"""Sharded checkpoints resume exactly, and refuse what they cannot load.

Exact resume with Megatron's default dropout (fp32, CPU, gloo; plain DP, ZeRO-3, TP2 with
sequence parallelism, PP2 on 2 ranks; ZeRO++ with qwZ, hpZ and
qgZ on 2 emulated nodes of 2 ranks): a run of 2N steps that
saves every N steps must give the same per-step losses as one that never saves; then a
new process loading the step-N checkpoint and running N more steps must give bitwise the
same losses for steps N+1..2N and bitwise the same final weights.
"""

import json
import os

import numpy as np
import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, files
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS_WITH_DROPOUT

N = 3
BASE = (
    OLD_DEFAULTS_WITH_DROPOUT  # Megatron's default dropout: every stream it draws from is restored
    + (
        f"--mock-data --hidden-size 32 --num-attention-heads 4 --group-query-attention "
        f"--num-query-groups 2 --seq-length "
        f"32 --vocab-size 128 --make-vocab-size-divisible-by 32 --num-layers 2 --attention-type "
        f"gla --softmax-attention-every 2 --gla-chunk-size 8 --train-iters {2 * N} "
        f"--global-batch-size 4 --micro-batch-size 1 --lr 3e-3 --lr-warmup-iters 2 --clip-grad 0.5 "
        f"--seed 11 --peak-tflops 1"
    ).split()
)
LAYOUTS = {
    "dp2": (2, []),
    "zero3": (2, ["--zero-stage", "3"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    # ZeRO++ on 2 emulated nodes of 2 ranks: qwZ, hpZ secondary shards, qgZ
    "zeropp": (
        4,
        (
            "--zero-stage 3 --ranks-per-node 2 --zero-quantized-weights --zero-hpz-partition-size 2 "
            "--zero-quantized-gradients --zero-quantization-block-size 64"
        ).split(),
    ),
}


def run_once(argv: list[str], world_size: int) -> dict:
    run = training.setup(validate(parse_args(argv), world_size))
    losses = [h["loss"] for h in training.train(run)]
    with run.dp.full_parameters():
        # numpy, not tensors: a tensor sent back through the spawn queue dies with its process; a copy,
        # not a numpy view (a view pins the storage that ZeRO-3 frees when full_parameters ends)
        weights = {
            f"{c}.{n}": p.detach().clone().numpy()
            for c, chunk in enumerate(run.chunks)
            for n, p in chunk.named_parameters()
        }
    return {
        "losses": losses,
        "weights": weights,
        "iteration": run.state.iteration,
        "consumed": run.state.consumed_samples,
    }


def _first_leg(rank, world_size, argv, ckpt):
    plain = run_once(argv, world_size)
    saving = run_once(argv + ["--save", ckpt, "--save-interval", str(N)], world_size)
    return plain, saving


def _second_leg(rank, world_size, argv, ckpt):
    return run_once(argv + ["--load", ckpt], world_size)


def point_latest_at(ckpt: str, iteration: int) -> None:
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write(f"iter_{iteration:07d}\n")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exact_resume(layout, tmp_path):
    world, extra = LAYOUTS[layout]
    argv, ckpt = BASE + extra, str(tmp_path / "ckpt")
    first = run_distributed(_first_leg, world, argv, ckpt)
    meta = json.loads((tmp_path / "ckpt" / "iter_0000003" / "meta.json").read_text())
    assert meta["iteration"] == N and meta["consumed_samples"] == 4 * N and meta["world_size"] == world
    assert sorted(meta["files"]) == [files.rank_file(r) for r in range(world)]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000006"
    point_latest_at(ckpt, N)  # as if the run had stopped after step N
    second = run_distributed(_second_leg, world, argv, ckpt)
    for (plain, saving), resumed in zip(first, second):
        assert saving["losses"] == plain["losses"], "saving changed the run"
        assert resumed["losses"] == plain["losses"][N:], "resumed losses differ"
        assert resumed["iteration"] == 2 * N and resumed["consumed"] == plain["consumed"]
        for name, w in plain["weights"].items():
            np.testing.assert_array_equal(resumed["weights"][name], w, err_msg=name)
    assert plain["losses"][-1] < plain["losses"][0]


# ---- failures (single process: fast) ------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-rank checkpoint at iteration N and one at 2N; `latest` names 2N."""
    ckpt = str(tmp_path_factory.mktemp("single") / "ckpt")
    run_once(BASE + ["--save", ckpt, "--save-interval", str(N)], 1)
    return ckpt


def _setup(argv, world=1):
    return training.setup(validate(parse_args(argv), world))


def test_corrupted_shard_names_the_file(saved, tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    shard = os.path.join(ckpt, "iter_0000006", files.rank_file(0))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors.*corrupted or truncated"):
        _setup(BASE + ["--load", ckpt])


def test_interrupted_save_keeps_previous(saved, tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    point_latest_at(ckpt, N)
    # a save of step 2N that died midway: a partial directory (no meta.json), `latest` not updated
    shutil.rmtree(os.path.join(ckpt, "iter_0000006"))
    os.makedirs(os.path.join(ckpt, "iter_0000006.tmp"))
    with open(os.path.join(ckpt, "iter_0000006.tmp", files.rank_file(0)), "wb") as f:
        f.write(b"partial")
    run = _setup(BASE + ["--load", ckpt])
    assert run.state.iteration == N and run.state.consumed_samples == 4 * N
    # and the next save of that step replaces the leftovers
    run.cfg.train.save = ckpt
    training.train(run)
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000006"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000006.tmp"))


def test_other_model_shape_says_what_differs(saved, tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    meta_path = os.path.join(ckpt, "iter_0000006", "meta.json")
    with pytest.raises(
        CheckpointError,
        match=r"holds another model \(embedding\.weight \(128, 32\) \(checkpoint\) "
        r"vs \(128, 64\) \(this run\).*: hidden_size 32 \(checkpoint\) vs "
        r"64 \(this run\)",
    ):
        _setup(
            [a if a != "32" or i != BASE.index("--hidden-size") + 1 else "64" for i, a in enumerate(BASE)]
            + ["--load", ckpt]
        )
    assert json.load(open(meta_path))["layout"]["tp"] == 1


def test_missing_checkpoint_starts_from_scratch_when_load_is_save(tmp_path):
    """A requeued job's first start (an empty --load elsewhere is an error: tests/checkpoint/test_load_save.py)."""
    run = _setup(BASE + ["--load", str(tmp_path / "nothing"), "--save", str(tmp_path / "nothing")])
    assert run.state.iteration == 0 and run.state.consumed_samples == 0


def test_rank_file_is_safetensors_with_nothing_pickled(saved):
    from safetensors import safe_open

    path = os.path.join(saved, "iter_0000006", files.rank_file(0))
    with open(path, "rb") as f:
        assert b"pickle" not in f.read(1 << 16) and not path.endswith(".pt")
    skeleton = json.loads(safe_open(path, framework="pt").metadata()["megatron_zpp"])  # the dict's shape: JSON
    want = {"rank", "iteration", "consumed_samples", "layout", "model", "optimizer", "rng", "buffers"}
    assert {k for k, _ in skeleton["d"]} == want
    state = files.RankFile(path).state()
    assert isinstance(state["rng"]["numpy"]["keys"], torch.Tensor) and isinstance(state["rng"]["python"]["state"], list)
    assert isinstance(state["optimizer"]["param_groups"][0]["betas"], tuple)  # tuples stay tuples
    assert sorted(state["optimizer"]["state"])[0] == 0  # int keys stay ints
    assert np.isfinite(sum(float(t.sum()) for t in state["model"].values()))


def test_ckpt_step_loads_that_iteration(saved):
    run = _setup(BASE + ["--load", saved, "--ckpt-step", str(N)])
    assert run.state.iteration == N and run.state.consumed_samples == 4 * N
    with pytest.raises(
        CheckpointError,
        match=r"--ckpt-step 5: .*iter_0000005 does not exist \(saved iterations in "
        r".*: iter_0000003, iter_0000006\)",
    ):
        _setup(BASE + ["--load", saved, "--ckpt-step", "5"])


def test_metrics_file_keeps_the_steps_before_the_resume(saved, tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    training.train(_setup(BASE + ["--metrics-file", metrics]))
    with open(metrics, "a") as f:
        f.write(json.dumps({"iteration": 99}) + "\n")  # a step the resumed run does not reach
    training.train(_setup(BASE + ["--metrics-file", metrics, "--load", saved, "--ckpt-step", str(N)]))
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in rows] == list(range(1, 2 * N + 1))
    # the first step after the load names its checkpoint (tools/plot_metrics.py marks the resume there)
    assert [(r["iteration"], r["resumed_from"]) for r in rows if "resumed_from" in r] == [
        (N + 1, os.path.join(saved, f"iter_{N:07d}"))
    ]
