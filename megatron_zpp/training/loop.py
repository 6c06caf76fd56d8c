"""The training loop: steps, evaluation cadence, metrics and the console line (Megatron-LM's log
line: the loss averaged over the log interval as `lm loss`, the consumed samples, the learning rate
of the next step; then ours: tokens/s, TFLOP/s, MFU against the peak of the dtype used, ETA), the
timers, tensorboard, checkpoint cadence, profiling windows, and the early stops: a signal
(--exit-signal-handler), --exit-interval and --exit-duration-in-mins, each after a checkpoint when
--save is given."""

from __future__ import annotations

import dataclasses
import gc
import math
import time

import torch

from .. import comm
from ..checkpoint import save_checkpoint
from ..checkpoint.save import finish_async_save
from ..logging_utils import MetricsSink, log
from ..optim import global_grad_norm, rates_at
from ..perf import flops_per_token, memory_gib, memory_report, memory_stats, peak_tflops
from .builders import training_dtype
from .evaluation import eval_due, evaluate_and_print
from .profiling import StepProfiler
from .run import Run
from .step import count_step, train_step
from .timers import Timers, format_timers


@dataclasses.dataclass
class Throughput:
    """What one step's time means: tokens and model FLOPs per sample, the peak for MFU (in the dtype
    the matmuls run in) and what that peak is ("989.4 bf16 TFLOP/s (dense peak of ...)")."""

    seq_length: int
    flops_per_sample: float
    peak: float
    world: int
    peak_desc: str = ""

    @classmethod
    def of(cls, run: Run) -> Throughput:
        cfg = run.cfg
        per_sample = flops_per_token(cfg.model, run.tokenizer.padded_vocab_size) * cfg.model.seq_length
        peak, peak_desc = peak_tflops(run.device, training_dtype(cfg), cfg.log.peak_tflops)
        flops = per_sample * cfg.train.global_batch_size
        log(f"MFU is measured against {peak_desc}; model FLOPs per step {flops / 1e9:.2f} G", run.rank)
        return cls(cfg.model.seq_length, per_sample, peak, cfg.parallel.world_size, peak_desc.split(" (")[0])

    def metrics(self, elapsed: float, batch: int) -> dict:
        """Rates of a step of `batch` samples (the global batch, which a ramp-up grows)."""
        tflops = self.flops_per_sample * batch / elapsed / self.world / 1e12
        return {
            "tokens_per_sec": self.seq_length * batch / elapsed,
            "step_time": elapsed,
            "tflops_per_rank": tflops,
            "mfu": tflops / self.peak if self.peak else None,
        }


class StepClock:
    """The mean iteration time of this run, for the ETA of the log line; the first step (warm-up:
    allocation, compilation) is left out once there are others."""

    def __init__(self):
        self.first, self.rest, self.count = 0.0, 0.0, 0

    def add(self, seconds: float) -> None:
        if self.count == 0:
            self.first = seconds
        else:
            self.rest += seconds
        self.count += 1

    def eta(self, remaining: int) -> float:
        mean = self.rest / (self.count - 1) if self.count > 1 else self.first
        return max(remaining, 0) * mean


def format_eta(seconds: float) -> str:
    """12345.6 -> '3:25:46'; past a day '2d 3:25:46'."""
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    clock = f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{days}d {clock}" if days else clock


@dataclasses.dataclass
class LogInterval:
    """The steps since the last log line, as Megatron's training_log sums them: `lm loss` is the mean
    loss of the steps that were applied (an fp16 step skipped on overflow is left out and counted as
    skipped, and as nan when its loss was not finite)."""

    loss_sum: float = 0.0
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    seconds: float = 0.0
    data_wait: float = 0.0

    def add(self, m: dict, skipped: bool) -> None:
        self.seconds += m["step_time"]
        self.data_wait += m["data_wait_time"]
        if skipped:
            self.skipped += 1
            self.nan += not math.isfinite(m["loss"])
        else:
            self.advanced += 1
            self.loss_sum += m["loss"]

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped

    @property
    def lm_loss(self) -> float:
        return self.loss_sum / max(1, self.advanced)


