"""Tokenize a jsonl corpus, plain-text files (or an HF dataset) into Megatron's `.bin/.idx` pairs, streaming.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --json-keys text --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --append-eod --workers 4
    python tools/preprocess_data.py --input 'docs/*.txt' --output-prefix data/docs --tokenizer-model tok.model

Writes `{output_prefix}_{key}_document.bin/.idx` per json key. Memory stays bounded whatever the
corpus size: lines travel to the workers in batches with a fixed number in flight, tokens go
straight to the `.bin`, lengths to a side file. Outputs are written under temporary names and
renamed only when the whole corpus succeeded, so an interrupted or failed run leaves no pair.
Bad input stops the run with `file:line: reason` unless --skip-bad-lines, which counts it.
A plain-text input (a file not named .jsonl/.json/.ndjson whose first line is not a JSON object:
the rule tools/train_tokenizer.py reads by, megatron_zpp/data/compressed.py) is one document,
under the first --json-keys name (`text`: `_text_document`), UTF-8 with undecodable bytes
replaced; it is read whole, so its size is the memory bound there.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from megatron_zpp.config import TOKENIZER_TYPES, ConfigError
from megatron_zpp.data.compressed import (
    CompressedInputError,
    is_json_lines,
    open_input,
    strip_compression_suffix,
    text_lines,
)
from megatron_zpp.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from megatron_zpp.data.inputs import checked_tokenizer
from megatron_zpp.data.tokenizer import build_tokenizer, infer_tokenizer_type
from megatron_zpp.progress import progress

BATCH_LINES, BATCH_BYTES = 1024, 1 << 20  # one task to a worker
IN_FLIGHT_PER_WORKER = 4  # batches queued or being tokenized per worker: the memory bound


# ---------------------------------------------------------------- reading
def expand_inputs(patterns: list[str]) -> list[str]:
    paths = []
    for p in patterns:
        hits = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
        for h in hits:
            if os.path.isdir(h):
                raise SystemExit(f"error: --input {h}: is a directory (give its files, e.g. {h}/*.jsonl)")
            if not os.path.isfile(h):
                raise SystemExit(f"error: --input {h}: no such file")
            if not os.access(h, os.R_OK):
                raise SystemExit(f"error: --input {h}: not readable (permission denied)")
        if not hits:
            raise SystemExit(f"error: --input {p}: no file matches")
        paths += hits
    return paths


def open_hf_dataset(sources: list[str], split: str = "train"):
    """Yield (row number, row dict) from a `save_to_disk` directory or local data files
    (json/jsonl/csv/parquet/txt), streaming so that nothing is loaded whole."""
    import datasets

    if len(sources) == 1 and os.path.isdir(sources[0]):
        ds = datasets.load_from_disk(sources[0])
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise SystemExit(f"error: {sources[0]}: no split {split!r} (has {list(ds)})")
            ds = ds[split]
    else:
        ext = os.path.splitext(strip_compression_suffix(sources[0]))[1].lstrip(".").lower()  # datasets decompresses
        builder = {"jsonl": "json", "ndjson": "json", "txt": "text", "parquet": "parquet", "csv": "csv"}.get(ext, ext)
        ds = datasets.load_dataset(builder, data_files=sources, split=split, streaming=True)
    return enumerate(ds, start=1)


def read_batches(args):
    """Yield (source, first line number, items, bytes read); items are raw jsonl lines or HF row dicts."""
    if args.hf_dataset:
        name = ",".join(args.input)
        rows = ({k: r[k] for k in args.json_keys if k in r} for _, r in open_hf_dataset(args.input, args.hf_split))
        for i, chunk in enumerate(iter(lambda: list(itertools.islice(rows, BATCH_LINES)), [])):
            yield name, i * BATCH_LINES + 1, chunk, len(chunk)
        return
    for path in args.input:
        if not is_json_lines(path):  # plain text, read as train_tokenizer.py reads it: the file is one document
            yield path, 1, [{args.json_keys[0]: "".join(text_lines(path))}], os.path.getsize(path)
            continue
        with open_input(path) as f:  # plain or compressed (gzip, zstd, bz2, xz)
            first, lines, size, done = 1, [], 0, 0  # done: bytes of the file on disk already counted
            for line in f:
                lines.append(line)
                size += len(line)
                if len(lines) >= BATCH_LINES or size >= BATCH_BYTES:
                    yield path, first, lines, f.position - done
                    first, lines, size, done = first + len(lines), [], 0, f.position
            if lines:
                yield path, first, lines, os.path.getsize(path) - done


_MISSING = object()


# ---------------------------------------------------------------- tokenizing (in workers)
@dataclass
class Encoded:
    source: str
    num_bytes: int
    tokens: dict = field(default_factory=dict)  # key -> 1-D token array of all kept documents
    lengths: dict = field(default_factory=dict)  # key -> int32 array, one length per kept document
    empty: dict = field(default_factory=dict)  # key -> documents with no tokens (dropped)
    docs: int = 0
    blank: int = 0
    errors: list = field(default_factory=list)  # (line number, reason)


_W = {}  # per-process state set by init_worker


def init_worker(tok_args: tuple, json_keys: list[str], append_eod: bool, dtype) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    tok = build_tokenizer(*tok_args)
    _W.update(tok=tok, keys=json_keys, eod=tok.eod if append_eod else None, dtype=np.dtype(dtype))


def parse_item(item, keys: list[str]):
    """Return (texts per key, None) or (None, reason). `item` is a raw jsonl line or an HF row."""
    if isinstance(item, bytes):
        try:
            line = item.decode("utf-8").rstrip("\r\n")  # so JSON errors point at a column of this line
        except UnicodeDecodeError as e:
            return None, f"invalid UTF-8 at byte {e.start} of the line ({item[e.start : e.start + 4]!r})"
        if not line.strip():
            return None, None  # blank line: counted, not an error
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            return None, f"invalid JSON: {e.msg} (column {e.colno})"
        if not isinstance(item, dict):
            return None, f"not a JSON object (got {type(item).__name__})"
    texts = []
    for k in keys:
        v = item.get(k, _MISSING)
        if v is _MISSING:
            return None, f"missing key {k!r} (has {', '.join(map(repr, list(item)[:8])) or 'no keys'})"
        if not isinstance(v, str):
            return None, f"key {k!r} is {type(v).__name__}, not a string"
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            return None, f"key {k!r} holds a lone surrogate {v[e.start]!r} at character {e.start} (not valid Unicode)"
        texts.append(v)
    return texts, None


PIECE_CHARS = 1 << 20  # a document longer than this is tokenized in pieces of about this size (the memory bound)
_BOUNDARY = re.compile(r"(?<=\S) (?=\S)")  # one space between two non-spaces: where a long document is cut
_PROBE = "Ab cd  ef\n gh\tij. 12 345 kl, mn\n\nop qr  st uv wx y z" * 8


def _cut(text: str, drop_space: bool, size: int):
    """`text` in pieces of about `size` characters, cut at single spaces between two words (the space
    dropped with `drop_space`: a tokenizer that adds a dummy prefix puts it back, as sentencepiece does)."""
    start = 0
    while len(text) - start > size:
        m = _BOUNDARY.search(text, start + size)
        if m is None:  # no cut point left: the rest is one piece
            break
        yield text[start : m.start()]
        start = m.start() + drop_space
    yield text[start:]


def piece_rule(tok) -> bool | None:
    """How this tokenizer can take a document in pieces and give the tokens of the whole: drop the space at
    each cut (True: sentencepiece, whose dummy prefix stands for it), keep it (False: byte-level BPE), or
    neither (None: long documents are tokenized whole). Decided on a probe text cut every few words."""
    whole = tok.tokenize(_PROBE)
    for drop in (True, False):
        if [i for piece in _cut(_PROBE, drop, 7) for i in tok.tokenize(piece)] == whole:
            return drop
    return None


def tokenize_long(tok, text: str, dtype) -> np.ndarray:
    """The tokens of a long document, in pieces of about PIECE_CHARS cut at whitespace, each turned into
    an array at once: its memory is that of one piece, not the 40-odd bytes per character that
    sentencepiece and a Python list of ids take for the whole (a 45 MB line took 2.2 GB)."""
    if "piece_rule" not in _W:
        _W["piece_rule"] = piece_rule(tok)
    if _W["piece_rule"] is None:
        return np.asarray(tok.tokenize(text), dtype)
    parts = [np.asarray(tok.tokenize(piece), dtype) for piece in _cut(text, _W["piece_rule"], PIECE_CHARS)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _tokenize_key(tok, texts: list[str], eod, dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens of the documents that have any, their lengths, how many had none)."""
    if all(len(t) <= PIECE_CHARS for t in texts):
        ids = tok.tokenize_batch(texts) if hasattr(tok, "tokenize_batch") else [tok.tokenize(t) for t in texts]
        ids = [d for d in ids if d]
        if eod is not None:
            for d in ids:
                d.append(eod)
        lengths = np.fromiter(map(len, ids), np.int32, len(ids))
        return (
            np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum())),
            lengths,
            len(texts) - len(ids),
        )
    docs = [tokenize_long(tok, t, dtype) if len(t) > PIECE_CHARS else np.asarray(tok.tokenize(t), dtype) for t in texts]
    docs = [d for d in docs if d.size]
    tail = [np.array([eod], dtype)] if eod is not None else []
    parts = [x for d in docs for x in (d, *tail)]
    lengths = np.fromiter((d.size + len(tail) for d in docs), np.int32, len(docs))
    return (np.concatenate(parts) if parts else np.zeros(0, dtype)), lengths, len(texts) - len(docs)


