"""The training loop: steps, evaluation cadence, metrics and the console line, checkpoint
cadence, profiling windows, and the early stops: a signal (--exit-signal-handler), --exit-interval
and --exit-duration-in-mins, each after a checkpoint when --save is given."""

from __future__ import annotations

import dataclasses
import gc
import time

from .. import comm
from ..checkpoint import save_checkpoint
from ..checkpoint.sharded import finish_async_save
from ..logging_utils import MetricsSink, log
from ..perf import flops_per_token, memory_gib, peak_tflops
from .builders import training_dtype
from .profiling import StepProfiler
from .run import Run
from .step import evaluate, train_step


@dataclasses.dataclass
class Throughput:
    """What one step's time means: tokens and model FLOPs per sample, the peak for MFU."""

    seq_length: int
    flops_per_sample: float
    peak: float
    world: int

    @classmethod
    def of(cls, run: Run) -> Throughput:
        cfg = run.cfg
        per_sample = flops_per_token(cfg.model, run.tokenizer.padded_vocab_size) * cfg.model.seq_length
        peak, peak_desc = peak_tflops(run.device, training_dtype(cfg), cfg.log.peak_tflops)
        flops = per_sample * cfg.train.global_batch_size
        log(f"MFU is measured against {peak_desc}: {peak:.3f}; model FLOPs per step {flops / 1e9:.2f} G", run.rank)
        return cls(cfg.model.seq_length, per_sample, peak, cfg.parallel.world_size)

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


def _log_line(run: Run, m: dict, data_wait: float, eta: float) -> None:
    """The console line of the last step; `data_wait`: seconds the steps since the last line waited for data;
    `eta`: seconds to --train-iters (or the iterations --train-samples makes) at the mean step time."""
    mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "n/a"
    val = f" | val loss {m['val_loss']:.4f}" if "val_loss" in m else ""
    if "loss_scale" in m:  # --fp16
        val += f" | loss scale {m['loss_scale']:g} | skipped {m['skipped_iterations']}"
    log(
        f"iter {run.iteration:5d}/{run.cfg.train.train_iters} | loss {m['loss']:.4f}{val} | lr {m['lr']:.3e} | "
        f"global batch {m['global_batch_size']} | grad norm {m['grad_norm']:.3f} | {m['tokens_per_sec']:.0f} tok/s | "
        f"{m['tflops_per_rank']:.3f} TFLOP/s/rank | MFU {mfu} | data wait {1e3 * data_wait:.1f} ms | "
        f"mem {m['memory_gib']:.2f} GiB | ETA {format_eta(eta)}",
        run.rank,
    )


def _timed_step(run: Run, throughput: Throughput) -> dict:
    batch = run.cfg.train.global_batch_at(run.consumed_samples)  # what train_step takes
    waited = run.train_data.wait_seconds
    start = time.perf_counter()
    loss, grad_norm, lr = train_step(run)
    elapsed = time.perf_counter() - start
    waited = run.train_data.wait_seconds - waited
    run.iteration += 1
    run.consumed_samples += batch
    comm.LEDGER.step()
    scaling = {}
    if run.loss_scaler is not None:
        scaling = {"loss_scale": run.loss_scaler.scale, "skipped_iterations": run.skipped_iterations}
        if run.last_step_skipped:
            log(
                f"iteration {run.iteration}: gradients overflowed in fp16, step skipped; loss scale now "
                f"{run.loss_scaler.scale:g} ({run.skipped_iterations} skipped so far)",
                run.rank,
            )
    return {
        **scaling,
        "iteration": run.iteration,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        **throughput.metrics(elapsed, batch),
        "global_batch_size": batch,
        "data_wait_time": waited,  # seconds this step blocked on its micro-batches
        "consumed_samples": run.consumed_samples,
        "memory_gib": memory_gib(run.device),
    }


def _save_due(run: Run) -> bool:
    t = run.cfg.train
    return bool(t.save) and (
        run.iteration == t.train_iters or (t.save_interval and run.iteration % t.save_interval == 0)
    )


