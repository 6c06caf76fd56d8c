"""The step-time simulator (megatron_zpp/planning/simulator/):

* its per-step bytes per (role, phase, op, link) equal a real --comm-report ledger exactly,
  for ZeRO++ (qwZ + hpZ + qgZ over 2 emulated nodes), ZeRO-3 with PP 1F1B and CP All-Scan,
  TP (sequence parallel) with PP, and a GDN hybrid at TP2 x SP x CP2 under full recompute (each rerun stops
  before the reduce-scatter that ends its layer): one 4-rank gloo spawn, one step each;
* the pipeline timing of the real schedules gives 1F1B's bubble (p-1)/(m+p-1) exactly with
  uniform forward/backward times, and the interleaved schedule a smaller one;
* more inter-node bandwidth never makes a step slower;
* qgZ's cross-node gradient bytes per node are 1/4 of a 16-bit gradient's (the paper's M/4),
  plus its fp32 block scales;
* mixture of experts: the same exact ledger for EP2 alltoall, EP2 x TP2 (SP, expert TP 1) alltoall with a
  shared expert under ZeRO-1, EP2 x expert TP2 allgather under ZeRO-3 (and with a shared expert under
  --moe-layer-recompute), and EP4 alltoall padded to the capacity with a random router (in the 4-rank spawn above);
  a token exchange's bytes per rank are tokens x topk x H x (EP-1)/EP on the EP group's link class (intra-
  or inter-node by the node size), and an imbalance stretches the busiest rank's exchange and compute;
* the CLI prints a table and a JSONL row.
"""

import importlib.util
import json
import os

import pytest

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.planning.simulator import ledger_rows, preset, simulate
from megatron_zpp.planning.simulator.schedule import uniform_pipeline
from megatron_zpp.validation import validate
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = (
    "--mock-data --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 32 "
    "--vocab-size 128 --make-vocab-size-divisible-by 32 --gla-chunk-size 8 --num-layers 2 "
    "--attention-type gla --softmax-attention-every 2 --global-batch-size 8 --train-iters 1 --ranks-per-node 2 "
    "--zero-quantization-block-size 64 --zero-gradient-quantization-block-size 64"
).split()
MOE = "--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --init-method-std 0 "
LAYOUTS = {
    "zero++ (qwZ, hpZ, qgZ), 2 nodes": "--zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 2 "
    "--zero-quantized-gradients",
    "zero-3 + PP2 1F1B + CP2 all-scan": "--zero-stage 3 --pipeline-model-parallel-size 2 --context-parallel-size 2 "
    "--cp-algo all-scan",
    "TP2 sequence parallel + PP2": "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--sequence-parallel",
    "zero-3 + hierarchy, bf16 gradient wire": "--zero-stage 3 --zero-hierarchy 2 --grad-reduce-in-bf16",
    "plain DP4, bf16 gradient wire": "--grad-reduce-in-bf16",
    # grouped value heads with K != V: the scan's K x V state per value head, the halo's q | k | v channels
    "GDN hybrid (2 key, 4 value heads, K 8, V 12), TP2 + CP2 all-scan": "--attention-type gdn "
    "--tensor-model-parallel-size 2 --context-parallel-size 2 --linear-num-key-heads 2 --linear-num-value-heads 4 "
    "--linear-key-head-dim 8 --linear-value-head-dim 12",
    "GDN hybrid, CP4 all-gather, bf16": "--attention-type gdn --context-parallel-size 4 --cp-algo all-gather --bf16",
    # full recompute without dropout: each layer's rerun stops at fc2's input (torch.utils.checkpoint's early stop),
    # before its reduce-scatter; the scan's state and the halo are recalled, not sent again
    "GDN hybrid, TP2 x SP x CP2, full recompute, no dropout": "--attention-type gdn --tensor-model-parallel-size 2 "
    "--sequence-parallel --context-parallel-size 2 --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1 --hidden-dropout 0 --attention-dropout 0",
    # Mixture of experts. A token exchange's rows depend on the routing (the ledger counts them exactly); the
    # simulator's are the even load's, which is also the exact mean over an EP group whose ranks route alike:
    # --init-method-std 0 makes every router send every token to the lowest experts (ties to the lower index).
    # Random routing here moves the dispatch rows' mean 4% off the even load.
    "MoE EP2 alltoall": MOE + "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
    "MoE EP2 x TP2 (SP, expert TP 1) alltoall, shared expert, ZeRO-1": MOE
    + "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --tensor-model-parallel-size 2 "
    "--sequence-parallel --moe-token-dispatcher-type alltoall --zero-stage 1 --moe-shared-expert-intermediate-size 32 "
    "--moe-shared-expert-gate",
    "MoE EP2 x expert TP2 allgather, ZeRO-3, bf16": MOE
    + "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --zero-stage 3 --bf16",
    # the MoE layer's rerun: its shared expert's gather again, not the shared expert's reduce-scatter that ends it
    "MoE EP2 x expert TP2 allgather, shared expert, --moe-layer-recompute": MOE
    + "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
    "--moe-shared-expert-intermediate-size 32 --moe-layer-recompute",
    # padded to the capacity, every expert takes exactly its capacity from each rank: exact with a random router
    "MoE EP4 alltoall padded to capacity, random router": MOE.replace("--init-method-std 0 ", "")
    + "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.5 "
    "--moe-pad-expert-input-to-capacity",
}


