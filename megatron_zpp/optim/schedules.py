"""Learning-rate and weight-decay schedules: Megatron's OptimizerParamScheduler.

The schedule counts "steps" in samples, as Megatron's does: with --train-iters every
length is iterations x --global-batch-size, with --train-samples it is given in samples
(--lr-warmup-samples, --lr-decay-samples, default the train samples,
--lr-wsd-decay-samples). An optimizer step runs at the count before it (0 for the first
step), and a step advances it by the samples it took, so a batch-size ramp-up moves the
schedule by the samples it really consumed; a step skipped for an fp16 overflow does not
move it. With `n` that count:

* warmup (n <= W, when W > 0): --lr-warmup-init + (lr - init) n / W, so the first step
  runs at --lr-warmup-init (default 0) and step W at --lr;
* then, by --lr-decay-style, over the decay span D (counted from 0, warmup included):
  constant lr; past D min-lr; inverse-square-root max(min, lr sqrt(max(W, 1) / max(n, 1)));
  linear and cosine over r = (n - W) / (D - W): min + (1 - r)(lr - min), min + (cos(pi r)
  + 1)/2 (lr - min); WSD stays at lr until D - S (S: --lr-wsd-decay-iters/-samples,
  required) and then decays over p = (n - D + S) / S by --lr-wsd-decay-style:
  exponential min + (2 * 0.5^p - 1)(lr - min), linear, cosine, minus_sqrt min + (1 -
  sqrt(p))(lr - min).

--lr-warmup-fraction F makes W = F x D. --decoupled-lr/--decoupled-min-lr give the word
embedding and the untied output layer their own lr and min-lr on the same curve (the warmup
starts from the same init). Weight decay (--weight-decay-incr-style) rises over the train
span T (the train iterations x batch, or the train samples) from --start-weight-decay to
--end-weight-decay: linear s + (e - s) n / T, cosine s + (e - s)(cos(pi (1 - n / T)) + 1) / 2,
e past T; constant is --weight-decay throughout. Norm weights and biases keep 0."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import Config, OptimConfig, TrainConfig


@dataclass(frozen=True)
class Schedule:
    """The lengths of a run's schedule, in samples (Megatron's scheduler steps)."""

    warmup: float
    decay: float
    wsd: float | None  # WSD's final decay
    wd_incr: float  # the weight-decay increment span: the whole run


@dataclass(frozen=True)
class Rates:
    """What one optimizer step runs at: the learning rate of the default parameter groups, that of
    the decoupled ones (--decoupled-lr: the embedding and output layer), the weight decay of the
    decayed groups (None: keep the groups' own)."""

    lr: float
    decoupled_lr: float | None = None
    weight_decay: float | None = None


def schedule_for(o: OptimConfig, t: TrainConfig) -> Schedule:
    """The schedule's lengths for a run with training config `t` (validated: train iters known)."""
    if t.train_samples is None:  # iteration-based: iterations x the (constant) global batch
        g = t.global_batch_size or 1
        decay = (o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters) * g
        wsd = o.lr_wsd_decay_iters * g if o.lr_wsd_decay_iters is not None else None
        warmup, wd_incr = o.lr_warmup_iters * g, t.train_iters * g
    else:
        decay = o.lr_decay_samples if o.lr_decay_samples is not None else t.train_samples
        wsd, warmup, wd_incr = o.lr_wsd_decay_samples, o.lr_warmup_samples, t.train_samples
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    return Schedule(warmup, decay, wsd, wd_incr)


def lr_at(o: OptimConfig, s: Schedule, n: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
    """The learning rate at scheduler count `n` (samples before the step), peak `max_lr` (default
    --lr) and floor `min_lr` (default --min-lr)."""
    max_lr = o.lr if max_lr is None else max_lr
    min_lr = o.min_lr if min_lr is None else min_lr
    if s.warmup > 0 and n <= s.warmup:
        return o.lr_warmup_init + (max_lr - o.lr_warmup_init) * n / s.warmup
    style = o.lr_decay_style
    if style == "constant":
        return max_lr
    if n > s.decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(s.warmup, 1)) / math.sqrt(max(n, 1)))
    if style == "WSD":
        coeff = _wsd_coeff(o.lr_wsd_decay_style, n, s.decay, s.wsd)
    else:
        r = (n - s.warmup) / (s.decay - s.warmup)
        coeff = 1.0 - r if style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def _wsd_coeff(style: str, n: float, decay: float, wsd: float) -> float:
    anneal_start = decay - wsd
    if n <= anneal_start:
        return 1.0
    p = (n - anneal_start) / wsd
    if style == "exponential":
        return 2.0 * 0.5**p - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(p)
    return 1.0 - p if style == "linear" else 0.5 * (math.cos(math.pi * p) + 1.0)


