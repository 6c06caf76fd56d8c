"""Train a sentencepiece tokenizer (BPE or unigram) from jsonl, plain text or an HF dataset.

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \
        --model-prefix data_cache/tok --vocab-size 32000 --model-type bpe

Writes MODEL_PREFIX.model and MODEL_PREFIX.vocab. Ids 0-3 are <unk>, <s> (bos), </s> (end of
document, what --append-eod appends) and <pad>. Normalization is the identity and whitespace is
kept, so detokenize(tokenize(text)) == text (code and indentation survive); byte fallback means
no character is ever <unk>. Malformed JSON lines are skipped and counted (one warning line: the
count and the first one); an input more than half malformed is refused, nothing written.
The last line gives the vocabulary really written, read back from the model: sentencepiece writes
fewer pieces than --vocab-size when the corpus holds no more (said so), and the size
pretrain_gpt.py pads it to. A file not named .jsonl/.json/.ndjson whose first line is not a JSON
object is plain text (the rule tools/preprocess_data.py reads by).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from megatron_zpp.data.compressed import CompressedInputError, is_json_lines, open_input, text_lines
from megatron_zpp.progress import progress

SPECIAL_IDS = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=3)
CHUNK_CHARS = 2000  # sentencepiece trains on "sentences"; long documents go in line-aligned chunks


def expand_inputs(patterns: list[str]) -> list[str]:
    paths = []
    for p in patterns:
        hits = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
        if not hits:
            raise SystemExit(f"error: --input {p}: no file matches")
        for h in hits:
            if not os.path.isfile(h):
                raise SystemExit(f"error: --input {h}: {'is a directory' if os.path.isdir(h) else 'no such file'}")
        paths += hits
    return paths


class TooManyMalformed(Exception):
    """More than half of the JSON lines are malformed: the wrong file or the wrong --json-keys."""


class LineStats:
    """What iter_texts saw of the JSON lines: how many (blank ones aside), how many were malformed
    (invalid JSON or UTF-8, not an object, or no string under any --json-keys) and the first of those."""

    def __init__(self):
        self.lines, self.malformed, self.first = 0, 0, None

    def bad(self, where: str) -> None:
        self.malformed += 1
        self.first = self.first or where

    def summary(self, json_keys: list[str]) -> str:
        return (
            f"{self.malformed:,} of {self.lines:,} JSON lines are malformed (invalid JSON or UTF-8, not an object, "
            f"or no string under --json-keys {' '.join(json_keys)}), the first at {self.first}"
        )

    def too_many(self) -> bool:
        return self.malformed * 2 > self.lines


def iter_texts(paths: list[str], json_keys: list[str], hf_dataset: bool = False, stats: LineStats | None = None):
    """Yield every text field of every document. Malformed JSON lines are skipped and counted in
    `stats`; when more than half of them are, TooManyMalformed is raised at the end of the input
    (before sentencepiece trains or writes anything)."""
    stats = stats if stats is not None else LineStats()
    if hf_dataset:
        from megatron_zpp.data.preprocess import open_hf_dataset

        for _, row in open_hf_dataset(paths):
            for k in json_keys:
                if isinstance(row.get(k), str):
                    yield row[k]
        return
    for path in paths:
        if not is_json_lines(path):  # plain text: the whole file is one stream of lines
            yield from text_lines(path)
            continue
        with open_input(path) as f:  # plain or compressed (gzip, zstd, bz2, xz)
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                stats.lines += 1
                try:
                    doc = json.loads(line)
                except ValueError:  # invalid JSON or UTF-8
                    doc = None
                texts = [doc[k] for k in json_keys if isinstance(doc, dict) and isinstance(doc.get(k), str)]
                if not texts:
                    stats.bad(f"{path}:{number}")
                yield from texts
    if stats.too_many():
        raise TooManyMalformed(stats.summary(json_keys))


class Counted:
    """An iterable that counts what went through it (to say how much text a failed training saw)."""

    def __init__(self, items):
        self.items, self.count = items, 0

    def __iter__(self):
        for item in self.items:
            self.count += 1
            yield item


def sentences(texts, max_chars: int = CHUNK_CHARS):
    """Line-aligned chunks of at most ~max_chars, newlines kept so the model learns them."""
    for text in texts:
        buf, n = [], 0
        for line in text.splitlines(keepends=True):
            buf.append(line)
            n += len(line)
            if n >= max_chars:
                yield "".join(buf)
                buf, n = [], 0
        if buf and "".join(buf).strip():
            yield "".join(buf)


def train(
    texts,
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    byte_fallback: bool = True,
    character_coverage: float = 0.9995,
    input_sentence_size: int = 2_000_000,
    num_threads: int | None = None,
    user_defined_symbols: list[str] | None = None,
    quiet: bool = True,
) -> str:
    """Train and write MODEL_PREFIX.model/.vocab; returns the .model path."""
    import sentencepiece as spm

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(texts)),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=byte_fallback,
        character_coverage=character_coverage,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=4 * CHUNK_CHARS * 4,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        num_threads=num_threads or os.cpu_count() or 1,
        user_defined_symbols=user_defined_symbols or [],
        hard_vocab_limit=False,
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        pad_piece="<pad>",
        minloglevel=2 if quiet else 0,
        **SPECIAL_IDS,
    )
    return model_prefix + ".model"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="jsonl or text files (globs allowed); with --hf-dataset a saved dataset dir or data files",
    )
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields of each json document to train on")
    p.add_argument("--hf-dataset", action="store_true", help="read --input with HF `datasets` (local only)")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument(
        "--no-byte-fallback",
        dest="byte_fallback",
        action="store_false",
        help="map unseen characters to <unk> instead of UTF-8 byte pieces",
    )
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument(
        "--input-sentence-size",
        type=int,
        default=2_000_000,
        help="train on a random sample of at most this many text chunks (bounds memory)",
    )
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--user-defined-symbols", nargs="*", default=[], help="extra pieces never split")
    p.add_argument("--verbose", action="store_true", help="show sentencepiece's own log")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)

    paths = args.input if args.hf_dataset else expand_inputs(args.input)
    if args.vocab_size < 1:
        p.error(f"--vocab-size must be >= 1 (got {args.vocab_size})")
    t0 = time.time()
    # sentencepiece trains in C++ with no progress to report: the bar covers reading the input
    stats = LineStats()
    texts = Counted(progress(iter_texts(paths, args.json_keys, args.hf_dataset, stats), "reading text", unit=" texts"))
    try:
        model = train(
            texts,
            args.model_prefix,
            args.vocab_size,
            args.model_type,
            args.byte_fallback,
            args.character_coverage,
            args.input_sentence_size,
            args.num_threads,
            args.user_defined_symbols,
            quiet=not args.verbose,
        )
    except CompressedInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (TooManyMalformed, RuntimeError) as e:  # sentencepiece's own refusal: no text, a vocabulary it cannot reach
        if stats.too_many():  # iter_texts' (sentencepiece passes it on as a RuntimeError): nothing was written
            print(
                f"error: {stats.summary(args.json_keys)}: more than half, so refused (nothing written); "
                "give the right --input or --json-keys",
                file=sys.stderr,
            )
            return 1
        found = f"{texts.count} text(s) of --json-keys {' '.join(args.json_keys)} found in --input"
        print(f"error: sentencepiece could not train ({' '.join(str(e).split())}); {found}", file=sys.stderr)
        return 1
    if stats.malformed:
        print(f"warning: {stats.summary(args.json_keys)}: skipped", file=sys.stderr)
    print(
        f"wrote {model} and {args.model_prefix}.vocab ({vocab_report(model, args)}) in {time.time() - t0:.1f}s",
        file=sys.stderr,
    )
    return 0


def vocab_report(model: str, args) -> str:
    """What the written model really holds, read back from it: sentencepiece (hard_vocab_limit off)
    writes fewer pieces than --vocab-size when the corpus has no more; and the size training pads it to."""
    import sentencepiece as spm

    from megatron_zpp.data.tokenizer import pad_vocab_size

    size = spm.SentencePieceProcessor(model_file=model).get_piece_size()
    text = f"{args.model_type}, vocab {size:,}"
    if size != args.vocab_size:
        text += f" where --vocab-size {args.vocab_size:,} was asked: the corpus gave no more pieces"
    padded = pad_vocab_size(size, 128, 1)
    return text + f"; pretrain_gpt.py pads it to {padded:,} at --make-vocab-size-divisible-by 128 and TP 1"
