"""tools/plot_metrics.py and tools/plot_scaling.py: the plotted series read back from the
figure's Line2D artists equal the input data (exactly: they are the file's numbers), the
smoothing equals a closed-form EMA (1e-12 relative), the PNG is written with the figure's size,
and a bad input is one error line."""

import json
import os
import struct

import numpy as np
import pytest

from megatron_zpp.plotting import X_LABELS
from tools import plot_metrics, plot_scaling


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _metrics_run(n, seed, mfu=True):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(1, n + 1):
        rows.append(
            {
                "iteration": i,
                "loss": float(8 - np.log(i) + 0.1 * rng.standard_normal()),
                "grad_norm": float(rng.uniform(0.5, 2)),
                "lr": 1e-3 * min(1, i / 5),
                "tokens_per_sec": float(rng.uniform(900, 1100)),
                "step_time": 1.0,
                "tflops_per_rank": 0.01,
                "mfu": float(rng.uniform(0.2, 0.3)) if mfu else None,
                "global_batch_size": 8,
                "consumed_samples": 8 * i,
                "memory_gib": 0.5 + 0.001 * i,
                **({"val_loss": 7.0 - 0.1 * i} if i % 5 == 0 else {}),
            }
        )
    return rows


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _lines(ax, gid):
    return [ln for ln in ax.get_lines() if ln.get_gid() == gid]