def weight_decay_at(o: OptimConfig, s: Schedule, n: float) -> float:
    """The weight decay of the decayed parameters at scheduler count `n`."""
    start, end = o.weight_decay_span()
    if n > s.wd_incr or o.weight_decay_incr_style == "constant":
        return end
    ratio = n / s.wd_incr
    coeff = ratio if o.weight_decay_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


def rates_at(cfg: Config, n: float, checkpoint: tuple[OptimConfig, Schedule] | None = None) -> Rates:
    """Every rate of the step at scheduler count `n` of a run of `cfg`; `checkpoint`: the settings
    and lengths that --use-checkpoint-opt_param-scheduler took from the loaded checkpoint."""
    o, s = checkpoint or (cfg.optim, schedule_for(cfg.optim, cfg.train))
    decoupled = None if o.decoupled_lr is None else lr_at(o, s, n, o.decoupled_lr, _decoupled_min(o))
    return Rates(lr_at(o, s, n), decoupled, weight_decay_at(o, s, n))


# what Megatron's scheduler keeps in a checkpoint (besides the count)
CHECKPOINT_SETTINGS = (
    "lr",
    "min_lr",
    "lr_decay_style",
    "weight_decay",
    "start_weight_decay",
    "end_weight_decay",
    "weight_decay_incr_style",
)


def checkpoint_schedule(cfg: Config, saved: dict) -> tuple[OptimConfig, Schedule]:
    """--use-checkpoint-opt_param-scheduler: the settings and lengths a resumed run of `cfg` takes
    from its checkpoint's config dict `saved` (meta.json), as Megatron's load_state_dict: the peak and
    minimum lr, warmup and decay lengths, decay style, weight decay ends, increment length and style;
    the warmup init, WSD's settings and --decoupled-lr stay this run's."""
    saved_optim = _section(OptimConfig, saved.get("optim", {}))
    lengths = schedule_for(saved_optim, _section(TrainConfig, saved.get("train", {})))
    o = dataclasses.replace(cfg.optim, **{k: getattr(saved_optim, k) for k in CHECKPOINT_SETTINGS})
    s = dataclasses.replace(
        schedule_for(cfg.optim, cfg.train), warmup=lengths.warmup, decay=lengths.decay, wd_incr=lengths.wd_incr
    )
    return o, s


def schedule_changes(cfg: Config, saved: dict) -> list[str]:
    """Each schedule setting where a resumed run of `cfg` differs from its checkpoint's config dict
    `saved`, in words: those Megatron's scheduler compares on load (the peak and minimum lr, the
    decay style, the weight decay's ends and style, and the warmup, decay and weight-decay
    increment lengths in samples, which the train iterations or samples and the batch size shape)."""
    if "optim" not in saved or "train" not in saved:  # a checkpoint that did not record them: nothing to compare
        return []
    train = saved["train"]
    if train.get("train_iters") is None and train.get("train_samples") is None:  # an import: no schedule ran
        return []
    o, old = cfg.optim, _section(OptimConfig, saved["optim"])
    mine, theirs = schedule_for(o, cfg.train), schedule_for(old, _section(TrainConfig, saved["train"]))
    settings = [
        ("--lr", o.lr, old.lr),
        ("--min-lr", o.min_lr, old.min_lr),
        ("--lr-decay-style", o.lr_decay_style, old.lr_decay_style),
        ("lr warmup samples (--lr-warmup-*)", mine.warmup, theirs.warmup),
        ("lr decay samples (--lr-decay-*, else --train-*)", mine.decay, theirs.decay),
        ("weight decay from-to", o.weight_decay_span(), old.weight_decay_span()),
        ("--weight-decay-incr-style", o.weight_decay_incr_style, old.weight_decay_incr_style),
        ("weight-decay increment samples (--train-*)", mine.wd_incr, theirs.wd_incr),
    ]
    return [f"{name} {_words(a)} here, {_words(b)} in the checkpoint" for name, a, b in settings if a != b]


def schedule_resume_warning(cfg: Config, saved: dict) -> str | None:
    """The one line a resume logs where its schedule differs from its checkpoint's: the settings,
    and whose win. Megatron refuses such a resume unless told which; here this command line's win
    unless --use-checkpoint-opt_param-scheduler is given."""
    changes = schedule_changes(cfg, saved)
    if not changes:
        return None
    if cfg.optim.use_checkpoint_opt_param_scheduler:
        winner = "the checkpoint's win (--use-checkpoint-opt_param-scheduler)"
    elif cfg.optim.override_opt_param_scheduler:
        winner = "this command line's win (--override-opt_param-scheduler)"
    else:
        winner = (
            "this command line's win, as with --override-opt_param-scheduler (Megatron would refuse the resume "
            "without it; --use-checkpoint-opt_param-scheduler takes the checkpoint's)"
        )
    return f"the LR schedule differs from the checkpoint's: {'; '.join(changes)}: {winner}"


