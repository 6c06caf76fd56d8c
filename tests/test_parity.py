"""Every parallel layout reproduces the single-rank run.

Same seed, same data, fp32: the per-step losses for 6 steps and the final weights
(reassembled from TP shards and pipeline stages) equal the single-process run within
1e-5 relative, for softmax, GLA and hybrid models (the hybrid with the GLA paper's
low-rank decay gate, whose replicated down-projection gets partial gradients under TP).
Gradient clipping is active (the clip is below the gradient norm), so the global norm
must count every parameter once. The same runs check the ledger: TP, CP, PP and plain-DP
bytes per step equal their closed forms. Four layouts also run with activation recompute (full
uniform, full block or selective), which must change nothing: each has a sibling layout without it.

Megatron's GPT defaults (learned absolute positions, biases in every linear layer, LayerNorm, gelu)
run through TP (hidden dropout on: the residual stream's masks are the single rank's), TP x SP x CP
with packed documents (--reset-position-ids: the positions restart) and TP x PP (tests/zero adds DP).
"""

import functools

import numpy as np
import pytest
import torch

from megatron_zpp import comm, training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.tensor_parallel import unshard
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import OLD_DEFAULTS

STEPS, GBS, MBS, SEQ, HIDDEN = 6, 8, 2, 32, 32
BASE = (
    OLD_DEFAULTS
    + (
        f"--mock-data --hidden-size {HIDDEN} --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        f"--seq-length {SEQ} --vocab-size 128 --make-vocab-size-divisible-by 32 --gla-chunk-size 8 "
        f"--train-iters {STEPS} --global-batch-size {GBS} --micro-batch-size {MBS} --lr 3e-3 "
        f"--lr-warmup-iters 2 --clip-grad 0.5 --seed 11 "
        f"--ffn-hidden-size {64 * ((int(8 * HIDDEN / 3) + 63) // 64)}"  # the SwiGLU width these tolerances were set at
    ).split()
)
KINDS = {
    "softmax": ["--attention-type", "softmax"],
    "gla": ["--attention-type", "gla"],
    "hybrid": ["--attention-type", "gla", "--softmax-attention-every", "2", "--gla-gate-low-rank", "4"],
    "gdn_hybrid": ["--attention-type", "gdn", "--softmax-attention-every", "2"],
}
FULL_UNIFORM_1 = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
LAYOUTS = {  # name: (world size, layers, flags)
    "dp2": (2, 4, []),  # plain data parallelism, 2 micro-batches accumulated per rank
    "tp2": (2, 4, ["--tensor-model-parallel-size", "2"]),
    "tp2_sp_recompute": (
        2,
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            *FULL_UNIFORM_1,
        ],
    ),
    "pp2": (2, 4, ["--pipeline-model-parallel-size", "2"]),
    "pp4_interleaved_recompute": (
        4,
        8,
        "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 --recompute-granularity full "
        "--recompute-method block --recompute-num-layers 1".split(),
    ),
    "tp2_pp2": (4, 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2_pp2_dp2_recompute": (
        8,
        4,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --recompute-granularity selective".split(),
    ),
    "cp2": (2, 4, ["--context-parallel-size", "2"]),
    "tp2_cp2_sp": (
        4,
        4,
        ("--tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --all-scan-blocks 2").split(),
    ),
    "cp4_allgather_recompute": (
        4,
        4,
        [
            "--context-parallel-size",
            "4",
            "--cp-algo",
            "all-gather",
            *FULL_UNIFORM_1,
        ],
    ),
}


def argv_for(kind: str, layers: int, flags: list[str]) -> list[str]:
    return BASE + KINDS[kind] + ["--num-layers", str(layers)] + flags


