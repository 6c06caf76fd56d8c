"""Activation recompute (--recompute-granularity full|selective, --recompute-method, --recompute-num-layers).

The reference is the same run without recompute. fp32 with hidden and attention dropout on:
every mode must give bitwise the same losses and gradients (single rank) or losses and
weights after 3 AdamW steps (TP2+SP, PP2 interleaved and 1F1B, CP2 All-Scan, ZeRO-3 with
hpZ; a hybrid GLA/softmax model, all in one spawn of 2 ranks), since the rerun repeats the
same arithmetic on the same inputs with the same random numbers. The ledger: the All-Scan
state is not sent again (its bytes are unchanged and no ":recompute" row appears), the
repeated sequence-parallel collectives are exactly one forward's worth per recomputed layer,
and ZeRO-3 gathers no extra byte (the rerun runs after the block's backward gather, or takes
its place).
"""

import numpy as np
import pytest
import torch

from megatron_zpp import recompute
from megatron_zpp.config import ConfigError, ModelConfig
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.tensor_parallel import random as tp_random
from megatron_zpp.validation import validate
from tests.dist import run_distributed
from tests.old_defaults import old_model
from tests.test_parity import BASE, HIDDEN, KINDS, MBS, SEQ, SP_PHASES, train_and_collect

FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers"]
SELECTIVE = ["--recompute-granularity", "selective"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
HYBRID_CFG = dict(attention_type="gla", softmax_attention_every=2)  # layers G S G S


# ---- single rank: gradients, the RNG streams -----------------------------------------


def _single_rank(**recompute_cfg):
    cfg = old_model(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=32,
        linear_chunk_size=8,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        **HYBRID_CFG,
        **recompute_cfg,
    )
    model = GPT(cfg, 96)
    init_weights(model, 3)
    tp_random.seed_parallel_rng(7, 0, 0, 0, torch.device("cpu"))  # attention dropout draws from the TP stream
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):  # two micro-batches: the streams must go on after a rerun as without one
        tokens = torch.randint(0, 96, (2, 32), generator=gen)
        loss = model(tokens=tokens, labels=tokens).mean()
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


MODES = {
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_uniform_3": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "full_block_2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
}


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is as fast, and does not stall on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_single_rank_modes_are_bitwise_no_recompute_with_dropout(monkeypatch, one_thread):
    ref_losses, ref_grads = _single_rank()
    for name, mode in MODES.items():
        losses, grads = _single_rank(**mode)
        assert losses == ref_losses, name
        for key, g in ref_grads.items():
            assert torch.equal(grads[key], g), f"{name}: {key}"
    # the check can fail: a rerun that did not restore the TP stream draws other dropout masks
    monkeypatch.setattr(tp_random, "set_tracker_state", lambda state: None)
    losses, grads = _single_rank(**MODES["full_uniform_1"])
    assert losses != ref_losses or any(not torch.equal(grads[k], g) for k, g in ref_grads.items())


def test_layer_groups_follow_megatron_methods():
    def groups(method, n, layers):
        return recompute.layer_groups(
            ModelConfig(recompute_granularity="full", recompute_method=method, recompute_num_layers=n), layers
        )

    assert groups("uniform", 2, 5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert groups("block", 2, 5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert groups("block", 3, 2) == [(0, 1, True), (1, 2, True)]  # a shorter (uneven) stage: all of it
    assert recompute.layer_groups(ModelConfig(recompute_granularity="selective"), 3) == [(0, 3, False)]


def test_saved_activations_shrink():
    """What the forward keeps for the backward (saved tensors, by storage): full < selective < none."""

    def saved_bytes(**mode):
        shape = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64, linear_chunk_size=8)
        cfg = old_model(**shape, **HYBRID_CFG, **mode)
        model = GPT(cfg, 96)
        init_weights(model, 0)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, 96, (2, 64))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens=tokens, labels=tokens).mean()
        return sum(storages.values())

    none, sel, full = saved_bytes(), saved_bytes(**MODES["selective"]), saved_bytes(**MODES["full_uniform_1"])
    assert full < sel < none


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity full"),
        (SELECTIVE + ["--recompute-num-layers", "1"], "--recompute-num-layers needs --recompute-granularity full"),
        (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
        (FULL_UNIFORM + ["0"], "--recompute-num-layers must be >= 1"),
        (FULL_BLOCK + ["3", "--pipeline-model-parallel-size", "2"], "exceeds the 2 layers"),
    ],
)
def test_meaningless_combinations_are_refused(flags, error):
    with pytest.raises(ConfigError, match=error):
        validate(parse_args(BASE + KINDS["gla"] + ["--num-layers", "4"] + flags), 2)


