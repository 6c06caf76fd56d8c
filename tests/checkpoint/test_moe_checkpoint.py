"""Checkpoints of mixture-of-experts runs: which experts a rank saves, exact resume, resharding across
expert parallelism (EP) and expert tensor parallelism (ETP), and the refusal of another expert count.

* Layout (no processes): the experts each rank's file holds, their expert-TP pieces and (ZeRO) their shards
  over the expert-data-parallel group, against megatron-core's own expert RankGenerator (order
  tp-cp-ep-dp-pp over ETP x EP x EDP x PP) and the experts' shapes written out here.
* Resharding (4 gloo ranks, fp32): a run trained 2 steps at EP 1 with ZeRO-3 saves; its checkpoint is loaded
  and saved again along a chain of layouts (EP 2 plain DP, EP 4 ZeRO-3, TP2 x ETP2 x EP2 ZeRO-1 in torch_dist,
  TP2 x SP x ETP1 x EP2 ZeRO-3); every save, consolidated with its AdamW moments,
  equals the source bitwise (pure copies), and every rank holds the source's expert bias.
* Exact resume: a MoE run at EP 2 (alltoall dispatcher) with ZeRO-3 over the expert-data-parallel group and
  aux-loss-free balancing (the expert bias moves every step) saved after step N and resumed gives bitwise the
  losses and weights of the uninterrupted run (tests/checkpoint/test_resume.py's harness); the same
  checkpoint resumed at EP 4 (plain DP) and at EP 1 x ETP 2 (ZeRO-1) follows it to fp32 round-off.
* Another --num-experts (or --moe-layer-freq, expert width) is refused in one line before any file is read.
"""

import os
import re

import numpy as np
import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, save_checkpoint
from megatron_zpp.checkpoint import load as load_module
from megatron_zpp.checkpoint import reshard as reshard_module
from megatron_zpp.checkpoint.full_state import full_state
from megatron_zpp.checkpoint.layout import rank_layout, topology_of
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from megatron_zpp.zero import persistent_buffers
from tests.checkpoint.test_resume import N as SAVED_AT
from tests.checkpoint.test_resume import _first_leg, _second_leg, point_latest_at
from tests.dist import run_distributed
from tests.old_defaults import DROPOUT_OFF

H, F, E = 32, 16, 4
N = 2
BASE = (
    f"--mock-data --device cpu --attention-type softmax --hidden-size {H} --num-attention-heads 4 "
    f"--seq-length 16 --vocab-size 128 --make-vocab-size-divisible-by 32 --num-layers 2 --swiglu "
    f"--global-batch-size 8 --micro-batch-size 1 --lr 3e-3 --lr-warmup-iters 1 --clip-grad 0.5 --seed 5 "
    f"--peak-tflops 1 --train-iters {N} "
    f"--num-experts {E} --moe-ffn-hidden-size {F} --moe-router-topk 2 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 --moe-aux-loss-coeff 0.01 "
    "--moe-shared-expert-intermediate-size 16"
).split()
EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(fc[12])\.(\d+)$")


# ---- which experts each rank saves (no processes) ------------------------------------------------
LAYOUTS = {  # name: (world size, flags)
    "ep2_plain": (4, "--expert-model-parallel-size 2"),
    "ep2_zero3": (4, "--expert-model-parallel-size 2 --zero-stage 3"),
    "ep4_zero1": (4, "--expert-model-parallel-size 4 --zero-stage 1"),
    "tp2_etp1_ep2_zero3": (
        4,
        "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 "
        "--expert-model-parallel-size 2 --zero-stage 3",
    ),
    "etp2_without_tp_ep2_zero3": (4, "--expert-tensor-parallel-size 2 --expert-model-parallel-size 2 --zero-stage 3"),
    "tp2_ep2_pp2_zero2": (
        8,
        "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --zero-stage 2",
    ),
}