def train_and_collect(argv: list[str], world_size: int) -> dict:
    cfg = validate(parse_args(argv), world_size)
    run = training.setup(cfg)
    history = training.train(run)
    losses = [h["loss"] for h in history]
    ledger = comm.LEDGER.local_rows()  # the steps' traffic, before the gathers below
    with run.dp.full_parameters():  # ZeRO-3 keeps only shards between uses
        weights = {
            name: p.detach().double().numpy().copy() for chunk in run.chunks for name, p in chunk.named_parameters()
        }
    splits = {name: p.tp_split for chunk in run.chunks for name, p in chunk.named_parameters()}
    grads = {  # the last step's reduced (and clipped) gradients, where the engine keeps them whole (DDP)
        name: p.main_grad.detach().double().numpy().copy()
        for chunk in run.chunks
        for name, p in chunk.named_parameters()
        if getattr(p, "main_grad", None) is not None
    }
    g = run.groups
    return {
        "losses": losses,
        "weights": weights,
        "grads": grads,
        "splits": splits,
        "ledger": ledger,
        "units": [(u.name, u.padded) for u in getattr(run.dp, "units", [])],  # ZeRO's flat buffers
        "dropped": [h.get("moe/dropped_fraction") for h in history],  # MoE with a capacity (tests/moe)
        "coords": {"tp": g.tp_rank, "pp": g.pp_rank, "dp": g.dp_rank, "cp": g.cp_rank, "etp": g.etp_rank},
    }


def _worker(rank, world_size, argvs):
    return [train_and_collect(argv, world_size) for argv in argvs]  # one spawn for all model kinds


@functools.cache
def reference(kind: str, layers: int) -> dict:
    return train_and_collect(argv_for(kind, layers, []), 1)


def full_weights(results: list[dict], key: str = "weights") -> dict[str, np.ndarray]:
    """Reassemble full weights (or `key`: the gradients) from DP replica 0: TP shards per stage, stages by name."""
    pieces: dict[str, dict[int, np.ndarray]] = {}
    splits = {}
    for r in results:
        if r["coords"]["dp"] or r["coords"]["cp"]:
            continue
        for name, w in r[key].items():
            pieces.setdefault((name, r["coords"]["pp"]), {})[r["coords"]["tp"]] = w
            splits[name] = r["splits"][name]
    full = {}
    for (name, _stage), by_tp in pieces.items():
        t = unshard([torch.from_numpy(by_tp[i]) for i in sorted(by_tp)], splits[name]).numpy()
        if name in full:  # the tied embedding on the last stage must equal the first stage's
            assert_close_relative(t, full[name], f"{name} (last-stage copy)", tol=1e-6)
        full[name] = t
    return full


def assert_close_relative(got: np.ndarray, ref: np.ndarray, name: str, tol: float = 1e-5):
    """||got - ref|| / ||ref|| <= tol: Adam turns fp32 round-off in near-zero gradients
    into a few 1e-6 moves of single elements, so elementwise checks would test noise."""
    rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel <= tol, f"{name}: relative difference {rel:.2e} > {tol}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(layout):
    world, layers, flags = LAYOUTS[layout]
    kinds = list(KINDS)
    argvs = [argv_for(kind, layers, flags) for kind in kinds]
    per_rank = run_distributed(_worker, world, argvs, timeout=600)
    for k, kind in enumerate(kinds):
        ref = reference(kind, layers)
        results = [r[k] for r in per_rank]
        assert_matches_reference(results, ref, kind)
        assert ref["losses"][-1] < ref["losses"][0]
        check_ledger(kind, layers, flags, world, results)


# Megatron's default dropout (hidden and attention 0.1) with the default layout-invariant masks: every layout drops
# the single rank's elements (model/dropout.py). ZeRO-3 over DP2 (other micro-batches than the single rank's
# sequence), TP2 x SP with selective recompute (the probabilities' masks redrawn in the rerun), CP2 (token
# offsets), PP2 with full recompute (another stage's layers; the hidden masks redrawn). Per-rank masks
# (--dropout-masks per-rank, torch's generators) miss the single rank here by ~1e-3 in the losses.
DROPOUT_ON = "--hidden-dropout 0.1 --attention-dropout 0.1 --train-iters 3".split()
DROPOUT_LAYOUTS = [
    "--use-distributed-optimizer --zero-stage 3",
    "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity selective",
    "--context-parallel-size 2",
    "--pipeline-model-parallel-size 2 " + " ".join(FULL_UNIFORM_1),
]


