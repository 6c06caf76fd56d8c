"""Learning-rate schedules against their closed forms (Megatron's semantics).

lr = 1 and min_lr = 0.1 keep the expected values readable: a cosine or linear midpoint
is (lr + min_lr) / 2 = 0.55. lr_decay_iters counts from iteration 0 (warmup included),
as Megatron's --lr-decay-iters does: decay runs from iteration `warmup` to `decay_iters`."""

import math

import pytest

from megatron_zpp.config import OptimConfig, TrainConfig
from megatron_zpp.optim import learning_rate, learning_rate_at_samples

LR, MIN = 1.0, 0.1
COS_QUARTER = MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi / 4))  # cosine at 1/4 of its decay
COS_3QUARTER = MIN + (LR - MIN) * 0.5 * (1 + math.cos(3 * math.pi / 4))


def cfg(style, warmup=0, decay_iters=None, **kw):
    return OptimConfig(
        lr=LR, min_lr=MIN, lr_warmup_iters=warmup, lr_decay_iters=decay_iters, lr_decay_style=style, **kw
    )


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "WSD"])
def test_warmup_rises_linearly_from_lr_over_warmup_to_lr(style):
    # 4 warmup steps: lr/4 at iteration 0, lr at the last warmup step (iteration 3)
    c = cfg(style, warmup=4, decay_iters=100)
    assert [learning_rate(c, i, 100) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_constant_stays_at_lr_after_warmup_and_past_the_end():
    c = cfg("constant", warmup=4, decay_iters=100)
    assert [learning_rate(c, i, 100) for i in (4, 5, 50, 99, 100, 500)] == [LR] * 6


# warmup 10, decay to min_lr by iteration 110: progress = (i - 10) / 100
LINEAR = [
    (10, 1.0),
    (11, 1.0 - 0.9 / 100),
    (35, 0.775),
    (60, 0.55),
    (85, 0.325),
    (109, MIN + 0.9 / 100),
    (110, MIN),
    (111, MIN),
    (1000, MIN),
]
COSINE = [(10, 1.0), (35, COS_QUARTER), (60, (LR + MIN) / 2), (85, COS_3QUARTER), (110, MIN), (111, MIN), (1000, MIN)]


@pytest.mark.parametrize("iteration,expected", LINEAR)
def test_linear_decay(iteration, expected):
    assert learning_rate(cfg("linear", warmup=10, decay_iters=110), iteration, 200) == pytest.approx(expected)


@pytest.mark.parametrize("iteration,expected", COSINE)
def test_cosine_decay(iteration, expected):
    assert learning_rate(cfg("cosine", warmup=10, decay_iters=110), iteration, 200) == pytest.approx(expected)


def test_first_decay_step_is_lr_then_strictly_below():
    c = cfg("cosine", warmup=10, decay_iters=110)
    assert learning_rate(c, 10, 200) == pytest.approx(LR)
    assert learning_rate(c, 11, 200) == pytest.approx(MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi / 100)))
    assert learning_rate(c, 11, 200) < LR


@pytest.mark.parametrize("style,table", [("linear", LINEAR), ("cosine", COSINE)])
def test_decay_iters_default_to_train_iters(style, table):
    # no --lr-decay-iters: decay ends at train_iters (110 here)
    c = cfg(style, warmup=10, decay_iters=None)
    for iteration, expected in table:
        assert learning_rate(c, iteration, 110) == pytest.approx(expected), iteration


# WSD, warmup 5, 100 decay iters, explicit --lr-wsd-decay-iters 20: stable at lr up to
# iteration 80, then the window 80..100 (p = (i - 80) / 20), min_lr from 100 on.
WSD_WINDOW = {  # style -> lr at p = 1/4, 1/2
    "linear": (0.775, 0.55),
    "cosine": (COS_QUARTER, (LR + MIN) / 2),
}


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential"])
def test_wsd_is_stable_at_lr_until_its_window_and_min_lr_after(style):
    c = cfg("WSD", warmup=5, decay_iters=100, lr_wsd_decay_iters=20, lr_wsd_decay_style=style)
    assert [learning_rate(c, i, 100) for i in (5, 6, 40, 79, 80)] == pytest.approx([LR] * 5)
    assert learning_rate(c, 81, 100) < LR
    assert [learning_rate(c, i, 100) for i in (100, 101, 1000)] == pytest.approx([MIN] * 3)


@pytest.mark.parametrize("style", sorted(WSD_WINDOW))
def test_wsd_window_shape(style):
    c = cfg("WSD", warmup=5, decay_iters=100, lr_wsd_decay_iters=20, lr_wsd_decay_style=style)
    quarter, half = WSD_WINDOW[style]
    assert learning_rate(c, 85, 100) == pytest.approx(quarter)
    assert learning_rate(c, 90, 100) == pytest.approx(half)


