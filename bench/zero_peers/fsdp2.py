"""Peer: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard` on every block and the root) on
gloo/CPU, training the model of common.py with our weights, data order, AdamW settings, LR
schedule and global-norm clipping.

    torchrun ... bench/zero_peers/fsdp2.py --warmup 1 --reshard-after-forward {true,2} -- <model flags>

--reshard-after-forward 2 (an int) keeps the parameters sharded over 2 ranks between forward
and backward, so the backward all-gather stays in the node: FSDP2's analogue of hpZ.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    PeerBatches,
    Probe,
    adamw_kwargs,
    adamw_param_groups,
    build_peer_model,
    lr_at,
    parse_model_args,  # noqa: E402
    peer_args,
)


def main() -> None:
    a, model_argv = peer_args(lambda ap: ap.add_argument("--reshard-after-forward", default="true"))
    raf = {"true": True, "false": False}.get(a.reshard_after_forward.lower())
    raf = int(a.reshard_after_forward) if raf is None else raf

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    probe = Probe(a.warmup, a.gate_every)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = parse_model_args(model_argv)
    torch.manual_seed(cfg.train.seed)
    model, _ = build_peer_model(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf)
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
    probe.finish(system="fsdp2", reshard_after_forward=raf, torch=torch.__version__)


if __name__ == "__main__":
    main()
