#!/usr/bin/env bash
# The README's demo: set up .venv (idempotent), build the embedded corpus (the Python
# standard library's text -> sentencepiece tokenizer -> .bin/.idx; skipped when present),
# then pretrain a small hybrid GPT on 4 CPU ranks as TP 2 x DP 2 and print a greedy sample.
# Extra arguments go to pretrain_gpt.py (e.g. --pipeline-model-parallel-size 2 --generate-tokens 0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
.venv/bin/python tools/make_demo_corpus.py --output data_cache/demo --build
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --standalone --nproc-per-node "${NPROC:-4}" pretrain_gpt.py \
  --config examples/configs/tiny_cpu.yaml \
  --tensor-model-parallel-size 2 \
  --metrics-file runs/quickstart/metrics.jsonl \
  --comm-report runs/quickstart/comm.json \
  "$@"
