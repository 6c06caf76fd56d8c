"""--apply-wd-to-qk-layernorm: which parameters AdamW decays, against megatron-core's own rule
(`get_standard_config_overrides` + `_get_param_groups` of megatron/core/optimizer) on the same
parameters under Megatron's names (our `q_norm.`/`k_norm.` are its `q_layernorm.`/`k_layernorm.`): without
the flag no 1-D parameter and no bias decays; with it the query/key norms decay too. Read off what a step
does, through the engine a run builds (plain DP; ZeRO-3, whose AdamW ZeRO-1/2 build alike): with zero
gradients AdamW moves a parameter only by its decoupled decay, p <- p (1 - lr wd), so a decayed one scales
by exactly that and every other one stays put. A LayerNorm model (norm weights and biases, linear biases)
and an RMSNorm one."""

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.optim.schedules import Rates
from megatron_zpp.validation import validate
from tests.dist import run_distributed

TINY = (
    "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
    "--make-vocab-size-divisible-by 32 --global-batch-size 2 --train-iters 1 --peak-tflops 1 --qk-layernorm "
    "--clip-grad 0"
).split()
LR, WD = 0.5, 0.2
APPLY = "--apply-wd-to-qk-layernorm"


def megatron_name(ours: str) -> str:
    return ours.replace("q_norm.", "self_attention.q_layernorm.").replace("k_norm.", "self_attention.k_layernorm.")


def _weights(run) -> dict[str, torch.Tensor]:
    with run.dp.full_parameters():
        return {n: p.detach().double().clone() for c in run.chunks for n, p in c.named_parameters()}


def _decayed(rank, world, variants):
    """Per variant: (how each parameter moved in a step on zero gradients: 'decayed', 'kept' or 'other',
    the names megatron-core's groups decay)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides

    out = []
    for flags in variants:
        run = training.setup(validate(parse_args(TINY + flags), world))
        before = _weights(run)
        run.dp.zero_grad()
        run.dp.step(Rates(LR, weight_decay=WD))
        after = _weights(run)
        moved = {}
        for n, w in before.items():
            decayed = torch.allclose(after[n], w * (1 - LR * WD), rtol=1e-6, atol=0) and bool(w.abs().max() > 0)
            moved[megatron_name(n)] = "decayed" if decayed else "kept" if torch.equal(after[n], w) else "other"

        full = {megatron_name(n): torch.nn.Parameter(w) for n, w in before.items()}  # ZeRO-3's are shards

        class Chunk:  # all _get_param_groups asks of a model chunk
            def named_parameters(self):
                return list(full.items())

        names = {id(p): n for n, p in full.items()}
        config = OptimizerConfig(lr=LR, weight_decay=WD, apply_wd_to_qk_layernorm=APPLY in flags)
        groups = _get_param_groups([Chunk()], config, get_standard_config_overrides(config))
        theirs = {names[id(p)] for g in groups if g["wd_mult"] > 0 for p in g["params"]}
        out.append((moved, theirs))
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_weight_decay_follows_megatron_core_under_each_engine():
    variants = [
        [],
        [APPLY],
        [APPLY, "--zero-stage", "3", "--normalization", "RMSNorm", "--disable-bias-linear"],
    ]
    results = run_distributed(_decayed, 1, variants)[0]
    for flags, (moved, theirs) in zip(variants, results):
        assert "other" not in moved.values(), (flags, moved)
        nonzero = {n for n, how in moved.items() if how == "decayed"}
        zeros = {n for n in theirs if moved[n] == "kept"}  # biases start at 0: decayed or not, they stay
        assert nonzero == theirs - zeros and all(n.endswith(".bias") for n in zeros), (flags, nonzero ^ theirs)
        qk = [n for n in moved if "q_layernorm.weight" in n or "k_layernorm.weight" in n]
        assert qk and all((APPLY in flags) == (n in nonzero) for n in qk), flags
        assert any(n.endswith(".bias") for n in moved) != ("--disable-bias-linear" in flags)
