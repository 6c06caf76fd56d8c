"""ParallelConfig (the grid: TP, PP, CP, DP and their options) and ZeroConfig (ZeRO and ZeRO++). Re-exported by
the config package."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import opt


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "--tensor-model-parallel-size", "TP: ranks that split each layer")
    pipeline_model_parallel_size: int = opt(1, "--pipeline-model-parallel-size", "PP: pipeline stages")
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "--num-layers-per-virtual-pipeline-stage", "layers per virtual stage (interleaved 1F1B)"
    )
    num_virtual_stages_per_pipeline_rank: int | None = opt(
        None,
        "--num-virtual-stages-per-pipeline-rank",
        "virtual stages per pipeline rank (interleaved 1F1B): sets --num-layers-per-virtual-pipeline-stage to "
        "layers / (PP x this)",
    )
    account_for_embedding_in_pipeline_split: bool = opt(
        False,
        "--account-for-embedding-in-pipeline-split",
        "count the embedding as a layer of the first stage in the even split (it holds one layer fewer)",
    )
    account_for_loss_in_pipeline_split: bool = opt(
        False,
        "--account-for-loss-in-pipeline-split",
        "count the output layer and loss as a layer of the last stage in the even split (one layer fewer)",
    )
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "--decoder-first-pipeline-num-layers", "layers on the first pipeline stage (default: even split)"
    )
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "--decoder-last-pipeline-num-layers", "layers on the last pipeline stage (default: even split)"
    )
    context_parallel_size: int = opt(1, "--context-parallel-size", "CP: ranks that split each sequence")
    expert_model_parallel_size: int = opt(
        1,
        "--expert-model-parallel-size",
        "EP: ranks that split the routed experts of each MoE layer, carved (as Megatron) from the TP x CP x DP ranks "
        "of a pipeline stage; the ranks holding the same experts form the expert-data-parallel group",
    )
    expert_tensor_parallel_size: int | None = opt(
        None,
        "--expert-tensor-parallel-size",
        "ranks that split each routed expert's width (default --tensor-model-parallel-size, as Megatron)",
    )
    sequence_parallel: bool = opt(False, "--sequence-parallel", "Megatron sequence parallelism in norm/dropout regions")
    cp_algo: str = opt(
        "all-scan",
        "--cp-algo",
        "GLA/GDN/KDA state passing under CP: ZeCO all-scan, all-gather (LASP-2; fla KCP for GDN), LASP-1 ring "
        "(softmax layers all-gather K/V)",
        choices=["all-scan", "all-gather", "ring"],
    )
    all_scan_blocks: int = opt(
        0,
        "--all-scan-blocks",
        "All-Scan: pipeline the state in this many blocks (GLA: along d_k, GDN and KDA: along d_v); 0 = the count that "
        "minimises the chain's time (P-2+n)(alpha + bytes/(n beta)) on the CP group's hops (context_parallel/chain.py:"
        " 1 at CP 2; CPU: the calibrated emulated preset's links)",
    )
    order: str = opt("tp-cp-dp-pp", "--parallel-order", "rank order of the 4D grid, first axis fastest")
    ranks_per_node: int | None = opt(
        None, "--ranks-per-node", "ranks per node (default: LOCAL_WORLD_SIZE); smaller values emulate several nodes"
    )
    distributed_timeout_minutes: float = opt(
        10.0,
        "--distributed-timeout-minutes",
        "a collective waiting longer than this for another rank fails the run instead of hanging (fractions allowed; "
        "at most 10080, a week)",
    )

    # filled by validate()
    world_size: int = 1
    data_parallel_size: int = 1

    @property
    def expert_tp_size(self) -> int:
        """--expert-tensor-parallel-size, Megatron's default: the attention TP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