def encode_batch(task) -> Encoded:
    source, first, items, num_bytes = task
    tok, keys, eod, dtype = _W["tok"], _W["keys"], _W["eod"], _W["dtype"]
    out = Encoded(source, num_bytes)
    per_key = [[] for _ in keys]
    for n, item in enumerate(items):
        texts, reason = parse_item(item, keys)
        if texts is None:
            if reason is None:
                out.blank += 1
            else:
                out.errors.append((first + n, reason))
            continue
        out.docs += 1
        for bucket, text in zip(per_key, texts):
            bucket.append(text)
    for key, texts in zip(keys, per_key):
        out.tokens[key], out.lengths[key], out.empty[key] = _tokenize_key(tok, texts, eod, dtype)
    return out


# ---------------------------------------------------------------- the run
def output_prefix(args, key: str) -> str:
    return f"{args.output_prefix}_{key}_document"


def encoded_stream(args, tok_args, dtype, stop: threading.Event):
    """Encoded batches in input order; with workers > 1 a Pool with a bounded number in flight."""
    if args.workers <= 1:
        init_worker(tok_args, args.json_keys, args.append_eod, dtype)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        yield from map(encode_batch, read_batches(args))
        return
    slots = threading.Semaphore(args.workers * IN_FLIGHT_PER_WORKER)

    def tasks():  # runs in the pool's feeder thread; blocks while enough batches are in flight
        for batch in read_batches(args):
            while not slots.acquire(timeout=0.1):
                if stop.is_set():
                    return
            if stop.is_set():
                return
            yield batch

    # spawn, not fork: forking a process that already runs threads (tqdm, the feeder, a
    # host that imported torch) can deadlock the children on a lock copied mid-use
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(args.workers, init_worker, (tok_args, args.json_keys, args.append_eod, dtype))
    try:
        for enc in pool.imap(encode_batch, tasks()):
            slots.release()
            yield enc
        pool.close()
    finally:
        stop.set()
        pool.terminate()
        pool.join()


