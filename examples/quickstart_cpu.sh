#!/usr/bin/env bash
# The README's demo: set up .venv (idempotent), build the embedded corpus (the Python
# standard library's text -> sentencepiece tokenizer -> .bin/.idx; skipped when present),
# then pretrain a small hybrid GPT on 4 CPU ranks as TP 2 x DP 2 and print a greedy sample.
# Extra arguments go to pretrain_gpt.py (e.g. --pipeline-model-parallel-size 2 --generate-tokens 0).
set -euo pipefail
source "$(dirname "$0")/demo_env.sh"   # repo root, .venv, data_cache/demo/
exec "$TORCHRUN" --standalone --nproc-per-node "${NPROC:-4}" pretrain_gpt.py \
  --config examples/configs/tiny_cpu.yaml \
  --tensor-model-parallel-size 2 \
  --metrics-file runs/quickstart/metrics.jsonl \
  --comm-report runs/quickstart/comm.json \
  "$@"
