"""The planning tools (tools/estimate_memory.py, tools/simulate_scaling.py) accept every shipped config
as it is: they check the model and the layout, not what only a run reads or writes (data,
tokenizer files, checkpoint directories), which pretrain_gpt.py still checks. The simulator prints MFU
against the preset's data-sheet peak, or against --peak-tflops when given."""

import glob
import importlib.util
import json
import os

import pytest

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


estimate_memory, simulate_scaling = _tool("estimate_memory"), _tool("simulate_scaling")


def test_configs_are_shipped():
    assert len(CONFIGS) >= 2, CONFIGS


# the world size of a config whose layout needs more than one rank (the others are planned at 1)
WORLD = {"demo_gdn_cpu.yaml": 8}


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_is_planned_as_it_is(config, capsys):
    world = ["--world-size", str(WORLD.get(os.path.basename(config), 1))]
    assert estimate_memory.main(["--config", config, *world]) == 0, capsys.readouterr().err
    assert "peak" in capsys.readouterr().out
    assert simulate_scaling.main(["--config", config, *world]) == 0, capsys.readouterr().err
    assert "MFU" in capsys.readouterr().out


def test_a_run_still_checks_its_paths():
    config = os.path.join(ROOT, "examples", "configs", "gpt1.3b_zeropp.yaml")
    with pytest.raises(ConfigError) as e:
        validate(parse_args(["--config", config]), 8)
    lines = str(e.value).splitlines()
    assert "--save-interval needs --save DIR (where to write checkpoints)" in lines
    assert "give --data-path PREFIX [...] or --mock-data" in lines
    validate(parse_args(["--config", config]), 8, run=False)  # the planning tools' rule: no path checks
    with pytest.raises(ConfigError, match="--num-attention-heads"):  # the model's checks still apply
        validate(parse_args(["--config", config, "--num-attention-heads", "7"]), 8, run=False)


SMALL = (
    "--world-size 8 --system a100 --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
    "--attention-type softmax --vocab-size 512 --global-batch-size 16 --json"
).split()


def _flops_per_token(layers=2, h=256, s=128, vocab=512):
    """Model FLOPs of a GeLU GPT written out: 2 per weight and token forward, causal attention
    2*s*h, backward twice the forward."""
    layer = 2 * (3 * h * h + h * h) + 2 * s * h + 2 * 2 * h * 4 * h
    return 3 * (2 * vocab * h + layers * layer)


@pytest.mark.parametrize("extra, peak", [([], 312.0), (["--peak-tflops", "100"], 100.0)])
def test_mfu_is_model_flops_over_the_peak(extra, peak, capsys):
    assert simulate_scaling.main(SMALL + extra) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["peak_tflops"] == peak
    per_rank = row["tokens_per_s"] * _flops_per_token() / 8 / 1e12
    assert row["mfu"] == pytest.approx(per_rank / peak, rel=1e-9)
    assert simulate_scaling.main([a for a in SMALL + extra if a != "--json"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("MFU"))
    assert f"{100 * per_rank / peak:.1f}%" in line
    assert ("(--peak-tflops)" in line) == bool(extra)


def test_mfu_without_a_known_peak_says_so(tmp_path, capsys):
    preset = simulate_scaling.preset("a100").to_json()
    preset["peak_tflops"] = 0.0
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(preset))
    assert simulate_scaling.main([*SMALL[:-1], "--system", "emulated", "--system-file", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("MFU"))
    assert "pass --peak-tflops" in line