OUTPUTS = (".bin", ".idx", ".lengths")  # what a run writes per key (the lengths side file: until the .idx is done)


def cannot_write(e: OSError, tag: str) -> SystemExit:
    """The one line for an output that cannot be written (the caller removes the partial outputs)."""
    path = str(e.filename or "the output").replace(tag, "")
    return SystemExit(
        f"error: cannot write {path}: {e.strerror or e}; nothing written (the partial outputs were removed): "
        "free space or give another --output-prefix"
    )


def run(args) -> int:
    plain = [] if args.hf_dataset else [path for path in args.input if not is_json_lines(path)]
    if plain and len(args.json_keys) > 1:
        keys = " ".join(args.json_keys)
        raise ConfigError(f"--json-keys {keys}: {plain[0]} is plain text, which has one field: give one key")
    if args.tokenizer_type is None:  # the rule training uses (validation.derive)
        args.tokenizer_type, why = infer_tokenizer_type(args.tokenizer_model, args.vocab_file, args.merge_file)
        if not args.quiet:
            print(f"--tokenizer-type {args.tokenizer_type} (inferred: {why})", file=sys.stderr)
    tok_args = (args.tokenizer_type, args.tokenizer_model, args.vocab_size, 1, 1, args.vocab_file, args.merge_file)
    files = {"vocab_file": args.vocab_file, "merge_file": args.merge_file}  # GPT2BPETokenizer's
    tok = checked_tokenizer(*tok_args[:5], **files)  # a missing or wrong tokenizer model: one line, before any output
    dtype = token_dtype(tok.vocab_size)
    tag = f".tmp{os.getpid()}"
    ours = {os.path.abspath(output_prefix(args, k) + e + t) for k in args.json_keys for e in OUTPUTS for t in ("", tag)}
    writers = _open_writers(args, dtype, tag)
    total = None if args.hf_dataset else sum(os.path.getsize(p) for p in args.input)
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the worker pool forks after the bar exists
    unit = "B" if total is not None else " docs"
    bar = progress(None, "tokenizing", total, unit, unit_scale=True, disable=args.quiet)  # bytes of the input files
    t0, ok = time.time(), False
    try:
        docs, blank, empty, bad = _tokenize_into(writers, args, tok_args, dtype, bar)
        bar.close()
        _refuse_empty(args, docs, blank, bad)
        _commit(writers, args, tag)
        ok = True
    except OSError as e:  # a full disk, a read-only file system, a quota: one line; the partial outputs go
        if e.filename is None or os.path.abspath(str(e.filename)) not in ours:
            raise  # not a write of ours
        raise cannot_write(e, tag) from None
    finally:
        bar.close()
        if not ok:
            for k, w in writers.items():
                w.abort()
                if os.path.exists(output_prefix(args, k) + ".idx" + tag):
                    os.remove(output_prefix(args, k) + ".idx" + tag)
    print_summary(args, writers, docs, blank, empty, bad, time.time() - t0)
    return 0


