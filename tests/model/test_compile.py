"""--torch-compile (training/builders.compile_model): each block's forward and the cross-entropy compiled by inductor.

* a hybrid model (layer 0 GLA with its own autograd Function, layer 1 softmax) gives the losses
  and gradients of eager over 3 steps within 1e-5 relative (inductor reorders fp32 sums: ~1e-6
  expected); parameter names and state_dict keys are unchanged (no `_orig_mod.` prefix); the
  steps after the first compile nothing new (no recompiles); another length runs eager;
* ZeRO-3, whose hooks gather a block's weights before its forward and free them after, trains
  to the losses and weights of eager plain data parallelism (1 rank, 3 steps, 1e-5), compiling
  one graph per block kind, not one per step;
* what is not verified with it is refused with a clear message.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.training.builders import compile_model
from megatron_zpp.validation import validate
from tests.old_defaults import old_model
from tests.test_parity import assert_close_relative, train_and_collect
from tests.test_training import TINY

HYBRID = ["--attention-type", "gla", "--softmax-attention-every", "2"]  # layer 0 GLA, layer 1 softmax
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_compiled_blocks_equal_eager():
    cfg = old_model(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=32,
        attention_type="gla",
        softmax_attention_every=2,
        linear_chunk_size=8,
    )
    eager, compiled = GPT(cfg, 128), GPT(cfg, 128)
    init_weights(eager, 7)
    init_weights(compiled, 7)
    compile_model([compiled], cfg.seq_length)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]

    gen = torch.Generator().manual_seed(3)
    graphs = []
    for _ in range(3):
        tokens = torch.randint(0, 128, (2, 33), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        losses = []
        for model in (eager, compiled):
            loss = model(x, y).mean()
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= TOL * abs(losses[0]), losses
        for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
            assert _rel(pc.grad, pe.grad) <= TOL, f"gradient of {name}: {_rel(pc.grad, pe.grad):.2e}"
        with torch.no_grad():  # a plain SGD step: the next step sees new weights
            for pe, pc in zip(eager.parameters(), compiled.parameters()):
                pe -= 0.5 * pe.grad
                pc -= 0.5 * pc.grad
                pe.grad = pc.grad = None
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[1:] == graphs[:1] * 2, f"recompiled after the first step: unique graphs {graphs}"

    with torch.no_grad():  # generation's lengths run eager: nothing compiled (weights now differ by round-off)
        short = torch.randint(0, 128, (1, 20), generator=gen)
        assert _rel(compiled(short), eager(short)) <= TOL
    assert counters["stats"]["unique_graphs"] == graphs[-1]


def test_zero3_with_compiled_blocks_equals_eager_plain():
    steps = ["--train-iters", "3"]  # 2 softmax blocks: the hooks do not depend on the mixer; GLA compiles slowly
    ref = train_and_collect(TINY + steps, 1)
    before = counters["stats"]["unique_graphs"]
    got = train_and_collect(TINY + steps + ["--zero-stage", "3", "--torch-compile"], 1)
    # at most one graph per block (the blocks may reuse the first test's): none per step
    assert counters["stats"]["unique_graphs"] - before <= 2
    assert list(got["weights"]) == list(ref["weights"])
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= TOL * abs(b), (got["losses"], ref["losses"])
    for name, w in ref["weights"].items():
        assert_close_relative(got["weights"][name], w, name, tol=TOL)


@pytest.mark.parametrize(
    "extra, world, says",
    [
        (["--tensor-model-parallel-size", "2"], 2, "--tensor-model-parallel-size 1"),
        (["--context-parallel-size", "2"], 2, "--context-parallel-size 1"),
        (["--attention-dropout", "0.1"], 1, "--attention-dropout 0"),
        (["--reset-attention-mask"], 1, "packed documents"),
        (["--reset-position-ids"], 1, "packed documents"),
    ],
)
def test_what_is_not_verified_is_refused(extra, world, says):
    with pytest.raises(ConfigError, match=f"--torch-compile.*{says}"):
        validate(parse_args(TINY + HYBRID + ["--torch-compile"] + extra), world)
