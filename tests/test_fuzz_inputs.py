"""Every reader of a user's input, fed mutated copies of a good input (truncated at several offsets,
bytes flipped, wrong dtypes and shapes, NaN, path traversal; one fixed seed): each mutation is
either refused with the project's own error type, one line per problem, or accepted with a
result an independent reader of the same bytes agrees with. Never another exception, never a
wrong result taken silently.

The oracles are written here, apart from the readers: a struct/numpy parser of `.idx`/`.bin`
(consistent offsets, every id inside the vocabulary), a numpy parser of safetensors (the imported
weights, exported back, equal the mutated file's tensors bitwise), yaml.safe_load, Python's own
int()/float(), and the regular expression of an iteration directory name."""

import dataclasses
import functools
import json
import os
import re
import shutil
import struct
import types
import typing

import numpy as np
import pytest
import torch
import yaml

from megatron_zpp.checkpoint.files import CheckpointError, read_meta
from megatron_zpp.config import SECTIONS, ConfigError, arguments
from megatron_zpp.config.arguments import load_yaml, parse_args, parse_config
from megatron_zpp.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron_zpp.data.inputs import check_data_path
from megatron_zpp.model import GPT
from megatron_zpp.validation import validate
from tools import convert_checkpoint as conv

RNG = np.random.default_rng(1234)
VOCAB = 300
TINY = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 2 --mock-data".split()


def truncations(data: bytes, count: int = 6) -> list[bytes]:
    """`data` cut at 0, 1, the middle, one byte short and at random offsets."""
    cuts = {0, 1, len(data) // 2, len(data) - 1, *RNG.integers(2, len(data) - 1, count).tolist()}
    return [data[:c] for c in sorted(cuts) if c < len(data)]


def flips(data: bytes, count: int = 8, lo: int = 0, hi: int | None = None) -> list[bytes]:
    """`data` with one byte in [lo, hi) replaced by another value, `count` times."""
    out = []
    for pos in RNG.integers(lo, hi or len(data), count).tolist():
        b = bytearray(data)
        b[pos] = (b[pos] + int(RNG.integers(1, 256))) % 256
        out.append(bytes(b))
    return out


def write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def one_line_each(text: str) -> None:
    assert text and all(line.strip() for line in text.splitlines()), repr(text)
    assert "Traceback" not in text


# ---------------------------------------------------------------- .idx/.bin and the token range
def idx_consistent(idx: bytes, bin_size: int) -> np.ndarray | None:
    """The token dtype the .idx names, by an independent parse of it, or None when the .idx is
    inconsistent in itself or with a .bin of `bin_size` bytes."""
    dtypes = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
    if len(idx) < 34 or idx[:9] != b"MMIDIDX\x00\x00" or struct.unpack("<Q", idx[9:17])[0] != 1:
        return None
    code, (n, d) = idx[17], struct.unpack("<QQ", idx[18:34])
    if code not in dtypes or len(idx) != 34 + 4 * n + 8 * n + 8 * d:
        return None
    size = np.dtype(dtypes[code]).itemsize
    lengths = np.frombuffer(idx, np.int32, n, 34).astype(np.int64)
    pointers = np.frombuffer(idx, np.int64, n, 34 + 4 * n)
    docs = np.frombuffer(idx, np.int64, d, 34 + 12 * n)
    expect = np.concatenate([[0], np.cumsum(lengths[:-1] * size)]) if n else np.zeros(0, np.int64)
    if (lengths < 0).any() or not np.array_equal(pointers, expect) or lengths.sum() * size != bin_size:
        return None
    if d < 1 or docs[0] != 0 or docs[-1] != n or (np.diff(docs) < 0).any():
        return None
    return np.dtype(dtypes[code])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    prefix = str(d / "good")
    w = IndexedDatasetWriter(prefix + ".bin", np.uint16)
    for n in (5, 9, 1, 17, 4):
        w.add_document(RNG.integers(0, VOCAB, n).tolist())
    w.finalize(prefix + ".idx")
    return d, open(prefix + ".idx", "rb").read(), open(prefix + ".bin", "rb").read()


def pair_mutations(idx: bytes, bin_: bytes) -> list[tuple[str, bytes, bytes]]:
    cases = [("good", idx, bin_)] + [(f"idx cut {len(i)}", i, bin_) for i in truncations(idx)]
    cases += [(f"bin cut {len(b)}", idx, b) for b in truncations(bin_)]
    cases += [("idx flip", i, bin_) for i in flips(idx, 12)]
    cases += [("idx header flip", i, bin_) for i in flips(idx, 6, 0, 34)]
    cases += [("bin flip", idx, b) for b in flips(bin_, 10)]
    cases += [(f"dtype code {c}", idx[:17] + bytes([c]) + idx[18:], bin_) for c in (0, 1, 4, 6, 7, 9, 255)]
    big = np.frombuffer(bin_, np.uint16).copy()
    big[3] = VOCAB + 5  # past the vocabulary: the padding rows of a padded embedding
    cases.append(("id past vocab", idx, big.tobytes()))
    cases.append(("empty bin", idx, b""))
    return cases


def test_data_pairs(pair):
    d, idx, bin_ = pair
    accepted = 0
    for i, (what, mi, mb) in enumerate(pair_mutations(idx, bin_)):
        prefix = str(d / f"m{i}")
        write(prefix + ".idx", mi)
        write(prefix + ".bin", mb)
        errors = check_data_path([prefix], VOCAB)
        dtype = idx_consistent(mi, len(mb))
        if errors:
            assert len(errors) == 1, (what, errors)
            one_line_each(errors[0])
            assert errors[0].startswith(f"--data-path {prefix}: "), (what, errors)
            continue
        accepted += 1  # then the independent parse agrees the pair is whole and every id fits
        assert dtype is not None and dtype.kind in "iu", what
        tokens = np.frombuffer(mb, dtype)
        assert len(tokens) and tokens.min() >= 0 and tokens.max() < VOCAB, what
        ds = IndexedDataset(prefix)
        assert np.array_equal(np.concatenate([ds[j] for j in range(len(ds))]), tokens), what
    assert accepted >= 3  # the good pair, and the .bin flips that keep every id in range


# ---------------------------------------------------------------- HF import
NP_OF = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "F16": np.float16}
KINDS = {
    "llama": "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights",
    "gpt2": "--position-embedding-type learned_absolute --add-bias-linear",
    "remote": "--attention-type gla --softmax-attention-every 2 --position-embedding-type rope --disable-bias-linear",
}