def _ledgers(rank, world_size, argvs):
    from megatron_zpp import comm, training

    out = []
    for argv in argvs:
        run = training.setup(validate(parse_args(argv), world_size))
        training.train(run)  # train() resets the ledger first: the report holds this run only
        out.append(comm.gather_report(world_size))
    return out


def test_bytes_equal_a_real_ledger():
    argvs = [BASE + flags.split() for flags in LAYOUTS.values()]
    reports = run_distributed(_ledgers, 4, argvs, timeout=600)[0]
    for name, report, argv in zip(LAYOUTS, reports, argvs):
        real = {(r["role"], r["phase"], r["op"], r["link"]): r["bytes_per_rank_per_step"] for r in report["records"]}
        sim = ledger_rows(validate(parse_args(argv), 4))
        assert set(sim) == set(real), (
            f"{name}: simulator-only {set(sim) - set(real)}, ledger-only {set(real) - set(sim)}"
        )
        for key, value in real.items():
            assert sim[key] == pytest.approx(value, rel=1e-12, abs=1e-9), f"{name} {key}"


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_1f1b_bubble_and_interleaving(pp, m):
    tf, tb = 1.0, 2.0
    step = uniform_pipeline(pp, 1, m, tf, tb)
    bubble = 1 - m * (tf + tb) / step
    assert bubble == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    v = 2  # each chunk holds half the layers: half the time per chunk
    inter = uniform_pipeline(pp, v, m, tf / v, tb / v)
    assert inter < step
    assert 1 - m * (tf + tb) / inter == pytest.approx((pp - 1) / (v * m + pp - 1), rel=1e-12)


def _cfg(extra: str, world: int = 32, rpn: int = 8):
    flags = (
        "--mock-data --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
        f"--vocab-size 32000 --global-batch-size {world * 2} --bf16 --ranks-per-node {rpn} "
    ) + extra
    return validate(parse_args(flags.split()), world)


def test_side_streams_hide_the_quantizer_on_an_accelerator():
    """On a GPU preset the quantizer and the hop chains run on the communication streams
    (zero_engine's accelerator schedule): ZeRO++'s step is faster than on the same preset
    timed with the CPU schedule (quantizer on the compute stream, one hop per later unit)."""
    import dataclasses

    cfg = validate(parse_args(BASE + LAYOUTS["zero++ (qwZ, hpZ, qgZ), 2 nodes"].split()), 4)
    gpu = preset("v100-ib100")
    on_streams = simulate(cfg, gpu).step_time_s
    on_compute = simulate(cfg, dataclasses.replace(gpu, device="cpu")).step_time_s
    assert on_streams < on_compute


