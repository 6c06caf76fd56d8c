"""The benches' verdict rule (megatron_zpp/testing/verdict.py) as a unit, no run: a target judged against
a peer that did not run is "not judged" and the exit status non-zero (a warning under
--allow-missing-peers). bench/zero.py's case with the step times a user measured (2026-12-05,
DeepSpeed 0.19.8): without DeepSpeed FSDP2 alone made both ZeRO++ targets MET (4.04x / 1.61x);
with it, 2.26x / 1.18x, both missed."""

import pytest

from bench import gla
from megatron_zpp.testing.verdict import EXIT_NOT_JUDGED, Absent, exit_status, verdict
from megatron_zpp.testing.zero_bench import results as zr
from megatron_zpp.testing.zero_bench.systems import HEADLINE, SYSTEMS

RATES = ["unshaped", "1gbit", "200mbit"]
# s/step per system and rate (unshaped, 1gbit, 200mbit): ZeRO++ and DeepSpeed ZeRO-3 as measured; FSDP2's
# from the ratios printed without DeepSpeed (4.04x / 1.61x of ZeRO++'s time)
STEP_S = {
    "ours-z3": (1.00, 1.90, 6.00),
    "ours-zpp": (1.10, 1.06, 1.67),
    "fsdp2": (1.05, 1.61 * 1.06, 4.04 * 1.67),
    "fsdp2-hpz": (1.08, 1.80, 7.00),
    "ds-z3": (0.98, 1.25, 3.78),
    "ds-hpz": (1.02, 1.40, 4.50),
}
NOT_INSTALLED = "deepspeed is not installed in this venv (/x/.venv/bin/python); install with bash bench/setup.sh"


def fake_results(without: tuple[str, ...] = ()) -> dict:
    out = {}
    for name, times in STEP_S.items():
        if name in without:
            out[name] = {"status": "failed", "reason": NOT_INSTALLED + " (the [bench] extra)"}
        else:
            out[name] = {"status": "ok", "rates": {r: {"step_s": t} for r, t in zip(RATES, times)}}
    return out


def test_verdict_lines():
    assert verdict(True) == "MET" and verdict(False) == "NOT MET" and verdict(None) == "not measured"
    ds = [Absent("DS Z3", "deepspeed is not installed"), Absent("DS hpZ", "deepspeed is not installed")]
    line = "not judged: DS Z3, DS hpZ did not run (deepspeed is not installed); install with bash bench/setup.sh"
    assert verdict(True, ds) == line and verdict(None, ds) == line  # absent wins over a value, met or not
    two = verdict(False, [ds[0], Absent("FSDP2-2", "not among the systems run", "add fsdp2-hpz to --systems")])
    assert two == (
        "not judged: DS Z3 did not run (deepspeed is not installed); install with bash bench/setup.sh; "
        "FSDP2-2 did not run (not among the systems run); add fsdp2-hpz to --systems"
    )


def test_exit_status(capsys):
    assert exit_status(["MET", "NOT MET", "not measured (rate not run)"], False) == 0
    assert exit_status(["MET", "not judged: X did not run (y); z"], False) == EXIT_NOT_JUDGED
    assert "1 target(s) not judged" in capsys.readouterr().err
    assert exit_status(["not judged: X did not run (y); z"], True) == 0
    assert capsys.readouterr().err.startswith("WARNING: 1 target(s) not judged")


def test_zero_bench_without_deepspeed_judges_nothing_against_the_best_peer():
    results = fake_results(without=("ds-z3", "ds-hpz"))
    t = {x["target"]: x for x in zr.check_targets(*targets_args(results, HEADLINE))}
    zpp_200 = t["200 Mbit/s: ours ZeRO++ >= 2.5x the best peer"]
    assert zpp_200["measured"] == pytest.approx(4.04)  # what the flattering verdict said MET
    want = (
        f"not judged: {SYSTEMS['ds-z3'][0]}, {SYSTEMS['ds-hpz'][0]} did not run (deepspeed is not installed in "
        "this venv (/x/.venv/bin/python)); install with bash bench/setup.sh"
    )
    assert zpp_200["verdict"] == want
    assert t["1 Gbit/s: ours ZeRO++ >= 1.5x the best peer"]["verdict"] == want
    assert t["unshaped: ours ZeRO-3 no slower than the best peer"]["verdict"] == want
    assert t["unshaped: ours ZeRO++ step within 15% of ours ZeRO-3's"]["verdict"] == "MET"  # ours vs ours: judged
    assert exit_status([x["verdict"] for x in t.values()], False) == EXIT_NOT_JUDGED


def test_zero_bench_with_deepspeed_misses_both_targets():
    t = {x["target"]: x for x in zr.check_targets(*targets_args(fake_results(), HEADLINE))}
    zpp_200, zpp_1g = (
        t["200 Mbit/s: ours ZeRO++ >= 2.5x the best peer"],
        t["1 Gbit/s: ours ZeRO++ >= 1.5x the best peer"],
    )
    assert (round(zpp_200["measured"], 2), zpp_200["verdict"]) == (2.26, "NOT MET")
    assert (round(zpp_1g["measured"], 2), zpp_1g["verdict"]) == (1.18, "NOT MET")
    assert exit_status([x["verdict"] for x in t.values()], False) == 0


def test_zero_bench_peer_not_selected_or_failed():
    results = fake_results()
    results["ds-hpz"] = {"status": "failed", "reason": "timed out after 300 s (--run-timeout)"}
    names = [n for n in HEADLINE if n != "fsdp2-hpz"]
    absent = zr.absent_peers(results, names)
    assert [(a.peer, a.why, a.fix) for a in absent] == [
        (SYSTEMS["fsdp2-hpz"][0], "not among the systems run", "add fsdp2-hpz to --systems"),
        (SYSTEMS["ds-hpz"][0], "timed out after 300 s (--run-timeout)", "see its row and the logs"),
    ]


def targets_args(results: dict, names: list[str]) -> tuple:
    heads = {rate: zr.headline(results, rate) for rate in RATES}
    return heads, RATES, True, zr.absent_peers(results, names)


def test_gla_time_target_needs_sdpa_at_8192():
    ours = {"times": [1.0], "mem_x": 4.0, "err": 1e-7, "vs_sdpa": 0.2}
    skipped = {"skipped": "skipped: est. 226 s per call (t ~ T^2) > --max-call-seconds 120"}
    results = {
        (8192, "fp32"): {"ours": ours, "sdpa": {"times": [5.0]}},
        (8192, "bf16"): {"ours": ours, "sdpa": skipped},
    }
    t = gla.check_targets(results, {})
    assert t["mem_x"]["verdict"] == "MET" and t["fp32_err"]["verdict"] == "MET"
    assert t["time_vs_sdpa_at_8192"]["verdict"] == (
        f"not judged: SDPA bf16 did not run ({skipped['skipped']}); raise --max-call-seconds / --max-saved-gib"
    )
    del results[(8192, "bf16")]
    assert gla.check_targets(results, {})["time_vs_sdpa_at_8192"]["verdict"] == "MET"
    results[(8192, "fp32")].pop("sdpa")
    assert gla.check_targets(results, {})["time_vs_sdpa_at_8192"]["verdict"].startswith("not judged: SDPA fp32")