def parse_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """An independent reader: 8-byte header length, JSON header, raw little-endian data."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, e in header.items():
        if name != "__metadata__":
            start, end = e["data_offsets"]
            raw = data[8 + n + start : 8 + n + end]
            out[name] = np.frombuffer(raw, NP_OF[e["dtype"]]).reshape(e["shape"])
    return out


def save_st(tensors: dict, path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{kind: (directory, its tensors, the config)}: a tiny model of each kind exported by export_hf."""
    base, out = tmp_path_factory.mktemp("hf"), {}
    for kind, flags in KINDS.items():
        argv = f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size {VOCAB} {flags}"
        cfg = validate(parse_args(["--mock-data", *argv.split()]), 1)
        gen = torch.Generator().manual_seed(7)
        state = {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in GPT(cfg.model, 320).named_parameters()}
        conv.export_hf(state, cfg.to_dict(), str(base / kind))
        from safetensors.torch import load_file

        out[kind] = (str(base / kind), load_file(str(base / kind / "model.safetensors")), cfg)
    return base, out


def tensor_mutations(tensors: dict) -> list[tuple[str, dict]]:
    names = sorted(tensors)
    matrix = next(n for n in names if tensors[n].dim() == 2 and tensors[n].shape[0] != tensors[n].shape[1])
    layer1 = [n for n in names if ".1." in n]
    out = []
    nan = dict(tensors)
    nan[names[3]] = nan[names[3]].clone().view(-1).index_fill(0, torch.tensor([0]), float("nan")).view_as(nan[names[3]])
    out.append(("nan", nan))
    inf = dict(tensors)
    inf[names[-1]] = torch.full_like(inf[names[-1]], float("inf"))
    out.append(("inf", inf))
    out.append(("transposed", {**tensors, matrix: tensors[matrix].t()}))
    out.append(("dropped layer", {n: t for n, t in tensors.items() if n not in layer1}))
    out.append(("dropped tensor", {n: t for n, t in tensors.items() if n != names[0]}))
    out.append(("extra tensor", {**tensors, "model.layers.9.mlp.up_proj.weight": torch.zeros(4, 4)}))
    out.append(("int dtype", {**tensors, names[1]: tensors[names[1]].to(torch.int32)}))
    out.append(("bf16 under float32", {**tensors, names[2]: tensors[names[2]].to(torch.bfloat16)}))
    out.append(("wider", {**tensors, matrix: torch.zeros(tensors[matrix].shape[0], tensors[matrix].shape[1] + 1)}))
    return out


