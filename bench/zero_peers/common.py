"""What every training script of bench/zero.py shares: the probe that measures a rank, and
for the peers the model, weights, data and optimizer settings identical to ours.

Probe (ours and the peers alike, so that the figures are measured the same way):
* step time: perf_counter around one optimizer step, which ends with the loss all-reduced
  over the ranks (our train_step does that; the peers do it too);
* peak memory: the rank's peak RSS (VmHWM) over the timed steps of each rate: reset through
  /proc/self/clear_refs after the warmup steps, read after the last one;
* rate gates: before the first step of each rate after the first, every rank writes
  gate<k>.rank<r> and waits (outside the timed step) for gate<k>.open, which bench/zero.py
  creates once it has reshaped the link (no traffic is in flight then);
* wire bytes: the first rank of each node reads its veth's tx_bytes (env ZPP_VETH) at every
  step boundary, so bench/zero.py can sum what both nodes put on the shaped link.
Each rank writes $ZPP_PROBE_DIR/rank<r>.json at the end.

Peers: `PeerGPT` of bench/single_rank.py (checked there to give our loss and gradients),
loaded with OUR initialized weights (megatron_zpp.model.init_weights of the same seed), fed
the token stream of megatron_zpp.data.mock.MockGPTDataset in our sample order, trained with
AdamW of our hyperparameters (no decay on 1-D weights), our LR schedule and clipping.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, os.path.join(ROOT, "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


def _tx_bytes(iface: str | None) -> int | None:
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


class Probe:
    """Per-rank measurements. With gate_every = S (timed steps per rate) the rank also waits
    before steps warmup + S, warmup + 2S, ... until bench/zero.py has reshaped the link for
    the next rate (files in $ZPP_PROBE_DIR); only the first rate has warmup steps."""

    def __init__(self, warmup: int, gate_every: int = 0):
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.node = int(os.environ.get("ZPP_NODE", os.environ.get("GROUP_RANK", 0)))
        self.warmup, self.gate_every = warmup, gate_every
        self.iface = os.environ.get("ZPP_VETH") if self.local_rank == 0 else None
        self.out_dir = os.environ.get("ZPP_PROBE_DIR")
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.tx_begin: list[int | None] = []  # veth tx_bytes at the start of step i
        self.tx_end: list[int | None] = []  # and at its end
        self.peak_rss_by_rate: list[int | None] = []  # VmHWM over the timed steps of each rate
        self.hwm_reset = False
        self.rss_start = _vm("VmRSS")
        self._t0 = 0.0

    def _close_rate(self) -> None:
        self.peak_rss_by_rate.append(_vm("VmHWM") if self.hwm_reset else None)
        self.hwm_reset = False

    def _gate(self, k: int) -> None:
        if not self.out_dir:
            return
        with open(os.path.join(self.out_dir, f"gate{k}.rank{self.rank}"), "w"):
            pass
        while not os.path.exists(os.path.join(self.out_dir, f"gate{k}.open")):
            time.sleep(0.02)

    def step_begin(self) -> None:
        s = len(self.step_times)
        rel = s - self.warmup
        gate = bool(self.gate_every) and rel > 0 and rel % self.gate_every == 0
        if gate:
            self._close_rate()
            self._gate(rel // self.gate_every)
        if s == self.warmup or gate:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
                self.hwm_reset = True
            except OSError:
                pass
        self.tx_begin.append(_tx_bytes(self.iface))
        self._t0 = time.perf_counter()

    def step_end(self, loss: float | None = None) -> float:
        dt = time.perf_counter() - self._t0
        self.tx_end.append(_tx_bytes(self.iface))
        self.step_times.append(dt)
        if loss is not None:
            self.losses.append(float(loss))
        return dt

    def finish(self, **extra) -> None:
        self._close_rate()
        res = {
            "rank": self.rank,
            "node": self.node,
            "local_rank": self.local_rank,
            "iface": self.iface,
            "warmup": self.warmup,
            "step_times": self.step_times,
            "losses": self.losses,
            "tx_begin": self.tx_begin,
            "tx_end": self.tx_end,
            "peak_rss_by_rate": self.peak_rss_by_rate,
            "rss_start": self.rss_start,
            "rss_end": _vm("VmRSS"),
            **extra,
        }
        try:
            import resource

            res["maxrss_lifetime"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except Exception:  # noqa: BLE001
            pass
        if self.out_dir:
            with open(os.path.join(self.out_dir, f"rank{self.rank}.json"), "w") as f:
                json.dump(res, f)


# ---------------------------------------------------------------- peers: model, data, optimizer


def peer_args(add_own=None) -> tuple[argparse.Namespace, list[str]]:
    """(this runner's flags, the flags after `--`): every runner takes --warmup and
    --gate-every; `add_own(parser)` adds its own."""
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gate-every", type=int, default=0, help="timed steps per link rate (bench/zero.py)")
    if add_own:
        add_own(ap)
    return ap.parse_args(argv[:split]), argv[split + 1 :]


def parse_model_args(argv: list[str]):
    """Our Config from the same flags pretrain_gpt.py gets (ZeRO flags left out)."""
    from megatron_zpp.arguments import parse_args
    from megatron_zpp.config import validate

    return validate(parse_args(argv), int(os.environ.get("WORLD_SIZE", 1)))


def build_peer_model(cfg):
    """PeerGPT holding exactly the weights our pretrain_gpt.py starts from."""
    import torch
    from single_rank import PeerGPT, to_peer_names

    from megatron_zpp.data.tokenizer import pad_vocab_size
    from megatron_zpp.model import GPT, init_weights

    m = cfg.model
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    assert m.attention_type == "softmax" and m.activation == "swiglu" and m.normalization == "RMSNorm", (
        "the peers implement softmax attention + SwiGLU + RMSNorm only"
    )
    assert not m.untie_embeddings_and_output_weights and m.kv_heads == m.num_attention_heads, (
        "the peers implement tied embeddings and no GQA only"
    )
    ours = GPT(m, vocab)
    init_weights(ours, cfg.train.seed)
    peer = PeerGPT(m, vocab)
    peer.load_state_dict(to_peer_names(ours.state_dict(), m.num_layers), strict=False)  # lm_head tied to wte
    del ours
    return peer.to(torch.bfloat16 if cfg.train.bf16 else torch.float32), vocab


class PeerBatches:
    """This rank's micro-batches in our order (megatron_zpp.data.loader): a global batch of
    G is taken in rounds of micro x DP; in each round DP rank d takes the d-th micro-batch."""

    def __init__(self, cfg, rank: int, world: int):
        from megatron_zpp.data.mock import MockGPTDataset

        t = cfg.train
        self.data = MockGPTDataset(
            t.train_iters * t.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size, t.seed
        )
        self.mbs, self.rank, self.world, self.G = t.micro_batch_size, rank, world, t.global_batch_size
        self.num_micro = t.global_batch_size // (t.micro_batch_size * world)

    def micro_batch(self, step: int, k: int):
        import numpy as np
        import torch

        first = step * self.G + k * self.mbs * self.world + self.rank * self.mbs
        data = torch.from_numpy(np.stack([self.data[i] for i in range(first, first + self.mbs)]))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def adamw_param_groups(model, cfg) -> list[dict]:
    """Our MixedPrecisionAdamW's groups: weight decay on >= 2-D weights only."""
    params = list(model.parameters())  # a tied weight is listed once
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def adamw_kwargs(cfg) -> dict:
    o = cfg.optim
    return {"lr": o.lr, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps}


def lr_at(cfg, iteration: int) -> float:
    from megatron_zpp.optim.schedules import learning_rate

    return learning_rate(cfg.optim, iteration, cfg.train.train_iters)
