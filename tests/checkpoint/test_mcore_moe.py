"""megatron-core (0.19.2) torch_dist checkpoints of MoE models, both ways, against megatron-core's own GPTModel
with its MoE layer spec (`get_gpt_decoder_block_spec`, local: SequentialMLP experts, the allgather dispatcher,
SharedExpertMLP with its gate), fp32 on CPU.

One single-rank gloo job imports megatron-core once and runs every case: our MoE GPT's weights written by our
writer are loaded by megatron-core's `dist_checkpointing.load` (its logits must be ours), and a fresh
megatron-core model saved by `dist_checkpointing.save` is read by our reader (our logits must be its). Cases:
every layer MoE (megatron-core stacks the layers' keys) with a sigmoid router, expert bias and a gated shared
expert; and a dense layer before two MoE ones (--moe-layer-freq as a list: megatron-core keys each layer on
its own) with softmax top-2, under both specs' names for an MoE layer's pre-MLP norm: the local spec's
(renamed into mlp.linear_fc1.layer_norm_weight by its sharded_state_dict_keys_map) and Transformer Engine's
(pre_mlp_layernorm.weight: its MoE layers keep their own norm). The TE spec itself cannot be built here (no
transformer-engine): its MoE layers' names are produced by the local spec's layers without that keys map.
Megatron-LM's own `load_checkpoint` (test_mcore_megatron_lm's harness) reads the --no-optim export of the mixed
model: every arg its checkpointing.py reads equals its parser's for the MoE command line, and its MoE GPTModel
gives our logits.

Shims (test_mcore._cpu_shims): megatron-core's buffers on torch.cuda.current_device() ('cpu' here), its
save's CUDA synchronize and writer process queue.
"""

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.checkpoint import mcore
from megatron_zpp.checkpoint.save import save_full_dcp
from megatron_zpp.model import GPT, init_weights
from tests.checkpoint.test_mcore import (
    ROWS,
    SEQ,
    _cfg,
    _close,
    _convert,
    _cpu_shims,
    _fresh,
    _mcore_forward,
    _probe,
    _zero_moments,
)
from tests.dist import run_distributed

BASE = (
    "--mock-data --num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 100 "
    "--make-vocab-size-divisible-by 32 --normalization RMSNorm --swiglu --ffn-hidden-size 48 "
    "--position-embedding-type rope --group-query-attention --num-query-groups 2 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
    "--num-experts 4 --moe-ffn-hidden-size 24 --moe-router-topk 2 "
)
CASES = {  # name: (our flags, the spec whose names the checkpoint uses)
    "all_moe_sigmoid": (
        BASE + "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-shared-expert-intermediate-size 40 --moe-shared-expert-gate",
        "local",
    ),
    "mixed_local": (BASE + "--moe-layer-freq [0,1,1]", "local"),
    "mixed_te": (BASE + "--moe-layer-freq [0,1,1] --moe-router-pre-softmax", "transformer_engine"),
}


