"""Merge `.bin/.idx` pairs into one, as Megatron's tools/merge_datasets.py does.

    python tools/merge_datasets.py --input DIR --output-prefix merged
    python tools/merge_datasets.py --input PREFIX_A PREFIX_B --output-prefix merged

With a directory, every prefix in it is merged in sorted order (Megatron's rule); otherwise the
prefixes in the order given. Tokens are copied in streaming, all pairs must share one dtype, and
the output appears (renamed from temporary names) only when the merge succeeded.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_zpp.data.indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from megatron_zpp.progress import progress


def find_prefixes(inputs: list[str]) -> list[str]:
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        d = inputs[0]
        prefixes = sorted(os.path.join(d, f[:-4]) for f in os.listdir(d) if f.endswith(".idx"))
        for p in prefixes:
            if not os.path.isfile(p + ".bin"):
                raise IndexedDatasetError(f"{p}.bin: missing (its .idx is in {d})")
        if not prefixes:
            raise SystemExit(f"error: {d}: no .idx files to merge")
        return prefixes
    return [p[:-4] if p.endswith((".bin", ".idx")) else p for p in inputs]


def merge(prefixes: list[str], output_prefix: str) -> IndexedDatasetWriter:
    first = IndexedDataset(prefixes[0])
    tag = f".tmp{os.getpid()}"
    writer = IndexedDatasetWriter(output_prefix + ".bin" + tag, first.dtype, output_prefix + ".lengths" + tag)
    bar = progress(
        None, "merging", sum(os.path.getsize(p + ".bin") for p in prefixes if os.path.isfile(p + ".bin")), "B"
    )
    try:
        for p in prefixes:
            writer.add_index(p)
            bar.update(os.path.getsize(p + ".bin"))
        bar.close()
        writer.finalize(output_prefix + ".idx" + tag)
    except BaseException:
        writer.abort()
        if os.path.exists(output_prefix + ".idx" + tag):
            os.remove(output_prefix + ".idx" + tag)
        raise
    if os.path.exists(output_prefix + ".idx"):
        os.remove(output_prefix + ".idx")  # a crash between the renames leaves a lone .bin, never a bad pair
    os.replace(output_prefix + ".bin" + tag, output_prefix + ".bin")
    os.replace(output_prefix + ".idx" + tag, output_prefix + ".idx")
    return writer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="a directory of pairs, or prefixes")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    try:
        prefixes = find_prefixes(args.input)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        w = merge(prefixes, args.output_prefix)
    except (IndexedDatasetError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"merged {len(prefixes)} pairs into {args.output_prefix}.bin/.idx: "
        f"{w.num_sequences:,} documents, {w.num_tokens:,} tokens ({w.dtype.name})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
