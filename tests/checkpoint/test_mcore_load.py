"""pretrain_gpt.py --load <a megatron-core torch_dist checkpoint>, as Megatron-LM loads it: converted on the
fly (checkpoint.mcore.import_checkpoint, one rank per node, into a temporary directory removed after set-up)
and resharded to the run's layout. The checkpoint is written by our exporter (checkpoint.mcore.
export_checkpoint, checked against megatron-core itself in test_mcore.py) from weights, Adam moments and a
position drawn here: the run at DP 2 with ZeRO-1 must hold exactly those weights, resume at that iteration and
sample count, and train on; its own save then goes beside Megatron's (same --save as Megatron's CI)."""

import contextlib
import glob
import io
import os
import tempfile

import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import mcore
from megatron_zpp.checkpoint.save import save_full_dcp
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT
from megatron_zpp.validation import validate
from megatron_zpp.validation.checkpoint import find_load
from tests.dist import run_distributed

FLAGS = (
    "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 100 "
    "--make-vocab-size-divisible-by 32 --normalization RMSNorm --swiglu --ffn-hidden-size 48 --disable-bias-linear "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --global-batch-size 4 --micro-batch-size 1 "
    "--lr 1e-3 --seed 7 --peak-tflops 1 --ckpt-format torch_dist"
).split()
ITERATION, CONSUMED, ROWS = 3, 12, 128


def _resume(rank, world, mlm, weights):
    argv = FLAGS + ["--load", mlm, "--save", mlm, "--train-iters", "4", "--zero-stage", "1", "--save-interval", "4"]
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "megatron_zpp_mcore_*")))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = training.setup(validate(parse_args(argv), world))
        with run.dp.full_parameters():
            same = {n: torch.equal(p.detach().float(), weights[n]) for n, p in run.chunks[0].named_parameters()}
        at = (run.state.iteration, run.state.consumed_samples, run.state.resumed_from)
        losses = [h["loss"] for h in training.train(run)]
    left = set(glob.glob(os.path.join(tempfile.gettempdir(), "megatron_zpp_mcore_*"))) - before  # after a save
    return same, at, sorted(left), losses, out.getvalue()


def test_load_of_a_megatron_core_checkpoint_converts_it_on_the_fly(tmp_path):
    cfg = validate(parse_args(FLAGS), 1)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, ROWS).named_parameters()}
    moments = {n: {k: torch.rand(w.shape, generator=gen) for k in mcore.MOMENTS} for n, w in weights.items()}
    save_full_dcp(str(tmp_path / "ours"), cfg, weights, moments, float(ITERATION), ITERATION, CONSUMED)
    mlm = str(tmp_path / "mlm")
    mcore.export_checkpoint(str(tmp_path / "ours"), mlm)
    assert find_load(mlm, None) == ("mcore", None) and not os.path.exists(os.path.join(mlm, "latest"))
    results = run_distributed(_resume, 2, mlm, weights)
    for same, at, left, losses, _ in results:
        assert same and all(same.values()), [n for n, ok in same.items() if not ok]
        assert at == (ITERATION, CONSUMED, os.path.join(mlm, f"iter_{ITERATION:07d}")), at
        assert left == [], left  # the conversion is gone once set up
        assert len(losses) == 1 and all(torch.isfinite(torch.tensor(losses)))
    assert "a megatron-core torch_dist checkpoint (iteration 3, 12 samples" in results[0][4]
    assert find_load(mlm, None) == ("ours", None)  # our save beside Megatron's: the next --load resumes it
