"""The learning-rate and weight-decay schedules against Megatron's OptimizerParamScheduler
(megatron/core/optimizer_param_scheduler.py at NVIDIA/Megatron-LM d98e8a64dd), whose formulas
`megatron_lr` / `megatron_wd` below write out again: a count `n` of samples (iterations x the
global batch with --train-iters), starting at 0 for the first step and advanced by each step's
batch; lr = init + (max - init) n / W in the warmup (n <= W), then the decay style. Every rate
of every step of a run is compared, for every style.

lr = 1 and min_lr = 0.1 keep the values readable: the WSD exponential decay's steps are
min + (2 * 0.5^p - 1)(max - min) at p = 1/4, 1/2, 3/4: 0.714, 0.473, 0.270."""

import math

import pytest

from megatron_zpp.config import ConfigError, OptimConfig, TrainConfig
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.optim import learning_rate, learning_rate_at_samples, rates_at
from megatron_zpp.optim.schedules import (
    lr_at,
    schedule_changes,
    schedule_for,
    schedule_resume_warning,
    weight_decay_at,
)
from megatron_zpp.validation import validate

LR, MIN = 1.0, 0.1


def megatron_lr(n, style, warmup, decay, init=0.0, max_lr=LR, min_lr=MIN, wsd=None, wsd_style=None):
    """OptimizerParamScheduler.get_lr, written out from its source (steps = samples)."""
    if warmup > 0 and n <= warmup:
        return init + (max_lr - init) * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = (n - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1)
    else:  # WSD
        start = decay - wsd
        p = (n - start) / wsd
        coeff = {
            "linear": 1 - p,
            "cosine": 0.5 * (math.cos(math.pi * p) + 1),
            "exponential": 2 * 0.5**p - 1,
            "minus_sqrt": 1 - p**0.5,
        }[wsd_style]
        coeff = 1.0 if n <= start else coeff
    return min_lr + coeff * (max_lr - min_lr)


def megatron_wd(n, style, start, end, incr):
    """OptimizerParamScheduler.get_wd."""
    if n > incr or style == "constant":
        return end
    r = n / incr
    return start + (end - start) * (r if style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1))


STYLES = [
    ("constant", None),
    ("linear", None),
    ("cosine", None),
    ("inverse-square-root", None),
    ("WSD", "exponential"),
    ("WSD", "linear"),
    ("WSD", "cosine"),
    ("WSD", "minus_sqrt"),
]


@pytest.mark.parametrize("style,wsd_style", STYLES)
@pytest.mark.parametrize("warmup", [0, 3])
def test_every_step_of_an_iteration_run_is_megatrons(style, wsd_style, warmup):
    # 20 train iters, decay over 16, WSD's last 6, batch 4: Megatron counts 4 samples a step
    G, init = 4, 0.05
    o = OptimConfig(
        lr=LR,
        min_lr=MIN,
        lr_decay_style=style,
        lr_warmup_iters=warmup,
        lr_decay_iters=16,
        lr_warmup_init=init,
        lr_wsd_decay_iters=6,
        lr_wsd_decay_style=wsd_style or "exponential",
    )
    s = schedule_for(o, TrainConfig(train_iters=20, global_batch_size=G))
    for i in range(22):
        want = megatron_lr(i * G, style, warmup * G, 16 * G, init, wsd=6 * G, wsd_style=wsd_style)
        assert lr_at(o, s, i * G) == pytest.approx(want, abs=1e-12), i


def test_wsd_exponential_iterations_6_to_8_are_megatrons():
    # 8 iterations, WSD's last 4, lr 1 -> min 0.1; iterations 6-8 (counts 5-7) in Megatron
    o = OptimConfig(lr=LR, min_lr=MIN, lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_style="exponential")
    rates = [learning_rate(o, i, 8, global_batch=2) for i in range(8)]
    assert rates[:5] == [LR] * 5
    assert [round(r, 3) for r in rates[5:]] == [0.714, 0.473, 0.270]
    assert learning_rate(o, 8, 8, global_batch=2) == pytest.approx(MIN)  # the count reaches the decay end


