"""Learning-rate schedules against their closed forms (Megatron's semantics).

lr = 1 and min_lr = 0.1 keep the expected values readable: a cosine or linear midpoint
is (lr + min_lr) / 2 = 0.55. lr_decay_iters counts from iteration 0 (warmup included),
as Megatron's --lr-decay-iters does: decay runs from iteration `warmup` to `decay_iters`."""

import math

import pytest

from megatron_zpp.config import OptimConfig
from megatron_zpp.optim import learning_rate

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
