"""A GDN checkpoint saved with one output-norm weight per head (--gdn-head-norm per_head, this codebase's layout
before the shared [V] weight of megatron-core, fla and Qwen3-Next) loads into a run with the shared weight when
every head's weight (and AdamW moment) is equal, and is refused in one line naming the tensor and the flag
otherwise; a checkpoint whose config predates the flag is read as per head. And the output norm's function
(--gdn-out-norm): a checkpoint saved before that flag reads as a plain RMSNorm; resuming it as another is refused."""

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError
from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.checkpoint.layout import config_from_dict
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

BASE = (
    OLD_DEFAULTS
    + (
        "--mock-data --hidden-size 32 --num-attention-heads 4 --seq-length 32 --vocab-size 128 "
        "--make-vocab-size-divisible-by 32 --num-layers 2 --attention-type gdn --softmax-attention-every 2 "
        "--linear-chunk-size 8 --global-batch-size 4 --micro-batch-size 1 --seed 7 --device cpu --train-iters 2"
    ).split()
)
# lr 0: the weights stay at their init (every head's norm weight 1), the moments do not (each head's gradient)
FROZEN = ["--lr", "0", "--min-lr", "0"]


def _train(rank, world_size, argv):
    training.train(training.setup(validate(parse_args(argv), world_size)))


def _setup(argv):
    return training.setup(validate(parse_args(argv), 1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(frozen, trained): per-head checkpoints saved at TP2 x ZeRO-1 (the norm weight split over TP)."""
    out = []
    for name, extra in (("frozen", FROZEN), ("trained", [])):
        ckpt = str(tmp_path_factory.mktemp(name) / "ckpt")
        layout = ["--tensor-model-parallel-size", "2", "--zero-stage", "1", "--gdn-head-norm", "per_head"]
        run_distributed(_train, 2, BASE + extra + layout + ["--save", ckpt])
        out.append(ckpt)
    return out


def test_equal_heads_map_to_the_shared_weight(saved):
    frozen = saved[0]
    run = _setup(BASE + FROZEN + ["--load", frozen, "--finetune"])
    assert "GDN output-norm weight per_head -> shared" in " ".join(run.resharded_from or [])
    mine = {n: p.detach() for n, p in run.chunks[0].named_parameters()}
    theirs = consolidate(frozen)[0]
    assert theirs["layers.0.mixer.head_norm"].shape == (32,) and mine["layers.0.mixer.head_norm"].shape == (8,)
    assert torch.equal(mine["layers.0.mixer.head_norm"], torch.ones(8))
    assert all(torch.equal(mine[n], theirs[n].to(mine[n].dtype)) for n in mine if n != "layers.0.mixer.head_norm")


@pytest.mark.parametrize("which, flags", [(0, []), (1, ["--finetune"])], ids=["moments_differ", "weights_differ"])
def test_unequal_heads_are_refused_by_name(saved, which, flags):
    ckpt = saved[which]
    with pytest.raises(CheckpointError) as info:
        _setup(BASE + ["--load", ckpt, *flags])
    (line,) = str(info.value).splitlines()
    assert line.startswith(f"{ckpt}/iter_0000002: layers.0.mixer.head_norm holds one GDN output-norm weight per head")
    assert line.endswith("this run shares one [8] weight: load it with --gdn-head-norm per_head")
    run = _setup(BASE + ["--load", ckpt, "--gdn-head-norm", "per_head", *flags])  # as saved, at another layout
    assert dict(run.chunks[0].named_parameters())["layers.0.mixer.head_norm"].shape == (32,)


def test_a_config_saved_before_the_flag_is_per_head():
    cfg = validate(parse_args(BASE), 1)
    d = cfg.to_dict()
    assert config_from_dict(d).model.gdn_head_norm == "shared"
    del d["model"]["gdn_head_norm"]
    assert config_from_dict(d).model.gdn_head_norm == "per_head"
    d["model"]["attention_type"] = "gla"
    assert config_from_dict(d).model.gdn_head_norm == "shared"  # no GDN layer: nothing to say


def test_a_config_saved_before_the_out_norm_flag_is_a_plain_rmsnorm():
    """GDN checkpoints saved before --gdn-out-norm had a plain RMSNorm output norm whatever --apply-layernorm-1p
    said: their config reads as --gdn-out-norm rmsnorm (the function they were trained with)."""
    cfg = validate(parse_args(BASE + ["--apply-layernorm-1p"]), 1)
    d = cfg.to_dict()
    assert config_from_dict(d).model.gdn_norm == ("RMSNorm", True)
    del d["model"]["gdn_out_norm"]
    assert config_from_dict(d).model.gdn_norm == ("RMSNorm", False)
    d["model"]["attention_type"] = "gla"
    assert config_from_dict(d).model.gdn_out_norm == "model"  # no GDN layer: nothing to say


def test_a_plain_rmsnorm_checkpoint_resumed_zero_centred_is_refused_by_name(tmp_path):
    """A --apply-layernorm-1p GDN checkpoint whose output norm is a plain RMSNorm (--gdn-out-norm rmsnorm, as every
    one saved before the flag) into a run whose output norm is zero-centred: the same tensors, another function:
    refused in one line naming the flag; with the flag as saved it loads and the weight is the saved one."""
    ckpt, one_p = str(tmp_path / "ckpt"), ["--apply-layernorm-1p"]
    run_distributed(_train, 1, BASE + one_p + ["--gdn-out-norm", "rmsnorm", "--save", ckpt])
    with pytest.raises(CheckpointError) as info:
        _setup(BASE + one_p + ["--load", ckpt])
    (line,) = str(info.value).splitlines()
    assert "saved with --gdn-out-norm rmsnorm (GDN output norm: RMSNorm)" in line, line
    assert line.endswith("has --gdn-out-norm model (RMSNorm, zero-centred: 1 + w): give --gdn-out-norm rmsnorm")
    run = _setup(BASE + one_p + ["--load", ckpt, "--gdn-out-norm", "rmsnorm"])
    mine = dict(run.chunks[0].named_parameters())["layers.0.mixer.head_norm"].detach()
    assert torch.equal(mine, consolidate(ckpt)[0]["layers.0.mixer.head_norm"].to(mine.dtype))