def check_import(hf_dir: str, out_dir: str, kind: str, cfg, what: str) -> bool:
    """Import `hf_dir`: refused with one line, or accepted equal to an independent read of its files."""
    try:
        state, _ = conv.import_hf(hf_dir, out_dir)
    except conv.ConversionError as e:
        one_line_each(str(e))
        assert "\n" not in str(e) and str(e).startswith(f"cannot import {hf_dir}: "), (what, str(e))
        return False
    files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    theirs = {}
    for f in files:
        theirs.update(parse_safetensors(open(os.path.join(hf_dir, f), "rb").read()))
    to_hf = {"remote": conv.hf_gla.to_remote_state, "gpt2": conv.hf_gpt2.to_gpt2_state}.get(kind, conv.to_hf_state)
    back = to_hf(state, cfg)  # the exported model's config: the weights are the same model's
    assert set(back) == set(theirs), what
    for name, t in back.items():
        assert torch.isfinite(t).all(), (what, name)
        assert np.array_equal(t.numpy(), theirs[name].astype(np.float32)), (what, name)
    return True


def test_hf_import(hf_dirs, tmp_path):
    _, dirs = hf_dirs
    accepted = 0
    for kind, (good, tensors, cfg) in dirs.items():
        config = open(os.path.join(good, "config.json"), "rb").read()
        weights = open(os.path.join(good, "model.safetensors"), "rb").read()
        header_end = 8 + struct.unpack("<Q", weights[:8])[0]
        cases = [("good", config, weights)]
        cases += [(f"config cut {len(c)}", c, weights) for c in truncations(config, 3)]
        cases += [("config flip", c, weights) for c in flips(config, 6)]
        cases += [(f"weights cut {len(w)}", config, w) for w in truncations(weights, 3)]
        cases += [("header flip", config, w) for w in flips(weights, 6, 0, header_end)]
        cases += [("data flip", config, w) for w in flips(weights, 3, header_end)]
        for what, tens in tensor_mutations(tensors):
            save_st(tens, tmp_path / "t.safetensors")
            cases.append((what, config, open(tmp_path / "t.safetensors", "rb").read()))
        cases.append(("config list", b"[1, 2]", weights))
        cases.append(("config not utf-8", b'{"model_type": "\xff"}', weights))
        spec = json.loads(config)
        wrong = "num_hidden_layers" if kind != "gpt2" else "n_layer"
        for value in ("2", None, -1, 0, 2.5, True, 10**6, 10**30):
            cases.append((f"{wrong}={value!r}", json.dumps({**spec, wrong: value}).encode(), weights))
        for i, (what, c, w) in enumerate(cases):
            d = tmp_path / f"{kind}{i}"
            os.makedirs(d)
            write(d / "config.json", c)
            write(d / "model.safetensors", w)
            accepted += check_import(str(d), str(tmp_path / f"out_{kind}{i}"), kind, cfg, f"{kind} {what}")
            shutil.rmtree(d)
    assert accepted >= 3  # the good directories at least


