#!/usr/bin/env bash
# One SLURM task = one rank: torch.distributed's variables from SLURM's, then the command replaces
# this shell (exec), so the signals SLURM sends the task (--signal, preemption) reach python itself.
#   srun bash examples/slurm/srun_task.sh python pretrain_gpt.py ...
# MASTER_ADDR and MASTER_PORT come from the batch script (rank 0's host, a port of the job's).
export RANK=$SLURM_PROCID
export WORLD_SIZE=$SLURM_NTASKS
export LOCAL_RANK=$SLURM_LOCALID          # the GPU of this task among those of its node
export LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE   # ranks per node: ZeRO++'s hpZ and qgZ node groups
export NODE_RANK=$SLURM_NODEID
: "${MASTER_ADDR:?set by the batch script}" "${MASTER_PORT:?set by the batch script}"
exec "$@"