def _log_line(run: Run, m: dict, interval: LogInterval, throughput: Throughput, eta: float) -> None:
    """Megatron's log line (its fields and names) for the interval ending at this step, then ours:
    tokens/s, TFLOP/s per rank, MFU and its peak, data wait, memory, ETA (at the mean step time)."""
    t, state = run.cfg.train, run.state
    per_it = interval.seconds / max(1, interval.iterations)
    mfu = f"{100 * m['mfu']:.1f}% of {throughput.peak_desc}" if m["mfu"] is not None else "n/a"
    extra = f" num zeros: {m['num_zeros']} |" if "num_zeros" in m else ""
    extra += f" params norm: {m['params_norm']:.3f} |" if "params_norm" in m else ""
    for name in ("load_balancing_loss", "z_loss"):  # Megatron's MoE names, then the worst expert load
        extra += f" {name}: {m[name]:.6E} |" if name in m else ""
    if "moe/expert_load_max_over_mean" in m:
        extra += f" expert load max/mean: {m['moe/expert_load_max_over_mean']:.2f} |"
    if "moe/dropped_fraction" in m:
        extra += f" dropped routes: {100 * m['moe/dropped_fraction']:.1f}% |"
    skipped = f" skipped samples: {state.skipped_samples:12d} |" if state.skipped_samples else ""
    log(
        f"iteration {state.iteration:8d}/{t.train_iters:8d} | "
        f"consumed samples: {state.consumed_samples:12d} |{skipped} "
        f"elapsed time per iteration (ms): {1e3 * per_it:.1f} | learning rate: {m['next_lr']:.6E} | "
        f"global batch size: {m['global_batch_size']:5d} | lm loss: {interval.lm_loss:.6E} | "
        f"loss scale: {m.get('loss_scale', 1.0):.1f} | grad norm: {m['grad_norm']:.3f} |{extra} "
        f"number of skipped iterations: {interval.skipped:3d} | number of nan iterations: {interval.nan:3d} | "
        f"{m['tokens_per_sec']:.0f} tok/s | {m['tflops_per_rank']:.3f} TFLOP/s/rank | MFU {mfu} | "
        f"data wait {1e3 * interval.data_wait:.1f} ms | mem {m['memory_gib']:.2f} GiB | ETA {format_eta(eta)}",
        run.rank,
    )


def _timed_step(run: Run, throughput: Throughput, timers: Timers) -> dict:
    state = run.state
    batch = run.cfg.train.global_batch_at(state.consumed_samples)  # what train_step takes
    waited = run.train_data.wait_seconds
    start = time.perf_counter()
    loss, grad_norm, lr = train_step(run, timers)
    elapsed = time.perf_counter() - start
    waited = run.train_data.wait_seconds - waited
    timers.add("batch-generator", waited)
    count_step(run, batch)
    scaling = {}
    if state.loss_scaler is not None:
        scaling = {"loss_scale": state.loss_scaler.scale, "skipped_iterations": state.skipped_iterations}
        if state.last_step_skipped:
            log(
                f"iteration {state.iteration}: gradients overflowed in fp16, step skipped; loss scale now "
                f"{state.loss_scaler.scale:g} ({state.skipped_iterations} skipped so far)",
                run.rank,
            )
    return {
        **scaling,
        "iteration": state.iteration,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        **throughput.metrics(elapsed, batch),
        "global_batch_size": batch,
        "data_wait_time": waited,  # seconds this step blocked on its micro-batches
        "consumed_samples": state.consumed_samples,
        "memory_gib": memory_gib(run.device),
        "next_lr": _next_lr(run),
        **_norms(run),
        **run.moe_metrics,
    }


def _next_lr(run: Run) -> float:
    """The learning rate of the next step: what Megatron logs (its scheduler has stepped by then)."""
    return rates_at(run.cfg, run.state.consumed_samples - run.state.skipped_samples, run.checkpoint_schedule).lr


def _norms(run: Run) -> dict:
    """--log-params-norm, --log-num-zeros-in-grad: collectives on every rank at every step they are on."""
    out = {}
    if run.cfg.log.log_params_norm:
        out["params_norm"] = global_grad_norm(run.dp.counted_parts("params"), phase="params_norm")
    if run.cfg.log.log_num_zeros_in_grad:
        out["num_zeros"] = 0
        for grads, groups in run.dp.counted_parts("grads"):
            zeros = torch.zeros(1, dtype=torch.float64, device=run.device)
            for g in grads:
                zeros += (g == 0).sum()
            for group in groups:
                comm.all_reduce(zeros, group, "num_zeros")
            out["num_zeros"] += int(zeros.item())
    return out