def test_dropout_on_layouts_match_single_rank():
    argv = argv_for("gdn_hybrid", 4, DROPOUT_ON)
    per_rank = run_distributed(_worker, 2, [argv + flags.split() for flags in DROPOUT_LAYOUTS], timeout=600)
    ref = train_and_collect(argv, 1)
    for k, flags in enumerate(DROPOUT_LAYOUTS):
        assert_matches_reference([r[k] for r in per_rank], ref, f"dropout on, {flags}")
    assert ref["losses"][-1] < ref["losses"][0]


def assert_matches_reference(results: list[dict], ref: dict, what: str) -> None:
    """Every rank's losses (each reports the global loss) and the reassembled weights equal the reference's."""
    for r in results:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=f"{what} losses, {r['coords']}")
    got = full_weights(results)
    assert set(got) == set(ref["weights"])
    for name, w in ref["weights"].items():
        assert_close_relative(got[name], w, f"{what} {name}")


def _bytes(rows, role, phase) -> float:
    return sum(r["bytes"] for r in rows if r["role"] == role and r["phase"] == phase)


def check_ledger(kind, layers, flags, world, results):
    """TP: per micro-batch, 2 per layer + 1 (embedding / output layer) collectives of a
    [micro, seq, hidden] activation each way; PP: one activation per micro-batch and
    chunk boundary each way; plain DP: one ring all-reduce of the fp32 gradients per step."""
    cfg = validate(parse_args(argv_for(kind, layers, flags)), world)
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    micro = cfg.num_micro_batches
    act = MBS * SEQ // cp * HIDDEN * 4
    for r in results:
        rows, c = r["ledger"], r["coords"]
        if tp > 1:
            stage_layers = layers // pp
            first, last = c["pp"] == 0, c["pp"] == pp - 1
            if p.sequence_parallel:
                for phase in SP_PHASES:
                    assert _bytes(rows, "tp", phase) == pytest.approx(
                        _sp_expect(phase, first, last, micro, stage_layers, tp, act)
                    ), phase
            else:  # forward: after each row-parallel linear + the embedding; backward: before each column one + output
                ring = 2 * (tp - 1) / tp * act * micro
                assert _bytes(rows, "tp", "tp_fwd_allreduce") == pytest.approx((2 * stage_layers + first) * ring)
                assert _bytes(rows, "tp", "tp_bwd_allreduce") == pytest.approx((2 * stage_layers + last) * ring)
        if cp > 1:  # GLA, GDN: one fp32 state [micro, heads/TP, d, d] per layer each way (All-Scan), whatever CP is
            m = cfg.model
            linear_layers = sum(m.layer_kind(i) in ("gla", "gdn") for i in range(layers))
            state = MBS * (m.num_attention_heads // tp) * m.head_dim**2 * 4
            fwd, bwd = _bytes(rows, "cp", "cp_allscan_fwd"), _bytes(rows, "cp", "cp_allscan_bwd")
            if p.cp_algo == "all-scan":
                assert fwd == pytest.approx(micro * linear_layers * state * (c["cp"] != cp - 1))
                assert bwd == pytest.approx(micro * linear_layers * state * (c["cp"] != 0))
            else:  # LASP-2 / KCP: every rank gathers (P-1) states (+ their transitions), so the bytes grow with P
                assert _bytes(rows, "cp", "cp_lasp2_fwd") >= micro * linear_layers * state * (cp - 1)
            # GDN's convolution: the last 3 tokens of q|k|v (fp32, heads/TP wide) to the next rank, gradients back
            halo = (
                micro
                * (kind == "gdn_hybrid")
                * linear_layers
                * MBS
                * 3
                * 3
                * m.num_attention_heads
                // tp
                * m.head_dim
                * 4
            )
            assert _bytes(rows, "cp", "cp_halo_fwd") == pytest.approx(halo * (c["cp"] != cp - 1))
            assert _bytes(rows, "cp", "cp_halo_bwd") == pytest.approx(halo * (c["cp"] != 0))
        if p.data_parallel_size > 1 and cfg.zero.zero_stage == 0:
            dp, numel = p.data_parallel_size, sum(w.size for w in r["weights"].values())
            assert _bytes(rows, "dp_cp", "grad_allreduce") == pytest.approx(2 * (dp - 1) / dp * 4 * numel)
        if pp > 1:
            chunks = p.num_layers_per_virtual_pipeline_stage and layers // (
                pp * p.num_layers_per_virtual_pipeline_stage
            )
            chunks = chunks or 1
            stage_act = act // (tp if p.sequence_parallel else 1)
            sends_fwd = micro * (chunks - (c["pp"] == pp - 1))
            sends_bwd = micro * (chunks - (c["pp"] == 0))
            assert _bytes(rows, "pp", "pp_fwd_p2p") == pytest.approx(sends_fwd * stage_act)
            assert _bytes(rows, "pp", "pp_bwd_p2p") == pytest.approx(sends_bwd * stage_act)