def _open_writers(args, dtype, tag: str) -> dict:
    """One .bin writer per --json-keys key, under the temporary `tag` (a failure: one line, nothing left)."""
    writers = {}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        for k in args.json_keys:
            prefix = output_prefix(args, k)
            writers[k] = IndexedDatasetWriter(prefix + ".bin" + tag, dtype, prefix + ".lengths" + tag)
    except OSError as e:
        for w in writers.values():
            w.abort()
        raise cannot_write(e, tag) from None
    return writers


def _tokenize_into(writers: dict, args, tok_args, dtype, bar) -> tuple[int, int, dict, list]:
    """Stream the encoded batches into the writers; (documents, blank lines, empty documents per key, bad lines)."""
    docs = blank = 0
    empty = dict.fromkeys(args.json_keys, 0)
    bad: list = []
    t0, last_post, stop = time.time(), 0.0, threading.Event()
    for enc in encoded_stream(args, tok_args, dtype, stop):
        if enc.errors and not args.skip_bad_lines:
            line, reason = enc.errors[0]
            raise SystemExit(
                f"error: {enc.source}:{line}: {reason}\n"
                "  (fix the input, or pass --skip-bad-lines to skip and count such lines)"
            )
        bad += [(enc.source, ln, r) for ln, r in enc.errors]
        docs, blank = docs + enc.docs, blank + enc.blank
        for k, w in writers.items():
            w.add_batch(enc.tokens[k], enc.lengths[k])
            empty[k] += enc.empty[k]
        bar.update(enc.num_bytes)
        now = time.time()
        if now - last_post > 0.5:
            dt = max(now - t0, 1e-9)
            ntok = sum(w.num_tokens for w in writers.values())
            bar.set_postfix_str(f"{docs / dt:,.0f} docs/s, {ntok / dt:,.0f} tokens/s", refresh=False)
            last_post = now
    return docs, blank, empty, bad


