"""load.plan_load: one plan per load, whatever the format. What a plan says it restores is what the
checkpoint's own reader lists (safetensors' key listing of the rank file; torch DCP's metadata), and a
load computes the layout changes once."""

from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_zpp import training
from megatron_zpp.checkpoint import LoadTarget, files, load
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

TINY = (
    OLD_DEFAULTS
    + (
        "--mock-data --device cpu --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--vocab-size 128 --make-vocab-size-divisible-by 32 --global-batch-size 2 --micro-batch-size 1 "
        "--train-iters 2 --seed 5 --peak-tflops 1"
    ).split()
)
ZERO1 = ["--use-distributed-optimizer"]


def _target(world, *argv) -> LoadTarget:
    run = training.setup(validate(parse_args(TINY + list(argv)), world))
    return LoadTarget(run.cfg, run.groups, run.device, run.dp, run.tokenizer.padded_vocab_size)


def _tensor_names(path: str) -> set[str]:
    with safe_open(f"{path}/{files.rank_file(0)}", "pt") as f:
        return set(f.keys())


def _plans(rank, world, root):
    for name, extra in (("zpp", []), ("dist", ["--ckpt-format", "torch_dist"]), ("zero1", ZERO1)):
        training.train(
            training.setup(
                validate(parse_args(TINY + ["--save", f"{root}/{name}", "--save-interval", "2", *extra]), world)
            )
        )
    plain, zero1 = _target(world), _target(world, *ZERO1)
    out = {}
    for name, target in (("zpp", plain), ("dist", plain), ("reshard", zero1)):
        path, meta = files.locate_checkpoint(f"{root}/{'zpp' if name == 'reshard' else name}")
        plan = load.plan_load(target, path, meta, weights_only=False)
        out[name] = (plan.changes, plan.files, set(plan.keys), plan.has_optimizer, plan.how, path, meta)
    calls, changes = [], load.layout_changes
    load.layout_changes = lambda *a: calls.append(a) or changes(*a)
    try:
        restored = load.load_checkpoint(zero1, f"{root}/zpp")
    finally:
        load.layout_changes = changes
    return out, len(calls), restored.resharded_from


def test_one_plan_per_format_lists_what_the_checkpoint_holds(tmp_path):
    plans, calls, resharded_from = run_distributed(_plans, 1, str(tmp_path))[0]
    changes, read, keys, has_optimizer, how, path, _ = plans["zpp"]
    assert (changes, read, has_optimizer, how) == ([], ("rank_00000.safetensors",), True, "same layout")
    assert keys == _tensor_names(path)  # every tensor of the rank file, as safetensors lists them
    assert {"/model/chunk0.embedding.weight", "/optimizer/state/0/exp_avg", "/rng/torch_cpu"} <= keys
    changes, read, keys, has_optimizer, how, path, meta = plans["dist"]
    assert (changes, read, has_optimizer, how) == ([], tuple(meta["files"]), True, "torch_dist, same layout")
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    assert keys == {k for k, v in saved.items() if isinstance(v, TensorStorageMetadata)}
    assert {"model.embedding.weight", "optimizer.step", "rng.rank0.torch_cpu"} <= keys
    changes, read, keys, has_optimizer, how, path, _ = plans["reshard"]
    assert any(c.startswith("zero_stage ") for c in changes) and how.startswith("resharded (zero_stage ")
    assert read == ("rank_00000.safetensors",) and has_optimizer
    # the ZeRO-1 run's own file holds these tensors, and its RNG streams, which a resharded load leaves fresh
    zero1_path = files.locate_checkpoint(str(tmp_path / "zero1"))[0]
    assert keys == {k for k in _tensor_names(zero1_path) if not k.startswith("/rng/")}
    assert calls == 1 and resharded_from == changes  # layout_changes once per load; Restored takes the plan's
