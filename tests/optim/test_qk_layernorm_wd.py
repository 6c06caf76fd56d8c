"""--apply-wd-to-qk-layernorm: which parameters AdamW decays, against megatron-core's own rule
(`get_standard_config_overrides` + `_get_param_groups` of megatron/core/optimizer) on the same
parameters under Megatron's names (our `q_norm.`/`k_norm.` are its `q_layernorm.`/`k_layernorm.`): without
the flag no 1-D parameter and no bias decays; with it the query/key norms decay too. A LayerNorm model
(norm weights and biases, linear biases) and an RMSNorm one, through the engine a run builds."""

import pytest

from megatron_zpp import training
from megatron_zpp.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed

TINY = (
    "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
    "--make-vocab-size-divisible-by 32 --global-batch-size 2 --train-iters 1 --peak-tflops 1 --qk-layernorm"
).split()


def megatron_name(ours: str) -> str:
    return ours.replace("q_norm.", "self_attention.q_layernorm.").replace("k_norm.", "self_attention.k_layernorm.")


def _decayed(rank, world, variants):
    """Per variant: (the names our engine's AdamW decays, the names megatron-core's groups decay, all names)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides

    out = []
    for flags in variants:
        run = training.setup(validate(parse_args(TINY + flags), world))
        names = {id(p): n for c in run.chunks for n, p in c.named_parameters()}
        opt = run.dp.optimizer  # the plain data-parallel engine's MixedPrecisionAdamW: masters by parameter
        master_of = {id(m): names[id(p)] for p, m in zip(opt.params, opt.masters)}
        ours = {master_of[id(m)] for g in opt.opt.param_groups if g["weight_decay"] > 0 for m in g["params"]}

        class Chunk:  # all _get_param_groups asks of a model chunk
            def named_parameters(self):
                return [(megatron_name(n), p) for c in run.chunks for n, p in c.named_parameters()]

        config = OptimizerConfig(
            lr=1e-3, weight_decay=0.1, apply_wd_to_qk_layernorm="--apply-wd-to-qk-layernorm" in flags
        )
        groups = _get_param_groups([Chunk()], config, get_standard_config_overrides(config))
        theirs = {megatron_name(names[id(p)]) for g in groups if g["wd_mult"] > 0 for p in g["params"]}
        out.append((sorted(megatron_name(n) for n in ours), sorted(theirs), sorted(names.values())))
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_weight_decay_groups_match_megatron_core():
    variants = [
        [],
        ["--apply-wd-to-qk-layernorm"],
        ["--apply-wd-to-qk-layernorm", "--normalization", "RMSNorm", "--disable-bias-linear"],
    ]
    results = run_distributed(_decayed, 1, variants)[0]
    for flags, (ours, theirs, names) in zip(variants, results):
        assert ours == theirs, (flags, sorted(set(ours) ^ set(theirs)))
        qk = [n for n in names if "q_norm." in n or "k_norm." in n]
        assert qk and all(("--apply-wd-to-qk-layernorm" in flags) == (megatron_name(n) in ours) for n in qk), flags
        assert any(n.endswith(".bias") for n in names) or "--disable-bias-linear" in flags
