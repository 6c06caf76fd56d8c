"""meta.json is verified, not trusted: its sha256 (meta.json.sha256 beside it), its fields and
their types, and the counters, layout and rank each rank file carries, so an edited counter,
swapped rank files (with their sha256 entries), a missing field, a wrong type or a tensor
rewritten in another dtype is one error naming the file and the field."""

import json
import os
import shutil

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, files
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

TINY = (
    OLD_DEFAULTS
    + (
        "--mock-data --device cpu --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--vocab-size 128 --make-vocab-size-divisible-by 32 --global-batch-size 4 --micro-batch-size 1 "
        "--train-iters 2 --seed 5 --peak-tflops 1"
    ).split()
)


def _train(rank, world, argv):
    try:
        training.train(training.setup(validate(parse_args(TINY + argv), world)))
    except CheckpointError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("meta") / "ck")
    assert run_distributed(_train, 2, ["--save", root]) == [None, None]
    return os.path.join(root, "iter_0000002")


def tampered(saved, tmp_path, edit_meta=None, reseal=True):
    """A copy of the checkpoint with meta.json edited (its sha256 rewritten to match when `reseal`)."""
    copy = str(tmp_path / "iter_0000002")
    shutil.copytree(saved, copy)
    meta = json.load(open(os.path.join(copy, "meta.json")))
    meta = edit_meta(meta, copy) if edit_meta else meta
    if reseal:
        files.write_meta(copy, meta)
    else:
        open(os.path.join(copy, "meta.json"), "w").write(json.dumps(meta))
    return copy


def opened(path, rank=0):
    _, meta = files.find_checkpoint(path)
    return files.open_rank_file(path, meta, rank)


def _set(key, value):
    def edit(meta, _):
        meta[key] = value
        return meta

    return edit


def _drop(key):
    def edit(meta, _):
        del meta[key]
        return meta

    return edit


def _swap_ranks(meta, copy):
    a, b = (os.path.join(copy, files.rank_file(r)) for r in (0, 1))
    os.rename(a, a + ".x"), os.rename(b, a), os.rename(a + ".x", b)
    f = meta["files"]
    f[files.rank_file(0)], f[files.rank_file(1)] = f[files.rank_file(1)], f[files.rank_file(0)]
    return meta


def _config_value(meta, _):
    meta["config"]["model"]["hidden_size"] = "32"
    return meta


CASES = [  # (edit, reseal, what the one error says)
    (_set("consumed_samples", 12), False, "meta.json: its sha256 does not match meta.json.sha256 beside it"),
    (_set("consumed_samples", 12), True, "rank_00000.safetensors: field 'consumed_samples' is 8 but meta.json says 12"),
    (_set("iteration", 5), True, "rank_00000.safetensors: field 'iteration' is 2 but meta.json says 5"),
    (_swap_ranks, True, "rank_00000.safetensors: holds rank 1's state, not rank 0's (rank files swapped?)"),
    (_drop("files"), True, "meta.json: field 'files' is missing"),
    (_drop("layout"), True, "meta.json: field 'layout' is missing"),
    (lambda meta, _: [meta], True, "meta.json: is a list, not an object"),
    (_set("iteration", "2"), True, "meta.json: field 'iteration' is a string, expected an integer"),
    (_config_value, True, "meta.json: field 'config.model.hidden_size' is a string '32', expected an integer"),
]


@pytest.mark.parametrize("edit,reseal,why", CASES, ids=[c[2].split(": ", 1)[1][:40] for c in CASES])
def test_tampered_meta_is_one_named_error(saved, tmp_path, edit, reseal, why):
    path = tampered(saved, tmp_path, edit, reseal)
    with pytest.raises(CheckpointError) as e:
        opened(path)
    assert why in str(e.value) and path in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_untouched_checkpoint_opens(saved, tmp_path):
    assert opened(tampered(saved, tmp_path), 1).header("rank") == 1


def test_tensor_rewritten_in_another_dtype_is_refused(saved, tmp_path):
    def to_fp16(meta, copy):
        state = files.read_rank_file(copy, meta, 0)
        key = next(iter(state["model"]))
        state["model"][key] = state["model"][key].to(torch.float16)
        meta["files"][files.rank_file(0)] = files.write_rank_file(copy, 0, state)
        return meta

    root = os.path.dirname(tampered(saved, tmp_path, to_fp16))
    open(os.path.join(root, "latest"), "w").write("iter_0000002\n")
    errors = run_distributed(_train, 2, ["--load", root, "--train-iters", "3"])
    assert errors[0].endswith(
        "/model/chunk0.embedding.weight is float16, this layout saves float32 (the file was rewritten?)"
    )


