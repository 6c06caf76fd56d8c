"""Build the demo corpus from text every Python install has: the standard library's sources and docstrings.

    python tools/make_demo_corpus.py --output data_cache/demo --build

Writes DIR/corpus.jsonl (per module, in sorted path order: one document of its docstrings, one
of its source). With --build it also trains DIR/tokenizer.model (BPE, 4096) on it and writes
DIR/corpus_text_document.bin/.idx. Each step is skipped when its output already exists.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

# test suites, vendored wheels, and codec/help tables (hex and generated text that would dominate a small model)
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "_bundled",
    "encodings",
    "pydoc_data",
}


def stdlib_modules(root: Path):
    """(relative path, source) of every stdlib module outside test suites, in sorted order."""
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts):
            continue
        try:
            yield rel.as_posix(), path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def docstrings(source: str) -> str:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                found.append(doc if isinstance(node, ast.Module) else f"{node.name}: {doc}")
    return "\n\n".join(found)


def write_corpus(out: Path, max_bytes: int) -> tuple[int, int]:
    """Write corpus.jsonl atomically; returns (documents, text bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    docs = size = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rel, source in stdlib_modules(root):
            for kind, text in (("docstrings", docstrings(source)), ("source", source)):
                if not text.strip():
                    continue
                f.write(json.dumps({"text": text, "path": rel, "kind": kind}) + "\n")
                docs, size = docs + 1, size + len(text.encode("utf-8"))
            if size >= max_bytes:
                break
    os.replace(tmp, out)
    return docs, size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="directory to write into")
    p.add_argument("--build", action="store_true", help="also train the tokenizer and preprocess")
    p.add_argument("--max-mb", type=float, default=16.0, help="stop adding modules past this much text")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    corpus, model = out / "corpus.jsonl", out / "tokenizer.model"
    prefix = out / "corpus"
    t0 = time.time()
    if corpus.exists():
        print(f"exists: {corpus}")
    else:
        docs, size = write_corpus(corpus, int(args.max_mb * 1e6))
        print(f"wrote {corpus}: {docs} documents, {size / 1e6:.1f} MB of text ({time.time() - t0:.1f}s)")
    if not args.build:
        return 0

    from megatron_zpp.data import tokenizer_training

    if model.exists():
        print(f"exists: {model}")
    else:
        t = time.time()
        tmp_prefix = str(out / f"tokenizer.tmp{os.getpid()}")
        texts = tokenizer_training.iter_texts([str(corpus)], ["text"])
        tokenizer_training.train(texts, tmp_prefix, args.vocab_size, "bpe", input_sentence_size=200_000)
        os.replace(tmp_prefix + ".vocab", out / "tokenizer.vocab")
        os.replace(tmp_prefix + ".model", model)  # last: its presence means the step finished
        print(f"wrote {model} (BPE, vocab {args.vocab_size}) in {time.time() - t:.1f}s")

    bin_, idx = Path(f"{prefix}_text_document.bin"), Path(f"{prefix}_text_document.idx")
    if bin_.exists() and idx.exists():
        print(f"exists: {bin_} and {idx}")
    else:
        from megatron_zpp.data import preprocess

        rc = preprocess.main(
            [
                "--input",
                str(corpus),
                "--output-prefix",
                str(prefix),
                "--json-keys",
                "text",
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                str(model),
                "--append-eod",
                "--workers",
                str(args.workers),
            ]
        )
        if rc:
            return rc
        print(f"wrote {bin_} and {idx}")
    print(
        f"demo data ready: --data-path {prefix}_text_document --tokenizer-type SentencePieceTokenizer "
        f"--tokenizer-model {model}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