def _tensorboard(run: Run, sink: MetricsSink, m: dict) -> None:
    """Megatron-LM's tensorboard scalars of a step (every --tensorboard-log-interval steps), beside ours."""
    g = run.cfg.log
    if run.state.iteration % g.tensorboard_log_interval:
        return
    scalars = {"learning-rate": m["next_lr"], "batch-size": m["global_batch_size"], "lm loss": m["loss"]}
    if run.state.skipped_samples:
        scalars["skipped-train-samples"] = run.state.skipped_samples
    if g.log_loss_scale_to_tensorboard:
        scalars["loss-scale"] = m.get("loss_scale", 1.0)
    if g.log_world_size_to_tensorboard:
        scalars["world-size"] = run.cfg.parallel.world_size
    scalars["grad-norm"] = m["grad_norm"]
    for ours, theirs in (("num_zeros", "num-zeros"), ("params_norm", "params-norm")):
        if ours in m:
            scalars[theirs] = m[ours]
    sink.tensorboard(scalars, run.state.iteration, run.state.consumed_samples)
    if g.log_memory_to_tensorboard:
        sink.tensorboard(memory_stats(run.device), run.state.iteration, run.state.consumed_samples)


def _log_timers(run: Run, sink: MetricsSink, timers: Timers, interval: LogInterval, m: dict, reset: bool) -> None:
    """After the log line: the timers (--timing-log-level), and to tensorboard with --log-timers-to-tensorboard
    the iteration time, throughput and each timer's max over ranks, as Megatron."""
    g = run.cfg.log
    times = timers.report(run.groups.world, interval.iterations, reset)  # a collective on every rank (level >= 1)
    if times:
        log(format_timers(times, g.timing_log_option), run.rank)
    if g.log_timers_to_tensorboard and reset:  # not the first step's early line, as Megatron
        per_it = interval.seconds / max(1, interval.iterations)
        scalars = {"iteration-time": per_it, "throughput": m["tflops_per_rank"]}
        scalars.update({f"{name}-time": max(v) for name, v in times.items()})
        sink.tensorboard(scalars, run.state.iteration, run.state.consumed_samples)


def _report_memory(run: Run) -> None:
    """--log-memory-interval: this rank's memory, on the first data-parallel rank of each model replica."""
    if run.groups.dp_rank == 0:
        stats = memory_report(run.device, run.cfg.log.log_device_memory_used)
        print(f"[Rank {run.rank}] (after {run.state.iteration} iterations) memory (MB) | {stats}", flush=True)


def _save_due(run: Run) -> bool:
    t = run.cfg.train
    return bool(t.save) and (
        run.state.iteration == t.train_iters or (t.save_interval and run.state.iteration % t.save_interval == 0)
    )


def _metrics_sink(run: Run) -> MetricsSink:
    """Rank 0's metrics outputs; a resumed run continues the checkpoint's W&B run and
    tensorboard step axis, and the W&B run's id goes into the checkpoints it saves."""
    cfg = run.cfg
    sink = MetricsSink(
        cfg.log,
        dataclasses.asdict(cfg),
        enabled=run.rank == 0,
        start_iteration=run.state.iteration,
        save_dir=cfg.train.save,
        wandb_run_id=run.state.tracking.get("wandb_run_id"),
    )
    if sink.wandb_run_id:
        run.state.tracking["wandb_run_id"] = sink.wandb_run_id
    return sink


def _stop_early(run: Run, why: str, saved: str | None) -> None:
    """Stop before --train-iters: save to --save (when given and not just saved) and say why."""
    t = run.cfg.train
    if t.save and not saved:
        saved = save_checkpoint(run, t.save)
    finish_async_save(run)  # an --async-save in flight is sealed before the run stops
    if why == "signal":
        cause = f"{' or '.join(t.exit_signal)} received"
    elif why == "interrupt":
        cause = "interrupted by SIGINT (Ctrl-C)"
    elif why == "interval":
        cause = f"--exit-interval {t.exit_interval} reached"
    else:
        cause = f"--exit-duration-in-mins {t.exit_duration_in_mins:g} passed"
    after = f"saved {saved}; resume with --load {t.save}" if saved else "not saved (no --save)"
    if why == "interrupt":  # every rank says it stopped: one line each, and no traceback
        print(f"rank {run.rank}: {cause}: stopped after iteration {run.state.iteration}, {after}", flush=True)
    else:
        log(f"{cause}: stopped after iteration {run.state.iteration}, {after}", run.rank)
    run.state.stopped_by = why