def _metrics_sink(run: Run) -> MetricsSink:
    """Rank 0's metrics outputs; a resumed run continues the checkpoint's W&B run and
    tensorboard step axis, and the W&B run's id goes into the checkpoints it saves."""
    cfg = run.cfg
    sink = MetricsSink(
        cfg.log,
        dataclasses.asdict(cfg),
        enabled=run.rank == 0,
        start_iteration=run.iteration,
        save_dir=cfg.train.save,
        wandb_run_id=run.tracking.get("wandb_run_id"),
    )
    if sink.wandb_run_id:
        run.tracking["wandb_run_id"] = sink.wandb_run_id
    return sink


def _stop_early(run: Run, why: str, saved: str | None) -> None:
    """Stop before --train-iters: save to --save (when given and not just saved) and say why."""
    t = run.cfg.train
    if t.save and not saved:
        saved = save_checkpoint(run, t.save)
    finish_async_save(run)  # an --async-save in flight is sealed before the run stops
    if why == "signal":
        cause = f"{' or '.join(t.exit_signal)} received"
    elif why == "interval":
        cause = f"--exit-interval {t.exit_interval} reached"
    else:
        cause = f"--exit-duration-in-mins {t.exit_duration_in_mins:g} passed"
    after = f"saved {saved}; resume with --load {t.save}" if saved else "not saved (no --save)"
    log(f"{cause}: stopped after iteration {run.iteration}, {after}", run.rank)
    run.stopped_by_signal = why == "signal"
    run.stopped_by = why


def train(run: Run) -> list[dict]:
    """Train to --train-iters (or the --exit-signal); the metrics of every step."""
    cfg, rank, t = run.cfg, run.rank, run.cfg.train
    sink = _metrics_sink(run)
    throughput = Throughput.of(run)
    history = []
    comm.LEDGER.reset()
    stop = run.exit_signal.install()  # again after a previous train() closed it
    profiler = StepProfiler(cfg, rank, run.device, run.iteration)
    if t.manual_gc:  # Megatron's --manual-gc: collect at chosen steps only, alike on every rank
        gc.disable()
        gc.collect()
    data_wait = 0.0  # since the last log line
    clock = StepClock()
    while run.iteration < t.train_iters:
        profiler.before_step(run.iteration + 1)
        metrics = _timed_step(run, throughput)
        profiler.after_step(run.iteration)
        if t.manual_gc and t.manual_gc_interval and run.iteration % t.manual_gc_interval == 0:
            gc.collect()
        data_wait += metrics["data_wait_time"]
        clock.add(metrics["step_time"])
        if t.eval_interval and run.iteration % t.eval_interval == 0 and run.valid_data:
            metrics["val_loss"] = evaluate(run)
        history.append(metrics)
        sink.write(metrics, run.iteration)
        if run.iteration % cfg.log.log_interval == 0 or run.iteration == t.train_iters:
            _log_line(run, metrics, data_wait, clock.eta(t.train_iters - run.iteration))
            run.memory_snapshots.dump()
            data_wait = 0.0
        saved = save_checkpoint(run, t.save) if _save_due(run) else None
        if saved:
            how = " (writing in the background: sealed at the next save or at exit)" if t.async_save else ""
            log(f"{'saving' if t.async_save else 'saved'} checkpoint {saved}{how}", rank)
        why = stop.anywhere(run.groups)
        if why is None and t.exit_interval and run.iteration % t.exit_interval == 0 and run.iteration < t.train_iters:
            why = "interval"
        if why:
            _stop_early(run, why, saved)
            break
    finish_async_save(run)  # every rank, before anything else follows the loop
    profiler.close()
    run.memory_snapshots.dump()
    stop.close()
    if t.manual_gc:
        gc.enable()
    sink.close()
    run.train_data.close()  # its loader threads; a later train() restarts them where the data stands
    if cfg.log.comm_report:
        comm.write_report(cfg.log.comm_report, cfg.parallel.world_size, rank)
        log(f"communication report written to {cfg.log.comm_report}", rank)
    return history
