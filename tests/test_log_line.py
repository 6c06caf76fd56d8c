"""Megatron-LM's log line, evaluation and logging flags: `lm loss` averaged over the log
interval, the next step's learning rate, the consumed samples; a validation iterator that continues
(across a resume too) and the final validation and test evaluations; --skip-train; MFU against the
peak of the dtype used; --log-params-norm and --log-num-zeros-in-grad (each element once over TP and
ZeRO shards); tensorboard's Megatron scalars; the timers; --deterministic-mode."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_zpp import training
from megatron_zpp.config import ConfigError, TrainConfig
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.perf import peak_tflops
from megatron_zpp.training.determinism import apply_deterministic_mode
from megatron_zpp.training.evaluation import evaluations_done, valid_samples_needed
from megatron_zpp.training.loop import LogInterval
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.test_training import TINY

LINE = re.compile(
    r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.* learning rate: (\S+) \| global batch size: +(\d+) \| "
    r"lm loss: (\S+) \|.* grad norm: \S+ \| num zeros: (\d+) \| params norm: (\S+) \| "
    r"number of skipped iterations: +(\d+) \| number of nan iterations: +(\d+) \|.* MFU \S+ of (\S+) (\w+) TFLOP/s"
)
VALID = re.compile(r"validation loss at iteration (\d+)( on (?:validation|test) set)? \| lm loss value: (\S+) \|")


def _setup(argv):
    return training.setup(validate(parse_args(TINY + argv), 1))


def _cfg(argv, world=1):
    return validate(parse_args(TINY + argv), world)


def test_log_line_validation_resume_final_and_skip_train(tmp_path, capsys):
    ck, tb, metrics = tmp_path / "ck", tmp_path / "tb", tmp_path / "m.jsonl"
    flags = "--untie-embeddings-and-output-weights --global-batch-size 2 --train-iters 4 --log-interval 2"
    flags += " --eval-interval 2 --eval-iters 1"
    flags += " --log-params-norm --log-num-zeros-in-grad --timing-log-level 2 --log-validation-ppl-to-tensorboard"
    flags += " --log-timers-to-tensorboard --log-memory-to-tensorboard --log-world-size-to-tensorboard"
    argv = f"{flags} --save {ck} --save-interval 2 --tensorboard-dir {tb} --metrics-file {metrics}".split()
    run = _setup(argv)
    whole = training.train(run, final_evaluation=True)
    out = capsys.readouterr().out
    losses = [h["loss"] for h in whole]

    # the log line: lm loss = the mean of the interval's losses, the LR of the next step, consumed samples;
    # as Megatron, also after the run's first step (the interval then goes on to iteration 2)
    lines = [LINE.search(line) for line in out.splitlines() if "| lm loss: " in line]
    assert all(lines) and len(lines) == 3, out
    for m, last, steps in zip(lines, (1, 2, 4), (1, 2, 2)):
        assert int(m[1]) == last and int(m[2]) == 2 * last and int(m[4]) == 2
        assert float(m[5]) == pytest.approx(np.mean(losses[last - steps : last]), rel=1e-6)
        assert int(m[8]) == 0 and int(m[9]) == 0
        assert int(m[6]) == whole[last - 1]["num_zeros"]
        assert float(m[7]) == pytest.approx(whole[last - 1]["params_norm"], abs=1e-3)
        assert m[11] == "fp32" and float(m[10]) > 0  # fp32 run: the measured fp32 matmul peak
    assert float(lines[0][3]) == pytest.approx(whole[1]["lr"], rel=1e-6)  # what step 2 then used
    assert float(lines[1][3]) == pytest.approx(whole[2]["lr"], rel=1e-6)
    assert float(lines[2][3]) == pytest.approx(3e-5, rel=1e-6)  # after the last step: cosine at its end, --min-lr
    assert "(min, max) time across ranks (ms):" in out and "forward-backward" in out and "batch-generator" in out

    # --log-params-norm: the fp32 weights after the step, in fp64 (1 rank, ZeRO-0: all of them)
    params = [p.detach().double() for c in run.chunks for p in c.parameters()]
    assert whole[-1]["params_norm"] == pytest.approx(math.sqrt(sum((p * p).sum().item() for p in params)), rel=1e-9)
    # --log-num-zeros-in-grad: the last step's gradients (the input embedding's rows of tokens not in the batch)
    grads = [p.main_grad for c in run.chunks for p in c.parameters()]
    assert whole[-1]["num_zeros"] == sum(int((g == 0).sum()) for g in grads) > 0

    # evaluation: at 2 and 4 on successive validation batches, then the validation and test sets
    evals = [(int(m[1]), m[2], float(m[3])) for m in map(VALID.search, out.splitlines()) if m]
    assert [e[:2] for e in evals] == [(2, None), (4, None), (4, " on validation set"), (4, " on test set")]
    assert [whole[1]["val_loss"], whole[3]["val_loss"]] == pytest.approx([evals[0][2], evals[1][2]], rel=1e-6)
    assert run.state.consumed_valid_samples == 3 * 2  # three validation batches of 2 read so far
    final = run.state.final_evaluation
    run.state.consumed_valid_samples = 2  # the batch the evaluation at iteration 4 read: it was the second one
    assert training.evaluate(run) == whole[3]["val_loss"]
    run.state.consumed_valid_samples = 0
    first_batch = training.evaluate(run)
    assert training.evaluate(run, "test") == final["test_loss"]  # the test set is read from its start
    assert final["val_loss"] != whole[3]["val_loss"]  # the final validation read the third batch

    # tensorboard: Megatron's names beside ours
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("learning-rate", "lm loss", "loss-scale", "world-size", "grad-norm", "params-norm", "num-zeros"):
        assert tag in tags and f"{tag} vs samples" in tags, tag
    for tag in ("mem-max-rss-bytes", "iteration-time", "forward-backward-time", "lm loss validation ppl", "loss"):
        assert tag in tags, tag
    assert [s.value for s in acc.Scalars("lm loss")] == pytest.approx(losses, rel=1e-6)
    assert [s.step for s in acc.Scalars("lm loss validation vs samples")] == [4, 8, 8]  # by consumed samples
    ppl = [s.value for s in acc.Scalars("lm loss validation ppl")]
    assert ppl == pytest.approx([math.exp(e[2]) for e in evals[:3]], rel=1e-5)
    assert [json.loads(r)["iteration"] for r in metrics.read_text().splitlines()] == [1, 2, 3, 4]

    # resumed at 2: the validation continues where it stood (bitwise), and the final ones alike
    resumed_run = _setup(argv[:-4] + ["--load", str(ck), "--ckpt-step", "2"])
    resumed = training.train(resumed_run, final_evaluation=True)
    assert [h["val_loss"] for h in resumed if "val_loss" in h] == [whole[3]["val_loss"]]
    assert resumed_run.state.final_evaluation == final

    # --skip-train: the checkpoint's weights, no step, the validation set from its start (as Megatron)
    capsys.readouterr()
    skip_run = _setup(argv[:-4] + ["--load", str(ck), "--skip-train"])
    assert training.train(skip_run) == [] and skip_run.state.iteration == 4
    assert skip_run.state.final_evaluation["test_loss"] == final["test_loss"]
    assert skip_run.state.final_evaluation["val_loss"] == first_batch != final["val_loss"]
    assert "| lm loss: " not in capsys.readouterr().out


def test_interval_average_leaves_skipped_steps_out():
    interval = LogInterval()
    steps = [(4.0, False), (9.0, True), (float("nan"), True), (2.0, False)]  # (loss, skipped on fp16 overflow)
    for loss, skipped in steps:
        interval.add({"loss": loss, "step_time": 0.5, "data_wait_time": 0.0}, skipped)
    assert interval.lm_loss == (4.0 + 2.0) / 2 and interval.skipped == 2 and interval.nan == 1
    assert interval.iterations == 4 and interval.seconds == 2.0


def test_evaluations_done_counts_the_due_iterations():
    for interval, start in [(3, None), (3, 5), (4, 0), (2, 7)]:
        t = TrainConfig(eval_interval=interval, start_eval_at_iter=start)
        for it in range(0, 20):
            due = [i for i in range(1, it + 1) if i % interval == 0 and (start is None or i >= start)]
            assert evaluations_done(t, it) == len(due), (interval, start, it)
    # the validation samples a run needs: 4 evaluations of 2 batches of 4 and the final one; resumed at
    # iteration 10 after 5 evaluations (made at --eval-interval 2), 2 more and the final one
    t = TrainConfig(eval_interval=5, eval_iters=2, train_iters=20, global_batch_size=4)
    assert valid_samples_needed(t) == 5 * 2 * 4
    assert valid_samples_needed(t, 5 * 2 * 4, 10) == (5 + 3) * 2 * 4
    assert valid_samples_needed(t, 2 * 2 * 4, 10) == 5 * 2 * 4  # the same cadence: the same size


def test_mfu_peak_is_the_dtypes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda, matmul = torch.device("cuda", 0), torch.backends.cuda.matmul
    tf32 = matmul.allow_tf32  # a module whose attributes monkeypatch cannot restore
    try:
        matmul.allow_tf32 = False
        assert peak_tflops(cuda, torch.bfloat16, None) == (989.4, "989.4 bf16 TFLOP/s (dense peak of NVIDIA H200)")
        assert peak_tflops(cuda, torch.float16, None)[0] == 989.4
        assert peak_tflops(cuda, torch.float32, None) == (66.9, "66.9 fp32 TFLOP/s (dense peak of NVIDIA H200)")
        matmul.allow_tf32 = True
        assert peak_tflops(cuda, torch.float32, None)[1].startswith("494.7 tf32 TFLOP/s")
    finally:
        matmul.allow_tf32 = tf32
    assert peak_tflops(torch.device("cpu"), torch.float16, 2.0) == (2.0, "2 fp16 TFLOP/s (--peak-tflops)")
    value, desc = peak_tflops(torch.device("cpu"), torch.bfloat16, None)
    assert value > 0 and desc.startswith(f"{value:.4g} bf16 TFLOP/s (measured bf16 matmul")


def _norms(rank, world, argv):
    run = training.setup(validate(parse_args(TINY + argv), world))
    return [(h["params_norm"], h["num_zeros"], h["loss"]) for h in training.train(run)]


# each with the timers' collectives of one --timing-log-option over the 2 ranks too
LAYOUTS = [
    "--tensor-model-parallel-size 2 --timing-log-level 1 --timing-log-option all",
    "--zero-stage 3 --timing-log-level 2",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_params_norm_and_zeros_count_each_element_once(layout, capfd):
    argv = "--untie-embeddings-and-output-weights --global-batch-size 2 --train-iters 2 --lr-warmup-iters 1".split()
    argv += ["--log-params-norm", "--log-num-zeros-in-grad"]
    one = _norms(0, 1, argv)
    two = run_distributed(_norms, 2, argv + layout.split())
    assert two[0] == two[1]  # known on every rank
    assert [n for n, _, _ in two[0]] == pytest.approx([n for n, _, _ in one], rel=1e-5)
    assert [z for _, z, _ in two[0]] == [z for _, z, _ in one]
    out = capfd.readouterr().out
    timer = r"forward-backward" if "all" in layout else r"batch-generator"  # every rank's or (min, max)
    assert re.search(timer + r"\.+: \(\d+\.\d+, \d+\.\d+\)\n", out), out[-2000:]


def test_deterministic_mode_sets_what_megatron_sets_and_repeats(monkeypatch):
    for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    try:
        runs = [training.train(_setup("--deterministic-mode --train-iters 3".split())) for _ in range(2)]
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_ALGO"] == "Ring"
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
        assert [h["loss"] for h in runs[0]] == [h["loss"] for h in runs[1]]
        env = {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        with pytest.raises(ConfigError, match=r"NCCL_ALGO='Tree' is not deterministic"):
            apply_deterministic_mode(env)
        assert "kept CUBLAS_WORKSPACE_CONFIG=:16:8" in apply_deterministic_mode({"CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_logging_flags_are_checked():
    with pytest.raises(ConfigError) as e:
        _cfg("--tensorboard-log-interval 0 --log-memory-interval 0 --logging-level 99 --start-eval-at-iter -1".split())
    text = str(e.value)
    flags = ("--tensorboard-log-interval 0", "--log-memory-interval 0", "--logging-level 99", "--start-eval-at-iter")
    assert all(flag in text for flag in flags), text
    cfg = _cfg("--timing-log-level 1 --timing-log-option max --no-log-loss-scale-to-tensorboard".split())
    assert cfg.log.timing_log_level == 1 and not cfg.log.log_loss_scale_to_tensorboard


def test_eval_batch_sizes_memory_line_and_level_1_barriers(capsys, monkeypatch):
    from megatron_zpp.training import timers

    barriers = []
    monkeypatch.setattr(timers.comm, "barrier", lambda group=None: barriers.append(group.role))
    base = "--global-batch-size 2 --train-iters 2 --lr-warmup-iters 1 --eval-interval 2 --eval-iters 1"
    base += " --eval-global-batch-size 4"
    argv = (base + " --log-interval 2 --log-memory-interval 1 --timing-log-level 1 --timing-log-option all").split()
    run = _setup(argv + ["--eval-micro-batch-size", "2"])
    two = training.train(run)[-1]["val_loss"]
    out = capsys.readouterr().out
    assert run.state.consumed_valid_samples == 4 and barriers == ["world"] * 4  # 2 level-1 phases x 2 steps
    assert "[Rank 0] (after 1 iterations) memory (MB) | max RSS: " in out and "(after 2 iterations)" in out
    assert "times across ranks (ms):" in out and "    optimizer" in out
    # micro-batches of 1 over the same 4 samples: the same mean loss (each sample has as many tokens)
    one = training.train(_setup(argv + ["--eval-micro-batch-size", "1", "--no-barrier-with-level-1-timing"]))
    assert one[-1]["val_loss"] == pytest.approx(two, rel=1e-6) and len(barriers) == 4
    with pytest.raises(ConfigError) as e:
        _cfg("--eval-global-batch-size 3 --eval-micro-batch-size 2".split())
    assert "--eval-global-batch-size 3 must be a multiple of the evaluation micro-batch 2 x DP 1 = 2" in str(e.value)
    with pytest.raises(ConfigError, match="--eval-micro-batch-size 2 with pipeline parallelism is not built"):
        _cfg("--pipeline-model-parallel-size 2 --global-batch-size 2 --eval-micro-batch-size 2".split(), 2)


def test_fp16_skipped_steps_are_left_out_of_lm_loss(capsys):
    # from 2^17 with --hysteresis 1 one step overflows here (at 65536 none does): skipped, scale halved
    argv = "--fp16 --initial-loss-scale 131072 --hysteresis 1 --train-iters 4 --log-interval 4 --eval-iters 0"
    history = training.train(_setup(argv.split()))
    counts = [0] + [h["skipped_iterations"] for h in history]
    skipped = [counts[i + 1] > counts[i] for i in range(len(history))]
    assert sum(skipped) == 1, counts
    line = [line for line in capsys.readouterr().out.splitlines() if "| lm loss: " in line][-1]  # iteration 4
    applied = [h["loss"] for h, s in zip(history, skipped) if not s]
    assert float(re.search(r"lm loss: (\S+) \|", line)[1]) == pytest.approx(np.mean(applied), rel=1e-6)
    assert "| loss scale: 65536.0 |" in line and "number of skipped iterations:   1 |" in line
    assert "| skipped samples:            1 |" in line
