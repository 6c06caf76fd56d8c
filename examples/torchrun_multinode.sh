#!/usr/bin/env bash
# GPT-1.3B with ZeRO++ (examples/configs/gpt1.3b_zeropp.yaml) on several nodes without a
# scheduler: run this same command on every node (ssh, pdsh, a cluster's own launcher):
#
#   NNODES=4 MASTER_ADDR=node0 DATA_PATH=... TOKENIZER=... bash examples/torchrun_multinode.sh
#   NNODES=4 MASTER_ADDR=node0 MOCK_DATA=1 bash examples/torchrun_multinode.sh --train-iters 50 --lr-warmup-iters 5
#
# torchrun's c10d rendezvous meets the nodes at MASTER_ADDR:MASTER_PORT (the node whose address
# that is serves it) and numbers the ranks; no node rank is needed, and the nodes may start in any
# order (each waits up to torchrun's rendezvous timeout for the others). Flags given to this
# script are added last and win. The same command resumes: --load names the --save directory
# (RUN_DIR/ckpt, on storage every node sees). A SIGTERM to torchrun reaches its ranks, which
# finish the step, save and exit (--exit-signal-handler); torchrun itself then reports the signal.
# It kills ranks still running 30 s after passing the signal on (recent torchrun: --shutdown-timeout):
# a step plus a save must fit in that, or stop the run with a SIGTERM to the ranks themselves.
#
# Environment: NNODES, MASTER_ADDR (required); MASTER_PORT (29500), GPUS_PER_NODE (8), RDZV_ID
# (a name of the run shared by its nodes), RUN_DIR (runs/gpt1.3b-zeropp), DATA_PATH + TOKENIZER or
# MOCK_DATA=1, TORCHRUN, and the network settings of examples/slurm/nccl_env.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/slurm/nccl_env.sh

NNODES=${NNODES:?set NNODES to the number of nodes}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the host name or address of one node}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RUN_DIR=${RUN_DIR:-runs/gpt1.3b-zeropp}
if [ "${MOCK_DATA:-0}" = 1 ]; then
  DATA=(--mock-data)
else
  DATA=(--data-path "${DATA_PATH:?set DATA_PATH to a .bin/.idx prefix, or MOCK_DATA=1}"
        --tokenizer-type SentencePieceTokenizer
        --tokenizer-model "${TOKENIZER:?set TOKENIZER to a sentencepiece .model}")
fi
mkdir -p "$RUN_DIR"

exec "${TORCHRUN:-torchrun}" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-gpt1.3b-zeropp}" \
  pretrain_gpt.py \
  --config examples/configs/gpt1.3b_zeropp.yaml \
  --zero-hpz-partition-size "$GPUS_PER_NODE" \
  "${DATA[@]}" \
  --save "$RUN_DIR/ckpt" --load "$RUN_DIR/ckpt" --exit-signal-handler \
  --tensorboard-dir "$RUN_DIR/tb" --metrics-file "$RUN_DIR/metrics.jsonl" \
  "$@"