def test_hf_index_paths(hf_dirs, tmp_path):
    """A sharded directory: the index's file names must stay inside it and agree with the files."""
    _, dirs = hf_dirs
    good, tensors, cfg = dirs["llama"]
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    outside = tmp_path / "outside"
    os.makedirs(outside)
    save_st({n: tensors[n] for n in names[1::2]}, outside / "model-00002-of-00002.safetensors")
    wmap = {n: f for f, ns in halves.items() for n in ns}
    second = "model-00002-of-00002.safetensors"
    mappings = {
        "good": wmap,
        "traversal": {**wmap, **{n: f"../outside/{second}" for n in halves[second]}},
        "absolute": {**wmap, **{n: str(outside / second) for n in halves[second]}},
        "missing file": {**wmap, names[1]: "model-00003-of-00002.safetensors"},
        "wrong file": {**wmap, names[0]: second},
        "not a mapping": ["a"],
        "empty": {},
    }
    cases = {what: json.dumps({"metadata": {}, "weight_map": m}).encode() for what, m in mappings.items()}
    cases.update({f"index cut {len(c)}": c for c in truncations(cases["good"], 3)})
    accepted = []
    for i, (what, index) in enumerate(cases.items()):
        d = tmp_path / f"sharded{i}"
        os.makedirs(d)
        shutil.copy(os.path.join(good, "config.json"), d / "config.json")
        for f, ns in halves.items():
            save_st({n: tensors[n] for n in ns}, d / f)
        write(d / "model.safetensors.index.json", index)
        if check_import(str(d), str(tmp_path / f"out_s{i}"), "llama", cfg, what):
            accepted.append(what)
    assert accepted == ["good"]


# ---------------------------------------------------------------- latest
@pytest.fixture(scope="module")
def checkpoint(hf_dirs, tmp_path_factory):
    _, dirs = hf_dirs
    out = str(tmp_path_factory.mktemp("ckpt") / "ck")
    conv.import_hf(dirs["llama"][0], out)
    return out


def test_latest(checkpoint):
    good = open(os.path.join(checkpoint, "latest"), "rb").read()
    cases = truncations(good, 3) + flips(good, 10)
    cases += [b"../x", b"/etc", b"iter_0000000/../../x", b"\xff\xfe", b"\n", b"iter_" + b"9" * 5000]
    cases += [b"iter_0000001", b"iter_0000000\n", b"  iter_0000000  \r\n"]
    accepted = 0
    for content in cases:
        write(os.path.join(checkpoint, "latest"), content)
        try:
            path, meta = read_meta(checkpoint)
        except CheckpointError as e:
            one_line_each(str(e))
            continue
        accepted += 1
        name = content.decode().strip()
        assert re.fullmatch(r"iter_[0-9]{7,}", name) and path == os.path.join(checkpoint, name), content
        assert os.path.isdir(path) and meta["iteration"] == int(name[5:]), content
    write(os.path.join(checkpoint, "latest"), good)
    assert accepted == 3  # the good name, with a newline, with spaces round it


def test_meta_json(checkpoint):
    """meta.json mutated, its sha256 beside it mutated or gone (the legacy format): refused in one line,
    or read equal to json.loads of the same bytes."""
    it = os.path.join(checkpoint, "iter_0000000")
    meta_path, digest_path = os.path.join(it, "meta.json"), os.path.join(it, "meta.json.sha256")
    meta, digest = open(meta_path, "rb").read(), open(digest_path, "rb").read()
    cases = [(m, digest) for m in truncations(meta, 4) + flips(meta, 8)]
    cases += [(meta, d) for d in truncations(digest, 2) + flips(digest, 3) + [b"\xff\xfe", b""]]
    cases += [(m, None) for m in truncations(meta, 4) + flips(meta, 16) + [b"[" * 100000, b"null", b"[]"]]
    accepted = 0
    try:
        for m, d in cases:
            write(meta_path, m)
            if d is not None:
                write(digest_path, d)
            elif os.path.exists(digest_path):
                os.remove(digest_path)
            try:
                _, got = read_meta(checkpoint)
            except CheckpointError as e:
                one_line_each(str(e))
                continue
            accepted += 1
            assert {k: v for k, v in got.items() if k in json.loads(m)} == json.loads(m), m
    finally:
        write(meta_path, meta)
        write(digest_path, digest)
    assert read_meta(checkpoint)[1]["iteration"] == 0 and accepted >= 1