@dataclass
class ZeroConfig:
    zero_stage: int = opt(0, "--zero-stage", "ZeRO stage over the data-parallel group", choices=[0, 1, 2, 3])
    zero_quantized_weights: bool = opt(False, "--zero-quantized-weights", "qwZ: int8 block-quantized weight all-gather")
    zero_hpz_partition_size: int = opt(
        1, "--zero-hpz-partition-size", "hpZ: secondary weight shard over K ranks of a node"
    )
    zero_quantized_gradients: bool = opt(
        False, "--zero-quantized-gradients", "qgZ: int4 hierarchical all-to-all gradient reduce"
    )
    zero_hierarchy: list[int] = opt(
        [],
        "--zero-hierarchy",
        "multi-level ZeRO++: ZeRO-group ranks per tier, innermost first (e.g. 2 4); the gradients are reduced tier "
        "by tier (quantized with --zero-quantized-gradients); the node boundary is always a tier",
        nargs="+",
        type=int,
    )
    zero_param_persistence: str = opt(
        "microbatch",
        "--zero-param-persistence",
        "ZeRO-3: free gathered weights after each micro-batch's forward and backward (least memory; 2 gathers per "
        "micro-batch), or keep them from their first gather until the optimizer step (1 gather per step; with "
        "pipelining and many micro-batches this trades ZeRO-2-like weight memory for far fewer gathers)",
        choices=["microbatch", "step"],
    )
    zero_quantization_block_size: int = opt(
        2048, "--zero-quantization-block-size", "qwZ: elements per int8 weight block (one fp32 scale each)"
    )
    zero_gradient_quantization_block_size: int = opt(
        64,
        "--zero-gradient-quantization-block-size",
        "qgZ: elements per int4 gradient block (one fp32 scale each); 64 has the least error x wire bytes in "
        "bench/quantize.py's table (Gaussian: 0.108 relative L2 at 0.5625 B/element, 0.150 at 2048)",
    )
    zero_gradient_stochastic_rounding: bool = opt(
        False,
        "--zero-gradient-stochastic-rounding",
        "qgZ: round the int4 gradients stochastically (unbiased; draws from the CPU generator, which checkpoints save)",
    )
    overlap_grad_reduce: bool = opt(
        True,
        "--overlap-grad-reduce",
        "reduce the gradients in buckets as the backward of the step's last micro-batch produces them, overlapping "
        "the backward (plain DP: all-reduce of --ddp-bucket-size buckets; ZeRO-1: reduce-scatter per unit; ZeRO-2/3 "
        "always reduce during the backward); --no-overlap-grad-reduce reduces everything after the backward",
    )
    grad_reduce_in_bf16: bool = opt(
        False,
        "--grad-reduce-in-bf16",
        "as Megatron: gradients cross the wire in bf16 (2 bytes per element; plain DP and ZeRO-1/2/3, and the "
        "unquantized hierarchy), accumulated over micro-batches and stepped in fp32; qgZ keeps its int4 wire",
    )
    zero_reduce_in_flight: int | None = opt(
        None,
        "--zero-reduce-in-flight",
        "ZeRO: gradient reductions in flight during the backward (each holds one unit's gradient until it lands); "
        "default 2; never fewer than the reduction's hops (1 flat, else the hierarchy's tiers + 1)",
    )
    check_collective_order: bool = opt(
        False,
        "--check-collective-order",
        "debug: after each step, hash every group's sequence of collectives and compare the hashes across the "
        "group; a difference stops the run naming the first collective that differs",
    )
    ddp_bucket_size: int | None = opt(
        None,
        "--ddp-bucket-size",
        "plain DP with --overlap-grad-reduce: gradient elements per all-reduce bucket (default, as Megatron: "
        "max(40M, 1M x DP x CP)); without overlap the gradients go in one bucket",
    )
    use_distributed_optimizer: bool = opt(
        False,
        "--use-distributed-optimizer",
        "Megatron's distributed optimizer (fp32 masters and AdamW state sharded over DP, gradients reduce-scattered): "
        "--zero-stage 1 here, unless --zero-stage is higher",
    )
    overlap_param_gather: bool = opt(
        False,
        "--overlap-param-gather",
        "ZeRO-1/2: start the all-gather of the updated weights at the end of the step and wait for each unit's "
        "weights just before its first forward of the next step (ZeRO-3 always gathers unit by unit, prefetching)",
    )
