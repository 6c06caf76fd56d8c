"""tools/convert_checkpoint.py never overwrites or mixes (megatron_zpp/checkpoint/convert_output.py): an
output that is the input, holds it, lies in an iteration directory, already holds the iteration written,
has a newer `latest` or the other format is refused with one line and rc 2, every file left as it was; a
conversion that fails or is interrupted leaves no file of it behind."""

import errno
import hashlib
import os

import pytest
import torch

from megatron_zpp.checkpoint import mcore
from megatron_zpp.checkpoint.save import save_full_dcp
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model.gpt import GPT
from megatron_zpp.validation import validate
from tools import convert_checkpoint as tool

FLAGS = (
    "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 100 "
    "--make-vocab-size-divisible-by 32 --normalization RMSNorm --swiglu --ffn-hidden-size 48 "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear"
).split()


def tree(root) -> dict[str, str]:
    """{path: sha256 (or 'dir')} of everything under `root`: what a refusal must leave as it was."""
    out = {}
    for d, dirs, names in os.walk(root):
        out.update({os.path.join(d, n): "dir" for n in dirs})
        out.update(
            {os.path.join(d, n): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest() for n in names}
        )
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Our root at iteration 7 (ours), its megatron-core export (mlm), its HF export (hf), the HF
    import (imported: our root at iteration 0), and a file: the converter's own outputs."""
    base = tmp_path_factory.mktemp("conv")
    cfg = validate(parse_args(FLAGS), 1)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, 128).named_parameters()}
    moments = {n: {k: torch.rand(w.shape, generator=gen) for k in mcore.MOMENTS} for n, w in weights.items()}
    p = {k: str(base / k) for k in ("ours", "mlm", "hf", "imported")} | {"file": str(base / "file.pt")}
    save_full_dcp(p["ours"], cfg, weights, moments, 7.0, 7, 28)
    assert tool.main(["--load", p["ours"], "--to", "megatron", "--save", p["mlm"]]) == 0
    assert tool.main(["--load", p["ours"], "--to", "hf", "--output", p["hf"]]) == 0
    assert tool.main(["--from", "hf", "--load", p["hf"], "--to", "sharded", "--output", p["imported"]]) == 0
    assert tool.main(["--load", p["ours"], "--to", "consolidated", "--output", p["file"]]) == 0
    os.makedirs(base / "mixed")
    open(base / "mixed" / mcore.TRACKER, "w").write("3")  # a megatron-core root's tracker
    p["mixed"], p["base"] = str(base / "mixed"), str(base)
    return p


REFUSED = [  # (argv with {names} of `made`, what the one error line says)
    ("--from megatron --load {mlm} --to sharded --save {mlm}", "--output {mlm} is --load itself"),
    ("--from megatron --load {mlm}/iter_0000007 --to sharded --save {mlm}", "--output {mlm} holds --load"),
    ("--from megatron --load {mlm} --to sharded --save {ours}", "--output {ours} already holds iter_0000007: the"),
    ("--from megatron --load {mlm} --to sharded --save {mixed}", "holds a megatron-core torch_dist checkpoint: the"),
    ("--from hf --load {hf} --to sharded --save {ours}", "its latest names iteration 7, newer than the 0 this"),
    ("--from megatron --load {mlm} --to sharded --save {hf}", "--output {hf} holds a HF (config.json + safetensors)"),
    ("--load {ours} --to megatron --save {ours}/iter_0000007", "is an iteration directory of a megatron_zpp"),
    ("--load {ours} --to megatron --save {imported}", "holds a megatron_zpp checkpoint: the converter never mixes"),
    ("--load {ours} --to megatron --save {mlm}", "--output {mlm} already holds iter_0000007"),
    ("--load {ours} --to consolidated --output {file}", "is an existing file: the converter never overwrites"),
    ("--load {ours} --to consolidated --output {ours}/iter_0000007/x.pt", "lies inside {ours}/iter_0000007, which"),
    ("--load {ours} --to hf --output {hf}", "--output {hf} is not empty: the converter never overwrites"),
    ("--load {ours} --to hf --output {base}", "--output {base} holds --load {ours}"),
]