def _mcore_moe_model(cfg, impl: str):
    """megatron-core's GPTModel with its MoE decoder block spec (local modules, fp32) of our config; with
    impl 'transformer_engine' its MoE layers keep pre_mlp_layernorm's own name, as TE's spec does."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    freq = [int(c) for c in m.moe_layer_freq if c.isdigit()] if "[" in m.moe_layer_freq else int(m.moe_layer_freq)
    tc = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_heads, ffn_hidden_size=m.ffn_size, normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        init_method_std=0.05, num_moe_experts=m.num_experts, moe_ffn_hidden_size=m.expert_ffn_size,
        moe_router_topk=m.moe_router_topk, moe_layer_freq=freq, moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax, moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate, moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
    )  # fmt: skip
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        tc, spec, vocab_size=ROWS, max_sequence_length=SEQ, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, parallel_output=False,
    )  # fmt: skip
    if impl == "transformer_engine":
        for i, layer in enumerate(model.decoder.layers):
            if m.is_moe_layer(i):  # TE's MoE layer: the attention's norm fused into linear_qkv, its own pre-MLP norm
                keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
                layer.submodules_config = dataclasses.replace(layer.submodules_config, sharded_state_dict_keys_map=keys)
    return model


def _our_state(cfg) -> dict[str, torch.Tensor]:
    """Our model's weights (and the routers' expert bias), every one off its init so that its mapping shows."""
    ours = GPT(cfg.model, ROWS)
    init_weights(ours, 3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for t in ours.state_dict().values():
            t.add_(0.05 * torch.randn(t.shape, generator=gen))
    return {n: t.detach().clone() for n, t in ours.state_dict().items()}


def _logits(cfg, state):
    model = GPT(cfg.model, ROWS)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(_probe())


def _case(root, name, flags, impl):
    from megatron.core import dist_checkpointing

    cfg = _cfg(flags)
    state = _our_state(cfg)
    there = os.path.join(root, f"{name}-to")
    tensors = mcore.to_mcore(state, cfg, impl)
    mcore.write(there, 0, tensors, {}, cfg.model)
    torch.manual_seed(1)
    theirs = _mcore_moe_model(cfg, impl).eval()
    loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, mcore.iteration_dir(there))
    theirs.load_state_dict(loaded["model"])
    with torch.no_grad():
        out = {"to": (_logits(cfg, state), _mcore_forward(theirs, _probe()))}
    torch.manual_seed(2)  # a fresh megatron-core model: its weights, our reader
    theirs = _mcore_moe_model(cfg, impl).eval()
    if cfg.model.moe_router_enable_expert_bias:
        with torch.no_grad():
            for layer in theirs.decoder.layers:
                layer.mlp.router.expert_bias.copy_(torch.randn(cfg.model.num_experts))
    back = _fresh(os.path.join(root, f"{name}-from"))
    dist_checkpointing.save(theirs.sharded_state_dict(), back, validate_access_integrity=False)
    read = mcore.read_tensors(back)
    with torch.no_grad():
        out["from"] = (_logits(cfg, mcore.from_mcore(read, cfg)), _mcore_forward(theirs, _probe()))
    out["keys"] = (sorted(tensors), sorted(read))  # ours written, megatron-core's saved
    out["objects"] = (mcore.object_keys(mcore.iteration_dir(there)), mcore.object_keys(back))  # the extra states
    out["transformer_impl"] = mcore.transformer_impl(read)
    return out


def _megatron_lm_loads(root):
    """Megatron-LM's own load_checkpoint (test_mcore_megatron_lm's parser, shims and diffs) reads our --no-optim
    export of the mixed model for --transformer-impl local: its args as its parser gives them for the MoE
    command line, the model settings its load_args_from_checkpoint takes, and its MoE GPTModel's logits."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.checkpoint import test_mcore_megatron_lm as mlm

    arguments, checkpointing, _ = mlm._megatron_lm()  # first: its typing shim before megatron.training imports
    mlm._load_shims(checkpointing)
    flags = CASES["mixed_local"][0].replace(
        "--hidden-dropout 0 --attention-dropout 0 ", "--max-position-embeddings 16 "
    )
    cfg = _cfg(flags + mlm.RUN)
    state = {n: t for n, t in _our_state(cfg).items()}
    save_full_dcp(os.path.join(root, "lm-ours"), cfg, state, None, None, mlm.ITERATION, mlm.CONSUMED)
    there = os.path.join(root, "lm-mlm")
    mcore.export_checkpoint(os.path.join(root, "lm-ours"), there, with_optimizer=False, impl="local")
    args = mlm._megatron_args(flags + " --no-load-optim", there)
    config = arguments.core_transformer_config_from_args(args)
    torch.manual_seed(3)
    model = GPTModel(
        config, get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        position_embedding_type="rope", share_embeddings_and_output_weights=False, parallel_output=False,
    )  # fmt: skip
    with contextlib.redirect_stdout(None):
        iteration, _ = checkpointing.load_checkpoint([model], None, None)
    exported = mcore.read_common(mcore.iteration_dir(there))["args"]
    with torch.no_grad():
        logits = (_logits(cfg, state), _mcore_forward(model.eval(), _probe()))
    diff = mlm._args_diff(exported, args) | mlm._from_checkpoint_diff(there, args)
    diff.pop("no_save_optim", None)  # True: the --no-optim export's own state, as --no-save-optim writes
    return {"iteration": iteration, "args": diff, "logits": logits, "moe": (args.num_experts, args.moe_layer_freq)}


def _mcore_chained_adam(model, step: float | None = None):
    """Megatron-LM's non-distributed Adam, as get_megatron_optimizer builds it: a ChainedOptimizer of
    FP32Optimizers, the dense parameters' groups, then (when megatron-core marked experts expert-parallel) the
    experts' (is_expert_parallel), each built without its __init__'s CUDA loss scale (test_mcore's way); with
    `step`, random moments at it."""
    from megatron.core.optimizer import (
        ChainedOptimizer,
        FP32Optimizer,
        MegatronOptimizer,
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )

    oc = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1)
    groups = _get_param_groups([model], oc, get_standard_config_overrides(oc))
    chained = []
    for experts in (False, True):
        if not (mine := [g for g in groups if g["is_expert_parallel"] == experts]):
            continue
        adam = torch.optim.AdamW(mine, lr=1e-3)
        opt = FP32Optimizer.__new__(FP32Optimizer)
        MegatronOptimizer.__init__(opt, adam, oc, _zero_moments)
        opt.is_stub_optimizer = False
        chained.append(opt)
    gen = torch.Generator().manual_seed(8)
    for opt in chained if step is not None else []:
        _zero_moments(opt.optimizer)  # the state's structure, as a step makes it
        for p, state in opt.optimizer.state.items():
            state.update(exp_avg=torch.randn(p.shape, generator=gen), exp_avg_sq=torch.rand(p.shape, generator=gen))
            state["step"] = torch.tensor(step)
    return ChainedOptimizer(chained)


