"""megatron_zpp/testing/reproduce.py (the sweeps' driver) on a fake finished launch (a real one takes minutes): the rows
are the medians of each rate's timed steps (warmup and each rate's first, gated step dropped),
computed here by hand; the ledger's cross-node bytes are summed from the report; the JSONL
round-trips and plots. zeropp_bandwidth.crossing against a hand-interpolated rate."""

import importlib.util
import json
import math
import os

import pytest

from megatron_zpp.testing import reproduce as sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example(name: str):
    """An example script as a module (examples/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "reproduce", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


zeropp = _example("zeropp_bandwidth")


def test_summarize_rows_and_jsonl(tmp_path):
    job = sweep.Job("exp", "ZeRO++", [], ranks=4, per_node=2, rates=["1gbit", "250mbit"], seq_length=128)
    warmup, steps = 2, 3
    # step times: warmup 9, 9; rate 0: gated 5, then 1, 3, 2; rate 1: gated 7, then 4, 6, 8
    times = [9, 9, 5, 1, 3, 2, 7, 4, 6, 8]
    metrics = [
        {"iteration": i + 1, "step_time": t, "tokens_per_sec": 512 / t, "tflops_per_rank": 0.1 / t, "loss": 10 - i}
        for i, t in enumerate(times)
    ]
    report = {
        "records": [
            {"role": "dp", "link": "inter_node", "bytes_per_rank_per_step": 3e6},
            {"role": "dp_hpz", "link": "intra_node", "bytes_per_rank_per_step": 5e6},
            {"role": "cp", "link": "inter_node", "bytes_per_rank_per_step": 0.5e6},
        ]
    }
    rows = sweep.summarize(job, metrics, report, steps, warmup)
    assert [r["link_gbps"] for r in rows] == [1.0, 0.25]
    assert [r["step_time_s"] for r in rows] == [2, 6]  # medians of (1, 3, 2) and (4, 6, 8)
    assert [r["tokens_per_s"] for r in rows] == [256, 512 / 6]
    assert rows[0]["tflops_per_gpu"] == pytest.approx(0.05, rel=1e-12)
    assert rows[1]["spread"] == pytest.approx((8 - 4) / 6, rel=1e-12) and rows[1]["loss"] == 1
    assert rows[0]["cross_node_mb_per_rank"] == pytest.approx(3.5) and rows[0]["cp_mb_per_rank"] == pytest.approx(0.5)
    assert {k: rows[0][k] for k in ("experiment", "system", "ranks", "seq_length", "source", "nodes")} == {
        "experiment": "exp", "system": "ZeRO++", "ranks": 4, "seq_length": 128, "source": "measured", "nodes": 2,
    }  # fmt: skip
    with pytest.raises(RuntimeError, match="9 steps in the metrics file, expected 10"):
        sweep.summarize(job, metrics[:-1], report, steps, warmup)

    out = tmp_path / "r.jsonl"
    sweep.write_rows(str(out), rows[:1], append=False)
    sweep.write_rows(str(out), rows[1:], append=True)
    assert sweep.read_rows(str(out)) == json.loads(json.dumps(rows))
    png = tmp_path / "r.png"
    sweep.save_plot(sweep.read_rows(str(out)), str(png), x="link_gbps")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_crossing():
    rows = [{"link_gbps": g, "tokens_per_s": t} for g, t in ((1.0, 400), (0.5, 300), (0.25, 100), (0.125, 50))]
    # 200 lies halfway between 100 (0.25) and 300 (0.5): geometric midpoint of the rates
    assert zeropp.crossing(rows, 200) == pytest.approx(math.sqrt(0.25 * 0.5), rel=1e-12)
    assert zeropp.crossing(rows, 40) == 0.125  # reached at the lowest rate tried
    assert zeropp.crossing(rows, 500) is None


def test_combine_rounds():
    def row(system, t, load):
        return {"experiment": "e", "system": system, "ranks": 4, "rate": "1gbit", "seq_length": 64,
                "step_time_s": t, "tokens_per_s": 256 / t if t else None, "tflops_per_gpu": 1 / t if t else None,
                "load": load}  # fmt: skip

    rounds = [[row("a", 2.0, 1), row("b", None, 1)], [row("b", None, 2), row("a", 4.0, 3)], [row("a", 3.0, 2)]]
    a, b = sweep.combine(rounds)
    assert a["step_time_s"] == 3.0 and a["round_step_time_s"] == [2.0, 4.0, 3.0] and a["rounds"] == 3
    assert a["tokens_per_s"] == 256 / 3.0 and a["load"] == 2 and a["round_spread"] == pytest.approx(2 / 3)
    assert b["step_time_s"] is None and b["system"] == "b"  # every round failed: the failed row


def test_open_gates(tmp_path):
    """The concurrent single-rank copies' gate opens in every dir only once each copy waits at it."""

    class Proc:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    (dirs[0] / "gate1.rank0").touch()  # copy b not at the gate yet and ended: no gate may open
    assert (
        sweep.open_gates([str(d) for d in dirs], 1, [Proc(None), Proc(1)], deadline=1e18)
        == "a copy ended before gate 1"
    )
    assert sweep.open_gates([str(d) for d in dirs], 1, [Proc(None)] * 2, deadline=0) == (
        "timed out at the gate (--run-timeout)"
    )
    assert not any((d / "gate1.open").exists() for d in dirs)
    (dirs[1] / "gate1.rank0").touch()
    assert sweep.open_gates([str(d) for d in dirs], 1, [Proc(None)] * 2, deadline=0) is None
    assert all((d / "gate1.open").exists() for d in dirs) and not (dirs[0] / "gate2.open").exists()
