"""Peer: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard` on every block and the root) on
gloo/CPU, training the model of model.py with our weights, data order, AdamW settings, LR
schedule and global-norm clipping.

    torchrun ... megatron_zpp/testing/peers/fsdp2.py --warmup 1 --reshard-after-forward {true,2} -- <model flags>

--reshard-after-forward 2 (an int) keeps the parameters sharded over 2 ranks between forward
and backward, so the backward all-gather stays in the node: FSDP2's analogue of hpZ.

With --bf16 among the model flags: MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32), FSDP2's best setting for bf16 training and the one closest to ours:
fp32 sharded parameters (the masters AdamW steps), bf16 all-gathers and compute, gradients
reduce-scattered and kept in fp32. The fp32 parameters start as our bf16 weights (the fp32
init rounded to bf16, as ours rounds it), so every system's masters start equal.
"""

from __future__ import annotations

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
    a, model_argv = peer_args(lambda ap: ap.add_argument("--reshard-after-forward", default="true"))
    raf = {"true": True, "false": False}.get(a.reshard_after_forward.lower())
    raf = int(a.reshard_after_forward) if raf is None else raf

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    install_gloo_collectives()  # its reduce_scatter_single: the real-fabric volume on gloo (gloo_collectives.py)
    probe = Probe(a.warmup, a.gate_every)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = parse_model_args(model_argv)
    torch.manual_seed(cfg.train.seed)
    model, _ = build_peer_model(cfg)
    model = model.float()  # bf16: our rounded weights, now the fp32 masters FSDP2 shards
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_kw = {
        "mesh": init_device_mesh("cpu", (world,)),
        "reshard_after_forward": raf,
        "mp_policy": bf16 if cfg.train.bf16 else MixedPrecisionPolicy(),  # the default: no casts
    }
    for block in model.h:
        fully_shard(block, **shard_kw)
    fully_shard(model, **shard_kw)
    opt = torch.optim.AdamW(adamw_param_groups(model, cfg), foreach=True, **adamw_kwargs(cfg))
    batches = PeerBatches(cfg, rank, world)
    clip = cfg.optim.clip_grad

    for it in range(cfg.train.train_iters):
        probe.step_begin()
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, it)
        losses = []
        for k in range(batches.num_micro):
            x, y = batches.micro_batch(it, k)
            loss = model(x, y)
            (loss / batches.num_micro).backward()
            losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = torch.stack(losses).mean().reshape(1)
        dist.all_reduce(mean)
        probe.step_end(mean.item() / world)
        if rank == 0:
            gn = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            print(
                f"fsdp2 iter {it + 1} loss {probe.losses[-1]:.4f} grad norm {float(gn):.3f} "
                f"step {probe.step_times[-1]:.3f}s",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()
    probe.finish(
        system="fsdp2", reshard_after_forward=raf, dtype="bf16" if cfg.train.bf16 else "fp32", torch=torch.__version__
    )


if __name__ == "__main__":
    main()