def _as_expert_parallel(model, ep: int):
    """At EP > 1 megatron-core's expert linears mark their weights allreduce=False (tensor_parallel/layers.py),
    which splits get_megatron_optimizer's groups into the ChainedOptimizer's second optimizer; one process here:
    the marks an EP 2 run's ranks carry (every expert global, as its checkpoint keys are)."""
    for name, p in model.named_parameters():
        if ep > 1 and ".experts." in name:
            p.allreduce = False
    return model


def _adam_both_ways(root, ep: int):
    """megatron-core's MoE model and chained Adam saved as Megatron-LM saves (chained_optim_avoid_prefix) ->
    our import -> our export -> a fresh megatron-core model and chained Adam load it: {param: (its moments back,
    the originals)}, the loaded step and how many optimizers the chain has."""
    from megatron.core import dist_checkpointing

    flags = CASES["mixed_local"][0] + f" --lr 1e-3 --min-lr 1e-4 --weight-decay 0.1 --expert-model-parallel-size {ep}"
    cfg = _cfg(flags, world=ep)
    torch.manual_seed(4)
    model = _as_expert_parallel(_mcore_moe_model(cfg, "local"), ep)
    adam = _mcore_chained_adam(model, 5.0)
    meta = {"chained_optim_avoid_prefix": True, "singleton_local_shards": False}
    sd = {"model": model.sharded_state_dict(metadata=meta)}
    sd["optimizer"] = adam.sharded_state_dict(sd["model"], metadata=meta)
    sd |= {"args": mcore.args_from_config(cfg, 5, 20, ROWS, True, "local"), "iteration": 5, "checkpoint_version": 3.0}
    written = os.path.join(root, f"adam{ep}-mlm")
    dist_checkpointing.save(sd, _fresh(os.path.join(written, "iter_0000005")))
    with open(os.path.join(written, mcore.TRACKER), "w") as f:
        f.write("5")
    ours, back = os.path.join(root, f"adam{ep}-ours"), os.path.join(root, f"adam{ep}-back")
    done = mcore.import_checkpoint(written, ours)[1]
    mcore.export_checkpoint(ours, back, impl="local", expert_parallel=ep)  # the imported config is EP-free
    torch.manual_seed(5)
    fresh = _as_expert_parallel(_mcore_moe_model(cfg, "local"), ep)
    loaded_adam = _mcore_chained_adam(fresh)
    sd = {"model": fresh.sharded_state_dict(metadata=meta)}
    sd["optimizer"] = loaded_adam.sharded_state_dict(sd["model"], is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load(sd, mcore.iteration_dir(back))
    fresh.load_state_dict(loaded["model"])
    loaded_adam.load_state_dict(loaded["optimizer"])
    names = {p: n for n, p in fresh.named_parameters()}
    originals = dict(model.named_parameters())
    out = {}
    for new, old in zip(loaded_adam.chained_optimizers, adam.chained_optimizers):
        for p in (p for g in new.optimizer.param_groups for p in g["params"]):
            was = old.optimizer.state[originals[names[p]]]
            out[names[p]] = [(new.optimizer.state[p][k], was[k]) for k in mcore.MOMENTS]
    steps = [float(o.optimizer.state[p]["step"]) for o in loaded_adam.chained_optimizers for p in o.optimizer.state]
    return {"moments": out, "steps": sorted(set(steps)), "imported": done, "chain": len(adam.chained_optimizers)}


def _all_cases(rank, world, root):
    _cpu_shims()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    out = {name: _case(root, name, flags, impl) for name, (flags, impl) in CASES.items()}
    adam = {f"adam_ep{ep}": _adam_both_ways(root, ep) for ep in (1, 2)}
    return out | adam | {"megatron_lm": _megatron_lm_loads(root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all_cases, 1, str(tmp_path_factory.mktemp("mcore_moe")), timeout=300)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_moe_logits_equal_megatron_core_both_ways(results, name):
    r = results[name]
    for way in ("to", "from"):
        ours, theirs = r[way]
        assert ours.shape == theirs.shape == (2, SEQ, ROWS)
        assert _close(ours, theirs, 1e-5), (way, (ours - theirs).abs().max().item())
    written, saved = r["keys"]
    assert written == saved  # our writer's keys are those megatron-core's own save gives
    ours, theirs = r["objects"]
    assert set(ours) - {mcore.COMMON_KEY} == set(theirs) - {mcore.COMMON_KEY}  # and its None extra states
    assert r["transformer_impl"] == CASES[name][1]


def test_megatron_lm_load_checkpoint_reads_our_moe_export(results):
    r = results["megatron_lm"]
    assert r["args"] == {}, r["args"]  # every arg its checkpointing.py reads, as its parser gives them
    assert r["iteration"] == 3 and r["moe"] == (4, [0, 1, 1])
    ours, theirs = r["logits"]
    assert ours.shape == theirs.shape and _close(ours, theirs, 1e-5), (ours - theirs).abs().max().item()


@pytest.mark.parametrize("ep", [1, 2])
def test_megatron_core_chained_adam_comes_back_bitwise(results, ep):
    """megatron-core's non-distributed Adam (at EP 2 a ChainedOptimizer of the dense and the experts' groups) ->
    ours -> megatron-core: every parameter's moments, the experts' included, bitwise, and the step."""
    r = results[f"adam_ep{ep}"]
    assert r["chain"] == (2 if ep > 1 else 1)
    assert r["imported"]["optimizer"] and r["imported"]["step"] == 5.0
    assert any("experts" in n for n in r["moments"]) and len(r["moments"]) == len(set(r["moments"]))
    for name, pairs in r["moments"].items():
        assert all(torch.equal(a, b) for a, b in pairs), name
    assert r["steps"] == [5.0]


def test_moe_keys_are_megatron_cores_layouts(results):
    stacked = results["all_moe_sigmoid"]["keys"][0]
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in stacked
    assert "decoder.layers.mlp.shared_experts.gate_weight" in stacked
    per_layer = results["mixed_te"]["keys"][0]
    assert {"decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"} <= set(
        per_layer
    )
    assert "decoder.layers.2.mlp.experts.experts.linear_fc2.weight" in per_layer


@pytest.mark.parametrize("name", list(CASES))
def test_moe_round_trip_is_bitwise(name):
    """Ours -> megatron-core's keys -> ours: every tensor back bitwise (transposes, stacks, the qkv rows)."""
    flags, impl = CASES[name]
    cfg = _cfg(flags)
    state = _our_state(cfg)
    back = mcore.from_mcore(mcore.to_mcore(state, cfg, impl), cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[n], t) for n, t in state.items())


def test_tool_moe_round_trip_and_refusals(tmp_path, capsys):
    """--to megatron then --from megatron: the weights, Adam's moments and step come back bitwise; the args carry
    the MoE settings as Megatron-LM's parser gives them; the distributed optimizer's state of an MoE model is
    refused by name."""
    cfg = _cfg(CASES["mixed_te"][0])
    weights = {n: t for n, t in _our_state(cfg).items()}
    moments = {n: {k: torch.rand(w.shape) for k in mcore.MOMENTS} for n, w in weights.items()}
    save_full_dcp(str(tmp_path / "ours"), cfg, weights, moments, 7.0, 7, 28)
    to = ["--load", str(tmp_path / "ours"), "--to", "megatron", "--save", str(tmp_path / "mlm")]
    assert _convert(to + ["--use-distributed-optimizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "distributed optimizer's Adam state of a model with experts" in err
    assert _convert(to + ["--expert-model-parallel-size", "2"]) == 0
    common = mcore.read_common(mcore.iteration_dir(str(tmp_path / "mlm")))
    args = common["args"]
    moe = (args.num_experts, args.moe_layer_freq, args.moe_router_topk, args.moe_ffn_hidden_size)
    assert moe == (4, [0, 1, 1], 2, 24) and args.expert_model_parallel_size == 2
    assert args.transformer_impl == "transformer_engine" and args.moe_router_pre_softmax
    groups = [[g["is_expert_parallel"] for g in o["param_groups"]] for o in common["optimizer"].values()]
    assert groups == [[False, False], [True]]  # megatron-core's ChainedOptimizer: the dense groups, the experts'
    back = ["--from", "megatron", "--load", str(tmp_path / "mlm"), "--to", "sharded", "--save", str(tmp_path / "b")]
    assert _convert(back) == 0
    got, got_moments, step, meta = mcore.our_full_state(str(tmp_path / "b"))
    assert got.keys() == weights.keys() and all(torch.equal(got[n], w) for n, w in weights.items())
    assert all(torch.equal(got_moments[n][k], moments[n][k]) for n in weights for k in mcore.MOMENTS)
    assert step == 7.0 and meta["iteration"] == 7 and meta["consumed_samples"] == 28
    assert meta["config"]["model"]["moe_layer_freq"] == "[0, 1, 1]" and meta["config"]["model"]["num_experts"] == 4