def _words(value) -> str:
    if isinstance(value, tuple):
        return " to ".join(_words(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _section(cls, saved: dict):
    """A config section from its saved dict: the fields it has (an older checkpoint lacks newer ones)."""
    return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.init and f.name in saved})


def _decoupled_min(o: OptimConfig) -> float:
    return o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr


def learning_rate(o: OptimConfig, iteration: int, train_iters: int, global_batch: int = 1) -> float:
    """The LR of step `iteration` (0-based, none skipped) of an iteration-based run."""
    t = TrainConfig(train_iters=train_iters, global_batch_size=global_batch)
    return lr_at(o, schedule_for(o, t), iteration * global_batch)


def learning_rate_at_samples(o: OptimConfig, consumed_samples: int, train_samples: int) -> float:
    """The LR of the step of a sample-based run that starts after `consumed_samples` (applied)."""
    t = TrainConfig(train_samples=train_samples, train_iters=1)
    return lr_at(o, schedule_for(o, t), consumed_samples)


# ---- the settings' checks (validation/ reports them with the others) ---------------------------


def schedule_errors(cfg: Config) -> list[str]:
    """One line per schedule setting that Megatron's scheduler would assert on."""
    o = cfg.optim
    both = o.use_checkpoint_opt_param_scheduler and o.override_opt_param_scheduler
    errors = ["give one of --use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler"] if both else []
    return errors + _length_errors(cfg) + _decoupled_errors(o) + _weight_decay_errors(o)


def _length_errors(cfg: Config) -> list[str]:
    """A decay span > 0 and longer than the warmup; WSD's final decay given (every line that applies)."""
    o, samples = cfg.optim, cfg.train.train_samples is not None
    unit = "samples" if samples else "iters"
    decay, wsd = (o.lr_decay_samples, o.lr_wsd_decay_samples) if samples else (o.lr_decay_iters, o.lr_wsd_decay_iters)
    errors = []
    if o.lr_decay_style == "WSD" and wsd is None:
        errors.append(
            f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}: the length of its final decay (Megatron's too)"
        )
    if (decay is not None and decay <= 0) or (wsd is not None and wsd < 0):
        return errors + [f"--lr-decay-{unit} must be > 0 and --lr-wsd-decay-{unit} >= 0 (got {decay} and {wsd})"]
    s = schedule_for(o, cfg.train)
    if s.warmup >= s.decay and (o.lr_warmup_iters or o.lr_warmup_samples or o.lr_warmup_fraction):
        given = o.lr_warmup_samples if samples else o.lr_warmup_iters
        warmup = (
            f"--lr-warmup-fraction {o.lr_warmup_fraction}" if o.lr_warmup_fraction else f"--lr-warmup-{unit} {given}"
        )
        per = 1 if samples else cfg.train.global_batch_size
        span = f"{s.decay / per:g} {unit}: --lr-decay-{unit}, default the train {unit}"
        errors.append(f"{warmup} must leave the warmup shorter than the decay span ({span}), as Megatron asserts")
    return errors


def _decoupled_errors(o: OptimConfig) -> list[str]:
    """--decoupled-lr/--decoupled-min-lr: the embedding and output layer's own peak and floor."""
    if o.decoupled_lr is None:
        alone = o.decoupled_min_lr is not None
        return ["--decoupled-min-lr needs --decoupled-lr (the peak it decays from)"] if alone else []
    if not 0 <= o.decoupled_lr < math.inf:
        return [f"--decoupled-lr {o.decoupled_lr} must be a finite number >= 0"]
    low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
    floor = "--min-lr" if o.decoupled_min_lr is None else "--decoupled-min-lr"
    ok = 0 <= low <= o.decoupled_lr
    return [] if ok else [f"{floor} {low} must be between 0 and --decoupled-lr {o.decoupled_lr}"]


def _weight_decay_errors(o: OptimConfig) -> list[str]:
    """Megatron's rule: constant takes --weight-decay only; linear and cosine take both ends, rising."""
    ends = "--start-weight-decay and --end-weight-decay"
    if o.weight_decay_incr_style == "constant":
        errors = (
            [] if 0 <= o.weight_decay < math.inf else [f"--weight-decay {o.weight_decay} must be a finite number >= 0"]
        )
        if o.start_weight_decay is not None or o.end_weight_decay is not None:
            errors.append(f"{ends} are for --weight-decay-incr-style linear or cosine (constant: --weight-decay)")
        return errors
    start, end = o.start_weight_decay, o.end_weight_decay
    if start is None or end is None:
        return [f"--weight-decay-incr-style {o.weight_decay_incr_style} needs {ends}"]
    ok = 0 <= start <= end < math.inf
    return [] if ok else [f"{ends} must be finite and satisfy 0 <= start <= end (got {start}, {end})"]
