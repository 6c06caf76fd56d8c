#!/usr/bin/env bash
# The README's demo: set up .venv (idempotent), then pretrain a small GPT on CPU ranks.
# NPROC (default 2) ranks under torchrun; extra arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --config examples/configs/tiny_cpu.yaml \
  --mock-data \
  --metrics-file runs/quickstart/metrics.jsonl \
  --comm-report runs/quickstart/comm.json \
  "$@"