def test_plot_metrics_series_and_png(tmp_path):
    a, b = _metrics_run(30, 0), _metrics_run(20, 1, mfu=False)  # b: MFU not reported (None), as on --peak-tflops 1
    fa, fb = _write_jsonl(tmp_path / "a.jsonl", a), _write_jsonl(tmp_path / "b.jsonl", b)
    fig = plot_metrics.plot_metrics([("a", a), ("b", b)], smooth=0.0)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == list(plot_metrics.METRICS.values())
    for key, title in plot_metrics.METRICS.items():
        lines = [ln for ln in _lines(axes[title], "raw") if "(val)" not in ln.get_label()]
        runs = [("a", a), ("b", b)] if key != "mfu" else [("a", a)]
        assert [ln.get_label() for ln in lines] == [r[0] for r in runs]
        for ln, (_, rows) in zip(lines, runs):
            assert list(ln.get_xdata()) == [r["iteration"] for r in rows]
            assert list(ln.get_ydata()) == [r[key] * (100 if key == "mfu" else 1) for r in rows]  # MFU in %
    val = [ln for ln in axes["loss"].get_lines() if ln.get_label() == "a (val)"][0]
    assert list(val.get_xdata()) == [5, 10, 15, 20, 25, 30] and val.get_marker() == "o"  # each point marked
    assert axes["MFU (%)"].get_title() == "MFU (%)"
    assert list(val.get_ydata()) == [r["val_loss"] for r in a if "val_loss" in r]

    # smoothed, log x, consumed samples on x, through main(): the PNG
    out = tmp_path / "m.png"
    assert plot_metrics.main([fa, fb, "--labels", "A", "B", "--smooth", "0.8", "--log-x", "--x", "consumed_samples",
                              "-o", str(out)]) == 0  # fmt: skip
    w, h = _png_size(out)
    assert (w, h) == (1500, 720) and 20_000 < out.stat().st_size < 2_000_000
    fig = plot_metrics.plot_metrics([("A", a)], ["loss", "lr"], smooth=0.8, log_x=True, x_key="consumed_samples")
    ax, ax_lr = fig.axes
    assert not _lines(ax_lr, "smoothed") and list(_lines(ax_lr, "raw")[0].get_ydata()) == [r["lr"] for r in a]
    assert ax.get_xscale() == "log"
    (sm,) = _lines(ax, "smoothed")
    x = np.array([r["loss"] for r in a])
    t = np.arange(1, len(x) + 1)
    # closed form of the debiased EMA: sum_i w^(t-i) (1-w) x_i / (1 - w^t)
    ref = [(0.2 * 0.8 ** (k - t[:k]) * x[:k]).sum() / (1 - 0.8**k) for k in t]
    np.testing.assert_allclose(sm.get_ydata(), ref, rtol=1e-12)
    assert list(sm.get_xdata()) == [r["consumed_samples"] for r in a]
    assert list(_lines(ax, "raw")[0].get_ydata()) == list(x)


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "no such file"),
        ('{"iteration": 1, "loss": 2.0}\n{"iteration": 2, "loss": \n', ":2: not JSON"),
        ("", "no records"),
        ("[1, 2]\n", ":1: a record must be a JSON object"),
    ],
)
def test_plot_metrics_bad_file_one_line(tmp_path, capsys, content, expected):
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    assert plot_metrics.main([str(path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def _row(exp, system, source, ranks=4, gbps=1.0, seq=256, tps=None):
    return {"experiment": exp, "system": system, "ranks": ranks, "link_gbps": gbps, "seq_length": seq,
            "step_time_s": None if tps is None else seq * 4 / tps, "tokens_per_s": tps, "tflops_per_gpu": None,
            "source": source}  # fmt: skip


def test_plot_scaling_series_and_png(tmp_path):
    bw = [_row("bandwidth", s, "measured", gbps=g, tps=t) for s, k in (("zero3", 1), ("zero++", 2))
          for g, t in ((0.2, 100 * k), (1.0, 300 * k), (0.5, 200 * k))]  # fmt: skip
    bw += [_row("bandwidth", "zero3", "simulated", gbps=g, tps=90 * g + 80) for g in (0.2, 0.5, 1.0)]
    bw += [_row("bandwidth", "zero++", "paper", gbps=g, tps=None) for g in (0.1, 0.4)]  # no y: skipped
    cp = [_row("cp", s, "measured", ranks=p, seq=q, tps=1000 * p / q) for s in ("all-scan", "ring")
          for p in (2, 4) for q in (256, 512, 1024)]  # fmt: skip
    cp += [_row("cp", "all-scan", "paper", ranks=p, seq=8192, tps=5.0 * p) for p in (2, 4)]
    f1, f2 = _write_jsonl(tmp_path / "bw.jsonl", bw), _write_jsonl(tmp_path / "cp.jsonl", cp)

    fig = plot_scaling.plot_scaling(bw + cp)
    ax_bw, ax_cp = fig.axes
    assert ax_bw.get_xlabel() == X_LABELS["link_gbps"] and ax_bw.get_xscale() == "log"
    lines = {ln.get_gid(): ln for ln in ax_bw.get_lines()}
    assert set(lines) == {"measured:zero3", "measured:zero++", "simulated:zero3"}  # paper rows had no tokens/s
    assert list(lines["measured:zero++"].get_xdata()) == [0.2, 0.5, 1.0]  # sorted by x
    assert list(lines["measured:zero++"].get_ydata()) == [200.0, 400.0, 600.0]
    assert list(lines["simulated:zero3"].get_ydata()) == pytest.approx([98.0, 125.0, 170.0], rel=1e-12)
    assert lines["simulated:zero3"].get_linestyle() == "--" and lines["measured:zero3"].get_linestyle() == "-"
    # cp: seq_length takes 4 values, ranks 2: x = seq_length, a series per (system, ranks)
    assert ax_cp.get_xlabel() == X_LABELS["seq_length"]
    by_label = {ln.get_label(): ln for ln in ax_cp.get_lines()}
    ring4 = by_label["ring, ranks 4 (measured)"]
    assert list(ring4.get_xdata()) == [256, 512, 1024] and list(ring4.get_ydata()) == [
        4000 / q for q in (256, 512, 1024)
    ]
    paper = by_label["all-scan, ranks 4 (paper)"]
    assert paper.get_linestyle() == "None" and list(paper.get_xdata()) == [8192] and list(paper.get_ydata()) == [20.0]
    assert len(by_label) == 6

    out = tmp_path / "s.png"
    assert plot_scaling.main([f1, f2, "--experiment", "cp", "--x", "ranks", "--linear-x", "-o", str(out)]) == 0
    assert _png_size(out) == (650, 450) and 10_000 < out.stat().st_size < 2_000_000
    fig = plot_scaling.plot_scaling(cp, x="ranks", log_x=False)
    assert fig.axes[0].get_xscale() == "linear"
    line = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}["all-scan, seq length 512 (measured)"]
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [1000 * p / 512 for p in (2, 4)]


def test_plot_scaling_bad_rows_one_line(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "r.jsonl", [{"experiment": "x", "system": "s", "source": "guessed"}])
    assert plot_scaling.main([path, "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "source 'guessed' is not one of measured" in err
    assert plot_scaling.main([str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_plot_metrics_tokens_axis_and_resume_marks(tmp_path):
    """--x tokens: consumed samples times the sequence length (128 here: tokens_per_sec x step_time /
    global_batch_size); a resume (a record naming its checkpoint, or an iteration that goes back)
    is a dotted vertical line at its x in every subplot."""
    rows = _metrics_run(12, 2)
    for r in rows:
        r["tokens_per_sec"] = 8 * 128 / 0.5  # 8 samples of 128 tokens in 0.5 s
        r["step_time"] = 0.5
    rows[6]["resumed_from"] = "ckpt/iter_0000006"  # the first step after a --load
    again = [dict(r) for r in rows[8:10]]  # a second run appended from iteration 9: goes back to 9
    fig = plot_metrics.plot_metrics([("a", rows + again)], ["loss", "mfu"], x_key="tokens")
    ax_loss, ax_mfu = fig.axes
    assert ax_loss.get_xlabel() == "tokens"
    (line,) = [ln for ln in _lines(ax_loss, "raw") if ln.get_label() == "a"]
    assert list(line.get_xdata()) == [8 * r["iteration"] * 128 for r in rows + again]
    for ax in (ax_loss, ax_mfu):
        marks = [ln.get_xdata()[0] for ln in _lines(ax, "resume")]
        assert marks == [7 * 8 * 128, 9 * 8 * 128]
    bad = [{"iteration": 1, "loss": 2.0}]
    with pytest.raises(plot_metrics.PlotError, match="--x tokens: record 1 has no consumed_samples"):
        plot_metrics.plot_metrics([("b", bad)], ["loss"], x_key="tokens")


MOE_RUN = (
    "--mock-data --num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --vocab-size 128 "
    "--make-vocab-size-divisible-by 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 2 --device cpu "
    "--peak-tflops 1 --num-workers 0 --num-experts 4 --moe-ffn-hidden-size 16 --moe-layer-freq [0,1,1] "
    "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall "
    "--moe-expert-capacity-factor 1.0"
)


def test_plot_metrics_draws_a_moe_runs_metrics(tmp_path):
    """A tiny MoE run's metrics file (2 steps, MoE layers 1 and 2, capacity dropping): by default the MoE subplots
    join the others; each layer's most/fewest tokens per expert, the balancing and z losses, the worst load over
    the mean and the dropped routes (in percent) are the file's numbers. Beside a dense run, only the MoE run has
    lines there."""
    from megatron_zpp import training
    from megatron_zpp.config.arguments import parse_config
    from tests.old_defaults import OLD_DEFAULTS

    path = str(tmp_path / "moe" / "metrics.jsonl")
    cfg = parse_config(OLD_DEFAULTS + MOE_RUN.split() + ["--metrics-file", path], 1)
    training.train(training.setup(cfg))
    rows = plot_metrics.load_jsonl(path)
    assert plot_metrics.moe_layers(rows) == [1, 2] and len(rows) == 2
    dense = _metrics_run(2, 0)
    fig = plot_metrics.plot_metrics([("moe", rows), ("dense", dense)])
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == list(plot_metrics.METRICS.values()) + list(plot_metrics.MOE_METRICS.values())
    loads = axes[plot_metrics.MOE_METRICS["expert_load"]]
    for i in (1, 2):
        for bound in ("max", "min"):
            (line,) = _lines(loads, f"layer{i}:{bound}")
            assert list(line.get_ydata()) == [r[f"moe/expert_load_{bound}/layer{i}"] for r in rows]
            assert list(line.get_xdata()) == [1, 2]
    for key, scale in [
        ("load_balancing_loss", 1),
        ("z_loss", 1),
        ("moe/expert_load_max_over_mean", 1),
        ("moe/dropped_fraction", 100),
    ]:
        (line,) = _lines(axes[plot_metrics.MOE_METRICS[key]], "raw")  # the dense run has none
        assert line.get_label() == "moe" and list(line.get_ydata()) == [scale * r[key] for r in rows], key
    assert 0 < rows[-1]["moe/dropped_fraction"] < 1 and rows[-1]["moe/expert_load_max_over_mean"] >= 1
    out = str(tmp_path / "m.png")
    assert plot_metrics.main([path, "--metrics", "loss", "expert_load", "z_loss", "-o", out]) == 0
    assert os.path.isfile(out) and _png_size(out) == (1500, 360)