def _megatron_expert_ranks(world: int, etp: int, ep: int, pp: int) -> dict[int, dict[str, tuple[int, int]]]:
    """rank -> {"ep"|"tp"|"dp": (its index, group size)} in megatron-core's expert RankGenerator."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out: dict[int, dict] = {r: {} for r in range(world)}
    for axis in ("ep", "tp", "dp"):
        for group in gen.get_ranks(axis):
            for i, r in enumerate(group):
                out[r][axis] = (i, len(group))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_slots_follow_megatrons_expert_grid(layout):
    world, flags = LAYOUTS[layout]
    cfg = validate(parse_args(BASE + flags.split()), world)
    p = cfg.parallel
    etp = p.expert_tp_size
    ep, zero = p.expert_model_parallel_size, cfg.zero.zero_stage
    want = _megatron_expert_ranks(world, etp, ep, p.pipeline_model_parallel_size)
    topo = topology_of(cfg)
    cache: dict = {}
    covered: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (name, etp rank) -> the spans saved
    for r in range(world):
        lay = rank_layout(cfg, 128, r, topo, cache)
        (ep_rank, _), (etp_rank, _), (_, edp) = want[r]["ep"], want[r]["tp"], want[r]["dp"]
        experts = [s for s in lay.slots if s.expert]
        held = {int(EXPERT.match(s.name).group(3)) for s in experts}
        assert held == set(range(ep_rank * E // ep, (ep_rank + 1) * E // ep)), (r, held)
        for s in experts:
            fc1 = EXPERT.match(s.name).group(2) == "fc1"
            assert s.full_shape == ((H, 2 * F) if fc1 else (F, H)), s
            assert (s.tp_rank, s.tp_size) == (etp_rank, etp), s
            assert s.shape == ((H, 2 * F // etp) if fc1 else (F // etp, H)), s
            covered.setdefault((s.name, etp_rank), []).append((s.start, s.start + s.hi - s.lo))
            if zero:  # the unit's shard: its buffer padded to a multiple of edp x block, cut in edp parts
                (length,), _ = lay.tensors[s.key]
                assert length % cfg.zero.zero_quantization_block_size == 0, s
        layers = {int(EXPERT.match(s.name).group(1)) for s in experts}
        assert lay.buffers == {f"layers.{i}.mlp.router.expert_bias": (E,) for i in layers}
    # the ranks of one (ETP, EP, PP) coordinate are one expert-data-parallel group: with plain DP each holds
    # its piece whole; with ZeRO their shards tile the piece exactly once
    for (name, _), spans in covered.items():
        numel = (H * 2 * F if ".fc1." in name else F * H) // etp
        if not zero:
            assert spans == [(0, numel)] * edp, (name, spans)
            continue
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == numel, (name, spans)
        assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:])), (name, spans)


# ---- resharding across EP and expert TP (4 ranks) -------------------------------------------------
def _train(rank, world_size, argv):
    run = training.setup(validate(parse_args(argv), world_size))
    training.train(run)
    return {n: t.clone().numpy() for n, t in persistent_buffers(run.chunks).items()}


def _load_and_save(rank, world_size, argv, out):
    run = training.setup(validate(parse_args(argv), world_size))
    save_checkpoint(run, out)
    return run.resharded_from, {n: t.clone().numpy() for n, t in persistent_buffers(run.chunks).items()}


CHAIN = [  # each loads the previous one's save and saves at once (no step)
    "--expert-model-parallel-size 2",
    "--expert-model-parallel-size 4 --zero-stage 3",
    "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --zero-stage 1 "
    "--ckpt-format torch_dist",
    "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 "
    "--expert-model-parallel-size 2 --zero-stage 3",
]


def test_reshard_across_expert_parallel_sizes(tmp_path):
    src = str(tmp_path / "src")
    bias = run_distributed(_train, 4, BASE + ["--zero-stage", "3", "--save", src])
    # sign updates of +-rate: two steps may cancel in one layer (its loads crossed the mean), not in every layer
    assert any(np.abs(b).sum() > 0 for b in bias[0].values()), "the expert bias never moved"
    want = full_state(src, optimizer=True)
    assert any(EXPERT.match(n) for n in want.weights) and want.moments is not None
    previous = src
    for i, flags in enumerate(CHAIN):
        out = str(tmp_path / f"hop{i}")
        got = run_distributed(_load_and_save, 4, BASE + flags.split() + ["--load", previous], out)
        for changes, buffers in got:
            assert changes, f"{flags}: not resharded"
            assert set(buffers) == set(bias[0]), flags
            for name, b in buffers.items():
                np.testing.assert_array_equal(b, bias[0][name], err_msg=f"{flags}: {name}")
        saved = full_state(out, optimizer=True)
        assert saved.step == want.step, flags
        assert set(saved.weights) == set(want.weights), flags
        for name, w in want.weights.items():
            torch.testing.assert_close(saved.weights[name], w, rtol=0, atol=0, msg=f"{flags}: {name}")
            for k, m in want.moments[name].items():
                torch.testing.assert_close(saved.moments[name][k], m, rtol=0, atol=0, msg=f"{flags}: {name} {k}")
        previous = out


# ---- another expert count is refused, before any file is read (1 process) -------------------------
@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe") / "ckpt")
    run_distributed(_train, 1, BASE + ["--save", ckpt])
    return ckpt


REFUSED = {
    "--num-experts": (["--num-experts", "8"], "--num-experts 4, this run has --num-experts 8"),
    "--moe-layer-freq": (
        ["--moe-layer-freq", "2"],
        r"--moe-layer-freq 1 \(MoE layers 11\), this run has --moe-layer-freq 2 \(MoE layers 10\)",
    ),
    "--moe-ffn-hidden-size": (["--moe-ffn-hidden-size", "8"], "--moe-ffn-hidden-size 16, this run has .* 8"),
    "dense": (["--num-experts", "0"], r"--num-experts 4, this run has --num-experts none \(a dense model\)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_another_expert_count_is_refused_in_one_line(moe_checkpoint, case, monkeypatch):
    flags, words = REFUSED[case]

    def no_read(*args, **kwargs):
        raise AssertionError("a checkpoint file was read")

    monkeypatch.setattr(reshard_module, "open_rank_file", no_read)
    monkeypatch.setattr(load_module, "read_rank_file", no_read)
    argv = [a for a in BASE if a != "--moe-router-enable-expert-bias"] if case == "dense" else BASE
    with pytest.raises(CheckpointError, match=words) as e:
        training.setup(validate(parse_args(argv + flags + ["--load", moe_checkpoint]), 1))
    assert "\n" not in str(e.value)
    assert os.path.exists(os.path.join(moe_checkpoint, "latest"))


def test_expert_bias_turned_on_or_off_at_a_load_is_said(moe_checkpoint, tmp_path, capfd):
    """The aux-loss-free bias may be switched at a load (as the router's other settings): the load's log line
    says that the checkpoint's is unused, or that this run's starts at 0."""
    without = [a for a in BASE if a != "--moe-router-enable-expert-bias"]
    run = training.setup(validate(parse_args(without + ["--load", moe_checkpoint]), 1))
    assert not persistent_buffers(run.chunks)
    assert "the checkpoint's layers.0.mlp.router.expert_bias, layers.1.mlp.router.expert_bias unused" in (
        capfd.readouterr().out
    )
    plain = str(tmp_path / "plain")
    run_distributed(_train, 1, without + ["--save", plain])
    run = training.setup(validate(parse_args(BASE + ["--load", plain]), 1))
    assert all(not b.any() for b in persistent_buffers(run.chunks).values())
    out = capfd.readouterr().out
    assert "layers.0.mlp.router.expert_bias, layers.1.mlp.router.expert_bias not in the checkpoint: start at 0" in out


# ---- exact resume (bitwise), and resumes at other EP / ETP sizes -------------------------------------
# EP 2 over DP 4 with the alltoall dispatcher; ZeRO-3 shards the experts over the expert-data-parallel group
# (2 ranks), the dense weights over DP (4); the expert bias moves every step. Dropout off, so that the resumes
# at other layouts (fresh RNG streams) follow the same trajectory
SOURCE = "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --zero-stage 3".split()
RESUMED_AT = {  # the same checkpoint, resharded: EP 4 plain DP; EP 1 with expert TP 2 (= TP) and ZeRO-1
    "ep4_plain": "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall",
    "tp2_etp2_ep1_zero1": "--tensor-model-parallel-size 2 --sequence-parallel --zero-stage 1",
}
RTOL = 2e-5  # fp32 round-off: other reduction orders over TP, DP, EP and micro-batches


def test_exact_resume_with_expert_bias_and_at_other_expert_layouts(tmp_path):
    model, ckpt = BASE + DROPOUT_OFF + ["--train-iters", str(2 * SAVED_AT)], str(tmp_path / "ckpt")
    argv = model + SOURCE
    first = run_distributed(_first_leg, 4, argv, ckpt)  # uninterrupted, then saving every SAVED_AT steps
    point_latest_at(ckpt, SAVED_AT)
    second = run_distributed(_second_leg, 4, argv, ckpt)
    for (plain, saving), resumed in zip(first, second):
        assert saving["losses"] == plain["losses"], "saving changed the run"
        assert resumed["losses"] == plain["losses"][SAVED_AT:], "resumed losses differ"
        for name, w in plain["weights"].items():
            np.testing.assert_array_equal(resumed["weights"][name], w, err_msg=name)
    losses = first[0][0]["losses"]
    final = {n: w for plain, _ in first for n, w in plain["weights"].items()}  # each EP rank's experts
    for name, flags in RESUMED_AT.items():
        out = run_distributed(_second_leg, 4, model + flags.split(), ckpt)
        torch.testing.assert_close(
            torch.tensor(out[0]["losses"]), torch.tensor(losses[SAVED_AT:]), rtol=RTOL, atol=0, msg=name
        )
        if "tensor-model-parallel" in flags:
            continue  # its weights are TP pieces: the losses above are its check
        # the weights after 3 resumed steps (a lost AdamW moment moves a weight by about lr: 3e-3)
        compared = {n for r in out for n in r["weights"]}
        assert compared == set(final), name
        for r in out:
            for n, w in r["weights"].items():
                np.testing.assert_allclose(w, final[n], rtol=1e-4, atol=1e-6, err_msg=f"{name}: {n}")
