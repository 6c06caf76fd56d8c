"""A checkpoint of one linear mixer (Kimi Delta Attention, Gated DeltaNet) loaded into a model of the other is
refused in one line naming both, before anything is read."""

import pytest

from megatron_zpp.checkpoint import CheckpointError
from megatron_zpp.checkpoint.formats.hf import export_format
from megatron_zpp.checkpoint.reshard import check_same_model
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate

FLAGS = "--mock-data --softmax-attention-every 2 --num-layers 2 --hidden-size 32 --num-attention-heads 4"
FLAGS += " --vocab-size 64 --make-vocab-size-divisible-by 64 --position-embedding-type rope --disable-bias-linear"


def _cfg(kind: str):
    return validate(parse_args([*FLAGS.split(), "--attention-type", kind]), 1)


@pytest.mark.parametrize(("saved", "now"), [("kda", "gdn"), ("gdn", "kda"), ("gla", "kda")])
def test_another_linear_mixers_checkpoint_is_refused_by_name(saved, now):
    meta = {"config": _cfg(saved).to_dict(), "padded_vocab_size": 64}
    names = {"kda": "Kimi Delta Attention", "gdn": "Gated DeltaNet", "gla": "GLA"}
    with pytest.raises(CheckpointError) as e:
        check_same_model("ckpt/iter_0000010", meta, _cfg(now), 64)
    message = str(e.value)
    assert "\n" not in message and message.startswith("ckpt/iter_0000010 was saved with --attention-type " + saved)
    assert f"({names[saved]}), this run has --attention-type {now} ({names[now]})" in message
    check_same_model("ckpt", {"config": _cfg(now).to_dict(), "padded_vocab_size": 64}, _cfg(now), 64)  # same: loads


def test_kda_hf_export_is_our_remote_code():
    """(tests/checkpoint/test_convert.py checks the exported KDA hybrid's logits, generation and import.)"""
    assert export_format(_cfg("kda")).NAME == "remote" and export_format(_cfg("gdn")).NAME == "remote"
