"""Preprocessing throughput and memory: tools/preprocess_data.py vs megatron-core's IndexedDatasetBuilder.

    python bench/preprocess.py [--workers 1 2] [--repeat-corpus 2]

Both sides tokenize the same jsonl (the demo corpus: Python's stdlib, repeated) with the same
sentencepiece model and append EOD. The peer is Megatron-LM's preprocess_data.py loop (a Pool
imap of json.loads + encode, chunksize 32, into IndexedDatasetBuilder.add_document), run from a
separate venv `.venv-bench/` that this script creates if missing (megatron-core 0.19.2 + triton;
the project venv's CPU torch is reused through a .pth file instead of downloading a CUDA torch).
megatron-core is never a dependency of the project.

Reported per run: tokens/s over the processing (imports excluded, pool start included) and peak
RSS summed over the process and its workers, sampled every 50 ms. The outputs of both sides are
compared byte for byte. The last line on stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

from megatron_zpp.data.indexed_dataset import IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCH_VENV = os.path.join(ROOT, ".venv-bench")
BENCH_PY = os.path.join(BENCH_VENV, "bin", "python")

OURS = r"""
import json, sys, time
from megatron_zpp.data.preprocess import main
t = time.perf_counter()
main(["--input", sys.argv[2], "--output-prefix", sys.argv[3], "--tokenizer-type",
    "SentencePieceTokenizer", "--tokenizer-model", sys.argv[4], "--append-eod", "--workers", sys.argv[5], "--quiet"])
print(json.dumps({"seconds": time.perf_counter() - t}))
"""

# Megatron-LM tools/preprocess_data.py, reduced to its GPT path (no sentence splitting).
MEGATRON = r"""
import json, multiprocessing, sys, time
import numpy as np
import sentencepiece as spm
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

class Encoder:
    def initializer(self):
        global sp
        sp = spm.SentencePieceProcessor(model_file=sys.argv[3])
    def encode(self, json_line):
        text = json.loads(json_line)["text"]
        ids = sp.encode(text)
        if len(ids) > 0:
            ids.append(sp.eos_id())
        return ids, [len(ids)] if ids else [], len(json_line)

if __name__ == "__main__":
    inp, out, model, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    t = time.perf_counter()
    vocab = spm.SentencePieceProcessor(model_file=model).get_piece_size()
    enc = Encoder()
    pool = multiprocessing.Pool(workers, initializer=enc.initializer)
    builder = IndexedDatasetBuilder(out + "_text_document.bin", dtype=np.uint16 if vocab < 65500 else np.int32)
    with open(inp, encoding="utf-8") as fin:
        for ids, lens, _ in pool.imap(enc.encode, fin, 32):
            builder.add_document(ids, lens)
    builder.finalize(out + "_text_document.idx")
    pool.close()
    print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def ensure_bench_venv() -> None:
    if peer_installed():
        return
    print(f"creating {BENCH_VENV} with megatron-core 0.19.2 (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", BENCH_VENV], check=True)
    site = subprocess.run(
        [BENCH_PY, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "_zpp_main_venv.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # reuse this venv's torch, numpy, sentencepiece
    subprocess.run(
        [
            BENCH_PY,
            "-m",
            "pip",
            "install",
            "-q",
            "--ignore-requires-python",
            "megatron-core==0.19.2",
            "triton",
            "sentencepiece",
            "numpy",
        ],
        check=True,
    )
    if not peer_installed():
        raise SystemExit(f"{BENCH_VENV}: megatron-core installed but does not import")


def tree_rss_bytes(pid: int) -> int:
    """RSS of pid and all its descendants, from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def measure(cmd: list[str]) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_bytes(proc.pid))
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"benchmark run failed: {' '.join(cmd[:3])}...\n{err[-3000:]}")
    return {"seconds": json.loads(out.strip().splitlines()[-1])["seconds"], "peak_rss_mb": peak / 2**20}


def peer_installed() -> bool:
    """Whether the bench venv imports megatron-core's dataset builder (the peer)."""
    check = [BENCH_PY, "-c", "import megatron.core.datasets.indexed_dataset"]
    return os.path.exists(BENCH_PY) and subprocess.run(check, capture_output=True).returncode == 0


def toy_corpus(work: str) -> tuple[str, str]:
    """--smoke: 300 short documents and a 400-piece BPE model trained on them, in `work`."""
    from megatron_zpp.data import tokenizer_training

    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"Document {i}: " + "words and more words, " * (i % 7) + "end."}) + "\n")
    prefix = os.path.join(work, "toy")
    tokenizer_training.train(tokenizer_training.iter_texts([corpus], ["text"]), prefix, 400, "bpe")
    return corpus, prefix + ".model"