def test_reductions_in_flight_cover_every_hop():
    """Three tiers: three reductions in flight (the engine's and the simulator's rule), so the
    outermost hop is never issued and waited for in the same call; a flag below it is raised."""
    from megatron_zpp.planning.simulator.model import reductions_in_flight

    argv = BASE + "--zero-stage 3 --zero-quantized-gradients --ranks-per-node 4 --zero-hierarchy 2".split()
    assert reductions_in_flight(validate(parse_args(argv), 8)) == 3
    assert reductions_in_flight(validate(parse_args(argv + ["--zero-reduce-in-flight", "1"]), 8)) == 3
    assert reductions_in_flight(validate(parse_args(argv + ["--zero-reduce-in-flight", "5"]), 8)) == 5
    assert reductions_in_flight(validate(parse_args(BASE + ["--zero-stage", "2"]), 4)) == 2


def test_more_bandwidth_is_never_slower():
    for extra in (
        "--zero-stage 3",
        "--zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 8 --zero-quantized-gradients",
        "--zero-stage 0",
    ):
        cfg = _cfg(extra)
        times = [simulate(cfg, preset("v100-ib100").with_inter_node(g)).step_time_s for g in (25, 100, 400, 1600)]
        assert all(a >= b for a, b in zip(times, times[1:])), (extra, times)
        assert times[0] > times[-1]


def test_qgz_cross_node_gradient_bytes_are_a_quarter_per_node():
    """ZeRO-3's reduce-scatter sends (n-1)/n x 4P bytes per rank across nodes (fp32 gradients here);
    qgZ sends (N-1)/N x (P/(2D) + scales) per rank: the node's D ranks together send
    (N-1)/N x P/2, i.e. 1/4 of a 16-bit gradient's P x 2 bytes (the paper's M/4 for M = 2P)."""
    z3 = ledger_rows(_cfg("--zero-stage 3"), [0])
    zpp = ledger_rows(_cfg("--zero-stage 3 --zero-quantized-gradients"), [0])
    grad_z3 = sum(v for k, v in z3.items() if k[1] == "zero_grad_reducescatter" and k[3] == "inter_node")
    grad_qgz = sum(v for k, v in zpp.items() if k[1] == "qgz_grad" and k[3] == "inter_node")
    n, nodes, D = 32, 4, 8
    padded_elems = grad_z3 / ((n - 1) / n * 4)
    fp16_per_node = (nodes - 1) / nodes * 2 * padded_elems  # a 16-bit gradient's cross-node share per node
    block = _cfg("").zero.zero_gradient_quantization_block_size  # one fp32 scale per block: 8/block more than int4
    assert D * grad_qgz / fp16_per_node == pytest.approx(0.25 * (1 + 8 / block), rel=1e-9)


def test_moe_exchange_bytes_link_class_and_imbalance():
    """EP8 alltoall over 64 ranks: each dispatch/combine (forward and backward) sends b s k h e (EP-1)/EP bytes per
    rank and MoE layer, on intra-node links with 8 ranks per node (the EP group inside a node) and inter-node
    with 4; an imbalance of 1.5 leaves the bytes and makes the exchanges and the step slower."""
    from megatron_zpp.planning.simulator import rank_step
    from megatron_zpp.planning.simulator.model import wire_time

    b, s, h, k, ep, L = 2, 512, 1024, 4, 8, 4
    moe = (
        f"--num-experts 16 --moe-ffn-hidden-size 512 --moe-router-topk {k} --expert-model-parallel-size {ep} "
        f"--moe-token-dispatcher-type alltoall --micro-batch-size {b} --num-layers {L}"
    )
    cl = preset("h100")
    for rpn, link in ((8, "intra_node"), (4, "inter_node")):
        cfg = _cfg(moe, world=64, rpn=rpn)
        names = ("moe_dispatch", "moe_combine", "moe_dispatch_bwd", "moe_combine_bwd")
        colls = [c for _, cs in rank_step(cfg, 0).per_op for _, c in cs if c.phase in names]
        assert len(colls) == 4 * L * cfg.num_micro_batches
        assert {c.link for c in colls} == {link} and {c.role for c in colls} == {"ep"}
        assert all(c.bytes() == b * s * k * h * 2 * (ep - 1) / ep for c in colls)
        slow = [c for _, cs in rank_step(cfg, 0, 1.5).per_op for _, c in cs if c.phase in names]
        assert [c.bytes() for c in slow] == [c.bytes() for c in colls]
        assert wire_time(slow[0], cl, rpn) > wire_time(colls[0], cl, rpn)
        even, busy = simulate(cfg, cl), simulate(cfg, cl, 1.5)
        assert busy.step_time_s > even.step_time_s and busy.bytes_per_rank == even.bytes_per_rank
        assert busy.exposed_s["moe dispatch (synchronous)"] > even.exposed_s["moe dispatch (synchronous)"] > 0


