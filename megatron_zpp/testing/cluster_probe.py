"""One rank of the calibration's measurements (megatron_zpp/testing/calibration.py) (run by torchrun in the emulated
cluster's namespaces; writes rank 0's figures as JSON to argv[1]; argv[2]: {"compute": [flags], "gla": [flags]}).

* p2p ping-pong rank 0 <-> 1 (same namespace: loopback) and rank 0 <-> P/2 (across the
  shaped veth) at a small and a large message: alpha and bandwidth per link class;
* compute: every rank at once runs forward + backward of the calibration models (what a
  training step's compute shares the cores with), model FLOP/s per rank (perf.py's count);
  and the GLA models with GLA and with softmax layers (the GLA layers' extra cost);
* quantizer: int8 wire quantize + dequantize elements per second (ops/quantize.py), and per
  (bits, block) of the runs (int4/int8 at 256) the per-element and per-call cost;
* AdamW: seconds per parameter of an optimizer step (torch's AdamW on the model's parameters).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT
from megatron_zpp.ops.quantize import dequantize_sum_wire, dequantize_wire, quantize_wire
from megatron_zpp.perf import flops_per_token

SMALL, LARGE = 1024, 4 << 20


def ping_pong(peer: int, nbytes: int, reps: int) -> float:
    """Seconds of one one-way message of `nbytes` between rank 0 and `peer` (half a round trip)."""
    rank = dist.get_rank()
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    dist.barrier()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        elif rank == peer:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        best = min(best, (time.perf_counter() - start) / 2)
    dist.barrier()
    return best


def link(peer: int) -> dict:
    t_small, t_large = ping_pong(peer, SMALL, 20), ping_pong(peer, LARGE, 4)
    bandwidth = (LARGE - SMALL) / max(t_large - t_small, 1e-9)
    return {
        "alpha": max(t_small - SMALL / bandwidth, 1e-6),
        "bandwidth": bandwidth,
        "small_s": t_small,
        "large_s": t_large,
    }


def compute(flags: list[str], reps: int = 5) -> dict:
    """Model FLOP/s of forward + backward of one micro-batch, all ranks at once."""
    cfg = parse_args(flags)
    m = cfg.model
    torch.manual_seed(0)
    model = GPT(m, m.vocab_size)
    tokens = torch.randint(0, m.vocab_size, (cfg.train.micro_batch_size, m.seq_length))
    model(tokens=tokens, labels=tokens).mean().backward()  # warm up
    dist.barrier()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model(tokens=tokens, labels=tokens).mean().backward()
        times.append(time.perf_counter() - start)
    dist.barrier()
    seconds = sorted(times)[len(times) // 2]
    flops = flops_per_token(m, m.vocab_size) * tokens.numel()
    params = [q for q in model.parameters()]
    adam = torch.optim.AdamW(params, lr=1e-4)
    adam.step()  # creates its state
    steps = []
    for _ in range(reps):
        start = time.perf_counter()
        adam.step()
        steps.append(time.perf_counter() - start)
    numel = sum(q.numel() for q in params)
    optimizer = sorted(steps)[len(steps) // 2] / numel
    return {
        "flags": " ".join(flags),
        "seconds": seconds,
        "flops": flops,
        "layers": m.num_layers,
        "optimizer_s_per_param": optimizer,
    }


def gla_overhead(flags: list[str]) -> dict:
    """Forward + backward of the same model with GLA and with softmax layers (all ranks at once):
    the GLA layers' extra seconds, which the FLOP count does not see (calibrate: gla_layer_s)."""
    gla = "--attention-type gla --softmax-attention-every 0".split()
    softmax, linear = compute(flags), compute(flags + gla)
    return {
        "flags": " ".join(flags),
        "layers": softmax["layers"],
        "softmax_s": softmax["seconds"],
        "gla_s": linear["seconds"],
    }


def quantizer() -> float:
    x = torch.randn(1 << 22)
    out = torch.empty_like(x)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        wire = quantize_wire(x.view(1, -1), 2048, 8)
        dequantize_wire(wire, x.numel(), 2048, 8, out=out.view(1, -1))
        best = min(best, time.perf_counter() - start)
    return 2 * x.numel() / best


def quantizer_geometry(bits: int, block: int) -> list[float]:
    """[seconds per element, seconds per call] of quantize + dequantize-sum at (bits, block), all
    ranks at once: the slope and intercept between a small and a large buffer (2 rows, as a hop)."""
    times = {}
    for n in (1 << 13, 1 << 21):
        x, out = torch.randn(2, n // 2), torch.empty(n // 2)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            wire = quantize_wire(x, block, bits)
            dequantize_sum_wire(wire, n // 2, block, bits, out)
            best = min(best, time.perf_counter() - start)
        times[n] = best
    (n1, t1), (n2, t2) = sorted(times.items())
    per_elem = (t2 - t1) / (n2 - n1)
    return [per_elem / 2, max(t1 - per_elem * n1, 0.0) / 2]  # elements counted twice, 2 calls (as Coll)


def main() -> None:
    out, models = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    result = {"intra_node": link(1), "inter_node": link(world // 2)}
    result["compute"] = [compute(f.split()) for f in models["compute"]]
    result["gla"] = [gla_overhead(f.split()) for f in models["gla"]]
    result["quant_elems_per_s"] = quantizer()
    result["quant"] = {f"{b}/{k}": quantizer_geometry(b, k) for b, k in ((4, 256), (8, 256))}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