# ---- the legacy format: a checkpoint saved before meta.json.sha256 (tests/fixtures/ck_ae388d2) ----
LEGACY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ck_ae388d2")
LEGACY_ARGV = (
    OLD_DEFAULTS
    + (
        "--mock-data --device cpu --num-layers 1 --hidden-size 16 --num-attention-heads 2 --ffn-hidden-size 32 "
        "--seq-length 16 --vocab-size 64 --make-vocab-size-divisible-by 32 --global-batch-size 4 "
        "--micro-batch-size 1 --train-iters 3 --seed 5 --peak-tflops 1 --lr 1e-3"
    ).split()
)


def _legacy_run(argv):
    run = training.setup(validate(parse_args(LEGACY_ARGV + argv), 1))
    losses = [h["loss"] for h in training.train(run)]
    return run, losses, {n: p.detach().clone() for n, p in run.chunks[0].named_parameters()}


def test_legacy_checkpoint_loads_with_one_warning_and_resumes_exactly(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(LEGACY, ck)
    run, losses, weights = _legacy_run(["--load", ck, "--save", ck])
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "legacy format" in warnings[0] and "unverified" in warnings[0], out
    assert run.state.iteration == 3 and len(losses) == 1
    assert abs(losses[0] - 4.1278) < 1e-4  # what the code of ae388d2 logged at iteration 3 without stopping
    _, plain_losses, plain_weights = _legacy_run([])  # this code, 3 iterations without stopping
    assert losses[0] == plain_losses[-1]
    # the fixture's two iterations ran on another CPU: its matmuls (AVX-512 there, AMX on a newer
    # Xeon) may round differently from this one's in the last bit, so the weights agree to fp32
    # round-off here and bitwise where the fixture was made
    for n in plain_weights:
        torch.testing.assert_close(weights[n], plain_weights[n], rtol=1e-6, atol=1e-8)
    assert os.path.exists(os.path.join(ck, "iter_0000003", files.META_DIGEST))  # the next save: current format


def _legacy_copy(tmp_path):
    copy = str(tmp_path / "iter_0000002")
    shutil.copytree(os.path.join(LEGACY, "iter_0000002"), copy)
    return copy


def test_legacy_checkpoint_still_verifies_what_it_can(tmp_path, saved):
    copy = _legacy_copy(tmp_path)
    fpath = os.path.join(copy, files.rank_file(0))
    open(fpath, "r+b").write(b"\0" * 8)  # a damaged rank file: its sha256 in meta.json still catches it
    with pytest.raises(CheckpointError, match="corrupted or truncated: its sha256 does not match meta.json"):
        opened(copy)
    # a legacy meta.json with a sha256 beside it that does not match: an error, not the legacy format
    copy = _legacy_copy(tmp_path / "b")
    open(os.path.join(copy, files.META_DIGEST), "w").write("0" * 64 + "\n")
    with pytest.raises(CheckpointError, match="its sha256 does not match meta.json.sha256"):
        opened(copy)
    # a current checkpoint whose meta.json.sha256 was lost is not taken for a legacy one
    copy = tampered(saved, tmp_path / "c")
    os.remove(os.path.join(copy, files.META_DIGEST))
    with pytest.raises(CheckpointError, match="carries its rank and layout .* meta.json.sha256 is missing"):
        opened(copy)


def test_legacy_checkpoint_consolidates_with_the_warning(capsys):
    from safetensors.torch import load_file

    from megatron_zpp.checkpoint.consolidate import consolidate

    state, _ = consolidate(LEGACY)
    assert "warning:" in capsys.readouterr().err
    raw = load_file(os.path.join(LEGACY, "iter_0000002", files.rank_file(0)))  # the file itself, read plainly
    assert state and all(torch.equal(t, raw[f"/model/chunk0.{n}"]) for n, t in state.items())


def test_a_resume_that_changes_what_the_tensors_compute_says_so_in_one_warning(tmp_path, capsys):
    """--apply-layernorm-1p and --rotary-base changed between save and resume: the same names and shapes load (a
    longer context's RoPE base is a deliberate change), with one warning naming each flag and both values."""
    ck, argv = str(tmp_path / "ck"), LEGACY_ARGV + ["--train-iters", "1"]
    training.train(training.setup(validate(parse_args(argv + ["--save", ck]), 1)))
    capsys.readouterr()
    training.setup(validate(parse_args(argv + ["--load", ck, "--apply-layernorm-1p", "--rotary-base", "500000"]), 1))
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning:" in line]
    assert len(warnings) == 1, warnings
    assert (
        "changes --apply-layernorm-1p False -> True, --rotary-base 10000.0 -> 500000.0 from the checkpoint's"
        in warnings[0]
    ), warnings
    training.setup(validate(parse_args(argv + ["--load", ck]), 1))  # unchanged: no warning
    assert "warning:" not in capsys.readouterr().out
