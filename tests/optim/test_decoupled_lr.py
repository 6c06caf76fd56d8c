"""--decoupled-lr through the engines, and the rates the training loop really applies.

AdamW's first step moves an element by lr * g / (|g| + eps), i.e. by its learning rate
wherever the gradient is far above eps (weight decay 0): the word embedding and the untied
output layer (Megatron's is_embedding_or_output_parameter) must move by --decoupled-lr, every
other parameter by --lr, with plain data parallelism on one rank and with ZeRO-1 and ZeRO-3
over two. The loop's own rates are read from AdamW's param groups at each step of a 3-step
run and compared with Megatron's warmup (init + (max - init) n / W, n = 0 at the first step)
and its linear weight-decay increment, written out here."""

import numpy as np
import pytest

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed

LR, DLR = 1e-3, 1e-2
TINY = (
    "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
    "--make-vocab-size-divisible-by 32 --hidden-dropout 0 --attention-dropout 0 --eval-iters 1 --log-interval 1 "
    "--global-batch-size 2 --clip-grad 0 --adam-eps 1e-12 --seed 3 --untie-embeddings-and-output-weights "
    "--peak-tflops 1"
).split()
DECOUPLED = {"embedding.weight", "output.weight"}


def first_step_moves(extra: list[str], world: int) -> dict[str, np.ndarray]:
    """|weight after one step - before| per parameter name (full weights, this rank's stage)."""
    argv = TINY + f"--train-iters 1 --lr {LR} --decoupled-lr {DLR} --lr-decay-style constant --weight-decay 0".split()
    run = training.setup(validate(parse_args(argv + extra), world))

    def weights():
        with run.dp.full_parameters():
            return {n: p.detach().double().numpy().copy() for c in run.chunks for n, p in c.named_parameters()}

    before = weights()
    training.train(run)
    return {n: np.abs(w - before[n]) for n, w in weights().items()}


def assert_moved_by_their_rates(moves: dict[str, np.ndarray], where: str) -> None:
    assert DECOUPLED <= set(moves), sorted(moves)
    for name, d in moves.items():
        lr = DLR if name in DECOUPLED else LR
        assert d.max() == pytest.approx(lr, rel=1e-3), f"{where} {name}: moved {d.max():.3e}, lr {lr:g}"
        assert d.max() <= lr * (1 + 1e-4), f"{where} {name}"


def test_decoupled_parameters_move_by_their_lr_on_one_rank():
    assert_moved_by_their_rates(first_step_moves([], 1), "plain")


def _zero_worker(rank, world, variants):
    return [first_step_moves(v, world) for v in variants]


def test_decoupled_parameters_move_by_their_lr_under_zero_1_and_3():
    variants = [["--zero-stage", "1"], ["--zero-stage", "3"]]
    per_rank = run_distributed(_zero_worker, 2, variants, timeout=300)
    for moves, v in zip(per_rank[0], variants):
        assert_moved_by_their_rates(moves, " ".join(v))


def test_the_loop_applies_megatrons_rates_at_each_step():
    argv = (
        TINY
        + (
            f"--train-iters 3 --lr {LR} --decoupled-lr {DLR} --decoupled-min-lr 0 --lr-warmup-iters 2 "
            "--lr-warmup-init 1e-4 --weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.3"
        ).split()
    )
    run = training.setup(validate(parse_args(argv), 1))
    seen = []
    adamw = getattr(run.dp.optimizer, "opt", run.dp.optimizer)  # plain DP wraps torch's AdamW
    adamw.register_step_pre_hook(lambda opt, *_: seen.append([dict(g, params=None) for g in opt.param_groups]))
    history = training.train(run)
    G = 2  # Megatron's count n: samples before the step (0, 2, 4); warmup 2 x 2, weight decay over 3 x 2
    for i, groups in enumerate(seen):
        n = i * G
        lr, dlr = (1e-4 + (m - 1e-4) * min(n / 4, 1) for m in (LR, DLR))
        assert history[i]["lr"] == pytest.approx(lr)
        assert {g["decoupled"] for g in groups} == {True, False}
        for g in groups:
            assert g["lr"] == pytest.approx(dlr if g["decoupled"] else lr), (i, g)
            assert g["weight_decay"] == pytest.approx(0.3 * n / 6 * g["wd_mult"]), (i, g)
    assert len(seen) == 3
