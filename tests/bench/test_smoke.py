"""Every bench runs at a toy size in seconds and prints its table, so that a change of defaults or of an
interface cannot break a bench silently. In-process `main(argv)` calls (a python start costs seconds here);
no network namespaces, no GPU: a bench that needs one says so in one line, which is asserted.
bench/compile_gpu.py is covered by tests/kernels/test_compile_gpu.py, bench/zero.py by its own smoke test;
bench/simulator_validation.py measures on the emulated cluster, so its smoke test gives the predicting and
reporting half stand-in measurements."""

import json

import numpy as np
import pytest
import torch

from bench import (
    checkpoint,
    cp,
    gla,
    gpu_shapes,
    kernels,
    memory,
    moe,
    parallel,
    preprocess,
    quantize,
    recompute,
    simulator_validation,
    single_rank,
    token_check,
)


@pytest.fixture(autouse=True)
def _keep_threads():
    """Benches set torch's thread count for their timing; the tests after them keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_token_check(tmp_path, capsys):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    token_check.main([str(path)])
    assert f"{path}: 0.000 GB, 1,000 tokens | cold" in capsys.readouterr().out


def test_quantize(capsys):
    quantize.main(["--numel", "65536", "--error-numel", "65536", "--warmup", "0", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "recommended qgZ (int4) block:" in out
    result = last_json(out)
    assert result["bench"] == "quantize" and set(result["speed"]) == {"fp32", "bf16"}


def test_kernels(capsys):
    assert kernels.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    result = last_json(out)
    assert result["bench"] == "kernels" and set(result["results"]) == set(kernels.OPS)
    assert all(f"\n{op:<14} " in out for op in kernels.OPS)  # a row per op


def test_gpu_shapes_says_it_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpu_check.sh runs this bench")
    with pytest.raises(SystemExit, match="^gpu_shapes: needs a CUDA GPU, and none is here"):
        gpu_shapes.main(["--device", "cuda"])


def test_gpu_shapes_cpu_dry_run(capsys):
    assert gpu_shapes.main(["--device", "cpu", "--family", "rope", "--scale", "4096"]) == 0
    out = capsys.readouterr().out
    assert "rope [" in out and last_json(out)["failed"] == []


def test_single_rank(capsys):
    model = "--hidden-size 32 --num-layers 1 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1"
    single_rank.main([*model.split(), "--vocab-size", "128", "--steps", "3", "--warmup", "0", "--no-compile"])
    out = capsys.readouterr().out
    assert "equivalence (fp32): loss ours" in out and "eager vs peer" in out
    assert last_json(out)["bench"] == "single_rank"


def test_gla(monkeypatch, capsys):
    # the bench's fixed shape, and the lengths of the probes that set its skip estimates
    monkeypatch.setattr(gla, "PROBE_LENS", (32, 64))
    monkeypatch.setattr(gla, "H", 2)
    monkeypatch.setattr(gla, "D", 16)
    gla.main(["--seq-lens", "64", "--dtypes", "fp32", "--systems", "ours", "sdpa", "--repeats", "1", "--no-regimes"])
    out = capsys.readouterr().out
    assert "GLA fwd+bwd on CPU: B=1 H=2 D=16" in out and "    64  fp32      ours " in out
    result = last_json(out)
    assert result["bench"] == "gla" and {r["system"] for r in result["results"]} == {"ours", "sdpa"}


def test_recompute(capsys):
    model = ["--hidden-size", "64", "--num-layers", "2", "--seq-length", "64"]
    recompute.main(["--layouts", "softmax", "--modes", "selective", *model])
    out = capsys.readouterr().out
    assert "softmax               none  " in out and "softmax               selective  " in out
    assert set(last_json(out)["results"]["softmax"]) == {"none", "selective"}


def test_memory(capsys):
    assert memory.main(["--only", "single", "--modes", "none"]) == 0
    out = capsys.readouterr().out
    assert "\nsingle           hybrid   none " in out and "largest deviation: " in out


def test_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(checkpoint, "WORK", str(tmp_path / "work"))
    checkpoint.main(["--smoke"])
    out = capsys.readouterr().out
    assert "ZeRO-3 over DP2 (2 ranks): ours " in out and "\n  save  " in out and "\n  load cold  " in out
    result = last_json(out)
    assert result["bench"] == "checkpoint" and set(result["layouts"]) == {"zero3_dp2"}


def test_cp(capsys):
    shape = ["--heads", "1", "--head-k", "16", "--head-v", "16", "--t-local", "64", "--chunk-size", "16"]
    assert cp.main(["--no-netns", "--ps", "2", *shape, "--iters", "1", "--comm-reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "shaped setting not run: --no-netns" in out and "all-scan auto vs all-gather: e2e x" in out
    result = last_json(out)
    assert result["bench"] == "cp" and set(result["settings"]["loopback"]) == {"2"}
    assert cp.main(["--no-netns", "--ps", "2", *shape, "--iters", "1", "--comm-reps", "1", "--mixer", "kda"]) == 0
    out = capsys.readouterr().out
    assert "Kimi Delta Attention context parallelism" in out and "own arithmetic (no-comm op / ideal): wall x" in out
    cost = last_json(out)["settings"]["loopback"]["2"]["operator_cost"]
    assert set(cost) == {"wall", "cpu"} and all(x > 0 for x in cost.values())


def test_moe(capsys):
    """bench/moe.py --quick: EP 2 on loopback, every system's row and the ledger tables; every system agrees
    with the single-rank layer, and the all-to-all bytes equal the count from the routing maps."""
    assert moe.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "where: loopback, unshaped (emulated cluster not used: --quick)" in out
    assert all(f" {name:<24} " in out for name in (moe.FLOOR, *moe.SYSTEMS, *moe.SKEWED))
    assert "ours alltoall / mcore alltoall: x" in out and "\n== under imbalance (--skew 3)" in out
    result = last_json(out)["results"]["2"]
    assert max(result["agree"].values()) < 1e-5
    assert all(
        r["dispatch"] == r["exact_dispatch"] and r["skew_fwd_bwd"] == r["skew_exact_fwd_bwd"] for r in result["ledger"]
    )


def test_parallel(capsys):
    parallel.main(["--smoke"])
    out = capsys.readouterr().out
    assert "\n    2   4 1F1B " in out and "   TP2 vs DTensor parallelize_module " in out
    result = last_json(out)
    assert result["bench"] == "parallel" and result["dp_overlap"] is None
    assert not [row for row in result["bubble"] if "error" in row]


def test_preprocess(capsys):
    assert preprocess.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "\nworkers |  ours tok/s mcore tok/s" in out
    if not preprocess.peer_installed():
        assert out.startswith("megatron-core peer not run: ")
    result = last_json(out)
    assert result["bench"] == "preprocess" and [r["workers"] for r in result["runs"]][0] == 1


def test_simulator_validation_predicts_every_held_out_run(capsys):
    """Every held-out run's flags parse under today's defaults and the simulator predicts it; the report
    counts a run within 15% as inside (stand-in measurements: 10% and 30% off the prediction)."""
    runs = simulator_validation.FULL
    predicted = {
        f"{lay} {size} {rate}": simulator_validation.predict(lay, size, rate, None) for lay, size, rate in runs
    }
    assert all(0 < t < 10 for t in predicted.values()), predicted
    off = {name: t / (1.1 if i % 2 else 1.3) for i, (name, t) in enumerate(predicted.items())}
    rows = simulator_validation.compare(runs, off, None)
    simulator_validation.print_summary(rows, 1.0, [0.0, 0.0])
    out = capsys.readouterr().out
    assert f"{len(runs) // 2} of {len(runs)} runs within 15%" in out and out.count("| zero++ |") == 4


def test_gpu_check_help_and_unknown_argument():
    """bench/gpu_check.sh --help prints its usage and runs nothing; an unknown argument is one line, exit 2."""
    import subprocess

    shown = subprocess.run(["bash", "bench/gpu_check.sh", "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--fetch-wheels" in shown.stdout and "===" not in shown.stdout
    bad = subprocess.run(["bash", "bench/gpu_check.sh", "--bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "gpu_check: unknown argument '--bogus' (--help lists the two uses)"
    ]