def prepare_corpus(work: str, repeat: int) -> tuple[str, str]:
    demo = os.path.join(ROOT, "data_cache", "demo")
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "make_demo_corpus.py"), "--output", demo, "--build"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    corpus = os.path.join(work, "corpus.jsonl")
    with open(os.path.join(demo, "corpus.jsonl"), "rb") as src, open(corpus, "wb") as dst:
        data = src.read()
        for _ in range(repeat):
            dst.write(data)
    return corpus, os.path.join(demo, "tokenizer.model")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat-corpus", type=int, default=2, help="concatenate the demo corpus this many times")
    p.add_argument("--trials", type=int, default=3, help="runs per configuration; the fastest is reported")
    p.add_argument("--smoke", action="store_true", help="seconds: a toy corpus, 1 worker, 1 trial; no peer install")
    args = p.parse_args(argv)
    if args.smoke:
        args.workers, args.trials = [1], 1
    peer = not args.smoke or peer_installed()
    if not args.smoke:
        ensure_bench_venv()
    elif not peer:
        print(f"megatron-core peer not run: {BENCH_VENV} does not have it (a run without --smoke installs it)")
    work = tempfile.mkdtemp(prefix="zpp_bench_")
    corpus, model = toy_corpus(work) if args.smoke else prepare_corpus(work, args.repeat_corpus)
    runs, rows = [], []
    load = round(os.getloadavg()[0], 2)  # other jobs on the machine skew the figures: say so
    for w in args.workers:
        res, trials = {}, {"megatron_zpp": [], "megatron_core": []}
        cmds = {
            "megatron_zpp": [
                sys.executable,
                "-c",
                OURS,
                ROOT,
                corpus,
                os.path.join(work, f"megatron_zpp_w{w}"),
                model,
                str(w),
            ],
            "megatron_core": [
                BENCH_PY,
                "-c",
                MEGATRON,
                corpus,
                os.path.join(work, f"megatron_core_w{w}"),
                model,
                str(w),
            ],
        }
        if not peer:
            del cmds["megatron_core"]
        for _ in range(args.trials):  # interleaved, so that load from elsewhere hits both sides alike
            for impl, cmd in cmds.items():
                trials[impl].append(measure(cmd))
        for impl in cmds:
            prefix = os.path.join(work, f"{impl}_w{w}")
            best = min(trials[impl], key=lambda r: r["seconds"])
            idx = prefix + "_text_document.idx"
            tokens = IndexedDataset(prefix + "_text_document").num_tokens
            res[impl] = dict(
                impl=impl,
                workers=w,
                seconds=round(best["seconds"], 3),
                tokens=tokens,
                tokens_per_s=round(tokens / best["seconds"]),
                peak_rss_mb=round(max(t["peak_rss_mb"] for t in trials[impl]), 1),
                idx=idx,
            )
        same = peer and all(
            open(res["megatron_zpp"]["idx"][:-4] + ext, "rb").read()
            == open(res["megatron_core"]["idx"][:-4] + ext, "rb").read()
            for ext in (".bin", ".idx")
        )
        for r in res.values():
            r.pop("idx")
            runs.append(r)
        rows.append((w, res["megatron_zpp"], res.get("megatron_core"), same))
    print(
        f"corpus: {os.path.getsize(corpus) / 1e6:.1f} MB jsonl, {rows[0][1]['tokens']:,} tokens, "
        f"sentencepiece BPE {model}"
    )
    print(
        f"{'workers':>7} | {'ours tok/s':>11} {'mcore tok/s':>11} {'ratio':>6} | "
        f"{'ours MB':>8} {'mcore MB':>8} {'ratio':>6} | identical output"
    )
    summary = {}
    for w, ours, peer, same in rows:
        if peer is None:
            print(f"{w:>7} | {ours['tokens_per_s']:>11,} {'-':>11} {'-':>6} | {ours['peak_rss_mb']:>8.0f} {'-':>8}")
            continue
        speed, mem = ours["tokens_per_s"] / peer["tokens_per_s"], ours["peak_rss_mb"] / peer["peak_rss_mb"]
        summary[str(w)] = {"tokens_per_s_ratio": round(speed, 3), "peak_rss_ratio": round(mem, 3), "identical": same}
        print(
            f"{w:>7} | {ours['tokens_per_s']:>11,} {peer['tokens_per_s']:>11,} {speed:>5.2f}x | "
            f"{ours['peak_rss_mb']:>8.0f} {peer['peak_rss_mb']:>8.0f} {mem:>5.2f}x | {same}"
        )
    print(f"machine: {os.cpu_count()} CPUs, load average before the runs {load}; best of {args.trials} trials")
    print(
        json.dumps(
            {
                "bench": "preprocess",
                "corpus_bytes": os.path.getsize(corpus),
                "cpus": os.cpu_count(),
                "load_average_before": load,
                "runs": runs,
                "ours_vs_megatron_core": summary,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
