"""tools/dry_run.py: ranks of a large layout run one by one on the fake process group and fake
tensors; the collective order, the point-to-point pairing and the memory beside the estimate."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest

from megatron_zpp.config.arguments import parse_config
from megatron_zpp.planning.dry_run import auto_ranks, check, dry_run, fused_attention, run_rank
from megatron_zpp.topology import topology_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("dry_run_tool", os.path.join(ROOT, "tools", "dry_run.py"))
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

TINY = (
    "--mock-data --hidden-size 64 --num-attention-heads 8 --seq-length 64 --micro-batch-size 1 "
    "--vocab-size 512 --tokenizer-type NullTokenizer --train-iters 1"
).split()
WIDE = (
    TINY
    + (
        "--num-layers 8 --global-batch-size 8 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
        "--zero-stage 1 --ranks-per-node 8"
    ).split()
)  # 512 ranks: TP8 x PP8 x DP8, one micro-batch per step


def test_auto_ranks_cover_every_role_and_one_group_of_each_kind():
    cfg = parse_config(WIDE, 512, run=False)
    topo = topology_from_config(cfg, 512)
    ranks = auto_ranks(cfg, 512)
    coords = [topo.coords(r) for r in ranks]
    for axis, last in (("tp", 7), ("dp", 7), ("pp", 7)):
        assert {c[axis] for c in coords} >= {0, last}
    assert {c["pp"] for c in coords} >= {0, 3, 7}  # first, middle, last stage
    for kind in ("tp", "dp", "pp"):
        assert set(topo.groups([kind])[0]) <= set(ranks)
    assert len(ranks) < 64


def test_wide_layout_dry_runs_clean(tmp_path, capsys):
    """512 ranks of a tiny model, --ranks auto through the tool over two worker processes: every
    group's members agree, every send meets its receive, each rank's step peak is the estimator's
    within 15% and its start-up between what set-up holds and that plus the init's largest full
    parameter, and a rank run by a worker is the rank run in this process."""
    out = tmp_path / "dry.json"
    rc = tool.main(["--world-size", "512", "--ranks", "auto", "--jobs", "2", "--json", str(out), *WIDE])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.strip().splitlines()[-1].startswith("OK")
    report = json.loads(out.read_text())
    assert report["ok"] and not report["mismatches"]
    ranks = report["ranks"]
    assert len(ranks) == len(auto_ranks(parse_config(WIDE, 512, run=False), 512))
    for r in ranks:
        assert 0.85 < r["ratio"] < 1.15, r
        assert r["startup_held_bytes"] <= r["startup_peak_bytes"] <= r["startup_held_bytes"] + r["startup_draw_bytes"]
        assert r["startup_peak_bytes"] <= r["step_peak_bytes"]
    here = run_rank(parse_config(WIDE, 512, run=False), ranks[-1]["rank"], 512)
    assert {f"{role} {list(g)}": seq for (role, g), seq in here.collectives.items()} == ranks[-1]["collectives"]
    assert (here.startup_peak, here.step_peak) == (ranks[-1]["startup_peak_bytes"], ranks[-1]["step_peak_bytes"])
    stages = {r["coords"]["pp"]: r for r in ranks}
    assert any(m[0] == "send" for msgs in stages[0]["p2p"].values() for m in msgs)  # pipeline traffic recorded
    assert all(r["collectives"] for r in ranks)
    estimate = [line for line in text.splitlines() if line.startswith("estimate: about ")]
    assert len(estimate) == 1 and f"for {len(ranks)} ranks" in estimate[0]  # printed once, after the first rank


MOE_512 = (
    TINY
    + (
        "--num-layers 4 --global-batch-size 64 --tensor-model-parallel-size 2 --sequence-parallel "
        "--pipeline-model-parallel-size 4 --zero-stage 1 --ranks-per-node 8 --num-experts 64 --moe-ffn-hidden-size 32 "
        "--moe-router-topk 4 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --moe-grouped-gemm"
    ).split()
)  # 512 ranks: TP2 (SP) x DP64 x PP4, 64 experts over EP8 (expert TP 1, 16 expert-data-parallel replicas)


def test_moe_layout_of_512_ranks_dry_runs_clean():
    """The 64-expert layout, EP8 x PP4 x DP64 (x TP2) over 512 ranks: rank 0's whole EP group (ranks 0-7, whose
    token all-to-alls must agree in order and size) and rank 8 (its expert-data-parallel peer) run on the fake
    process group; every group's members issue the same collectives, each rank's bytes per link are the
    simulator's and its peak the estimator's within 5%. A rank that left out a token exchange (its results
    tampered) is named by its EP group. --ranks auto would add rank 0's whole DP group (64 ranks), too long for
    the suite: auto's expert groups are checked without running them; pipeline pairing is test_wide_layout's."""
    cfg = parse_config(MOE_512, 512, run=False)
    ranks = [*range(8), 8]
    report = dry_run(cfg, 512, ranks)
    assert report.ok, [m.message for m in report.mismatches]
    for r in report.results:
        assert 0.95 < r.ratio < 1.05, (r.rank, r.ratio)
    ep = ("ep", tuple(range(8)))
    phases = [c.split()[1] for c in report.results[0].collectives[ep]]
    per_layer = ["moe_counts", "moe_dispatch", "moe_combine"]  # forward; the backward's two, micro-batch by micro-batch
    assert phases[:3] == per_layer and phases.count("moe_dispatch_bwd") == cfg.num_micro_batches
    assert all(report.results[i].collectives[ep] == report.results[0].collectives[ep] for i in range(8))
    assert ("edp", tuple(range(0, 128, 8))) in report.results[8].collectives  # expert grads over 16 replicas
    tampered = [dataclasses.replace(r, collectives=dict(r.collectives)) for r in report.results]
    seq = list(tampered[5].collectives[ep])
    seq.remove(next(c for c in seq if " moe_dispatch " in c))
    tampered[5].collectives[ep] = seq
    found = [m.message for m in check(tampered) if m.what == "order"]
    assert len(found) == 1 and found[0].startswith("group ep [0, 1, 2, 3, 4, 5, 6, 7] diverged at collective #1")
    picked = auto_ranks(cfg, 512)
    assert set(range(8)) | set(range(0, 128, 8)) <= set(picked)  # rank 0's ep and edp groups


def test_fake_peaks_are_the_real_runs_live_bytes():
    """One rank of a small model, dropout off (with dropout, real CPU SDPA takes its math path, which
    the dry run replaces with the fused kernel's tensors): the dry run's start-up and step peaks equal the live
    bytes of the same set-up and step on real CPU tensors (LiveBytes), on its first run in the
    process (shapes new to FakeTensorMode's dispatch cache: its decompositions' intermediates are
    not the model's) and on its second (cache hits)."""
    import dataclasses as dc

    from megatron_zpp import training
    from megatron_zpp.planning import live_bytes
    from megatron_zpp.planning.dry_run import fake_world
    from megatron_zpp.training.step import train_step

    argv = TINY + "--num-layers 2 --hidden-size 80 --seq-length 72 --global-batch-size 1".split()
    argv += "--attention-dropout 0 --hidden-dropout 0".split()
    cfg = parse_config(argv, 1, run=False)
    fake = [run_rank(cfg, 0, 1) for _ in range(2)]
    with fake_world(0, 1, 1), live_bytes.LiveBytes() as live:
        run = training.setup(cfg)
        startup = live.peak
        live.reset_peak()
        train_step(dc.replace(run))
        step = live.peak
    assert [(r.startup_peak, r.step_peak) for r in fake] == [(startup, step)] * 2


def test_attention_with_dropout_keeps_what_the_fused_kernel_keeps():
    """Under the dry run, SDPA with dropout (and with a CP mask, grouped KV heads) keeps its output and
    an fp32 logsumexp, as CUDA's flash/efficient kernels do, not the CPU math path's [b, h, s, s]."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_zpp.planning.live_bytes import LiveBytes

    b, h, s, d = 1, 8, 1024, 64
    real = F.scaled_dot_product_attention
    with FakeTensorMode(allow_non_fake_inputs=True), fused_attention(), LiveBytes() as live:
        q = torch.empty(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.empty(b, 2, s, d, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(s, s, dtype=torch.bool)
        for extra in ({"is_causal": True}, {"attn_mask": mask}):
            before = live.live
            out = F.scaled_dot_product_attention(q, kv, kv, dropout_p=0.1, enable_gqa=True, **extra)
            assert out.shape == q.shape and out.grad_fn is not None
            assert live.live - before == b * h * s * (2 * d + 4)
            out.sum().backward()
            assert kv.grad.shape == kv.shape
            del out
    assert F.scaled_dot_product_attention is real  # put back


def test_zeropp_three_tiers_match_the_simulator_bytes():
    """ZeRO++ (qwZ, hpZ over a pair, qgZ over pair / node / cluster) on 8 ranks of 4 per node, two
    steps: the ledger's bytes per link class and step are the simulator's on each rank run, the
    groups agree, the second step issues the first's collectives again, and its peak holds AdamW's
    moments besides."""
    argv = (
        TINY
        + (
            "--num-layers 2 --global-batch-size 8 --bf16 --zero-stage 3 --zero-quantized-weights "
            "--zero-hpz-partition-size 2 --zero-quantized-gradients --zero-hierarchy 2 --ranks-per-node 4"
        ).split()
    )
    argv[argv.index("--train-iters") + 1] = "2"
    cfg = parse_config(argv, 8, run=False)
    report = dry_run(cfg, 8, [0, 1, 2, 7], steps=2)  # a pair, its node, the other node
    assert report.ok, [m.message for m in report.mismatches]
    for r in report.results:
        assert set(r.link_bytes) == {"tier0", "intra_node", "inter_node"}
        assert r.link_bytes == pytest.approx(r.simulated, rel=1e-9)
        for seq in r.collectives.values():
            half = len(seq) // 2
            assert seq[:half] == seq[half:] and half > 0
        first, second = r.step_peaks
        assert second > first


@pytest.mark.parametrize("mixer", ["gla", "gdn"])
def test_hybrid_all_scan_under_cp(mixer):
    """A hybrid GLA or GDN model at CP4 x TP2 with All-Scan: the scan's p2p chain (and GDN's convolution
    halo) pairs up along the CP group and the softmax layer's all-gathers agree."""
    argv = (
        TINY
        + (
            f"--num-layers 2 --global-batch-size 1 --attention-type {mixer} --softmax-attention-every 2 "
            "--gla-chunk-size 16 --tensor-model-parallel-size 2 --context-parallel-size 4 --cp-algo all-scan "
            "--sequence-parallel"
        ).split()
    )
    cfg = parse_config(argv, 8, run=False)
    report = dry_run(cfg, 8, [0, 2, 4, 6])  # the CP group of TP rank 0
    assert report.ok, [m.message for m in report.mismatches]
    cp = [k for k in report.results[1].p2p if k[0] == "cp"]
    assert cp and {m[0] for m in report.results[1].p2p[cp[0]]} == {"send", "recv"}


def test_skipped_reduction_is_caught_and_named():
    """Rank 3 leaves out its first ZeRO gradient reduce-scatter: its data-parallel group diverges at
    collective #0, and the message names the group, the op and the rank."""
    argv = TINY + "--num-layers 2 --global-batch-size 4 --tensor-model-parallel-size 2 --zero-stage 1".split()
    cfg = parse_config(argv, 8, run=False)
    report = dry_run(cfg, 8, [1, 3, 5, 7], skip={3: "zero_grad_reducescatter"})
    assert not report.ok
    orders = [m.message for m in report.mismatches if m.what == "order"]
    assert len(orders) == 1, orders
    msg = orders[0]
    assert "group dp_cp [1, 3, 5, 7] diverged at collective #0" in msg
    assert "rank 3: reduce_scatter zero_grad_reducescatter" in msg
    assert "rank 1: reduce_scatter zero_grad_reducescatter" in msg


def test_unmatched_send_is_caught():
    """A stage's receive that does not match the previous stage's send is named (tampered results)."""
    argv = TINY + "--num-layers 2 --global-batch-size 2 --pipeline-model-parallel-size 2".split()
    cfg = parse_config(argv, 2, run=False)
    results = [run_rank(cfg, r, 2) for r in (0, 1)]
    assert check(results) == []
    key = next(iter(results[1].p2p))
    first = results[1].p2p[key].index(next(m for m in results[1].p2p[key] if m[0] == "recv"))
    op, peer, n, dtype, tag = results[1].p2p[key][first]
    results[1].p2p[key][first] = (op, peer, n + 1, dtype, tag)
    found = check(results)
    assert [m.what for m in found] == ["p2p"]
    assert "rank 0 -> rank 1 message #0" in found[0].message


@pytest.mark.parametrize(
    "argv",
    [
        ["--world-size", "3", *WIDE],  # not divisible by TP x PP
        ["--world-size", "512", "--steps", "2", *WIDE],  # more steps than --train-iters 1 has data for
        ["--world-size", "512", "--jobs", "0", *WIDE],
    ],
)
def test_bad_layout_is_a_config_error(argv, capsys):
    assert tool.main(argv) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--world-size", "0"], "error: --world-size 0: give at least 1"),
        (["--world-size", "4x"], "error: argument --world-size: invalid int value: '4x'"),
        (
            ["--world-size", "512", "--ranks", "3", "-1"],
            "error: --ranks -1: give rank numbers (0 to 511) or auto alone",
        ),
        (["--world-size", "512", "--ranks", "512"], "error: --ranks 512: not a rank of --world-size 512 (0 to 511)"),
        (
            ["--world-size", "512", "--gpu-memory-gb", "nan"],
            "error: --gpu-memory-gb nan: give a positive number of GiB",
        ),
        (["--world-size", "512", "--json", "/proc/no/such/dir/x.json"], "error: --json /proc/no/such/dir/x.json: "),
        (["--world-size", "512", "--max-ranks", "10"], "error: --ranks auto picks "),
    ],
)
def test_bad_tool_arguments_are_one_line_before_any_work(argv, line, capsys):
    """The tool's own arguments are checked before any rank runs (an unwritable --json too): one line."""
    assert tool.main([*argv, *WIDE]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    assert captured.err.startswith(line), captured.err


def test_max_ranks_is_checked_before_the_ranks_are_picked(monkeypatch, capsys):
    """A million ranks under --ranks auto: refused from the group sizes alone (O(1)), before auto_ranks
    or any walk over the world's groups runs; rank 0's groups are picked without walking the world."""
    from megatron_zpp.topology import Topology

    def never(*a, **k):
        raise AssertionError("O(world) work before the --max-ranks check")

    monkeypatch.setattr(tool, "auto_ranks", never)
    monkeypatch.setattr(Topology, "groups", never)
    million = [*WIDE, "--global-batch-size", "15625"]  # TP8 x PP8 x DP15625
    assert tool.main(["--world-size", str(10**6), "--ranks", "auto", *million]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --ranks auto picks at least 15625 ranks, more than --max-ranks 512 (about 2 s each on one "
                   "core): raise --max-ranks or name fewer with --ranks"], err  # fmt: skip
    monkeypatch.undo()
    cfg = parse_config(WIDE, 512, run=False)
    monkeypatch.setattr(Topology, "groups", never)  # auto_ranks takes rank 0's groups by their coordinates
    picked = auto_ranks(cfg, 512)
    monkeypatch.undo()
    topo = topology_from_config(cfg, 512)
    assert all(set(topo.groups([k])[0]) <= set(picked) for k in ("tp", "cp", "dp", "pp"))
