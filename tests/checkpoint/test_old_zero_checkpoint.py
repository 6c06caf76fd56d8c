"""A ZeRO-3 checkpoint written by the code before the engines described their own rank layout
(tests/fixtures/ck_zero3_00a0f35) still reads: its shards hold the parameters in the unit order
that code wrote, and a run resharded from it to one rank continues as the saving run did."""

import os
import shutil

import torch
from safetensors.torch import load_file

from megatron_zpp import training
from megatron_zpp.checkpoint import files
from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.config import ModelConfig, former_names
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT
from megatron_zpp.validation import validate

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ck_zero3_00a0f35")
ARGV = (
    "--mock-data --device cpu --num-layers 1 --hidden-size 16 --num-attention-heads 2 --ffn-hidden-size 32 "
    "--seq-length 16 --vocab-size 64 --make-vocab-size-divisible-by 32 --global-batch-size 4 --micro-batch-size 1 "
    "--train-iters 3 --seed 5 --peak-tflops 1 --lr 1e-3 --hidden-dropout 0 --attention-dropout 0 --log-interval 1"
).split()
# the unit names of that code's files and the parameters each flat buffer holds, by name prefix
UNIT_PREFIXES = {
    "embedding": ("embedding.",),
    "position_embeddings": ("position_embeddings.",),
    "layer0": ("layers.0.",),
    "head": ("final_norm.", "output."),
}


def test_old_zero3_shards_are_the_parameters_in_unit_order():
    state, config = consolidate(FIXTURE)
    renamed = former_names("model")  # the config was saved before some settings were renamed
    model = ModelConfig(**{renamed.get(k, k): v for k, v in config["model"].items()})
    order = [n for n, _ in GPT(model, 64).named_parameters()]  # the model's own order, no layout code
    raw = [load_file(os.path.join(FIXTURE, "iter_0000002", files.rank_file(r))) for r in range(2)]
    keys = sorted(
        (k for k in raw[0] if k.startswith("/model/")), key=lambda k: int(k.split(".")[0][len("/model/unit") :])
    )
    assert [k.split(".")[1] for k in keys] == list(UNIT_PREFIXES)
    for key in keys:
        flat = torch.cat([r[key] for r in raw])  # rank 0's shard, then rank 1's: the unit's padded buffer
        names = [n for n in order if n.startswith(UNIT_PREFIXES[key.split(".")[1]])]
        want = torch.cat([state[n].reshape(-1) for n in names])
        assert names and torch.equal(flat[: want.numel()], want) and not flat[want.numel() :].any(), key
    assert sorted(state) == sorted(order)


def test_old_zero3_checkpoint_resumes_on_one_rank(tmp_path):
    ck = str(tmp_path / "ck")
    shutil.copytree(FIXTURE, ck)
    run = training.setup(validate(parse_args(ARGV + ["--load", ck]), 1))  # ZeRO-3 over 2 -> plain DP on 1
    losses = [h["loss"] for h in training.train(run)]
    assert run.state.iteration == 3 and len(losses) == 1
    assert abs(losses[0] - 4.124788) < 2e-6  # what the code of 00a0f35 logged at iteration 3 without stopping