# ---- two ranks: TP2+SP, PP2 interleaved and 1F1B, CP2 All-Scan, ZeRO-3 + hpZ -----------

HYBRID = KINDS["hybrid"] + DROPOUT + ["--train-iters", "3"]
LAYOUTS = {  # name: (layers, layout flags, the recompute modes run besides none)
    "tp2_sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], [FULL_UNIFORM + ["1"], SELECTIVE]),
    "pp2_interleaved": (
        8,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
        [FULL_BLOCK + ["1"], SELECTIVE],
    ),
    "pp2_1f1b": (4, ["--pipeline-model-parallel-size", "2"], [FULL_UNIFORM + ["2"]]),
    "cp2": (4, ["--context-parallel-size", "2"], [FULL_UNIFORM + ["2"], SELECTIVE]),
    "zero3_hpz": (
        4,
        ["--zero-stage", "3", "--zero-hpz-partition-size", "2"],
        [FULL_UNIFORM + ["2"], FULL_BLOCK + ["1"], SELECTIVE],
    ),
}


def _argvs():
    out = []
    for layers, flags, modes in LAYOUTS.values():
        for mode in [[]] + modes:
            out.append(BASE + HYBRID + ["--num-layers", str(layers)] + flags + mode)
    return out


def _worker(rank, world_size, argvs):
    return [train_and_collect(argv, world_size) for argv in argvs]


def _rows(result, role, phase) -> float:
    return sum(r["bytes"] for r in result["ledger"] if r["role"] == role and r["phase"] == phase)


def test_layouts_bitwise_equal_no_recompute_and_ledger():
    argvs = _argvs()
    per_rank = run_distributed(_worker, 2, argvs, timeout=600)
    i = 0
    for name, (layers, _, modes) in LAYOUTS.items():
        refs, i = [r[i] for r in per_rank], i + 1
        for mode in modes:
            runs, i = [r[i] for r in per_rank], i + 1
            label = f"{name} {' '.join(mode)}"
            for ref, got in zip(refs, runs):
                assert got["losses"] == ref["losses"], label
                for key, w in ref["weights"].items():
                    assert np.array_equal(got["weights"][key], w), f"{label}: {key}"
                _check_ledger(name, mode, layers, ref, got)


def _check_ledger(name, mode, layers, ref, got):
    cfg = validate(parse_args(BASE + HYBRID + ["--num-layers", str(layers)] + LAYOUTS[name][1] + mode), 2)
    micro, full = cfg.num_micro_batches, cfg.model.recompute_granularity == "full"
    if name == "cp2":  # the state is never sent again; a full rerun gathers the softmax layers' K/V again
        for phase in ("cp_allscan_fwd", "cp_allscan_bwd", "cp_attn_fwd", "cp_attn_bwd"):
            assert _rows(got, "cp", phase) == _rows(ref, "cp", phase), phase
        assert _rows(ref, "cp", "cp_allscan_fwd") + _rows(ref, "cp", "cp_allscan_bwd") > 0  # one way per end rank
        assert not [r for r in got["ledger"] if r["phase"].startswith("cp_allscan") and "recompute" in r["phase"]]
        again = _rows(ref, "cp", "cp_attn_fwd") if full else 0.0
        assert _rows(got, "cp", "cp_attn_fwd:recompute") == pytest.approx(again)
    if name == "tp2_sp":  # a full rerun repeats the 2 all-gathers and 2 reduce-scatters of each layer's forward
        act = MBS * SEQ * HIDDEN * 4
        again = micro * 2 * layers * act / 2 if full else 0.0  # (tp - 1) / tp of the gathered activation
        assert _rows(got, "tp", "sp_fwd_allgather:recompute") == pytest.approx(again)
        assert _rows(got, "tp", "sp_fwd_reducescatter:recompute") == pytest.approx(again)
        for phase in SP_PHASES:  # the backward's re-gathers too: the rerun keeps shards as the first run does
            assert _rows(got, "tp", phase) == _rows(ref, "tp", phase) > 0, phase
    if name == "zero3_hpz":  # no extra gather: the rerun uses the backward's gather (or issues it itself)

        def gathers(result):
            return sum(r["bytes"] for r in result["ledger"] if "allgather" in r["phase"] and r["role"] != "tp")

        assert gathers(got) == gathers(ref) > 0
