"""Each engine's `slots` describes exactly what its built engine holds: the keys, shapes and
dtypes of its model_state_dict, and for every slot the span of the parameter it says it holds
(read from the live engine, its full weights gathered), on 2 ranks with TP2 or DP2; the slots
come from the rank's model rebuilt on the meta device, as the checkpoint code gets them. With routed experts
(EP 2; expert TP 1 under TP 2 with ZeRO-3) the rank's own experts, sharded over the expert-data-parallel group."""

import torch

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.pipeline_parallel import build_rank_chunks, stand_in_context
from megatron_zpp.tensor_parallel.layers import shard
from megatron_zpp.training.builders import training_dtype
from megatron_zpp.validation import validate
from megatron_zpp.zero import engine_class
from tests.dist import run_distributed

BASE = (
    "--mock-data --device cpu --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--vocab-size 100 --make-vocab-size-divisible-by 32 --global-batch-size 4 --micro-batch-size 1 "
    "--train-iters 1 --seed 3 --peak-tflops 1"
).split()
MOE = "--num-experts 4 --moe-ffn-hidden-size 16 --moe-router-topk 2 --swiglu".split()
VARIANTS = {
    "plain_tp2_bf16": ["--tensor-model-parallel-size", "2", "--bf16"],
    "zero1_dp2_untied": ["--zero-stage", "1", "--untie-embeddings-and-output-weights"],
    "zero3_dp2_bf16": ["--zero-stage", "3", "--bf16"],
    # routed experts: EP 2 (each rank its 2 of 4 experts); expert TP 1 under TP 2, so ZeRO-3 shards the experts
    # over the expert-data-parallel group (2 ranks) while the dense units have a DP x CP group of 1
    "plain_ep2_moe": MOE + ["--expert-model-parallel-size", "2"],
    "zero3_tp2_etp1_moe": MOE
    + "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 --zero-stage 3".split(),
}


def _described_vs_held(rank, world_size, argv):
    run = training.setup(validate(parse_args(BASE + argv), world_size))
    g, groups = run.groups.dp_cp, run.groups
    ctx = stand_in_context(run.cfg, groups.tp_rank, ep_rank=groups.ep_rank, etp_rank=groups.etp_rank)
    meta = build_rank_chunks(run.cfg, run.tokenizer.padded_vocab_size, groups.pp_rank, ctx)  # as checkpoints do
    lay = engine_class(run.cfg).slots(run.cfg, meta, g.rank, g.size, (groups.edp_rank, groups.edp.size))
    held = run.dp.model_state_dict()
    dtype = training_dtype(run.cfg)
    want = {k: (shape, torch.float32 if master else dtype) for k, (shape, master) in lay.tensors.items()}
    problems = [
        k for k in set(want) | set(held) if k not in held or want.get(k) != (tuple(held[k].shape), held[k].dtype)
    ]
    with run.dp.full_parameters():
        full = {n: p.detach().float().clone() for c in run.chunks for n, p in c.named_parameters()}
    for s in lay.slots:
        piece = full[s.name].reshape(-1)[s.start : s.start + s.hi - s.lo]  # this TP rank's piece
        span = held[s.master_key or s.key].reshape(-1)[s.lo : s.hi]  # the fp32 weight
        if not torch.equal(piece, span.to(dtype).float()) or tuple(full[s.name].shape) != s.shape:
            problems.append(s.name)
        if tuple(shard(torch.zeros(s.full_shape), s.tp_split, s.tp_rank, s.tp_size).shape) != s.shape:
            problems.append(f"{s.name} full shape")
    return problems


def test_each_engine_describes_what_it_holds():
    for name, argv in VARIANTS.items():
        per_rank = run_distributed(_described_vs_held, 2, argv, timeout=600)
        assert per_rank == [[], []], f"{name}: {per_rank}"
