"""The files of a HF model directory, read for import (tools/convert_checkpoint.py --from hf) by
their content, never trusted by name:

- config.json must parse as a JSON object;
- model.safetensors, or the files model.safetensors.index.json's weight_map names: plain file names
  inside the directory (no `../`, no absolute path), each tensor in exactly the file the index says;
- every file's header is read first (safetensors checks that the data covers it: a truncated file
  is refused before any tensor is read), so the names, shapes and dtypes are checked against the
  model the config describes (check_tensors) before any data is;
- every tensor read is finite.

Each fault is an HFImportError: one line naming the file (and tensor) and what is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from ...progress import progress
from .base import ConversionError

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the dtypes a weight may have
# config.json's torch_dtype / dtype -> the safetensors dtype every tensor must have
CONFIG_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}
# buffers older HF checkpoints saved beside the weights (a causal mask, RoPE's frequencies): not weights
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


HFImportError = ConversionError  # a fault of the files: one conversion error, as every refusal


@dataclass(frozen=True)
class TensorEntry:
    file: str  # the file name inside the directory
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...
    stored: str = ""  # the name in the file when the format reads it under another (hf.py: `their_entries`)


def _read_json(hf_dir: str, name: str):
    """The JSON file `name` of `hf_dir` (messages name the file; the caller names the directory)."""
    try:
        with open(os.path.join(hf_dir, name), "rb") as f:
            data = f.read()
    except OSError as e:
        raise HFImportError(f"{name}: cannot read ({e.strerror or e})") from None
    try:
        return json.loads(data)
    except UnicodeDecodeError as e:
        raise HFImportError(f"{name}: not UTF-8 JSON ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        why = "ends early (truncated?)" if e.pos >= len(data.rstrip()) else e.msg
        raise HFImportError(f"{name}: not valid JSON: {why} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise HFImportError(f"{name}: not valid JSON: nested too deeply") from None


def read_config(hf_dir: str) -> dict:
    """config.json of `hf_dir` as a dict."""
    if not os.path.isfile(os.path.join(hf_dir, CONFIG)):
        raise HFImportError(f"no {CONFIG} (give the directory save_pretrained wrote)")
    config = _read_json(hf_dir, CONFIG)
    if not isinstance(config, dict):
        raise HFImportError(f"{CONFIG}: expected a JSON object (read {type(config).__name__})")
    return config


def _plain_name(name) -> bool:
    """A file name that stays inside the directory: no separator, no `..`, not absolute."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and not any(c in name for c in "/\\\x00")
    )


def weight_map(hf_dir: str) -> dict[str, str] | None:
    """{tensor: file} of the index, None without an index (one model.safetensors)."""
    if not os.path.exists(os.path.join(hf_dir, INDEX)):
        return None
    index = _read_json(hf_dir, INDEX)
    mapping = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(mapping, dict) or not mapping:
        raise HFImportError(f"{INDEX}: has no weight_map object of tensor -> file")
    for tensor, file in mapping.items():
        if not _plain_name(file) or not file.endswith(".safetensors"):
            raise HFImportError(
                f"{INDEX}: weight_map[{tensor!r}] = {file!r} is not the name of a .safetensors file in the directory"
            )
        if not os.path.isfile(os.path.join(hf_dir, file)):
            raise HFImportError(f"{INDEX}: weight_map[{tensor!r}] names {file}, which is missing")
    return mapping


def _weight_files(hf_dir: str, mapping: dict[str, str] | None) -> list[str]:
    if mapping is not None:
        return sorted(set(mapping.values()))
    if os.path.isfile(os.path.join(hf_dir, SINGLE)):
        return [SINGLE]
    pickled = [
        n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.exists(os.path.join(hf_dir, n))
    ]
    hint = f" ({pickled[0]} is a pickle: re-save it with save_pretrained(safe_serialization=True))" if pickled else ""
    raise HFImportError(f"no {SINGLE} and no {INDEX}{hint}")


def read_headers(hf_dir: str) -> dict[str, TensorEntry]:
    """{tensor: where it is, its shape and dtype} from the headers of the directory's safetensors
    files (no tensor data read), checked against the index when there is one."""
    mapping = weight_map(hf_dir)
    entries: dict[str, TensorEntry] = {}
    for file in _weight_files(hf_dir, mapping):
        for name, shape, dtype in _header(hf_dir, file):
            if name in entries:
                raise HFImportError(f"tensor {name} is in both {entries[name].file} and {file}")
            if mapping is not None and mapping.get(name) != file:
                raise HFImportError(f"{file}: holds {name}, which {INDEX} puts in {mapping.get(name)}")
            entries[name] = TensorEntry(file, shape, dtype)
    if mapping is not None and (absent := sorted(set(mapping) - set(entries))):
        raise HFImportError(f"{INDEX} puts {absent[0]} in {mapping[absent[0]]}, which does not hold it")
    return entries


def _header(hf_dir: str, file: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each tensor in the header of `file` (safetensors checks the data covers it)."""
    try:
        with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
            slices = [(n, f.get_slice(n)) for n in f.keys()]
            return [(n, tuple(s.get_shape()), s.get_dtype()) for n, s in slices]
    except (SafetensorError, OSError) as e:
        raise HFImportError(f"{file}: not a readable safetensors file ({' '.join(str(e).split())})") from None


def check_tensors(entries: dict[str, TensorEntry], expected: dict[str, tuple[int, ...]], config: dict) -> None:
    """Every expected tensor present with its shape, none unused (beyond HF's old buffers), each of
    config.json's dtype when it names one (else any float dtype)."""
    want_dtype = CONFIG_DTYPES.get(config.get("torch_dtype") or config.get("dtype") or "")
    missing = [n for n in expected if n not in entries]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise HFImportError(
            f"tensor {missing[0]}{more} is missing: the files do not hold the model config.json describes"
        )
    unused = [n for n in entries if n not in expected and not n.endswith(BUFFER_SUFFIXES)]
    if unused:
        raise HFImportError(
            f"{entries[unused[0]].file}: tensor {unused[0]} is not part of the model config.json describes"
            + (f" ({len(unused) - 1} more)" if len(unused) > 1 else "")
        )
    for name, shape in expected.items():
        e = entries[name]
        if e.shape != tuple(shape):
            flipped = " (transposed?)" if e.shape == tuple(shape)[::-1] else ""
            raise HFImportError(
                f"{e.file}: tensor {name} has shape {list(e.shape)}, config.json implies {list(shape)}{flipped}"
            )
        if e.dtype not in FLOAT_DTYPES or (want_dtype and e.dtype != want_dtype):
            need = want_dtype or "a float dtype"
            raise HFImportError(f"{e.file}: tensor {name} is {e.dtype}, config.json implies {need}")


def read_tensors(hf_dir: str, entries: dict[str, TensorEntry], names) -> dict[str, torch.Tensor]:
    """The tensors `names` (checked by check_tensors), each refused unless finite."""
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(entries[n].file, []).append(n)
    out: dict[str, torch.Tensor] = {}
    for file, tensors in progress(by_file.items(), "reading HF files", unit=" files"):
        try:
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for n in tensors:
                    out[n] = f.get_tensor(entries[n].stored or n)
                    if not torch.isfinite(out[n]).all():
                        bad = int((~torch.isfinite(out[n])).sum())
                        raise HFImportError(f"{file}: tensor {n} holds {bad} non-finite values (NaN or inf)")
        except (SafetensorError, OSError) as e:
            raise HFImportError(f"{file}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    return out
