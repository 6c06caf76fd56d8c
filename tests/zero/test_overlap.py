"""Overlapped gradient reduction and parameter gather give the run they overlap.

One spawn of 4 gloo ranks trains each layout twice, overlap on and off, and compares the
two (the reference is the non-overlapped engine, which tests/test_parity.py holds to the
single-rank run):

* plain DP with --overlap-grad-reduce and small --ddp-bucket-size buckets, with gradient
  accumulation: DP 4; DP 2 x CP 2 (the DP x CP group); PP 2 x DP 2 (1F1B, the tied
  embedding on both end stages) and interleaved; TP 2 x DP 2 with sequence parallelism
  (the TP-partial norm gradients). Over a 2-rank group losses and weights are bitwise
  equal (a sum of two is exact in any order); over 4 ranks gloo's ring sums each element
  in an order that depends on its place in the bucket, so losses agree within 1e-6 and
  weights within 1e-5 relative (the parity test's bound). Every bucket started during
  the last micro-batch's backward, and the ledger has one all-reduce per bucket per step
  (earlier micro-batches reduce nothing) of exactly 2(n-1)/n x 4 x numel bytes;
* ZeRO-1 with --overlap-grad-reduce (units reduce-scattered in the last backward) and
  ZeRO-1/2 with --overlap-param-gather: equal to the non-overlapped runs bitwise (the
  same sums, started earlier), with the next step's gathers left in flight by the step and
  ended by the forward pre-hooks of one more forward.
"""

import numpy as np
import pytest
import torch

from megatron_zpp import comm, training
from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args, parse_config
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS
from tests.test_parity import assert_close_relative

BASE = (
    OLD_DEFAULTS
    + (
        "--mock-data --hidden-size 32 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --seq-length 32 "
        "--vocab-size 128 --make-vocab-size-divisible-by 32 --gla-chunk-size 8 --num-layers 4 "
        "--micro-batch-size 1 --global-batch-size 8 "
        "--train-iters 3 --lr 3e-3 --lr-warmup-iters 1 --clip-grad 0.5 --seed 7 --peak-tflops 1"
    ).split()
)
BUCKET = ["--ddp-bucket-size", "3000"]  # a few parameters per bucket: several buckets per chunk
PLAIN = {  # name: flags (DP x CP = 4 or 2; 2 to 4 micro-batches per rank)
    "dp4": [],
    "dp2_cp2": ["--context-parallel-size", "2"],
    "pp2_dp2": ["--pipeline-model-parallel-size", "2"],
    "pp2_vpp_dp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "tp2_sp_dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
}
ZERO = {  # name: (overlapped flags, reference flags)
    "zero1_grads": (["--zero-stage", "1"], ["--zero-stage", "1", "--no-overlap-grad-reduce"]),
    "zero1_gather": (["--zero-stage", "1", "--overlap-param-gather"], ["--zero-stage", "1"]),
    "zero2_gather": (["--zero-stage", "2", "--overlap-param-gather"], ["--zero-stage", "2"]),
}


def _train(argv: list[str], world_size: int) -> dict:
    run = training.setup(validate(parse_args(argv), world_size))
    losses = [h["loss"] for h in training.train(run)]
    dp = run.dp
    out = {"losses": losses, "ledger": comm.LEDGER.local_rows()}
    if hasattr(dp, "grads"):  # plain DP
        out["buckets"], out["started_in_backward"] = len(dp.grads.buckets), dp.grads.started_in_backward
        out["overlap"], out["dp_cp"], out["chunks"] = dp.overlap, run.groups.dp_cp.size, len(run.chunks)
    else:
        out["reduced_in_backward"], out["units"] = dp.reduced_in_backward, len(dp.units)
        out["gathers_in_flight"] = sum(u._gather is not None for u in dp.units)  # left by the last step
        tokens = torch.zeros(1, 32, dtype=torch.long)
        with torch.no_grad():  # one forward: its pre-hooks must end every unit's gather before reading it
            run.chunks[0](tokens=tokens, labels=tokens, hidden=None)
        out["gathers_after_forward"] = sum(u._gather is not None or not u.gathered for u in dp.units)
    with dp.full_parameters():
        out["weights"] = {n: p.detach().double().numpy().copy() for c in run.chunks for n, p in c.named_parameters()}
    out["numel"] = sum(w.size for w in out["weights"].values())
    return out


