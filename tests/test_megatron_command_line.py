"""A Megatron-LM command line in one pass (arguments.parse_config, as pretrain_gpt.py calls it): every
refused flag, every bad value, the --load check and the input files' check in one ConfigError; --load as
Megatron-LM reads it (validation.check_load: no checkpoint is a start from scratch unless
--exit-on-missing-checkpoint; megatron-core's tracker is recognised); the Megatron spelling of a setting
given beside ours with another value; the hybrid periods Megatron accepts but that leave one kind of layer."""

import os

import pytest

from megatron_zpp.checkpoint.mcore import TRACKER
from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_config
from megatron_zpp.data.inputs import check_inputs
from megatron_zpp.validation.checkpoint import find_load
from megatron_zpp.validation.model import model_warnings

TINY = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --device cpu".split()


def errors(argv: list[str], world: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(TINY + argv, world, inputs=check_inputs)
    return str(info.value).splitlines()


def test_every_problem_of_a_command_line_in_one_pass(tmp_path):
    missing = str(tmp_path / "none")
    lines = errors(["--use-mup", "--mock-data", "--load", missing, "--exit-on-missing-checkpoint", "--lr", "nan"])
    assert lines == [
        "--use-mup: the muP parametrization is not built: drop it",
        "--lr nan must be a finite number",  # a value check that stops the others still has --load's beside it
        f"--load {missing}: does not exist (--exit-on-missing-checkpoint)",
    ]
    lines = errors(["--use-mup", "--data-path", missing, "--pretrained-checkpoint", missing, "--seed", "-1"])
    assert lines[0].startswith("--use-mup: ") and "--seed -1 must be in [0, 2^32)" in lines
    assert f"--pretrained-checkpoint {missing}: does not exist" in lines
    assert len(lines) == 3  # the data files are checked once the settings pass
    lines = errors(["--use-mup", "--data-path", missing])  # ... and then beside the refused flags
    assert lines == [
        "--use-mup: the muP parametrization is not built: drop it",
        f"--data-path {missing}: {missing}.idx is missing",
    ]
    lines = errors(["--use-mup", "--data-path", missing, "--num-layers", "3", "--pipeline-model-parallel-size", "2"])
    assert len(lines) == 3 and not any("--data-path" in ln for ln in lines), lines  # (not when a setting failed)


def test_load_without_a_checkpoint_starts_from_scratch_as_megatron(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for load in (str(empty), str(tmp_path / "absent")):  # a first CI run: accepted (the run warns)
        assert parse_config(TINY + ["--mock-data", "--load", load], 1).train.load == load
        assert find_load(load, None) == (None, None)
    (line,) = errors(["--mock-data", "--load", str(empty), "--exit-on-missing-checkpoint"])
    assert line == f"--load {empty}: holds no checkpoint (no 'latest', no meta.json) (--exit-on-missing-checkpoint)"
    (empty / "latest").write_text("../x")  # a checkpoint that is there: the load reads and checks it
    assert find_load(str(empty), None) == ("ours", None)


def test_megatron_core_checkpoints_are_recognised_by_their_tracker(tmp_path):
    root = tmp_path / "mlm"
    (root / "iter_0000005").mkdir(parents=True)
    (root / TRACKER).write_text("5")
    (line,) = errors(["--mock-data", "--load", str(root)])  # the tracker names a dir without DCP's metadata
    assert line.startswith(f"--load {root}: a megatron-core checkpoint that cannot be read: ") and ".metadata" in line
    (root / "iter_0000005" / ".metadata").write_bytes(b"")
    assert find_load(str(root), None) == ("mcore", None)  # a run converts it on the fly
    assert find_load(str(root / "iter_0000005"), None) == ("mcore", None)
    (line,) = errors(["--mock-data", "--pretrained-checkpoint", str(root)])
    convert = f"python tools/convert_checkpoint.py --from megatron --to sharded --load {root} --output DIR"
    assert line == f"--pretrained-checkpoint {root}: a megatron-core checkpoint: convert it first with {convert}"
    assert sorted(os.listdir(root)) == sorted(["iter_0000005", TRACKER])  # nothing written there


GDN = "--attention-type gdn --mock-data".split()


def test_megatron_and_our_spelling_of_the_hybrid_period_must_agree():
    m = parse_config(TINY + GDN + ["--linear-attention-freq", "2", "--softmax-attention-every", "2"], 1).model
    assert m.softmax_attention_every == 2
    (line,) = errors(GDN + ["--softmax-attention-every", "2", "--linear-attention-freq", "4"])
    assert line == "--linear-attention-freq 4 and --softmax-attention-every 2 disagree (the same setting): give one"


@pytest.mark.parametrize(
    "period, warning",
    [
        (2, None),
        (4, None),
        (1, "--softmax-attention-every 1 (Megatron's --linear-attention-freq 1): every layer is softmax attention"),
        (5, "--softmax-attention-every 5 (Megatron's --linear-attention-freq 5) is past --num-layers 4: no layer"),
    ],
)
def test_hybrid_periods_megatron_accepts_that_leave_one_kind_warn(period, warning):
    cfg = parse_config(TINY + GDN + ["--linear-attention-freq", str(period)], 1)
    kinds = {cfg.model.layer_kind(i) for i in range(4)}
    got = model_warnings(cfg)
    assert (got == []) == (warning is None) and len(kinds) == (2 if warning is None else 1), (got, kinds)
    assert warning is None or got[0].startswith(warning)