# ---------------------------------------------------------------- --config YAML
GOOD_YAML = b"num-layers: 2\nhidden-size: 64\nmodel:\n  seq-length: 128\ntokenizer-type: NullTokenizer\nlr: 0.001\n"


def _by_field(raw: dict) -> dict[str, object]:
    """yaml.safe_load's mapping keyed by 'section.field' (flag or field names, flat or nested)."""
    names = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            for n in (f.name, f.metadata.get("flag", "").lstrip("-").replace("-", "_")):
                names[n] = f"{section}.{f.name}"
    flat = {}
    for k, v in raw.items():
        items = v.items() if k in SECTIONS and isinstance(v, dict) else [(k, v)]
        flat.update({names.get(str(kk).lstrip("-").replace("-", "_")): vv for kk, vv in items})
    return flat


def test_yaml_config(tmp_path):
    cases = truncations(GOOD_YAML, 6) + flips(GOOD_YAML, 25)
    cases += [
        b"1: 5\n",
        b"model:\n  2: 3\n",
        b"num-layers:\n",
        b"0\n",
        b"- a\n",
        b"'text'\n",
        b"num-layers: 2\nnum-layers: 3\n",
    ]
    cases += [
        b"hidden-size: \xe9\n",
        b"\xff\xfe\x00\x00",
        b"[" * 2000,
        b"hidden-size: {a: 1}\n",
        b"data-path: [null]\n",
    ]
    cases += [b"num_layers: 2\nnum-layers: 2\n", b"hidden-size: .nan\n", b"lr: .inf\n", b"hidden-size: 1e400\n"]
    accepted = 0
    for i, content in enumerate(cases):
        path = write(tmp_path / f"c{i}.yaml", content)
        try:
            values = load_yaml(path)
        except ConfigError as e:
            one_line_each(str(e))
            assert all(line.startswith(f"--config {path}") for line in str(e).splitlines()), str(e)
            continue
        accepted += 1  # an independent parse gives each accepted value
        raw = _by_field(yaml.safe_load(content) or {})
        for key, value in values.items():
            assert key in raw and (raw[key] == value or str(raw[key]) == str(value)), (content, key, value)
        try:  # then the run's checks: a ConfigError at most
            parse_config(TINY + ["--config", path], 1)
        except ConfigError as e:
            one_line_each(str(e))
    assert accepted >= 3


# ---------------------------------------------------------------- numeric flags
def numeric_flags() -> list[tuple[str, str, type]]:
    """(flag, 'section.field', int or float) of every numeric flag."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if typing.get_origin(tp) in (typing.Union, types.UnionType):
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            if "flag" in f.metadata and tp in (int, float):
                out.append((f.metadata["flag"], f"{section}.{f.name}", tp))
    return out


VALUES = ["nan", "inf", "-1", "0", "1e400", str(2**64), "1_000", ""]


def test_numeric_flags(monkeypatch):
    """Each numeric flag alone with each value: refused with one line per problem, or holding Python's
    own parse of the text, finite and within 64 bits."""
    monkeypatch.setattr(arguments, "build_parser", functools.cache(arguments.build_parser))  # 15 ms a build
    flags = numeric_flags()
    assert len(flags) > 40
    for flag, dest, kind in flags:
        argv = list(TINY)
        if flag in argv:
            del argv[argv.index(flag) : argv.index(flag) + 2]
        for value in VALUES:
            try:
                cfg = parse_config([*argv, flag, value], 1)
            except ConfigError as e:
                one_line_each(str(e))
                continue
            section, name = dest.split(".")
            got = getattr(getattr(cfg, section), name)
            fits = -(2**63) <= got < 2**63 if kind is int else np.isfinite(got)
            assert got == kind(value) and fits, (flag, value, got)
