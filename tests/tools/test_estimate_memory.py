"""tools/estimate_memory.py's start-up section for a 70B-shaped model (Llama-2-70B sizes) at TP1/PP1,
ZeRO-3 bf16 over 64 ranks, built on the meta device (nothing is allocated): what the rank holds after
set-up is its shard three times over (bf16 weights, fp32 master, fp32 gradient: 10 bytes per shard
element), the init's transient is the largest full parameter (the SwiGLU fc1, [2 x 28672, 8192] fp32),
and the rank's whole slice in fp32 (what the start-up before the sharded one held) is 4 bytes per
parameter."""

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("estimate_memory", os.path.join(ROOT, "tools", "estimate_memory.py"))
estimate_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(estimate_memory)

LLAMA_70B = (
    "--world-size 64 --mock-data --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 28672 --vocab-size 32000 --seq-length 4096 --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --bf16 --zero-stage 3 "
    "--micro-batch-size 1 --global-batch-size 64 --attention-type softmax "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
).split()


def _bytes(out: str, label: str) -> int:
    line = next(x for x in out.splitlines() if x.strip().startswith(label))
    return int(re.search(r"([\d,]{5,})", line[len(label) + 2 :]).group(1).replace(",", ""))


def test_startup_section_of_a_70b_zero3_run(capsys):
    assert estimate_memory.main(LLAMA_70B) == 0
    out = capsys.readouterr().out
    shard = int(re.search(r"shard ([\d,]+) per rank", out).group(1).replace(",", ""))
    device = _bytes(out, "start-up peak on the device (GPU)")
    transient = _bytes(out, "+ one full parameter drawn by the init (fp32)")
    whole = _bytes(out, "(this rank: its whole (TP, PP) slice in fp32)")
    assert device == 10 * shard
    assert transient == 4 * 2 * 28672 * 8192
    assert _bytes(out, "start-up peak on a CPU run") == device + transient
    h, kv, layers, vocab = 8192, 8 * 128, 80, 32000
    params = layers * (h * (h + 2 * kv) + h * h + 3 * 28672 * h + 2 * h) + 2 * vocab * h + h
    assert whole == 4 * params  # 69.0e9 parameters: 276 GB of fp32 before the first shard, 10.8 GB after
    assert device < whole / 25


def test_moe_imbalance_is_checked_and_shown(capsys):
    """--moe-imbalance below 1 is refused in one line before any work; a valid one is named in the report."""
    moe = "--world-size 2 --mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    moe += "--global-batch-size 2 --num-experts 4 --expert-model-parallel-size 2"
    assert estimate_memory.main(moe.split() + ["--moe-imbalance", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --moe-imbalance 0.5: give a factor >= 1 (the busiest rank's share)"]
    assert estimate_memory.main(moe.split() + ["--moe-imbalance", "1.25"]) == 0
    assert "an even share x 1.25 (--moe-imbalance)" in capsys.readouterr().out
