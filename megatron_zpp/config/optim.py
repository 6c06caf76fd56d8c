"""OptimConfig: AdamW, its schedules and clipping. Re-exported by the config package."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import opt


@dataclass
class OptimConfig:
    lr: float = opt(3e-4, "--lr", "peak learning rate")
    min_lr: float = opt(0.0, "--min-lr", "learning rate at the end of decay")
    lr_warmup_iters: int = opt(0, "--lr-warmup-iters", "linear warmup iterations")
    lr_warmup_samples: int = opt(
        0, "--lr-warmup-samples", "linear warmup over this many samples (sample-based training: --train-samples)"
    )
    lr_warmup_fraction: float | None = opt(
        None,
        "--lr-warmup-fraction",
        "warmup over this fraction of the decay iterations or samples (instead of --lr-warmup-iters/-samples)",
    )
    lr_decay_iters: int | None = opt(None, "--lr-decay-iters", "iterations of decay (default: train iters)")
    lr_decay_samples: int | None = opt(
        None, "--lr-decay-samples", "samples of decay, with --train-samples (default: train samples)"
    )
    lr_decay_style: str = opt(
        "linear",
        "--lr-decay-style",
        "decay after warmup (Megatron's OptimizerParamScheduler): to --min-lr at the end of the decay span",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_warmup_init: float = opt(
        0.0, "--lr-warmup-init", "learning rate of the first step: the warmup rises linearly from it to --lr"
    )
    lr_wsd_decay_iters: int | None = opt(
        None, "--lr-wsd-decay-iters", "WSD: iterations of the final decay, at the end of the decay span (required)"
    )
    lr_wsd_decay_samples: int | None = opt(
        None,
        "--lr-wsd-decay-samples",
        "WSD with --train-samples: samples of the final decay, at the end of the decay span (required)",
    )
    lr_wsd_decay_style: str = opt(
        "exponential",
        "--lr-wsd-decay-style",
        "WSD: shape of the final decay, over its fraction p: exponential min + (2*0.5^p - 1)(lr - min), "
        "linear, cosine, minus_sqrt min + (1 - sqrt(p))(lr - min)",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
    )
    decoupled_lr: float | None = opt(
        None,
        "--decoupled-lr",
        "peak learning rate of the word embedding and the untied output layer, on the same schedule (None: --lr)",
    )
    decoupled_min_lr: float | None = opt(
        None, "--decoupled-min-lr", "with --decoupled-lr: their learning rate at the end of decay (None: --min-lr)"
    )
    weight_decay: float = opt(
        0.01,
        "--weight-decay",
        "AdamW weight decay (not applied to norms and biases), with --weight-decay-incr-style constant",
    )
    apply_wd_to_qk_layernorm: bool = opt(
        False,
        "--apply-wd-to-qk-layernorm",
        "weight decay on the query/key norms of --qk-layernorm too (Megatron's rule, Qwen3-Next's recipe); "
        "every other norm weight and bias stays undecayed",
    )
    start_weight_decay: float | None = opt(
        None, "--start-weight-decay", "weight decay of the first step (--weight-decay-incr-style linear or cosine)"
    )
    end_weight_decay: float | None = opt(
        None, "--end-weight-decay", "weight decay at the end of training (--weight-decay-incr-style linear or cosine)"
    )
    weight_decay_incr_style: str = opt(
        "constant",
        "--weight-decay-incr-style",
        "weight decay over training: constant (--weight-decay), or linear/cosine from --start-weight-decay to "
        "--end-weight-decay over the train iterations or samples",
        choices=["constant", "linear", "cosine"],
    )
    use_checkpoint_opt_param_scheduler: bool = opt(
        False,
        "--use-checkpoint-opt_param-scheduler",
        "a resumed run takes the schedule of its checkpoint (as Megatron: --lr, --min-lr, the warmup and decay "
        "lengths, --lr-decay-style, the weight decay ends, increment length and style), not this command line's",
    )
    override_opt_param_scheduler: bool = opt(
        False,
        "--override-opt_param-scheduler",
        "a resumed run takes the schedule of this command line, not its checkpoint's: what happens here without "
        "--use-checkpoint-opt_param-scheduler (Megatron would refuse a resume whose schedule differs)",
    )
    adam_beta1: float = opt(0.9, "--adam-beta1", "AdamW beta1")
    adam_beta2: float = opt(0.999, "--adam-beta2", "AdamW beta2")
    adam_eps: float = opt(1e-8, "--adam-eps", "AdamW epsilon")
    clip_grad: float = opt(1.0, "--clip-grad", "global gradient-norm clip (0 = off)")

    def weight_decay_span(self) -> tuple[float, float]:
        """(first, last) weight decay of the schedule: --weight-decay for both when constant (Megatron's rule)."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        start, end = self.start_weight_decay, self.end_weight_decay
        assert start is not None and end is not None, "validation requires both with a weight-decay schedule"
        return start, end
