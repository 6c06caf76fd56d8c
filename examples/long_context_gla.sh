#!/usr/bin/env bash
# Long-context hybrid GLA model with sequence (context) parallelism: each of CP ranks holds
# a contiguous slice of every 16K-token sequence, GLA layers pass their state with ZeCO's
# All-Scan (one state per rank whatever CP is), the softmax layers (every 4th) all-gather
# K/V. TP 2 inside a node splits heads. On one 8-GPU node: TP 2 x CP 4.
#   bash examples/long_context_gla.sh            (GPUs, NCCL)
#   NPROC=4 TP=1 CP=4 SEQ=1024 LAYERS=4 HIDDEN=128 HEADS=4 bash examples/long_context_gla.sh --mock-data --train-iters 20 --lr-warmup-iters 2
#                                                (a CPU-sized smoke run on mock data)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-8}; TP=${TP:-2}; CP=${CP:-4}; SEQ=${SEQ:-16384}
LAYERS=${LAYERS:-24}; HIDDEN=${HIDDEN:-2048}; HEADS=${HEADS:-16}
if [ $# -eq 0 ]; then
  set -- --data-path "${DATA_PATH:?set DATA_PATH or pass --mock-data}" \
         --tokenizer-type SentencePieceTokenizer --tokenizer-model "${TOKENIZER:?set TOKENIZER}" --bf16
fi
exec torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" --sequence-parallel \
  --attention-type gla --softmax-attention-every 4 --gla-chunk-size 64 \
  --cp-algo all-scan --all-scan-blocks 4 \
  --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
  --seq-length "$SEQ" --micro-batch-size 1 --global-batch-size 8 --train-iters 1000 \
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --lr-decay-style cosine --log-interval 1 \
  --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
  --hidden-dropout 0 --attention-dropout 0 --weight-decay 0.1 --adam-beta2 0.95 \
  --metrics-file runs/long_context/metrics.jsonl --comm-report runs/long_context/comm.json "$@"
