"""Peer: DeepSpeed ZeRO-3 (optionally + hpZ) on CPU (DS_ACCELERATOR=cpu, gloo), training the
model of model.py with our weights, data order, AdamW settings (torch.optim.AdamW as the
client optimizer), LR schedule and gradient clipping. DeepSpeed is a bench-only dependency
(the [bench] extra, installed with DS_BUILD_OPS=0). DeepSpeed's own ZeRO-3 defaults are kept (buckets, prefetch,
persistence threshold); only the settings below are ours.

With --bf16 among the model flags: DeepSpeed's `bf16: {enabled: true}` and nothing else, as
its users run it: bf16 weights, gathers and compute, fp32 master partitions in the optimizer,
and (its defaults: communication_data_type and grad_accum_dtype follow the model dtype)
gradients reduce-scattered and accumulated in bf16, half the bytes of ours and FSDP2's fp32
reduction.

    torchrun ... megatron_zpp/testing/peers/deepspeed_zero.py --warmup 1 --hpz 2 -- <model flags>
"""

from __future__ import annotations

import json
import os

from megatron_zpp.testing.peers.gloo_collectives import install_gloo_collectives
from megatron_zpp.testing.peers.model import (
    PeerBatches,
    adamw_kwargs,
    adamw_param_groups,
    build_peer_model,
    lr_at,
    parse_model_args,
)
from megatron_zpp.testing.peers.probe import Probe, peer_args


def main() -> None:
    def own(ap):
        ap.add_argument("--hpz", type=int, default=1, help="zero_hpz_partition_size")
        ap.add_argument("--zero-config", default="{}", help="JSON merged into zero_optimization (experiments)")

    a, model_argv = peer_args(own)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import deepspeed
    import torch
    import torch.distributed as dist

    # before init_distributed, which binds torch.distributed.reduce_scatter_tensor (gloo_collectives.py)
    install_gloo_collectives()
    probe = Probe(a.warmup, a.gate_every)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = parse_model_args(model_argv)
    torch.manual_seed(cfg.train.seed)
    model, _ = build_peer_model(cfg)
    t = cfg.train
    num_micro = t.global_batch_size // (t.micro_batch_size * world)
    ds_config = _ds_config(cfg, a, num_micro)
    opt = torch.optim.AdamW(adamw_param_groups(model, cfg), foreach=True, **adamw_kwargs(cfg))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    batches = PeerBatches(cfg, rank, world)

    _train(engine, optimizer, batches, probe, cfg, num_micro)
    dist.barrier()
    dist.destroy_process_group()
    probe.finish(
        system="deepspeed",
        hpz=a.hpz,
        dtype="bf16" if cfg.train.bf16 else "fp32",
        communication_data_type=str(engine.communication_data_type),
        grad_accum_dtype=str(engine.get_data_types()[1]),
        deepspeed=deepspeed.__version__,
        torch=torch.__version__,
    )


def _ds_config(cfg, a, num_micro: int) -> dict:
    """DeepSpeed's ZeRO-3 (+ hpZ) config for our batch, clipping and dtype."""
    t = cfg.train
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": num_micro,
        "gradient_clipping": cfg.optim.clip_grad,
        "bf16": {"enabled": cfg.train.bf16},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": a.hpz, **json.loads(a.zero_config)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _train(engine, optimizer, batches, probe, cfg, num_micro: int) -> None:
    """Our schedule's iterations through DeepSpeed's engine, each timed by the probe."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for it in range(cfg.train.train_iters):
        probe.step_begin()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(cfg, it)
        losses = []
        for k in range(num_micro):
            x, y = batches.micro_batch(it, k)
            loss = engine(x, y)
            engine.backward(loss)  # scales by 1/gradient_accumulation_steps
            engine.step()  # steps the optimizer at the accumulation boundary
            losses.append(loss.detach())
        mean = torch.stack(losses).mean().reshape(1).float()
        dist.all_reduce(mean)
        probe.step_end(mean.item() / world)
        if rank == 0:
            print(
                f"deepspeed iter {it + 1} loss {probe.losses[-1]:.4f} grad norm "
                f"{engine.get_global_grad_norm()} step {probe.step_times[-1]:.3f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()