def _refuse_empty(args, docs: int, blank: int, bad: list) -> None:
    """An empty input, or only blank or skipped lines: nothing to write, and no empty pair."""
    if docs:
        return
    what = f"{len(bad):,} bad line(s) skipped (--skip-bad-lines)" if bad else f"{blank:,} blank line(s)"
    what = what if bad or blank else "it is empty"
    raise SystemExit(
        f"error: --input {', '.join(args.input)}: holds no documents ({what}); nothing written "
        f"(give the corpus: one JSON object per line, or plain-text files)"
    )


def _commit(writers: dict, args, tag: str) -> None:
    """Write the indexes and rename into place: any old index goes first, so a crash between renames leaves a
    lone .bin (never a stale .idx beside a new .bin)."""
    for k, w in writers.items():
        w.finalize(output_prefix(args, k) + ".idx" + tag)
    for k in args.json_keys:
        final = output_prefix(args, k)
        if os.path.exists(final + ".idx"):
            os.remove(final + ".idx")
        os.replace(final + ".bin" + tag, final + ".bin")
        os.replace(final + ".idx" + tag, final + ".idx")


def print_summary(args, writers, docs, blank, empty, bad, elapsed):
    ntok = sum(w.num_tokens for w in writers.values())
    dt = max(elapsed, 1e-9)
    lines = [
        f"done: {docs:,} documents, {ntok:,} tokens in {elapsed:.1f}s "
        f"({docs / dt:,.0f} docs/s, {ntok / dt:,.0f} tokens/s, {args.workers} worker(s))"
    ]
    for k in args.json_keys:
        if empty[k]:
            lines.append(f"  {empty[k]:,} empty '{k}' documents (no tokens) were dropped, not written")
    if blank:
        lines.append(f"  {blank:,} blank lines were ignored")
    if bad:
        lines.append(f"  {len(bad):,} bad lines skipped (--skip-bad-lines); first ones:")
        lines += [f"    {s}:{ln}: {r}" for s, ln, r in bad[:5]]
    for k, w in writers.items():
        final = output_prefix(args, k)
        lines.append(
            f"  wrote {final}.bin ({os.path.getsize(final + '.bin'):,} bytes, {w.dtype.name}) "
            f"and {final}.idx ({w.num_sequences:,} documents)"
        )
    print("\n".join(lines), file=sys.stderr)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="jsonl files (globs allowed), one document per line, or plain-text files, one document each "
        "(as tools/train_tokenizer.py reads them); with --hf-dataset a saved dataset directory or local data files",
    )
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize, one output pair each")
    p.add_argument(
        "--tokenizer-type",
        default=None,
        choices=TOKENIZER_TYPES,
        help="default: inferred as pretrain_gpt.py does (--vocab-file and --merge-file: GPT2BPETokenizer; "
        "a --tokenizer-model .model file: SentencePieceTokenizer, a directory: HuggingFaceTokenizer)",
    )
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece model file, or HF tokenizer directory")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip (and count) lines with invalid JSON/UTF-8, a missing key or non-string text",
    )
    p.add_argument("--hf-dataset", action="store_true", help="read --input with HF `datasets` (local only)")
    p.add_argument("--hf-split", default="train")
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none either when stderr is not a terminal)"
    )
    args = p.parse_args(argv)
    if not args.hf_dataset:
        args.input = expand_inputs(args.input)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM (a scheduler killing the job) unwinds like Ctrl-C so the temporary files go away.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr)
        return 130
    except (CompressedInputError, ConfigError) as e:  # an input that cannot be read; no output written
        print(f"error: {e}", file=sys.stderr)
        return 1
