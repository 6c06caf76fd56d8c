"""A checkpoint saved at one layout resumes at another with the same weights and optimizer state.

The source run (fp32, CPU; a 4-layer GLA/softmax hybrid) trains 2N steps at TP2 x PP2 x
DP2 with ZeRO-3 on 8 gloo ranks and saves after step N. Each target layout loads the
step-N checkpoint and trains steps N+1..2N; its losses must equal the source run's own
steps N+1..2N (the unchanged layout) to fp32 round-off, and its final weights, consolidated,
must equal the source's. Weights alone would not pass: had the AdamW moments or the step
count been lost, the first update would differ by about lr per weight.

Targets: TP1 x PP4 x DP2 (ZeRO-3), DP4 (plain DP), CP2 x DP2 (ZeRO-1); and the other
direction, plain TP2 x DP2 -> ZeRO-2 over DP4 with a change of the vocabulary padding,
whose weights must arrive bitwise. Megatron's defaults (learned positions, biases split over TP in
fused sections: q|k|v with GQA, gate|up) resume from TP2 x SP x PP2 at DP4 with ZeRO-3.
"""

import os

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, save_checkpoint
from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

N = 2
BASE = (
    OLD_DEFAULTS
    + (
        f"--mock-data --hidden-size 32 --num-attention-heads 4 --group-query-attention "
        f"--num-query-groups 2 --seq-length "
        f"32 --vocab-size 128 --make-vocab-size-divisible-by 32 --num-layers 4 --attention-type "
        f"gla --softmax-attention-every 2 --gla-chunk-size 8 --train-iters {2 * N} "
        f"--global-batch-size 8 --micro-batch-size 1 --lr 3e-3 --lr-warmup-iters 1 --clip-grad 0.5 "
        f"--seed 7 --peak-tflops 1 --device cpu"
    ).split()
)
SOURCE = (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "3"])
TARGETS = {
    "tp1_pp4_dp2_zero3": (8, ["--pipeline-model-parallel-size", "4", "--zero-stage", "3"]),
    "dp4_plain": (4, []),
    "cp2_dp2_zero1": (4, ["--context-parallel-size", "2", "--zero-stage", "1"]),
}
RTOL = 2e-5  # fp32 round-off: other reduction orders over TP, DP and micro-batches


def _train(rank, world_size, argv):
    run = training.setup(validate(parse_args(argv), world_size))
    start = run.state.iteration
    losses = [h["loss"] for h in training.train(run)]
    return {"start": start, "losses": losses, "resharded": run.resharded_from}


def point_latest_at(ckpt: str, iteration: int) -> None:
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write(f"iter_{iteration:07d}\n")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(step-N checkpoint dir, losses of steps 1..2N, consolidated weights after step 2N)."""
    ckpt = str(tmp_path_factory.mktemp("source") / "ckpt")
    world, extra = SOURCE
    out = run_distributed(_train, world, BASE + extra + ["--save", ckpt, "--save-interval", str(N)], timeout=300)
    final, _ = consolidate(ckpt)
    point_latest_at(ckpt, N)  # as if the source run had stopped after step N
    return ckpt, out[0]["losses"], final


def _assert_close_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=1e-6, msg=name)


@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_at_another_layout(source, target, tmp_path):
    ckpt, losses, final = source
    world, extra = TARGETS[target]
    out_ckpt = str(tmp_path / "out")
    out = run_distributed(_train, world, BASE + extra + ["--load", ckpt, "--save", out_ckpt], timeout=300)
    r0 = out[0]
    assert r0["start"] == N and r0["resharded"], "the checkpoint was not resharded"
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(losses[N:]), rtol=RTOL, atol=0)
    _assert_close_weights(consolidate(out_ckpt)[0], final)


def _load_and_save(rank, world_size, argv, out):
    run = training.setup(validate(parse_args(argv), world_size))
    save_checkpoint(run, out)
    return run.resharded_from


def test_plain_tp_to_zero2_with_vocab_padding_change(tmp_path):
    """Plain TP2 x DP2 -> ZeRO-2 over DP4, loaded and saved again at once: every weight
    arrives unchanged. The padded vocabulary shrinks from 288 to 240 rows (vocab 200 padded
    to a multiple of 48 x TP): the padding rows past 240 are cut, the others kept."""
    base = [a if a != "128" else "200" for a in BASE]
    base[base.index("--make-vocab-size-divisible-by") + 1] = "48"
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    run_distributed(_train, 4, base + ["--tensor-model-parallel-size", "2", "--save", src, "--train-iters", str(N)])
    changes = run_distributed(_load_and_save, 4, base + ["--zero-stage", "2", "--load", src], dst)[0]
    assert "tp 2 -> 1" in changes and "zero_stage 0 -> 2" in changes
    before, after = consolidate(src)[0], consolidate(dst)[0]
    assert before["embedding.weight"].shape[0] == 288 and after["embedding.weight"].shape[0] == 240
    for name, w in before.items():
        torch.testing.assert_close(after[name], w[:240] if name == "embedding.weight" else w, rtol=0, atol=0, msg=name)


def test_biases_and_positions_reshard(tmp_path):
    """TP2 x SP x PP2 -> DP4 ZeRO-3 of a softmax model with learned positions and every bias (SwiGLU and GQA:
    fc1's and qkv's biases are split per section): the resumed losses are the source's own."""
    megatron = (
        "--attention-type softmax --softmax-attention-every 0 --position-embedding-type learned_absolute "
        "--add-bias-linear --num-layers 2"
    ).split()
    ckpt = str(tmp_path / "ckpt")
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]
    src = run_distributed(_train, 4, BASE + megatron + layout + ["--save", ckpt, "--save-interval", str(N)])[0]
    point_latest_at(ckpt, N)
    out = run_distributed(_train, 4, BASE + megatron + ["--zero-stage", "3", "--load", ckpt])[0]
    assert out["start"] == N and out["resharded"]
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(src["losses"][N:]), rtol=RTOL, atol=0)
    names = set(consolidate(ckpt)[0])
    assert {"position_embeddings.weight", "layers.0.mixer.qkv.bias", "layers.1.mlp.fc2.bias"} <= names


def test_other_model_is_refused_with_its_differences(source, tmp_path):
    ckpt = source[0]
    argv = BASE + ["--load", ckpt, "--num-layers", "2"]
    with pytest.raises(
        CheckpointError,
        match=r"holds another model \(not in this model: \['layers\.2\..*"
        r"num_layers 4 \(checkpoint\) vs 2 \(this run\)",
    ):
        training.setup(validate(parse_args(argv), 1))


def test_bf16_masters_into_interleaved_pipeline(tmp_path):
    """bf16 ZeRO-1 over DP2 -> plain DP at PP2 with 2 virtual stages per rank: the fp32
    master weights (not their bf16 roundings) arrive bitwise."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    run_distributed(_train, 2, BASE + ["--bf16", "--zero-stage", "1", "--save", src, "--train-iters", str(N)])
    changes = run_distributed(
        _load_and_save,
        2,
        BASE
        + [
            "--bf16",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--load",
            src,
        ],
        dst,
    )[0]
    assert "vpp None -> 1" in changes
    before, after = consolidate(src)[0], consolidate(dst)[0]
    assert any(not torch.equal(w, w.bfloat16().float()) for w in before.values())  # masters are not bf16 values
    for name, w in before.items():
        assert torch.equal(after[name], w), name
