"""Damaged and crafted torch_dist checkpoints, megatron-core's (`--from megatron`) and ours (`--to megatron`):
tools/convert_checkpoint.py exits 2 with one line naming the file and the cause, no traceback, writes nothing,
and no pickled code runs (a crafted `.metadata` whose unpickling would create a file creates none)."""

import contextlib
import dataclasses
import json
import os
import pickle
import shutil

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, files, mcore, pickled
from megatron_zpp.checkpoint.save import save_full_dcp
from megatron_zpp.model import GPT
from tests.checkpoint.test_mcore import LLAMA_FLAGS, ROWS, RUN, _cfg, _convert
from tests.dist import run_distributed


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Our torch_dist checkpoint (weights and moments) and its --to megatron export."""
    root = tmp_path_factory.mktemp("saved")
    cfg = _cfg(LLAMA_FLAGS + RUN)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, ROWS).named_parameters()}
    moments = {n: {k: torch.rand(w.shape, generator=gen) for k in mcore.MOMENTS} for n, w in weights.items()}
    save_full_dcp(str(root / "ours"), cfg, weights, moments, 3.0, 3, 12)
    assert _convert(["--load", str(root / "ours"), "--to", "megatron", "--save", str(root / "mlm")]) == 0
    return root, cfg, weights


def _copy(saved, tmp_path, which="mlm"):
    shutil.copytree(saved[0] / which, tmp_path / which)
    path = tmp_path / which / "iter_0000003"
    return path, next(p for p in path.iterdir() if p.suffix == ".distcp")


def _one_line(capsys, argv) -> str:
    assert _convert(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in captured.out + err, err
    return err


def _import(capsys, tmp_path) -> str:
    err = _one_line(capsys, ["--from", "megatron", "--load", str(tmp_path / "mlm"), "--to", "sharded",
                             "--save", str(tmp_path / "out")])  # fmt: skip
    assert not (tmp_path / "out").exists()
    return err


class _Crafted:
    """A common state entry whose unpickling would run a shell command that creates `marker`."""

    marker = ""

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _payload(marker) -> bytes:
    """A pickle whose loading runs a shell command that creates `marker`."""

    class Crafted:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return pickle.dumps(Crafted())


def test_damaged_megatron_checkpoint_is_one_line_naming_the_file(saved, tmp_path, capsys):
    path, distcp = _copy(saved, tmp_path)
    data = distcp.read_bytes()
    distcp.write_bytes(data[: len(data) // 2])
    err = _import(capsys, tmp_path)
    assert f"checkpoint file {distcp} is truncated: {len(data) // 2} bytes" in err
    distcp.unlink()
    assert f"checkpoint file {distcp} is missing" in _import(capsys, tmp_path)
    half = len(data) // 2  # among the tensors' bytes
    distcp.write_bytes(data[:half] + b"\xff" * 8 + data[half + 8 :])  # no checksum there: the bytes read as NaN
    assert f"{path}: non-finite values (inf or NaN) in " in _import(capsys, tmp_path)
    distcp.write_bytes(data)
    metadata = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(metadata[: len(metadata) // 2])
    assert f"{path / '.metadata'} is truncated or corrupted" in _import(capsys, tmp_path)
    (path / ".metadata").write_bytes(metadata)
    (tmp_path / "mlm" / mcore.TRACKER).write_text("3a\n")
    assert f"{tmp_path / 'mlm' / mcore.TRACKER} holds '3a': neither an iteration number nor 'release'" in _import(
        capsys, tmp_path
    )


def test_crafted_metadata_runs_nothing(saved, tmp_path, capsys):
    """The crafted file does run its command under a plain pickle.load (what DCP's reader calls); ours refuses
    its global by name and the command never runs, in megatron-core's checkpoint and in ours."""
    proof = tmp_path / "ran-under-pickle"
    pickle.loads(_payload(proof))
    assert proof.exists()
    path, _ = _copy(saved, tmp_path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(_payload(marker))
    err = _import(capsys, tmp_path)
    assert f"{path / '.metadata'}: refused: its pickle names posix.system" in err and not marker.exists()
    shutil.rmtree(tmp_path / "mlm")
    cfg = _cfg(LLAMA_FLAGS)
    weights = {n: torch.zeros(p.shape) for n, p in GPT(cfg.model, ROWS).named_parameters()}
    common = {"args": mcore.args_from_config(cfg, 3, 12, ROWS), "iteration": _Crafted()}
    _Crafted.marker = str(marker)
    mcore.write(str(tmp_path / "mlm"), 3, mcore.to_mcore(weights, cfg), common, 2)
    err = _import(capsys, tmp_path)
    assert "(common_state/shard_0_1): its common state is not read, as that would run pickled code" in err
    assert "posix.system" in err and not marker.exists()
    ours, _ = _copy(saved, tmp_path, "ours")
    (ours / ".metadata").write_bytes(_payload(marker))
    meta = json.loads((ours / "meta.json").read_text())
    meta["files"][".metadata"] = files.sha256_of(str(ours / ".metadata"))  # sealed as a save would
    files.write_meta(str(ours), meta)
    err = _one_line(capsys, ["--load", str(tmp_path / "ours"), "--to", "megatron", "--save", str(tmp_path / "x")])
    assert f"{ours / '.metadata'}: refused: its pickle names posix.system" in err and not marker.exists()
    assert not (tmp_path / "x").exists()


def test_damaged_own_checkpoint_is_one_line_naming_the_file(saved, tmp_path, capsys):
    ours, distcp = _copy(saved, tmp_path, "ours")
    distcp.write_bytes(distcp.read_bytes()[:100])
    err = _one_line(capsys, ["--load", str(tmp_path / "ours"), "--to", "megatron", "--save", str(tmp_path / "x")])
    assert f"checkpoint file {distcp} is corrupted or truncated" in err and not (tmp_path / "x").exists()


def _write(root, cfg_tensors, cfg_args):
    """A megatron-core checkpoint of `cfg_tensors`' weights whose args are `cfg_args`'."""
    gen = torch.Generator().manual_seed(0)
    model = GPT(cfg_tensors.model, ROWS)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    args = mcore.args_from_config(cfg_args, 3, 12, ROWS)
    mcore.write(str(root), 3, mcore.to_mcore(weights, cfg_tensors), {"args": args, "iteration": 3}, 2)


def test_args_that_disagree_with_the_tensors_are_refused_by_key(tmp_path, capsys):
    cfg = _cfg(LLAMA_FLAGS)
    _write(tmp_path / "mlm", cfg, _cfg(LLAMA_FLAGS.replace("--ffn-hidden-size 48", "--ffn-hidden-size 64")))
    err = _import(capsys, tmp_path)
    assert "decoder.layers.mlp.linear_fc1.weight is [2, 96, 32] where its args give [2, 128, 32]" in err
    assert "decoder.layers.mlp.linear_fc2.weight is [2, 32, 48] where its args give [2, 32, 64]" in err
    shutil.rmtree(tmp_path / "mlm")
    _write(tmp_path / "mlm", cfg, _cfg(LLAMA_FLAGS.replace("--num-layers 2", "--num-layers 3")))
    err = _import(capsys, tmp_path)
    assert "decoder.layers.mlp.linear_fc1.weight stacks 2 layers where its args say --num-layers 3" in err


def _load_error(rank, world, root):
    try:
        training.setup(_cfg(f"{LLAMA_FLAGS}{RUN} --ckpt-format torch_dist --load {root}", world))
    except CheckpointError as e:
        return str(e)
    return None


def test_a_missing_layer_is_named_not_blamed_on_the_vocabulary(saved, tmp_path, capsys):
    """Our torch_dist checkpoint whose DCP files lack one layer's tensor (its meta.json is sound): the load
    and the export name that tensor."""
    root, cfg, weights = saved
    lost = "layers.1.mlp.fc2.weight"
    save_full_dcp(str(tmp_path / "ours"), cfg, {n: w for n, w in weights.items() if n != lost}, None, None, 3, 12)
    error = run_distributed(_load_error, 1, str(tmp_path / "ours"))[0]
    assert f"holds no model.{lost}, which this run's model has" in error and "vocabulary" not in error
    err = _one_line(capsys, ["--load", str(tmp_path / "ours"), "--to", "megatron", "--save", str(tmp_path / "x")])
    assert f"the checkpoint holds no {lost}, which the model of its config has" in err
    assert not (tmp_path / "x").exists()


def test_metadata_naming_a_file_outside_the_directory_is_refused(saved, tmp_path, capsys):
    path, _ = _copy(saved, tmp_path)
    metadata = pickled.read_metadata(str(path / ".metadata"))
    outside = {k: dataclasses.replace(v, relative_path="../../ours/x.distcp") for k, v in metadata.storage_data.items()}
    metadata.storage_data = outside
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    assert f"{path / '.metadata'}: names a data file outside {path}: '../../ours/x.distcp'" in _import(capsys, tmp_path)


def test_a_crafted_pickled_object_in_our_checkpoint_runs_nothing(saved, tmp_path, capsys):
    """Our torch_dist checkpoint with a pickled object added under "model." (its .metadata declaring it,
    meta.json resealed): DCP's own planner would unpickle it with weights_only=False (torch's dcp_to_torch_save
    runs its command); our reads refuse it by key and run nothing."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    ours, distcp = _copy(saved, tmp_path, "ours")
    metadata = pickled.read_metadata(str(ours / ".metadata"))
    marker, proof = tmp_path / "ran", tmp_path / "ran-under-dcp"
    offset = distcp.stat().st_size
    for path, mark in ((ours, proof), (ours, marker)):
        payload = _payload(mark)
        (path / distcp.name).write_bytes((path / distcp.name).read_bytes()[:offset] + payload)
        metadata.state_dict_metadata["model.crafted"] = BytesStorageMetadata()
        metadata.planner_data["model.crafted"] = ("model", "crafted")
        metadata.storage_data[MetadataIndex("model.crafted")] = _StorageInfo(distcp.name, offset, len(payload))
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
        if mark == proof:
            with contextlib.suppress(CheckpointException):  # torch.load's first unpickle runs it, then fails
                dcp_to_torch_save(str(path), str(tmp_path / "full.pt"))
            assert proof.exists()
    meta = json.loads((ours / "meta.json").read_text())
    meta["files"] = {f: files.sha256_of(str(ours / f)) for f in meta["files"]}  # resealed, as a save would
    files.write_meta(str(ours), meta)
    err = _one_line(capsys, ["--load", str(tmp_path / "ours"), "--to", "megatron", "--save", str(tmp_path / "x")])
    assert f"{ours}: model.crafted is a pickled object that would run code when read: Unsupported" in err
    assert not marker.exists() and not (tmp_path / "x").exists()