def test_wsd_exponential_falls_faster_than_linear_and_monotonically():
    # exponential decay drops fastest early on: below the linear value mid-window
    c = cfg("WSD", decay_iters=100, lr_wsd_decay_iters=20, lr_wsd_decay_style="exponential")
    window = [learning_rate(c, i, 100) for i in range(80, 101)]
    assert window[0] == pytest.approx(LR) and window[-1] == pytest.approx(MIN)
    assert all(a > b for a, b in zip(window, window[1:]))
    assert MIN < window[10] < 0.55


@pytest.mark.parametrize("style,half", [("linear", 0.55), ("cosine", (LR + MIN) / 2)])
def test_wsd_default_window_is_a_tenth_of_decay_iters(style, half):
    # no --lr-wsd-decay-iters, no --lr-decay-iters: 100 train iters -> window 90..100
    c = cfg("WSD", lr_wsd_decay_style=style)
    assert learning_rate(c, 89, 100) == pytest.approx(LR)
    assert learning_rate(c, 90, 100) == pytest.approx(LR)
    assert learning_rate(c, 91, 100) < LR
    assert learning_rate(c, 95, 100) == pytest.approx(half)
    assert learning_rate(c, 100, 100) == pytest.approx(MIN)


# ---- sample-based schedules and the batch-size ramp-up (--train-samples) -----------------


@pytest.mark.parametrize(
    "style,kw",
    [
        ("linear", {}),
        ("cosine", {}),
        ("constant", {}),
        ("WSD", {"lr_wsd_decay_style": "cosine"}),
        ("cosine", {"fraction": 0.1}),
    ],
)
def test_sample_schedule_at_a_constant_batch_equals_the_iteration_schedule(style, kw):
    # G samples per step: warmup 10 x G, decay 110 x G samples give the rate of warmup 10, decay 110 iterations
    G, fraction = 6, kw.pop("fraction", None)
    warmup = 0 if fraction else 10
    by_iter = cfg(style, warmup=warmup, decay_iters=110, lr_warmup_fraction=fraction, lr_wsd_decay_iters=20, **kw)
    by_samples = OptimConfig(
        lr=LR,
        min_lr=MIN,
        lr_decay_style=style,
        lr_warmup_samples=warmup * G,
        lr_decay_samples=110 * G,
        lr_wsd_decay_samples=20 * G,
        lr_warmup_fraction=fraction,
        **kw,
    )
    for i in range(0, 130, 3):
        assert learning_rate_at_samples(by_samples, i * G, G, 200 * G) == pytest.approx(
            learning_rate(by_iter, i, 200)
        ), i


def test_warmup_fraction_is_a_fraction_of_the_decay_span():
    # Megatron: warmup = fraction x decay iters (here 0.25 x 40 = 10 iterations; train iters 40 by default)
    c = cfg("linear", lr_warmup_fraction=0.25)
    assert [learning_rate(c, i, 40) for i in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert learning_rate(c, 25, 40) == pytest.approx(LR - (LR - MIN) * 15 / 30)


def ramp(start=4, incr=4, samples=48, gbs=16, train_samples=120):
    return TrainConfig(global_batch_size=gbs, rampup_batch_size=[start, incr, samples], train_samples=train_samples)


def test_rampup_grows_the_batch_in_equal_sample_increments():
    # (16 - 4) / 4 = 3 increments over 48 samples: one every 16 samples, full batch past 48
    t, consumed, batches = ramp(), 0, []
    for _ in range(10):
        batches.append(t.global_batch_at(consumed))
        consumed += batches[-1]
    assert batches == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16]  # starts at 0 4 8 12 | 16 24 | 32 44 | 56 72
    # Megatron's update_train_iters: steps starting at <= 48 samples (8 of them, 56 samples), then (120-56)//16
    assert t.iterations_for_samples() == 8 + 4
    assert t.samples_after(12) == 120 and t.samples_after(3) == 12
    assert TrainConfig(global_batch_size=16, train_samples=120).iterations_for_samples() == 7


def test_sample_warmup_follows_the_samples_a_ramp_up_really_consumed():
    o = OptimConfig(lr=LR, min_lr=MIN, lr_decay_style="linear", lr_warmup_samples=24, lr_decay_samples=124)
    t, consumed, rates = ramp(), 0, []
    for _ in range(7):
        batch = t.global_batch_at(consumed)
        rates.append(learning_rate_at_samples(o, consumed, batch, 120))
        consumed += batch
    # steps end at 4, 8, 12, 16, 24 samples (warmup: lr x end / 24), then decay from sample 24 over 100
    assert rates == pytest.approx([4 / 24, 8 / 24, 12 / 24, 16 / 24, 1.0, 1.0, LR - (LR - MIN) * 8 / 100])