def _cli():
    spec = importlib.util.spec_from_file_location(
        "simulate_scaling", os.path.join(ROOT, "tools", "simulate_scaling.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_table_and_json(capsys):
    flags = [
        "--world-size",
        "16",
        "--system",
        "a100",
        "--mock-data",
        "--num-layers",
        "2",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--global-batch-size",
        "32",
        "--zero-stage",
        "3",
    ]
    cli = _cli()
    assert cli.main(flags) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "TFLOP/s per GPU" in out and "inter_node" in out
    assert cli.main(["--json", *flags]) == 0
    row = json.loads(capsys.readouterr().out)
    assert set(row) == {
        "experiment",
        "system",
        "ranks",
        "link_gbps",
        "seq_length",
        "step_time_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "peak_tflops",
        "source",
    }
    assert row["source"] == "simulated" and row["ranks"] == 16 and row["step_time_s"] > 0
    assert cli.main([*flags, "--system", "nonesuch"]) == 2
    assert "unknown cluster preset" in capsys.readouterr().err


def test_calibration_fit_recovers_known_terms(monkeypatch, tmp_path):
    """megatron_zpp.testing.calibration.fit_runs (tools/calibrate_cluster.py's) on "runs" that are the
    simulator itself with known overhead, overlap, per-call quantizer and chain-message terms gets those terms back (the
    fit is a linear solve on the simulator's own columns: exact up to its max(0, .) kinks,
    here within 1% for the linear ones, 10% for the per-call and per-message ones); --refit of
    a preset that stores those runs, with stale terms in it, gets the known terms back too."""
    from megatron_zpp.testing import calibration as cc

    link = {"alpha": 1.5e-4, "bandwidth": 2e9, "shared": "rank"}
    base = {  # an emulated preset as the probe writes it (figures of a 2026-12-01 calibration)
        "name": "emulated",
        "ranks_per_node": 2,
        "sustained_tflops": 0.08,
        "links": {"intra_node": link, "inter_node": {**link, "bandwidth": 1.25e8, "shared": "node"}},
        "quant_elems_per_s": 6.5e8,
        "quant": {"4/256": [2e-9, 3e-4], "8/256": [1e-9, 2e-4]},
        "optimizer_s_per_param": 2e-8,
        "device": "cpu",
        "per_layer_s": 0.017,
        "measured": {"inter_node_efficiency": 1.0},
    }
    truth = {
        "fixed_step_s": 0.03,
        "unit_step_s": 0.004,
        "overlap_efficiency": 0.3,
        "quant": {"4/256": [2e-9, 5e-3], "8/256": [1e-9, 2e-3]},
        "scan_msg_s": 2e-3,
    }
    monkeypatch.setattr(
        cc,
        "measure_runs",
        lambda cluster, runs, world, rounds, log=None: {
            k: cc._sim(base, argv, rate, world, **truth) for k, (argv, rate) in runs.items()
        },
    )
    got = cc.fit_runs(None, base, 4)
    for k in ("fixed_step_s", "unit_step_s", "overlap_efficiency"):
        assert got[k] == pytest.approx(truth[k], rel=0.01), k
    assert got["scan_msg_s"] == pytest.approx(truth["scan_msg_s"], rel=0.1)
    for key, (_, per_call) in truth["quant"].items():
        assert got["quant"][key][1] == pytest.approx(per_call, rel=0.1), key
    assert all(preset(n).overlap_efficiency == 1.0 and preset(n).unit_step_s == 0.0 for n in ("v100-ib100", "h100"))
    stale = {**base, "fixed_step_s": 1.0, "overlap_efficiency": 0.9, "notes": "old"}
    stale["measured"] = {**base["measured"], "quant": base["quant"], "calibration_runs": got["calibration_runs"]}
    (tmp_path / "p.json").write_text(json.dumps(stale))
    refitted = cc.refit(str(tmp_path / "p.json"), 4)
    for k in ("fixed_step_s", "unit_step_s", "overlap_efficiency"):  # the stale terms are not kept
        assert refitted[k] == pytest.approx(truth[k], rel=0.01), k
    assert refitted["scan_msg_s"] == pytest.approx(truth["scan_msg_s"], rel=0.1)
    for key, (_, per_call) in truth["quant"].items():
        assert refitted["quant"][key][1] == pytest.approx(per_call, rel=0.1), key
    assert "refitted" in refitted["notes"]


def test_sp_backward_gathers_hide_behind_their_matmuls():
    """TP2 + SP on an H100 preset (overlap efficiency 1): every TP collective is exposed, but in each
    column-parallel backward (qkv and fc1 of each layer, the output layer) the input's re-gather hides
    behind the input-gradient matmul and the gradient's reduce-scatter behind the weight-gradient one:
    2 b s h w / TP FLOPs each (w: the product's full width) at the preset's sustained rate."""
    from megatron_zpp.planning.simulator import rank_step
    from megatron_zpp.planning.simulator.model import coll_time

    L, h, s, b, heads, kv, ffn, vocab, world = 4, 1024, 512, 2, 16, 4, 2816, 32000, 16
    cfg = _cfg(
        f"--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size {b} --attention-type softmax "
        f"--group-query-attention --num-query-groups {kv} --swiglu --ffn-hidden-size {ffn} --num-layers {L}",
        world=world,
    )
    cl = preset("h100")
    assert cl.overlap_efficiency == 1.0
    colls = [c for _, cs in rank_step(cfg, 0).per_op for _, c in cs if c.kind == "tp"]
    every = sum(coll_time(c, cl, cfg.parallel.ranks_per_node) for c in colls)
    t_gather = coll_time(next(c for c in colls if c.phase == "sp_bwd_regather"), cl, cfg.parallel.ranks_per_node)
    t_scatter = coll_time(next(c for c in colls if c.phase == "sp_bwd_reducescatter"), cl, cfg.parallel.ranks_per_node)
    d = h // heads
    widths = [(heads + 2 * kv) * d, 2 * ffn] * L + [vocab]  # vocab 32000 is a multiple of 128 x TP: no padding
    hidden = 0.0
    for w in widths:
        matmul = 2 * b * s * h * w / 2 / (cl.sustained_tflops * 1e12)
        hidden += min(t_gather, matmul) + min(t_scatter, matmul)
    micro = cfg.num_micro_batches
    assert micro * len(widths) * 2 == sum(c.phase in ("sp_bwd_regather", "sp_bwd_reducescatter") for c in colls)
    got = simulate(cfg, cl).exposed_s["tp+cp (synchronous)"]
    assert got == pytest.approx(every - micro * hidden, rel=1e-9)
    assert 0 < micro * hidden < every


def test_emulated_preset_ships_as_package_data():
    """The emulated preset is read from the installed package (importlib.resources), not from bench/."""
    from importlib import resources

    from megatron_zpp.planning.simulator.hardware import EMULATED_JSON

    data = resources.files("megatron_zpp.planning.simulator").joinpath("presets", "emulated_cluster.json")
    assert data.is_file() and os.path.samefile(str(data), EMULATED_JSON)
    emulated = preset("emulated")
    assert emulated.name == "emulated" and emulated.ranks_per_node == 2
    assert preset("emulated", EMULATED_JSON).sustained_tflops == emulated.sustained_tflops