def _worker(rank, world_size, argvs):
    return [_train(argv, world_size) for argv in argvs]


def _grad_allreduce(rows) -> tuple[float, float]:
    rows = [r for r in rows if r["phase"] == "grad_allreduce"]
    return sum(r["bytes"] for r in rows), sum(r["calls"] for r in rows)


def test_overlap_on_equals_off():
    argvs, names = [], []
    for name, flags in PLAIN.items():
        for mode in ("on", "off"):
            argvs.append(BASE + flags + (BUCKET if mode == "on" else ["--no-overlap-grad-reduce"]))
            names.append((name, mode))
    for name, (on, off) in ZERO.items():
        argvs += [BASE + on, BASE + off]
        names += [(name, "on"), (name, "off")]
    per_rank = run_distributed(_worker, 4, argvs, timeout=600)
    res = {key: [r[i] for r in per_rank] for i, key in enumerate(names)}

    for name in PLAIN:
        for on, off in zip(res[name, "on"], res[name, "off"]):
            n = on["dp_cp"]
            if n == 2:  # a sum of two is exact in any order: bitwise
                assert on["losses"] == off["losses"], name
                for key, w in off["weights"].items():
                    np.testing.assert_array_equal(on["weights"][key], w, err_msg=f"{name} {key}")
            else:  # 1e-5: the parity test's bound (Adam moves near-zero gradients' round-off to ~1e-6)
                np.testing.assert_allclose(on["losses"], off["losses"], rtol=1e-6, err_msg=name)
                for key, w in off["weights"].items():
                    assert_close_relative(on["weights"][key], w, f"{name} {key}", tol=1e-5)
            assert on["overlap"] and not off["overlap"]
            assert on["buckets"] > off["chunks"] and off["buckets"] == off["chunks"], name  # off: one per chunk
            assert on["started_in_backward"] == on["buckets"], name  # all of them overlapped the backward
            for r, calls in ((on, on["buckets"]), (off, off["chunks"])):
                nbytes, ncalls = _grad_allreduce(r["ledger"])
                assert ncalls == calls, name  # only the last micro-batch reduces
                assert nbytes == pytest.approx(2 * (n - 1) / n * 4 * r["numel"]), name
        assert res[name, "on"][0]["losses"][-1] < res[name, "on"][0]["losses"][0]

    for name in ZERO:
        for on, off in zip(res[name, "on"], res[name, "off"]):
            assert on["losses"] == off["losses"], name  # bitwise: the same sums, started earlier
            for key, w in off["weights"].items():
                np.testing.assert_array_equal(on["weights"][key], w, err_msg=f"{name} {key}")
            assert [r["phase"] for r in on["ledger"]] == [r["phase"] for r in off["ledger"]]
            assert _bytes(on["ledger"]) == _bytes(off["ledger"]), name
            if name == "zero1_grads":
                assert on["reduced_in_backward"] == on["units"] and off["reduced_in_backward"] == 0
            else:
                assert on["gathers_in_flight"] == on["units"] and off["gathers_in_flight"] == 0
                assert on["gathers_after_forward"] == 0, name  # the forward waited for each unit


def _bytes(rows) -> dict:
    return {(r["phase"], r["op"]): r["bytes"] for r in rows}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--zero-stage", "3", "--overlap-param-gather"], "--overlap-param-gather applies to ZeRO-1/2"),
        (["--overlap-param-gather"], "--overlap-param-gather applies to ZeRO-1/2"),
        (["--zero-stage", "2", "--no-overlap-grad-reduce"], "--no-overlap-grad-reduce: ZeRO-2/3"),
        (["--zero-stage", "1", "--ddp-bucket-size", "1000"], "--ddp-bucket-size applies to plain"),
        (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1"),
    ],
)
def test_bad_overlap_settings_are_clear_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(BASE + flags, 4)


def test_bucket_bounds_close_at_parameter_boundaries():
    from megatron_zpp.zero.grad_buffer import bucket_bounds

    assert bucket_bounds([4, 4, 4, 10, 1], 8) == [(0, 2), (2, 4), (4, 5)]
    assert bucket_bounds([4, 4, 4], None) == [(0, 3)]
    assert bucket_bounds([20, 1], 8) == [(0, 1), (1, 2)]  # a parameter larger than a bucket is one bucket
