#!/usr/bin/env bash
# GPT-1.3B (24 layers, hidden 2048, 16 heads) with ZeRO++ (qwZ + hpZ + qgZ) on a SLURM
# cluster of 8-GPU nodes, bf16, NCCL. One torchrun per node; every rank's data parallel.
# Submit with:  sbatch --nodes 4 --gpus-per-node 8 --ntasks-per-node 1 examples/slurm_gpt1.3b_zeropp.sh
# DATA_PATH/TOKENIZER: a Megatron .bin/.idx prefix and a sentencepiece model (see README "Data").
#SBATCH --job-name=gpt1.3b-zeropp
#SBATCH --exclusive
set -euo pipefail
DATA_PATH=${DATA_PATH:?set DATA_PATH to a .bin/.idx prefix}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a sentencepiece .model}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29500" --rdzv-id "$SLURM_JOB_ID" \
  pretrain_gpt.py \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
  --micro-batch-size 4 --global-batch-size 512 --train-iters 100000 \
  --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 2000 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
  --normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 --adam-beta2 0.95 \
  --bf16 --zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size "$GPUS_PER_NODE" \
  --zero-quantized-gradients \
  --data-path "$DATA_PATH" --split 969,30,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
  --log-interval 10 --eval-interval 1000 --eval-iters 10 \
  --tensorboard-dir "runs/$SLURM_JOB_ID/tb" --metrics-file "runs/$SLURM_JOB_ID/metrics.jsonl" \
  --comm-report "runs/$SLURM_JOB_ID/comm.json"