def train(run: Run, final_evaluation: bool = False) -> list[dict]:
    """Train to --train-iters (or the --exit-signal); the metrics of every step. With
    `final_evaluation` (pretrain_gpt.py, as Megatron's pretrain): after a run that was not stopped
    early, evaluate the validation and the test sets; --skip-train does only that."""
    cfg, t = run.cfg, run.cfg.train
    sink = _metrics_sink(run)
    history = []
    run.state.stopped_by = None
    stop = run.exit_signal.install()  # again after a previous train() closed it
    if t.skip_train:
        log(f"skipping training (--skip-train): evaluating the weights of iteration {run.state.iteration}", run.rank)
    else:
        history = _steps(run, sink, stop)
    run.train_data.close()  # its loader threads; a later train() restarts them where the data stands
    if cfg.log.comm_report:  # of the training steps: before the final evaluation's traffic
        comm.write_report(cfg.log.comm_report, cfg.parallel.world_size, run.rank)
        log(f"communication report written to {cfg.log.comm_report}", run.rank)
    if (final_evaluation or t.skip_train) and not run.state.stopped_by:
        _final_evaluation(run, sink)
    stop.close()
    sink.close()
    return history


def _steps(run: Run, sink: MetricsSink, stop) -> list[dict]:
    cfg, rank, t, state = run.cfg, run.rank, run.cfg.train, run.state
    throughput = Throughput.of(run)
    barrier = run.groups.world if cfg.log.barrier_with_l1_time else None
    timers = Timers(cfg.log.timing_log_level, cfg.log.timing_log_option, run.device, barrier)
    history = []
    comm.LEDGER.reset()
    profiler = StepProfiler(cfg, rank, run.device, state.iteration)
    if t.manual_gc:  # Megatron's --manual-gc: collect at chosen steps only, alike on every rank
        gc.disable()
        gc.collect()
    interval, clock = LogInterval(), StepClock()
    while state.iteration < t.train_iters:
        profiler.before_step(state.iteration + 1)
        metrics = _timed_step(run, throughput, timers)
        profiler.after_step(state.iteration)
        if t.manual_gc and t.manual_gc_interval and state.iteration % t.manual_gc_interval == 0:
            gc.collect()
        interval.add(metrics, state.last_step_skipped)
        clock.add(metrics["step_time"])
        _tensorboard(run, sink, metrics)
        due = state.iteration % cfg.log.log_interval == 0 or state.iteration == t.train_iters
        first = clock.count == 1 and not due  # this run's first step, logged as Megatron does; the interval goes on
        if due or first:
            metrics.update(lm_loss=interval.lm_loss, advanced_iterations=interval.advanced)
            metrics.update(nan_iterations=interval.nan)
            _log_line(run, metrics, interval, throughput, clock.eta(t.train_iters - state.iteration))
            _log_timers(run, sink, timers, interval, metrics, reset=due)
            run.memory_snapshots.dump()
            interval = LogInterval() if due else interval
        if cfg.log.log_memory_interval and state.iteration % cfg.log.log_memory_interval == 0:
            _report_memory(run)
        if eval_due(t, state.iteration):
            metrics.update(evaluate_and_print(run, sink, "valid", f"iteration {state.iteration}"))
        if state.resumed_from:  # the first step after a --load says so (tools/plot_metrics.py marks it)
            metrics["resumed_from"], state.resumed_from = state.resumed_from, None
        history.append(metrics)
        sink.write(metrics, state.iteration)
        saved = save_checkpoint(run, t.save) if _save_due(run) else None
        if saved:
            how = " (writing in the background: sealed at the next save or at exit)" if t.async_save else ""
            log(f"{'saving' if t.async_save else 'saved'} checkpoint {saved}{how}", rank)
        why = stop.anywhere(run.groups, state.stop_request)
        if (
            why is None
            and t.exit_interval
            and state.iteration % t.exit_interval == 0
            and state.iteration < t.train_iters
        ):
            why = "interval"
        if why:
            _stop_early(run, why, saved)
            break
    finish_async_save(run)  # every rank, before anything else follows the loop
    profiler.close()
    run.memory_snapshots.dump()
    if t.manual_gc:
        gc.enable()
    return history


def _final_evaluation(run: Run, sink: MetricsSink) -> dict:
    """The validation and test sets after training, as Megatron (the console and tensorboard: the
    metrics file keeps one record per step); {"val_loss", "val_ppl", "test_loss", "test_ppl"}."""
    out = {}
    for which, where in (("valid", "validation"), ("test", "test")):
        out.update(evaluate_and_print(run, sink, which, f"iteration {run.state.iteration} on {where} set"))
    run.state.final_evaluation = out
    sink.wandb_log({f"final_{k}": v for k, v in out.items()}, run.state.iteration)
    return out
