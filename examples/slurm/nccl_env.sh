# Sourced (not run) by the multi-node recipes (examples/slurm/gpt1.3b_zeropp.sbatch,
# examples/torchrun_multinode.sh): the communication settings a multi-node run needs, in one place.
# Every value set here can be overridden from the environment (NCCL_IB_TIMEOUT=23 sbatch ...); the
# commented ones are cluster-specific: set them when NCCL's choice is wrong. To see what NCCL chose
# (interfaces, IB/RoCE or sockets, rings and trees), run a few steps with NCCL_DEBUG=INFO.

# ---- which network ---------------------------------------------------------------------------
# NCCL_SOCKET_IFNAME: the IP interface of NCCL's bootstrap and of its socket transport. NCCL's
# default skips lo and docker* and prefers ib*; name yours when a node has several (e.g. bond0,
# =eth0 for exactly eth0, ^eth1 to exclude one).
# export NCCL_SOCKET_IFNAME=bond0
# GLOO_SOCKET_IFNAME: the same for gloo (CPU runs; torch's CPU-side groups). Default: the interface
# of the host name's address.
# export GLOO_SOCKET_IFNAME=bond0
# NCCL_IB_HCA: which InfiniBand / RoCE adapters (and ports) to use, e.g. mlx5_0,mlx5_1 or =mlx5_0:1;
# default: every one found. Exclude the storage adapter if it shares the node: ^mlx5_4
# export NCCL_IB_HCA=mlx5
# NCCL_IB_GID_INDEX: RoCE only: the GID table entry that holds the RoCEv2 address (often 3;
# `show_gids` lists them). InfiniBand needs none.
# export NCCL_IB_GID_INDEX=3
# NCCL_IB_DISABLE=1: no IB/RoCE at all, TCP sockets only (slow: to tell a fabric fault from a bug).

# ---- a fabric that drops or stalls ------------------------------------------------------------
# NCCL_IB_TIMEOUT: the InfiniBand verbs retransmission timeout, 4.096 us x 2^value (NCCL's
# default 20: about 4 s). Large or congested fabrics fail with "transport retry counter exceeded"
# at the default; 22 is about 17 s.
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
# NCCL_IB_RETRY_CNT: retransmissions before that error (NCCL's default, 7).
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}

# ---- fail instead of hanging ------------------------------------------------------------------
# A collective stuck past --distributed-timeout-minutes (a dead or hung rank) must end the job, so
# that srun --kill-on-bad-exit stops the other tasks and the job can be resubmitted or requeued.
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1: on such an error or timeout, torch's watchdog aborts the NCCL
# communicators and then ends the process (torch's default, 3, ends it without the abort).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# The flight recorder: on a timeout every rank dumps its last collectives (which rank was behind,
# in which collective) to ${TORCH_NCCL_DEBUG_INFO_TEMP_FILE}<rank> (default /tmp/nccl_trace_rank_).
# (torch before 2.6 names the buffer size TORCH_NCCL_TRACE_BUFFER_SIZE)
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}

# ---- logs and threads -------------------------------------------------------------------------
# NCCL_DEBUG: WARN prints NCCL's errors (and nothing on a healthy run); INFO its set-up.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# One OpenMP thread per rank unless told otherwise: 8 ranks x all cores each would oversubscribe.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
