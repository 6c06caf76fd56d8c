"""Megatron's checkpoint flags: --no-save-optim/--no-save-rng leave those parts out,
--no-load-optim/--no-load-rng/--finetune skip them on load (a finetune starts at iteration 0 from
the weights alone: it trains as a weights-only checkpoint of the same tensors does),
--save-retain-interval thins old checkpoints as Megatron's does, and checkpoint and export files
get the umask's mode, not safetensors' 0600."""

import contextlib
import io
import os
import stat

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import files
from megatron_zpp.checkpoint.save import save_weights
from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS_WITH_DROPOUT

TINY = (
    OLD_DEFAULTS_WITH_DROPOUT  # dropout on: the RNG streams matter
    + (
        "--mock-data --device cpu --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--vocab-size 128 --make-vocab-size-divisible-by 32 --global-batch-size 2 --micro-batch-size 1 "
        "--seed 5 --peak-tflops 1 --lr 1e-2 --lr-warmup-iters 0"
    ).split()
)


def _setup(argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        run = training.setup(validate(parse_args(TINY + argv), 1))
    return run, out.getvalue()


def _train(argv):
    run, log = _setup(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        losses = [h["loss"] for h in training.train(run)]
    return run, losses, log


def _load_flags(rank, world, root, weights_dir):
    _train(["--save", root, "--train-iters", "2"])
    out = {}
    for name, flags in {
        "all": [],
        "no_optim": ["--no-load-optim"],
        "no_rng": ["--no-load-rng"],
        "finetune": ["--finetune"],
        "override": ["--override-ckpt-iteration", "1"],
    }.items():
        run, log = _setup(["--load", root, "--train-iters", "4", *flags])
        moments = len(run.dp.optimizer.state_dict()["state"])
        out[name] = (run.state.iteration, run.state.consumed_samples, moments, run.state.pending_rng_state is None)
        out[name + "_log"] = log
    weights = files.RankFile(os.path.join(root, "iter_0000002", files.rank_file(0))).state()["model"]
    cfg = validate(parse_args(TINY + ["--train-iters", "2"]), 1)
    save_weights(weights_dir, cfg, {k.removeprefix("chunk0."): v for k, v in weights.items()})
    out["finetune_losses"] = _train(["--load", root, "--finetune", "--train-iters", "2"])[1]
    out["weights_losses"] = _train(["--load", weights_dir, "--train-iters", "2"])[1]
    return out


def test_no_load_optim_rng_and_finetune(tmp_path):
    out = run_distributed(_load_flags, 1, str(tmp_path / "root"), str(tmp_path / "weights"))[0]
    n_params = out["all"][2]
    assert n_params > 0 and out["all"] == (2, 4, n_params, False)
    assert out["no_optim"] == (2, 4, 0, False)  # the position and the RNG, not AdamW
    assert "weights only (--no-load-optim: AdamW starts fresh from them)" in out["no_optim_log"]
    assert out["no_rng"] == (2, 4, n_params, True)
    assert "RNG states not loaded (--no-load-rng" in out["no_rng_log"]
    assert out["finetune"] == (0, 0, 0, True)
    assert out["override"] == (1, 1 * 2, n_params, False)  # Megatron's rule: N x the global batch (2)
    assert "iteration 0, 0 samples consumed" in out["finetune_log"]
    # a finetune is a fresh run from the checkpoint's weights: as a weights-only checkpoint of them
    assert out["finetune_losses"] == out["weights_losses"]


def _no_save_and_modes(rank, world, root):
    os.umask(0o022)
    _train(["--save", root, "--train-iters", "2", "--no-save-optim", "--no-save-rng"])
    state = files.RankFile(os.path.join(root, "iter_0000002", files.rank_file(0))).state()
    run, log = _setup(["--load", root, "--train-iters", "3"])
    return state["optimizer"], state["rng"], run.state.iteration, len(run.dp.optimizer.state_dict()["state"]), log


def test_no_save_optim_rng_and_file_modes(tmp_path):
    root = tmp_path / "root"
    optimizer, rng, iteration, moments, log = run_distributed(_no_save_and_modes, 1, str(root))[0]
    assert optimizer == {} and rng == {} and iteration == 2 and moments == 0
    assert "weights only (the checkpoint has no optimizer state)" in log
    modes = {
        p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in root.rglob("*")
        if p.is_file() and p.name != ".lock"
    }
    names = {"latest", "iter_0000002/meta.json", "iter_0000002/meta.json.sha256", "iter_0000002/rank_00000.safetensors"}
    assert names <= set(modes) and {modes[n] for n in names} == {0o644}, modes


def test_save_safetensors_takes_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        assert files.new_file_mode() == 0o640
        files.save_safetensors({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"), {"k": "v"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o640


def _retain(rank, world, root):
    _train(["--save", root, "--train-iters", "5", "--save-interval", "1", "--save-retain-interval", "2"])
    return files.saved_iterations(root)


def test_save_retain_interval(tmp_path):
    # Megatron's rule: once iteration i is saved, the one `latest` named before it goes unless a multiple of N
    kept, previous = [], None
    for i in range(1, 6):
        if previous is not None and previous % 2:
            kept.remove(previous)
        kept.append(i)
        previous = i
    assert kept == [2, 4, 5]
    assert run_distributed(_retain, 1, str(tmp_path / "root"))[0] == kept


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--save-retain-interval 3 --save-interval 2", "--save-retain-interval 3 must be a multiple of --save-inte"),
        ("--save-retain-interval 2", "--save-retain-interval needs --save DIR"),
        ("--finetune", "--finetune needs --load DIR"),
        ("--override-ckpt-iteration 3", "--override-ckpt-iteration needs --load DIR"),
        ("--ckpt-format torch", "--ckpt-format torch (Megatron's legacy per-rank torch.save pickles) is not built"),
    ],
)
def test_refusals(tmp_path, flags, message):
    argv = TINY + flags.split()
    if "--save-interval" in flags:
        argv += ["--save", str(tmp_path)]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(parse_args(argv), 1)


def _pretrained(rank, world, root, fresh):
    _train(["--save", root, "--train-iters", "2"])
    first, _ = _setup(["--load", fresh, "--save", fresh, "--pretrained-checkpoint", root, "--train-iters", "3"])
    _, log = _setup(["--load", fresh, "--save", fresh, "--train-iters", "3", "--override-checkpoint"])
    try:
        _setup(["--load", fresh, "--save", fresh, "--train-iters", "3", "--exit-on-missing-checkpoint"])
    except Exception as e:  # noqa: BLE001
        return first.state.iteration, log, str(e)
    return first.state.iteration, log, None


def test_pretrained_checkpoint_and_exit_on_missing(tmp_path):
    root, fresh = str(tmp_path / "root"), str(tmp_path / "fresh")
    iteration, log, error = run_distributed(_pretrained, 1, root, fresh)[0]
    assert iteration == 0  # --load held nothing: a finetune from --pretrained-checkpoint
    assert "starting from scratch" in log  # --load is --save, empty: a requeued job's first start
    assert error and "holds no checkpoint (no 'latest', no meta.json) (--exit-on-missing-checkpoint)" in error


def _async_nonfinite(rank, world, root):
    from megatron_zpp.checkpoint.save import finish_async_save, save_checkpoint

    run, _ = _setup(["--save", root, "--train-iters", "1", "--async-save"])
    next(iter(run.dp.model_state_dict().values())).view(-1)[0] = float("nan")
    save_checkpoint(run, root)  # returns at once: the check runs in the writer thread
    try:
        finish_async_save(run)
    except Exception as e:  # noqa: BLE001
        return str(e), os.path.exists(os.path.join(root, "latest"))
    return None, None


def test_async_save_refuses_a_nonfinite_state_when_sealing(tmp_path):
    error, sealed = run_distributed(_async_nonfinite, 1, str(tmp_path / "root"))[0]
    assert error.startswith(f"refused to save iteration 0 to {tmp_path / 'root'}: 1 non-finite tensors here"), error
    assert sealed is False
