"""Hardware and cluster presets: per-rank sustained compute, and an alpha-beta link per
link class of the ledger (topology.py: "tier0", ... inside a node, "intra_node",
"inter_node").

A link is (alpha: seconds per message step, bandwidth: bytes/s, shared): `shared` says
whether the bandwidth belongs to one rank ("rank": NVLink/xGMI ports, each GPU has its
own) or to a whole node whose ranks all send at once in our collectives ("node": a NIC
or a shaped veth; each rank then gets bandwidth / ranks_per_node).

The sustained compute rate is stated, not measured, for the GPU presets: the fraction
of the dense bf16/fp16 peak that a well-tuned GPT step reaches (MFU), given per preset
with where it comes from. The `emulated` preset is written by tools/calibrate_cluster.py
from measurements on this machine's emulated cluster (megatron_zpp/testing/cluster.py); it ships
as package data (presets/emulated_cluster.json).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from ...context_parallel.chain import EMULATED_PRESET

GBPS = 1e9 / 8  # bytes/s in one Gbit/s


@dataclass(frozen=True)
class Link:
    alpha: float  # s per message step
    bandwidth: float  # bytes/s
    shared: str = "rank"  # "rank" or "node"


@dataclass
class Cluster:
    name: str
    ranks_per_node: int
    sustained_tflops: float  # model FLOP/s per rank the step's compute reaches (TFLOP/s)
    links: dict[str, Link]
    quant_elems_per_s: float = 50e9  # elements quantized or dequantized per second per rank
    optimizer_s_per_param: float = 0.0  # AdamW step time per fp32 master element on a rank
    sub_node_tiers: tuple[int, ...] = ()  # ranks per tier domain inside a node (Frontier: (2,) GCD pairs)
    device: str = "cuda"  # the device whose link facts pick All-Scan's blocks (context_parallel/chain.py)
    fixed_step_s: float = 0.0  # per-step overhead outside the model (Python, data, logging)
    per_layer_s: float = 0.0  # per layer and micro-batch, forward + backward (kernel launches, hooks)
    # Extra per GLA layer and micro-batch over a softmax one, forward + backward: the chunked
    # scan's many small ops, which perf.py's FLOP count does not see (CPU: ~2x a softmax layer at
    # 2 chunks; the probe measures it at the CP runs' local length). 0 on GPUs (fused kernels).
    gla_layer_s: float = 0.0
    # Per ZeRO unit and step: the engine's Python work per unit (gather/release hooks, the
    # reduction's bookkeeping, AdamW over the unit's shard segments). ~0 on GPUs (hidden by async
    # kernels); the emulated preset fits it from calibration-only training runs.
    unit_step_s: float = 0.0
    # Fraction of the communication-stream time that really hides behind compute. 1.0 where
    # collectives run on their own stream/engine (NCCL/RCCL on GPUs); on the emulated cluster 4
    # ranks share 2 cores with gloo's threads, so a "hidden" transfer still takes CPU from the
    # compute: fitted from calibration runs at two link rates (tools/calibrate_cluster.py).
    overlap_efficiency: float = 1.0
    # Quantizer cost per (bits, block), key "bits/block": [seconds per element, seconds per call]
    # (a call: one quantize or dequantize(-sum) pass, whose fixed cost is chunk loops and small
    # tensors). Per element measured by the probe at the runs' geometry; per call fitted from
    # calibration-only qwZ / qgZ runs. Keys absent here fall back to quant_elems_per_s.
    quant: dict = field(default_factory=dict)
    # Extra seconds per message of the CP state chain (All-Scan's K blocks x chain steps, ring's
    # and all-gather's P-1 steps) beyond the link alpha: gloo's per-send cost with 4 ranks on 2 cores
    # (fitted from a calibration-only CP run). 0 on GPUs.
    scan_msg_s: float = 0.0
    notes: str = ""
    # Dense bf16/fp16 peak per rank (TFLOP/s, data sheet): what MFU is measured against; 0 where
    # unknown (the emulated CPU cluster: pass --peak-tflops).
    peak_tflops: float = 0.0
    measured: dict = field(default_factory=dict)

    def link(self, name: str) -> Link:
        if name in self.links:
            return self.links[name]
        if name.startswith("tier") and "intra_node" in self.links:
            return self.links["intra_node"]
        raise KeyError(f"cluster {self.name} has no link class {name!r} (has {sorted(self.links)})")

    def with_inter_node(self, gbps: float) -> Cluster:
        """The same cluster with another per-node inter-node bandwidth (Gbit/s)."""
        links = dict(self.links)
        old = links["inter_node"]
        links["inter_node"] = Link(old.alpha, gbps * GBPS, old.shared)
        return Cluster(**{**self.__dict__, "links": links, "name": f"{self.name}@{gbps:g}Gbps"})

    def to_json(self) -> dict:
        d = asdict(self)
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        return d

    @staticmethod
    def from_json(d: dict) -> Cluster:
        d = dict(d)
        d["links"] = {k: Link(**v) for k, v in d["links"].items()}
        d["sub_node_tiers"] = tuple(d.get("sub_node_tiers", ()))
        return Cluster(**d)


def _v100_dgx2(ib_gbps: float) -> Cluster:
    # ZeRO++ (arXiv 2306.10209) Sec. 5: 24 DGX-2 nodes of 16 V100 SXM3 32 GB, NVSwitch inside a
    # node, InfiniBand between nodes with 1, 4 or 8 100 Gbit/s links enabled (100/400/800 Gbps per node).
    # V100: 125 TFLOP/s fp16 tensor peak (NVIDIA V100 data sheet); 40% sustained is our assumption
    # (DeepSpeed's ZeRO-3 runs on V100 report 40-50 TFLOP/s per GPU at high bandwidth).
    # NVLink 2 on V100: 6 links x 25 GB/s = 150 GB/s per direction per GPU (data sheet).
    return Cluster(
        name=f"v100-dgx2-ib{ib_gbps:g}",
        ranks_per_node=16,
        sustained_tflops=0.40 * 125.0,
        peak_tflops=125.0,
        links={
            "intra_node": Link(10e-6, 150e9 * 0.8, "rank"),  # ~80% of the link rate as NCCL bus bandwidth
            "inter_node": Link(20e-6, ib_gbps * GBPS * 0.9, "node"),
        },
        quant_elems_per_s=100e9,  # ZeRO++'s fused CUDA quantizers: memory-bound, ~900 GB/s HBM2
        optimizer_s_per_param=16 * 2 / 900e9,  # fused Adam: ~32 bytes moved per fp32 element at 900 GB/s
        notes="ZeRO++ paper cluster (arXiv 2306.10209, Sec. 5)",
    )


def _frontier() -> Cluster:
    # Frontier node (OLCF user guide; arXiv 2501.04266 Sec. III): 4 MI250X = 8 GCDs. The two GCDs of
    # one MI250X share 4 Infinity Fabric links (4 x 50 GB/s = 200 GB/s per direction); GCDs on
    # different MI250X are joined by 1-2 links (50-100 GB/s); each MI250X has its own 25 GB/s
    # Slingshot-11 NIC: 4 x 25 = 100 GB/s per node. MI250X peak 383 TFLOP/s fp16/bf16 dense, i.e.
    # 191.5 per GCD (AMD data sheet); 30% sustained is our assumption (ROCm GPT runs reported ~30-40%).
    return Cluster(
        name="frontier-mi250x",
        ranks_per_node=8,
        sustained_tflops=0.30 * 191.5,
        peak_tflops=191.5,
        links={
            "tier0": Link(8e-6, 200e9 * 0.7, "rank"),  # GCD pair in one MI250X package
            "intra_node": Link(10e-6, 50e9 * 0.7, "rank"),  # GCD to GCD across MI250X packages
            "inter_node": Link(20e-6, 100e9 * 0.8, "node"),  # 4 Slingshot NICs per node
        },
        sub_node_tiers=(2,),
        quant_elems_per_s=80e9,
        optimizer_s_per_param=32 / 1.6e12,  # HBM2e 1.6 TB/s per GCD
        notes="Frontier (arXiv 2501.04266 Sec. III, OLCF Frontier user guide)",
    )


def _nvidia(name: str, peak: float, nvlink: float, ib_per_gpu_gbps: float, hbm: float, mfu: float) -> Cluster:
    return Cluster(
        name=name,
        ranks_per_node=8,
        sustained_tflops=mfu * peak,
        peak_tflops=peak,
        links={
            "intra_node": Link(8e-6, nvlink * 0.8, "rank"),
            "inter_node": Link(15e-6, 8 * ib_per_gpu_gbps * GBPS * 0.9, "node"),
        },
        quant_elems_per_s=hbm / 6,  # read fp32/bf16, write int8 + scales: ~6 bytes per element
        optimizer_s_per_param=32 / hbm,
    )


PRESETS = {
    "v100-ib100": lambda: _v100_dgx2(100),
    "v100-ib400": lambda: _v100_dgx2(400),
    "v100-ib800": lambda: _v100_dgx2(800),
    "frontier": _frontier,
    # DGX A100: NVLink 3 600 GB/s bidirectional (300 per direction), 8 x 200 Gbit/s HDR IB; 312 TFLOP/s bf16.
    "a100": lambda: _nvidia("a100-dgx", 312.0, 300e9, 200, 2.0e12, 0.45),
    # DGX H100: NVLink 4 900 GB/s bidirectional (450 per direction), 8 x 400 Gbit/s NDR IB; 989 TFLOP/s bf16.
    "h100": lambda: _nvidia("h100-dgx", 989.4, 450e9, 400, 3.35e12, 0.40),
    # H200: H100's interconnect and peak, 4.8 TB/s HBM3e (NVIDIA H200 data sheet).
    "h200": lambda: _nvidia("h200-dgx", 989.4, 450e9, 400, 4.8e12, 0.40),
}
# package data: read with importlib.resources; the path is where tools/calibrate_cluster.py writes it (named once,
# in context_parallel/chain.py, whose block choice reads the same links at run time)
EMULATED_JSON = str(EMULATED_PRESET)


def preset(name: str, path: str | None = None) -> Cluster:
    """A preset by name; "emulated" reads the calibration JSON (tools/calibrate_cluster.py)."""
    if name == "emulated":
        if path is None and EMULATED_PRESET.is_file():
            return Cluster.from_json(json.loads(EMULATED_PRESET.read_text()))
        path = path or EMULATED_JSON
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: run tools/calibrate_cluster.py first (it writes the emulated preset)")
        with open(path) as fh:
            return Cluster.from_json(json.load(fh))
    if name not in PRESETS:
        raise KeyError(f"unknown cluster preset {name!r}; choose one of {sorted(PRESETS) + ['emulated']}")
    return PRESETS[name]()
