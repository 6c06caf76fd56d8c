"""examples/quickstart_cpu.sh as a user runs it, for 3 steps: the README's layout (a GDN hybrid on 8 ranks,
TP 2 x CP 2 All-Scan x DP 2 with ZeRO++ over 2 emulated nodes) starts, trains, saves, and the script then
shows a greedy sample from the checkpoint, the ledger's one-screen summary and the metrics PNG. What the
layout computes is the parity tests' (tests/test_parity.py); this checks the demo is that layout and runs."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_runs_the_gdn_hybrid_over_tp_cp_dp_zeropp(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, "RUN": str(run), "SAMPLE_TOKENS": "4", "OMP_NUM_THREADS": "1"}
    steps = "--train-iters 3 --lr-warmup-iters 1 --eval-iters 1 --log-interval 1".split()
    res = subprocess.run(
        ["bash", "examples/quickstart_cpu.sh", *steps], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "world 8 = TP 2 x CP 2 x DP 2 x PP 1" in out and "2 node(s) of 4 ranks" in out
    assert "layers DSDS" in out  # Gated DeltaNet at 0 and 2, softmax at 1 and 3
    assert "qwZ int8 weight gathers" in out and "hpZ secondary shard" in out and "qgZ int4" in out
    assert "iteration        3/       3" in out
    sample = out.split("== greedy sample")[1].splitlines()[1]
    assert sample.startswith("    def __init__(self,") and len(sample) > len("    def __init__(self,")
    summary = out.split("== communication per rank per step")[1]
    for axis in ("TP ", "CP ", "DP/ZeRO ", "across nodes: "):
        assert f"\n{axis}" in summary, summary
    assert "cp_allscan_fwd" in (run / "comm.json").read_text()  # the GDN state went by All-Scan
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "ckpt" / "latest").read_text().strip() == "iter_0000003"
    rerun = subprocess.run(["bash", "examples/quickstart_cpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert rerun.returncode == 2 and "is not empty" in rerun.stderr  # a second run into it overwrites nothing
