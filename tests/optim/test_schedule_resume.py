"""The schedule of a resumed run: this command line's by default (Megatron's
--override-opt_param-scheduler), the checkpoint's with --use-checkpoint-opt_param-scheduler
(Megatron's values: peak and minimum lr, warmup and decay lengths, decay style; the expected
rates are Megatron's formulas, written out in tests/optim/test_schedules.py), with one warning
line naming what differs and whose win; and a checkpoint saved without --decoupled-lr resumes with it."""

import pytest

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.optim.test_decoupled_lr import DLR, LR, TINY
from tests.optim.test_schedules import megatron_lr

G = 2  # TINY's global batch: Megatron's count advances by 2 a step


def history(argv: list[str]) -> list[dict]:
    return training.train(training.setup(validate(parse_args(TINY + argv), 1)))


def schedule_warnings(capsys) -> list[str]:
    return [ln.split("] ", 1)[1] for ln in capsys.readouterr().out.splitlines() if "the LR schedule differs" in ln]


def test_use_checkpoint_opt_param_scheduler_takes_the_checkpoints_schedule(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    first = history(
        f"--lr {LR} --min-lr 1e-4 --lr-warmup-iters 1 --train-iters 4 --save {ck} --save-interval 2".split()
    )
    other = (
        f"--lr 5e-3 --min-lr 0 --lr-decay-style cosine --lr-warmup-iters 2 --train-iters 6 --load {ck} --ckpt-step 2"
    )
    capsys.readouterr()
    mine = history(other.split())
    (warning,) = schedule_warnings(capsys)  # one line, naming each setting that differs and whose win
    changed = f"--lr 0.005 here, {LR:g} in the checkpoint; --min-lr 0 here, 0.0001 in the checkpoint; --lr-decay-style"
    assert warning.startswith(f"warning: the LR schedule differs from the checkpoint's: {changed}")
    assert "lr decay samples (--lr-decay-*, else --train-*) 12 here, 8 in the checkpoint" in warning
    assert ": this command line's win, as with --override-opt_param-scheduler" in warning
    theirs = history(other.split() + ["--use-checkpoint-opt_param-scheduler"])
    (warning,) = schedule_warnings(capsys)
    assert warning.endswith("in the checkpoint: the checkpoint's win (--use-checkpoint-opt_param-scheduler)")
    counts = [i * G for i in range(2, 6)]  # steps 3-6 of the resumed run
    # the checkpoint's: linear from 1e-3 to 1e-4, warmup 1 x 2, decay over its 4 iterations x 2 (then min)
    assert [h["lr"] for h in theirs] == pytest.approx([megatron_lr(n, "linear", G, 4 * G, 0, LR, 1e-4) for n in counts])
    assert [h["lr"] for h in theirs[:2]] == [h["lr"] for h in first[2:]]
    # by default this command line's: cosine from 5e-3 to 0, warmup 2 x 2, decay over 6 x 2
    assert [h["lr"] for h in mine] == pytest.approx(
        [megatron_lr(n, "cosine", 2 * G, 6 * G, 0, 5e-3, 0) for n in counts]
    )


def test_a_checkpoint_saved_without_decoupled_lr_resumes_with_it(tmp_path):
    # the same AdamW numbering, cut into more groups: the moments load, the groups are this run's
    ck = str(tmp_path / "ck")
    argv = TINY + f"--lr {LR} --lr-decay-style constant --weight-decay 0 --save {ck}".split()
    training.train(training.setup(validate(parse_args(argv + ["--train-iters", "1"]), 1)))
    run = training.setup(validate(parse_args(argv + f"--train-iters 2 --load {ck} --decoupled-lr {DLR}".split()), 1))
    adamw = run.dp.optimizer.opt
    assert [int(s["step"]) for s in adamw.state.values()] == [1] * len(adamw.state)  # restored
    assert len(training.train(run)) == 1
    assert sorted((g["decoupled"], g["lr"]) for g in adamw.param_groups if g["params"]) == [
        (False, LR),
        (False, LR),
        (True, DLR),
        (True, DLR),
    ]