SP_PHASES = ("sp_fwd_allgather", "sp_fwd_reducescatter", "sp_bwd_regather", "sp_bwd_allgather", "sp_bwd_reducescatter")


def _sp_expect(phase, first, last, micro, stage_layers, tp, act) -> float:
    """Sequence parallel: all-gather before each column-parallel linear (2 per layer, +1
    for the output layer on the last stage), reduce-scatter after each row-parallel one
    (2 per layer, +1 for the embedding on the first stage); the backward mirrors them and, as
    Megatron's, all-gathers each column-parallel input again (only its shard was kept)."""
    gathers = 2 * stage_layers + last
    scatters = 2 * stage_layers + first
    n = {
        "sp_fwd_allgather": gathers,
        "sp_bwd_regather": gathers,
        "sp_bwd_reducescatter": gathers,
        "sp_fwd_reducescatter": scatters,
        "sp_bwd_allgather": scatters,
    }[phase]
    return micro * n * (tp - 1) / tp * act


MEGATRON = (
    "--attention-type softmax --normalization LayerNorm --activation gelu --position-embedding-type learned_absolute "
    "--add-bias-linear --max-position-embeddings 40 --num-layers 2"
).split()
MEGATRON_LAYOUTS = {  # name: (world size, model and data flags (the reference's too), layout flags)
    "tp2_dropout": (2, ["--hidden-dropout", "0.1"], ["--tensor-model-parallel-size", "2"]),
    "tp2_sp_cp2_packed": (
        4,
        ["--reset-position-ids", "--reset-attention-mask", "--apply-layernorm-1p"],
        "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2".split(),
    ),
    "tp2_pp2": (4, [], "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2".split()),
}


def _megatron_worker(rank, world_size, argv):
    return train_and_collect(argv, world_size)


@pytest.mark.parametrize("layout", list(MEGATRON_LAYOUTS))
def test_megatron_defaults_match_single_rank(layout):
    world, model_flags, flags = MEGATRON_LAYOUTS[layout]
    argv = BASE + MEGATRON + model_flags
    results = run_distributed(_megatron_worker, world, argv + flags, timeout=600)
    ref = train_and_collect(argv, 1)
    assert any(n.endswith("mlp.fc2.bias") for n in ref["weights"]) and "position_embeddings.weight" in ref["weights"]
    for r in results:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=f"{layout} losses, {r['coords']}")
    got = full_weights(results)
    assert set(got) == set(ref["weights"])
    for name, w in ref["weights"].items():  # biases start at 0: Adam turns round-off into 1e-5 of their small norm
        assert_close_relative(got[name], w, f"{layout} {name}", tol=5e-5 if name.endswith("bias") else 1e-5)
    assert ref["losses"][-1] < ref["losses"][0]
