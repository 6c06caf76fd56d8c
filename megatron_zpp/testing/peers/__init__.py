"""The peer harness of bench/zero.py: the probe of every rank (probe.py), the peers' model, data and
optimizer settings identical to ours (model.py), their gloo reduce-scatter at the real-fabric volume
(gloo_collectives.py), and the runner scripts torchrun launches by path: ours.py (pretrain_gpt.py
under the probe), fsdp2.py (PyTorch FSDP2), deepspeed_zero.py (DeepSpeed ZeRO-3). bench/moe.py's peer:
megatron_moe.py (megatron-core's MoELayer on CPU ranks)."""

import os

RUNNERS = os.path.dirname(os.path.abspath(__file__))  # the runner scripts' folder