def test_refusals_are_one_line_and_touch_nothing(made, capsys):
    before = tree(made["base"])
    failures = []
    for argv, why in REFUSED:
        args, why = argv.format(**made).split(), why.format(**made)
        code = tool.main(args)
        err = capsys.readouterr().err.strip().splitlines()
        if code != 2 or len(err) != 1 or why not in err[0] or "Traceback" in err[0]:
            failures.append(f"{' '.join(args)}: rc {code}, {err}, wanted {why!r}")
    assert not failures, "\n".join(failures)
    assert tree(made["base"]) == before


def test_adds_a_newer_iteration_to_a_root_of_its_format(made, tmp_path, capsys):
    """Into a root that lacks the iteration and whose latest is older: the iteration joins it, latest
    moves on, the old iteration stays; nothing .tmp is left. An empty directory takes a HF export."""
    root = tmp_path / "root"
    assert tool.main(["--from", "hf", "--load", made["hf"], "--to", "sharded", "--output", str(root)]) == 0
    old = tree(root / "iter_0000000")
    assert tool.main(["--from", "megatron", "--load", made["mlm"], "--to", "sharded", "--output", str(root)]) == 0
    assert "wrote " + str(root / "iter_0000007") in capsys.readouterr().out
    assert sorted(os.listdir(root)) == ["iter_0000000", "iter_0000007", "latest"]
    assert open(root / "latest").read() == "iter_0000007\n" and tree(root / "iter_0000000") == old
    got, _, step, meta = mcore.our_full_state(str(root))
    want, _, _, _ = mcore.our_full_state(made["ours"])
    assert meta["iteration"] == 7 and step == 7.0 and all(torch.equal(got[k], want[k]) for k in want)
    os.makedirs(tmp_path / "empty")
    assert tool.main(["--load", made["ours"], "--to", "hf", "--output", str(tmp_path / "empty")]) == 0
    assert sorted(os.listdir(tmp_path)) == ["empty", "root"]
    assert (os.stat(tmp_path / "empty").st_mode & 0o777) == 0o777 & ~_umask()  # not mkdtemp's 0700


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_failed_or_interrupted_conversion_leaves_nothing(made, tmp_path, monkeypatch, capsys):
    """The writer stops half-way (a full disk: one line naming it, rc 2; Ctrl-C: the interrupt goes on):
    a new output does not appear, an existing root is as it was, no .tmp is left."""

    def half_then(exc):
        def write(load, save, with_optimizer=True):
            os.makedirs(os.path.join(save, "iter_0000007"))
            open(os.path.join(save, "iter_0000007", "half"), "wb").write(b"x" * 100)
            raise exc

        return write

    root = tmp_path / "root"
    assert tool.main(["--from", "hf", "--load", made["hf"], "--to", "sharded", "--output", str(root)]) == 0
    before = tree(tmp_path)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root / "x"))
    for out in (root, tmp_path / "new"):
        monkeypatch.setattr(mcore, "import_checkpoint", half_then(full))
        argv = ["--from", "megatron", "--load", made["mlm"], "--to", "sharded", "--output", str(out)]
        assert tool.main(argv) == 2
        assert capsys.readouterr().err.strip() == f"error: no space left on device writing {root / 'x'}"
        monkeypatch.setattr(mcore, "import_checkpoint", half_then(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            tool.main(argv)
        assert tree(tmp_path) == before
    monkeypatch.setattr(tool, "export_hf", lambda *a: half_then(KeyboardInterrupt())(None, a[2]))
    with pytest.raises(KeyboardInterrupt):
        tool.main(["--load", made["ours"], "--to", "hf", "--output", str(tmp_path / "hf")])
    assert tree(tmp_path) == before