def test_warmup_starts_at_lr_warmup_init_on_the_first_step():
    o = OptimConfig(lr=LR, min_lr=MIN, lr_decay_style="linear", lr_warmup_iters=4, lr_warmup_init=0.2)
    assert [learning_rate(o, i, 100) for i in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    zero = OptimConfig(lr=LR, lr_warmup_iters=4)  # Megatron's default init: 0
    assert [learning_rate(zero, i, 100, global_batch=8) for i in range(5)] == pytest.approx([0, 0.25, 0.5, 0.75, 1])


def test_inverse_square_root_counts_samples():
    # no warmup: Megatron's max(warmup, 1) is one sample, so step i runs at lr / sqrt(i x G)
    o = OptimConfig(lr=LR, min_lr=0.0, lr_decay_style="inverse-square-root")
    G = 8
    assert [learning_rate(o, i, 100, global_batch=G) for i in (0, 1, 2, 50)] == pytest.approx(
        [1.0, 1 / math.sqrt(8), 1 / math.sqrt(16), 1 / math.sqrt(400)]
    )


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_weight_decay_every_step_is_megatrons(style):
    ends = {} if style == "constant" else dict(start_weight_decay=0.01, end_weight_decay=0.1)
    o = OptimConfig(weight_decay=0.05, weight_decay_incr_style=style, **ends)
    G = 3
    s = schedule_for(o, TrainConfig(train_iters=10, global_batch_size=G))
    start, end = (0.05, 0.05) if style == "constant" else (0.01, 0.1)
    for i in range(12):
        assert weight_decay_at(o, s, i * G) == pytest.approx(megatron_wd(i * G, style, start, end, 10 * G)), i


def config(argv: str, world: int = 1):
    base = "--mock-data --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --vocab-size 64 "
    return validate(parse_args((base + argv).split()), world)


def test_decoupled_lr_follows_the_same_curve_with_its_own_peak_and_floor():
    cfg = config(
        "--train-iters 10 --global-batch-size 2 --lr 1 --min-lr 0.1 --lr-warmup-iters 2 --lr-decay-style cosine "
        "--decoupled-lr 0.5 --decoupled-min-lr 0.05 --weight-decay-incr-style linear "
        "--start-weight-decay 0 --end-weight-decay 0.2"
    )
    for i in range(10):
        r = rates_at(cfg, 2 * i)
        assert r.lr == pytest.approx(megatron_lr(2 * i, "cosine", 4, 20))
        assert r.decoupled_lr == pytest.approx(megatron_lr(2 * i, "cosine", 4, 20, max_lr=0.5, min_lr=0.05))
        assert r.weight_decay == pytest.approx(megatron_wd(2 * i, "linear", 0.0, 0.2, 20))
    no_floor = config("--train-iters 10 --lr 1 --min-lr 0.1 --decoupled-lr 0.5")  # floor: --min-lr
    assert rates_at(no_floor, 10).decoupled_lr == pytest.approx(megatron_lr(10, "linear", 0, 10, max_lr=0.5))
    assert rates_at(config("--train-iters 10"), 3).decoupled_lr is None


def test_sample_schedule_follows_the_samples_a_ramp_up_really_consumed():
    # ramp 4 -> 16 by 4 over 48 samples; warmup 24, decay 124 samples; Megatron adds each step's batch
    o = OptimConfig(lr=LR, min_lr=MIN, lr_decay_style="linear", lr_warmup_samples=24, lr_decay_samples=124)
    t = TrainConfig(global_batch_size=16, rampup_batch_size=[4, 4, 48], train_samples=120)
    n, rates, counts = 0, [], []
    for _ in range(8):
        rates.append(learning_rate_at_samples(o, n, 120))
        counts.append(n)
        n += t.global_batch_at(n)
    assert counts == [0, 4, 8, 12, 16, 24, 32, 44]
    assert rates == pytest.approx([megatron_lr(c, "linear", 24, 124) for c in counts])
    assert rates[:5] == pytest.approx([0, 4 / 24, 8 / 24, 12 / 24, 16 / 24])


def test_sample_schedule_at_a_constant_batch_equals_the_iteration_schedule():
    G = 6
    by_iter = OptimConfig(lr=LR, min_lr=MIN, lr_decay_style="cosine", lr_warmup_iters=10, lr_decay_iters=110)
    by_samples = OptimConfig(
        lr=LR, min_lr=MIN, lr_decay_style="cosine", lr_warmup_samples=10 * G, lr_decay_samples=110 * G
    )
    for i in range(0, 130, 3):
        assert learning_rate_at_samples(by_samples, i * G, 200 * G) == pytest.approx(
            learning_rate(by_iter, i, 200, global_batch=G)
        ), i


def test_warmup_fraction_is_a_fraction_of_the_decay_span():
    o = OptimConfig(lr=LR, min_lr=MIN, lr_decay_style="linear", lr_warmup_fraction=0.25)  # 10 of 40 iterations
    assert [learning_rate(o, i, 40) for i in (0, 5, 10, 25)] == pytest.approx([0, 0.5, 1.0, LR - (LR - MIN) * 0.5])


@pytest.mark.parametrize(
    "argv,line",
    [
        ("--lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        ("--train-samples 64 --lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-samples"),
        ("--start-weight-decay 0.1", "--start-weight-decay and --end-weight-decay are for --weight-decay-incr-style"),
        ("--weight-decay-incr-style cosine --start-weight-decay 0", "--weight-decay-incr-style cosine needs"),
        ("--weight-decay-incr-style linear --start-weight-decay 0.2 --end-weight-decay 0.1", "0 <= start <= end"),
        ("--decoupled-min-lr 1e-5", "--decoupled-min-lr needs --decoupled-lr"),
        ("--weight-decay nan", "--weight-decay nan must be a finite number"),
        ("--decoupled-lr 1e-5 --min-lr 1e-4", "--min-lr 0.0001 must be between 0 and --decoupled-lr"),
        ("--lr 1e-3 --lr-warmup-init 1e-2", "--lr-warmup-init 0.01 must be between 0 and --lr"),
        (
            "--train-iters 10 --lr-warmup-iters 10",
            "--lr-warmup-iters 10 must leave the warmup shorter than the decay span (10 iters",
        ),
        ("--lr-decay-iters 0", "--lr-decay-iters must be > 0"),
        (
            "--use-checkpoint-opt_param-scheduler --override-opt_param-scheduler",
            "give one of --use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler",
        ),
    ],
)
def test_bad_schedule_settings_are_one_line_each(argv, line):
    with pytest.raises(ConfigError) as e:
        config(argv)
    assert any(line in ln for ln in str(e.value).splitlines()), str(e.value)


def test_resume_warning_names_each_changed_setting_and_the_winner():
    saved = config("--lr 1e-3 --min-lr 1e-4 --train-iters 8 --global-batch-size 4 --lr-warmup-iters 2").to_dict()
    same = config("--lr 1e-3 --min-lr 1e-4 --train-iters 8 --global-batch-size 4 --lr-warmup-iters 2 --seed 9")
    assert schedule_resume_warning(same, saved) is None  # what does not shape the schedule is not compared
    longer = "--lr 1e-3 --min-lr 1e-4 --train-iters 12 --global-batch-size 4 --lr-warmup-iters 2 --lr-decay-iters 8"
    (only,) = schedule_changes(config(longer), saved)  # the decay kept, the train length not: Megatron compares both
    assert only == "weight-decay increment samples (--train-*) 48 here, 32 in the checkpoint"
    changed = "--lr 2e-3 --min-lr 1e-4 --train-iters 10 --global-batch-size 4 --lr-decay-style cosine"
    line = schedule_resume_warning(config(changed), saved)
    assert line.startswith(
        "the LR schedule differs from the checkpoint's: --lr 0.002 here, 0.001 in the checkpoint; "
        "--lr-decay-style cosine here, linear in the checkpoint; lr warmup samples (--lr-warmup-*) 0 here, 8 in the "
        "checkpoint; lr decay samples (--lr-decay-*, else --train-*) 40 here, 32 in the checkpoint; "
        "weight-decay increment samples (--train-*) 40 here, 32 in the checkpoint: this command line's win, as with "
        "--override-opt_param-scheduler (Megatron would refuse"
    ), line
    override = schedule_resume_warning(config(changed + " --override-opt_param-scheduler"), saved)
    assert override.endswith("32 in the checkpoint: this command line's win (--override-opt_param-scheduler)")
    theirs = schedule_resume_warning(config(changed + " --use-checkpoint-opt_param-scheduler"), saved)
    assert theirs.endswith("32 in the checkpoint: the checkpoint's win (--use-checkpoint-opt_param-scheduler)")
    wd = config("--lr 1e-3 --min-lr 1e-4 --train-iters 8 --global-batch-size 4 --lr-warmup-iters 2 --weight-decay 0.1")
    assert schedule_changes(wd, saved) == ["weight decay from-to 0.1 to 0.1 here, 0.01 to 0.01 in the checkpoint"]
