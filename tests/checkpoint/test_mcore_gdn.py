"""megatron-core (0.19.2) torch_dist checkpoints of Gated DeltaNet hybrids, both ways, against megatron-core's own
GPTModel built as Megatron-LM builds it for --experimental-attention-variant gated_delta_net --linear-attention-freq
N: its `get_linear_attention_pattern` places the layers, its `get_gated_delta_net_module_spec` gives the GDN layers
(GatedDeltaNet: fused in_proj q | k | v | z | beta | alpha, depthwise conv1d [C, 1, kernel], A_log, dt_bias, a
shared out_norm, out_proj) and the local spec the softmax layers and MLPs; fp32 on CPU.

One 2-rank gloo job imports megatron-core once and runs every case, for equal heads at TP1, for Megatron's
default head ratio (key heads = value heads / 2) with key and value head dims apart at TP1 and TP2, and for
Megatron-LM's Qwen3-Next recipe (--apply-layernorm-1p: every norm zero-centred, the GDN out_norm too) at TP1:

* our GDN hybrid written by our exporter (export_checkpoint, args and all) is loaded by megatron-core's
  `dist_checkpointing.load`: its logits must be ours;
* megatron-core's model, randomly initialised and saved by its own `dist_checkpointing.save` (with Megatron-LM's
  args for that command line, written out here), is imported (import_checkpoint): our logits must be its;
  exported back (export_checkpoint), every model tensor is bitwise the one it saved;
* its Adam (FP32Optimizer at TP2, one step) saved with the model: imported and exported back, a fresh
  megatron-core model and optimizer load every moment bitwise;
* the gated delta net args our export pickles equal Megatron-LM's own parser's for that command line.

CPU stand-ins (no GPU, no Transformer Engine): test_mcore._cpu_shims; fla's Triton q/k L2 norm as its formula
(x / sqrt(sum x^2 + 1e-6), fla.modules.l2norm's kernel); megatron-core's torch.compile'd helpers run eagerly;
--deterministic-mode (megatron-core's torch chunked delta rule and F.conv1d in place of fla's kernels); and
Transformer Engine's fused norm + column-parallel linear (in_proj's `layer_norm_weight`, the key Megatron-LM's TE
spec saves) as that norm followed by megatron-core's ColumnParallelLinear; under --apply-layernorm-1p, whose
zero_centered_gamma torch's norms (the local spec's) refuse, Transformer Engine's norms by their formula
(testing/peers/megatron_gdn.TENorm).
"""

import argparse
import contextlib
import dataclasses
import os
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_zpp.checkpoint import mcore
from megatron_zpp.checkpoint.save import save_full_dcp
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.testing.peers.megatron_gdn import TENorm, fla_l2norm
from tests.checkpoint.test_mcore import (
    ROWS,
    SEQ,
    _cfg,
    _close,
    _cpu_shims,
    _fresh,
    _mcore_forward,
    _probe,
    _zero_moments,
)
from tests.dist import run_distributed

# Megatron-LM's GDN command line (its spelling, which ours reads): softmax attention on every 2nd layer
GDN_FLAGS = (
    "--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 100 "
    "--make-vocab-size-divisible-by 32 --normalization RMSNorm --swiglu --ffn-hidden-size 48 "
    "--position-embedding-type rope --group-query-attention --num-query-groups 2 "
    "--untie-embeddings-and-output-weights --disable-bias-linear "
    "--experimental-attention-variant gated_delta_net --linear-attention-freq 2 --linear-conv-kernel-dim 4 "
    "--linear-key-head-dim 8 --linear-value-head-dim 8 --linear-num-key-heads 4 --linear-num-value-heads 4"
)
# Megatron's default head layout (key heads = value heads / 2), key and value head dims apart
GROUPED = GDN_FLAGS.replace("--linear-value-head-dim 8", "--linear-value-head-dim 16").replace(
    "--linear-num-key-heads 4", "--linear-num-key-heads 2"
)
# Qwen3-Next's mix (the GDN+MoE functional test's): every layer MoE with a gated shared expert, a gated softmax layer
MOE = GROUPED + (
    " --num-experts 4 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate "
    "--moe-router-topk 2 --qk-layernorm --attention-output-gate"
)
# Qwen3-Next's recipe (Megatron-LM's: --normalization RMSNorm --apply-layernorm-1p): every norm zero-centred, the GDN
# out_norm too
ONE_P = GROUPED + " --apply-layernorm-1p"
CASES = {"equal_heads": GDN_FLAGS, "grouped": GROUPED, "moe": MOE, "one_p": ONE_P}
LAYOUTS = [("equal_heads", 1), ("grouped", 1), ("moe", 1), ("one_p", 1), ("grouped", 2)]


def _gdn_shims():
    """fla's Triton L2 norm as its formula; megatron-core's torch.compile'd GDN helpers run eagerly."""
    import megatron.core.ssm.gated_delta_net.common as gdn_common

    torch._dynamo.config.disable = True
    gdn_common.l2norm = fla_l2norm


def _mcore_gdn_model(cfg, tp: int):
    """megatron-core's GPTModel of our GDN hybrid config as Megatron-LM builds it (see the module docstring);
    the caller seeds torch's generator."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
        get_linear_attention_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    class NormColumnParallelLinear(ColumnParallelLinear):  # Transformer Engine's LayerNormColumnParallelLinear
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.one_p = config.layernorm_zero_centered_gamma  # TE's zero_centered_gamma: 1 + w, w initialised 0
            self.layer_norm_weight = nn.Parameter(torch.zeros(input_size) if self.one_p else torch.ones(input_size))
            self.eps = config.layernorm_epsilon

        def forward(self, x):
            weight = self.layer_norm_weight + 1 if self.one_p else self.layer_norm_weight
            return super().forward(F.rms_norm(x, x.shape[-1:], weight, self.eps))

    class Backend(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self):
            return NormColumnParallelLinear

    m = cfg.model
    tc = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_heads, ffn_hidden_size=m.ffn_size, normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        params_dtype=torch.float32, init_method_std=0.05, deterministic_mode=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=m.softmax_attention_every,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim, linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim, linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads, qk_layernorm=m.qk_layernorm,
        attention_output_gate=m.attention_output_gate, layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        **_moe_settings(m),
    )  # fmt: skip
    local = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=m.qk_layernorm)
    layers = [local] * m.num_layers  # MoE: megatron-core's local MoE layers (SequentialMLP, allgather dispatcher)
    if m.num_experts:
        plain = dataclasses.replace(tc, experimental_attention_variant=None, linear_attention_freq=None)
        layers = get_gpt_decoder_block_spec(plain, use_transformer_engine=False, normalization="RMSNorm").layer_specs
    gdn = get_gated_delta_net_module_spec(tc, Backend())
    specs = [
        ModuleSpec(
            module=layer.module,
            submodules=dataclasses.replace(layer.submodules, input_layernorm=IdentityOp, self_attention=gdn),
        )  # its metainfo fuse_input_layernorm: the norm lives in in_proj
        if linear
        else layer
        for layer, linear in zip(layers, get_linear_attention_pattern(tc))
    ]
    block = TransformerBlockSubmodules(layer_specs=specs, layer_norm=local.submodules.input_layernorm)
    with contextlib.ExitStack() as stack:
        if m.apply_layernorm_1p:  # torch's norms (its local spec's) refuse zero_centered_gamma: TE's by its formula
            new = staticmethod(lambda cls, config, hidden_size, eps=1e-5, **kw: TENorm(config, hidden_size, eps))
            stack.enter_context(mock.patch.object(WrappedTorchNorm, "__new__", new))
        return GPTModel(
            tc, block, vocab_size=ROWS, max_sequence_length=SEQ, position_embedding_type="rope",
            share_embeddings_and_output_weights=False, parallel_output=False,
        )  # fmt: skip


def _moe_settings(m) -> dict:
    """megatron-core's MoE settings of our model (its args' names where they are its config's), none without."""
    if not m.num_experts:
        return {}
    return dict(
        num_moe_experts=m.num_experts, moe_ffn_hidden_size=m.expert_ffn_size, moe_router_topk=m.moe_router_topk,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate, moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
    )  # fmt: skip


def _megatron_args(cfg, tp: int):
    """The args Megatron-LM's save_checkpoint pickles for GDN_FLAGS, under its own names (written out here)."""
    m = cfg.model
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads, group_query_attention=True, num_query_groups=m.kv_heads,
        kv_channels=m.head_dim, normalization="RMSNorm", norm_epsilon=m.norm_epsilon, swiglu=True,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=True, seq_length=SEQ, max_position_embeddings=SEQ,
        vocab_size=100, make_vocab_size_divisible_by=32, padded_vocab_size=ROWS, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1, bf16=False, fp16=False, ckpt_format="torch_dist", iteration=3,
        train_iters=5, global_batch_size=4, micro_batch_size=1, lr=1e-3, min_lr=0.0, weight_decay=0.1,
        consumed_train_samples=12, num_experts=m.num_experts, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=m.softmax_attention_every, linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        linear_key_head_dim=m.linear_key_head_dim, linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads, linear_num_value_heads=m.linear_num_value_heads,
        qk_layernorm=m.qk_layernorm, attention_output_gate=m.attention_output_gate,
        apply_layernorm_1p=m.apply_layernorm_1p, transformer_impl="local",
        **{k: v for k, v in _moe_settings(m).items() if k != "num_moe_experts"},
    )  # fmt: skip


def _our_weights(cfg) -> dict:
    """Our GDN hybrid's weights off their init (every mapping shows in the logits)."""
    ours = GPT(cfg.model, ROWS)
    init_weights(ours, 3)
    gen = torch.Generator().manual_seed(4)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in ours.named_parameters()}


def _our_logits(cfg, weights):
    model = GPT(cfg.model, ROWS)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(_probe())


def _mcore_logits(model):
    with torch.no_grad():
        return _mcore_forward(model.eval(), _probe())


def _perturb(model):
    """Megatron-core's fresh model with its norms and gates off their init too."""
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def _impl(cfg) -> str:
    """The spec whose names the export writes: an MoE layer's pre-MLP norm under the local spec's name, as the
    megatron-core model here (local MoE layers) keys it; else Transformer Engine's (Megatron-LM's default)."""
    return "local" if cfg.model.num_experts else "transformer_engine"


def _ours_to_mcore(rank, root, name, cfg, tp):
    """Our weights -> export_checkpoint -> megatron-core at TP `tp` loads it: (our logits, its logits)."""
    from megatron.core import dist_checkpointing

    weights, there = _our_weights(cfg), os.path.join(root, f"{name}-to")
    if rank == 0 and tp == 1:
        save_full_dcp(os.path.join(root, f"{name}-ours"), cfg, weights, None, None, 3, 12)
        mcore.export_checkpoint(os.path.join(root, f"{name}-ours"), there, with_optimizer=False, impl=_impl(cfg))
    torch.distributed.barrier()
    torch.manual_seed(1)
    theirs = _mcore_gdn_model(cfg, tp)
    loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, mcore.iteration_dir(there))
    theirs.load_state_dict(loaded["model"])
    return _our_logits(cfg, weights), _mcore_logits(theirs)


def _mcore_to_ours(rank, root, name, cfg, tp):
    """megatron-core's model at TP `tp` saves -> import_checkpoint -> our logits; export_checkpoint back:
    (our logits, its logits, {key: bitwise equal} of every tensor it saved)."""
    from megatron.core import dist_checkpointing

    torch.manual_seed(2)
    theirs = _mcore_gdn_model(cfg, tp)
    _perturb(theirs)  # each rank its own slice's noise: the saved model is whatever the ranks hold
    saved = _fresh(os.path.join(root, f"{name}-tp{tp}", "iter_0000003"))
    state = {"model": theirs.sharded_state_dict(), "args": _megatron_args(cfg, tp), "iteration": 3}
    dist_checkpointing.save(state | {"checkpoint_version": 3.0}, saved)
    out = None
    if rank == 0:
        with open(os.path.join(os.path.dirname(saved), mcore.TRACKER), "w") as f:
            f.write("3")
        ours, back = os.path.join(root, f"{name}-tp{tp}-ours"), os.path.join(root, f"{name}-tp{tp}-back")
        mcore.import_checkpoint(os.path.dirname(saved), ours, with_optimizer=False)
        mcore.export_checkpoint(ours, back, with_optimizer=False, impl=_impl(cfg))
        written, again = mcore.read_tensors(saved), mcore.read_tensors(mcore.iteration_dir(back))
        from megatron_zpp.checkpoint.consolidate import consolidate

        out = (consolidate(ours)[0], {k: torch.equal(t, again.get(k, torch.empty(0))) for k, t in written.items()})
    torch.distributed.barrier()
    logits = _mcore_logits(theirs)
    if rank == 0:
        return _our_logits(cfg, out[0]), logits, out[1]
    return None, logits, None


def _all_cases(rank, world, root):
    _cpu_shims()
    _gdn_shims()
    from megatron.core import parallel_state

    out = {}
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tp, 1)
        for name, flags in CASES.items() if tp == 1 else [("grouped", GROUPED)]:  # TP2: the grouped layout
            cfg = _cfg(flags)
            out[name, tp] = {"to": _ours_to_mcore(rank, root, name, cfg, tp),
                             "from": _mcore_to_ours(rank, root, name, cfg, tp)}  # fmt: skip
        if tp == 2:
            out["adam"] = _adam_round_trip(rank, root, _cfg(GROUPED))
        elif rank == 0:
            out["parser"] = _parser_differences(os.path.join(root, "grouped-to"))
        parallel_state.destroy_model_parallel()
    return out


def _parser_differences(exported: str) -> dict:
    """{arg: (our export's, Megatron-LM's)} of the gated delta net args that differ: Megatron-LM's own parser and
    validate_args on GROUPED's command line (test_mcore_megatron_lm's harness) against the args our export of
    that model pickled."""
    from tests.checkpoint.test_mcore_megatron_lm import _megatron_args as parsed_args

    args = parsed_args(GROUPED + " --max-position-embeddings 16", exported)
    ours = mcore.read_common(mcore.iteration_dir(exported))["args"]
    names = [
        "experimental_attention_variant",
        "linear_attention_freq",
        *(n for n in vars(args) if n.startswith("linear_")),
    ]
    return {n: (getattr(ours, n, None), getattr(args, n)) for n in names if getattr(ours, n, None) != getattr(args, n)}


def _mcore_adam(cfg, tp: int, seed: int):
    """megatron-core's GDN hybrid and Adam over its parameter groups (FP32Optimizer, built as test_mcore does)."""
    from megatron.core.optimizer import (
        FP32Optimizer,
        MegatronOptimizer,
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )

    torch.manual_seed(seed)
    model = _mcore_gdn_model(cfg, tp)
    oc = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=0.0, weight_decay=0.1)
    adam = torch.optim.AdamW(_get_param_groups([model], oc, get_standard_config_overrides(oc)), lr=1e-3)
    opt = FP32Optimizer.__new__(FP32Optimizer)  # its __init__ allocates a loss scale on 'cuda'
    MegatronOptimizer.__init__(opt, adam, oc, _zero_moments)
    opt.is_stub_optimizer = False
    return model, opt


def _adam_round_trip(rank, root, cfg):
    """megatron-core's GDN hybrid at TP2 steps Adam once and saves model and optimizer -> import_checkpoint ->
    export_checkpoint -> a fresh megatron-core model and optimizer load it: {parameter: its moments bitwise the
    saved ones}."""
    from megatron.core import dist_checkpointing

    model, opt = _mcore_adam(cfg, 2, 3)
    loss = _mcore_forward(model, _probe()).logsumexp(-1).mean()
    loss.backward()
    opt.optimizer.step()
    saved = _fresh(os.path.join(root, "adam", "iter_0000003"))
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = opt.sharded_state_dict(state)
    dist_checkpointing.save(state | {"args": _megatron_args(cfg, 2), "iteration": 3, "checkpoint_version": 3.0}, saved)
    if rank == 0:
        with open(os.path.join(root, "adam", mcore.TRACKER), "w") as f:
            f.write("3")
        mcore.import_checkpoint(os.path.join(root, "adam"), os.path.join(root, "adam-ours"))
        mcore.export_checkpoint(os.path.join(root, "adam-ours"), os.path.join(root, "adam-back"))
    torch.distributed.barrier()
    back, back_opt = _mcore_adam(cfg, 2, 4)
    state = {"model": back.sharded_state_dict()}
    state["optimizer"] = back_opt.sharded_state_dict(state, is_loading=True)
    loaded = dist_checkpointing.load(state, mcore.iteration_dir(os.path.join(root, "adam-back")))
    back.load_state_dict(loaded["model"])
    back_opt.load_state_dict(loaded["optimizer"])
    names = dict(zip(map(id, back.parameters()), (n for n, _ in back.named_parameters())))
    pairs = zip(opt.optimizer.param_groups, back_opt.optimizer.param_groups)
    return {
        (names[id(q)], kind): torch.equal(opt.optimizer.state[p][kind], back_opt.optimizer.state[q][kind])
        for a, b in pairs
        for p, q in zip(a["params"], b["params"])
        for kind in mcore.MOMENTS
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all_cases, 2, str(tmp_path_factory.mktemp("mcore_gdn")), timeout=400)[0]


@pytest.mark.parametrize("name,tp", LAYOUTS)
def test_our_gdn_hybrid_loads_in_megatron_core_with_equal_logits(results, name, tp):
    ours, theirs = results[name, tp]["to"]
    assert ours.shape == theirs.shape == (2, SEQ, ROWS)
    assert _close(ours, theirs, 1e-5), (ours - theirs).abs().max().item()


@pytest.mark.parametrize("name,tp", LAYOUTS)
def test_megatron_core_gdn_hybrid_imports_with_equal_logits_and_exports_bitwise(results, name, tp):
    ours, theirs, same = results[name, tp]["from"]
    assert _close(ours, theirs, 1e-5), (ours - theirs).abs().max().item()
    model = {k for k in same if "self_attention.in_proj.weight." in k or "conv1d.weight." in k}
    assert len(model) == 2 * 9 and all(same.values()), [k for k, ok in same.items() if not ok]
    assert name != "moe" or sum(".mlp.experts." in k for k in same) == 2 * 4  # 4 MoE layers' fc1 and fc2


def test_exported_gdn_args_equal_megatron_lm_parsers(results):
    """The variant, --linear-attention-freq and the linear_* shapes our export pickles are its parser's."""
    assert results["parser"] == {}


def test_megatron_core_adam_state_of_a_gdn_hybrid_round_trips_bitwise(results):
    """Its Adam moments at TP2, every GDN tensor's included, through our import and export, as it loads them."""
    same = results["adam"]
    gdn = {n for n, _ in same if ".self_attention.in_proj." in n or ".conv1d." in n or n.endswith(("A_log", "dt_bias"))}
    assert len(gdn) == 2 * 5 and all(same.values()), [k for k, ok in same.items() if not ok]


# ---- bad input (no megatron-core needed) --------------------------------------------------
SOFTMAX_FLAGS = GDN_FLAGS.split(" --experimental-attention-variant")[0]
RUN = " --global-batch-size 2 --micro-batch-size 1 --lr 1e-3 --train-iters 4 --ckpt-format torch_dist --finetune"


def _saved(root: str, name: str, flags: str, megatron: bool) -> str:
    """A checkpoint of the model `flags` describe (random weights): ours, or with `megatron` exported to
    megatron-core's torch_dist."""
    cfg = _cfg(flags)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, ROWS).named_parameters()}
    save_full_dcp(os.path.join(root, name), cfg, weights, None, None, 3, 6)
    if not megatron:
        return os.path.join(root, name)
    mcore.export_checkpoint(os.path.join(root, name), os.path.join(root, name + "-mlm"), with_optimizer=False)
    return os.path.join(root, name + "-mlm")


def _load_errors(rank, world, loads):
    """Each (checkpoint, the run's flags): the one line a run's set-up refuses it with."""
    from megatron_zpp import training
    from megatron_zpp.checkpoint.files import CheckpointError

    errors = []
    for path, flags in loads:
        try:
            training.setup(_cfg(f"{flags}{RUN} --load {path}", world))
            errors.append(None)
        except CheckpointError as e:
            errors.append(str(e))
    return errors


def test_a_gdn_checkpoint_and_a_softmax_or_gla_model_refuse_each_other_by_name(tmp_path):
    """Each kind's checkpoint (megatron-core's converted by --load, or ours) into a run of another kind: one line
    naming attention_type; the megatron-core GDN checkpoint into the GDN run it describes loads (our spelling)."""
    gdn, soft = _saved(str(tmp_path), "gdn", GDN_FLAGS, True), _saved(str(tmp_path), "soft", SOFTMAX_FLAGS, True)
    gla = SOFTMAX_FLAGS + " --attention-type gla --softmax-attention-every 2"
    ours = _saved(str(tmp_path), "gla", gla, False)
    loads = [(gdn, SOFTMAX_FLAGS), (gdn, gla), (soft, GDN_FLAGS), (ours, GDN_FLAGS)]
    spelled = SOFTMAX_FLAGS + " --attention-type gdn --softmax-attention-every 2"  # our flags for GDN_FLAGS' model
    errors = run_distributed(_load_errors, 1, [*loads, (gdn, spelled)])[0]
    assert errors.pop() is None
    want = [  # one line each: the settings that differ, or (two linear kinds) reshard.check_same_mixers' line
        "attention_type gdn (checkpoint) vs softmax (this run)",
        "saved with --attention-type gdn (Gated DeltaNet), this run has --attention-type gla",
        "attention_type softmax (checkpoint) vs gdn (this run)",
        "saved with --attention-type gla (GLA), this run has --attention-type gdn",
    ]
    for error, words in zip(errors, want):
        assert error is not None and "\n" not in error and words in error, error


def test_tool_round_trip_of_a_model_without_softmax_layers(tmp_path, capsys):
    """Every layer GDN (--attention-type gdn, no period): --linear-attention-freq is then the list Megatron-LM's
    parser evaluates; ours -> --to megatron -> --from megatron gives the weights bitwise and the model back."""
    from tests.checkpoint.test_mcore import _convert

    flags = SOFTMAX_FLAGS + " --attention-type gdn"
    ours = _saved(str(tmp_path), "all", flags, False)
    assert _convert(["--load", ours, "--to", "megatron", "--save", str(tmp_path / "mlm"), "--no-optim"]) == 0
    args = mcore.read_common(mcore.iteration_dir(str(tmp_path / "mlm")))["args"]
    assert args.linear_attention_freq == [1, 1, 1, 1] and args.experimental_attention_variant == "gated_delta_net"
    argv = ["--from", "megatron", "--load", str(tmp_path / "mlm"), "--to", "sharded", "--save", str(tmp_path / "b")]
    assert _convert([*argv, "--no-optim"]) == 0
    capsys.readouterr()
    before, after = mcore.our_full_state(ours), mcore.our_full_state(str(tmp_path / "b"))
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    m = _cfg(flags).model
    assert {k: after[3]["config"]["model"][k] for k in ("attention_type", "softmax_attention_every")} == {
        "attention_type": "gdn",
        "softmax_attention_every": 0,
    }
    assert all(m.layer_kind(i) == "gdn" for i in range(m.num_layers))


def test_tool_refuses_what_megatron_cores_gdn_cannot_hold_by_name(tmp_path, capsys):
    from tests.checkpoint.test_mcore import _convert

    def refused(flags: str) -> str:
        name = str(len(os.listdir(tmp_path)))
        ours = _saved(str(tmp_path), name, flags, False)
        assert _convert(["--load", ours, "--to", "megatron", "--save", str(tmp_path / f"{name}-mlm")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: cannot convert "), err
        return err

    assert "its layers are GLA" in refused(SOFTMAX_FLAGS + " --attention-type gla --softmax-attention-every 2")
    # our GDN (--attention-type gdn) with a plain RMSNorm output norm in a LayerNorm model: megatron-core's out_norm
    # would be a LayerNorm (Megatron's variant flag with it is refused earlier, by validation: check_megatron_gdn)
    layer_norm = GDN_FLAGS.replace("--normalization RMSNorm", "--normalization LayerNorm").replace(
        "--experimental-attention-variant gated_delta_net --linear-attention-freq 2", "--attention-type gdn"
    )
    assert "--gdn-out-norm rmsnorm: megatron-core's gated delta net output norm follows --normalization LayerNorm" in (
        refused(layer_norm + " --softmax-attention-every 2 --gdn-out-norm rmsnorm")
    )
    # as megatron-core builds it (--gdn-out-norm model), its LayerNorm out_norm's bias goes out as out_norm.bias
    ln = _saved(str(tmp_path), "layer_norm", layer_norm + " --softmax-attention-every 2", True)
    bias = mcore.read_tensors(mcore.iteration_dir(ln))["decoder.layers.0.self_attention.out_norm.bias"]
    ours = mcore.our_full_state(os.path.join(tmp_path, "layer_norm"))[0]
    assert torch.equal(bias, ours["layers.0.mixer.head_norm_bias"])
    assert "--gdn-head-norm per_head: megatron-core's" in refused(GDN_FLAGS + " --gdn-head-norm per_head")
    # Megatron-LM's list pattern that no period gives
    mlm = _saved(str(tmp_path), "list", GDN_FLAGS, True)
    common = mcore.read_common(mcore.iteration_dir(mlm))
    common["args"].linear_attention_freq = [1, 0, 0, 1]
    tensors = mcore.read_tensors(mcore.iteration_dir(mlm))
    mcore.write(str(tmp_path / "list2"), 3, tensors, common, _cfg(GDN_FLAGS).model)
    argv = ["--from", "megatron", "--load", str(tmp_path / "list2"), "--to", "sharded", "--save", str(tmp_path / "x")]
    assert _convert([*argv, "--no-optim"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--linear-attention-freq [1, 0, 0, 1]: only a period" in err, err
    assert not os.path.exists(tmp_path / "x")
    # Megatron's HybridModel (layers by --hybrid-layer-pattern), not its GPTModel
    common["args"].linear_attention_freq, common["args"].hybrid_layer_pattern = 2, "G*G*"
    mcore.write(str(tmp_path / "hybrid"), 3, tensors, common, _cfg(GDN_FLAGS).model)
    assert _convert(["--from", "megatron", "--load", str(tmp_path / "hybrid"), *argv[4:], "--no-optim"]) == 2
    assert "--hybrid-layer-pattern G*G*: Megatron's HybridModel" in capsys.readouterr().err
    common["args"].hybrid_layer_pattern = None
    # the distributed optimizer's flat buffers: weights only
    common["optimizer"] = {"param_state_sharding_type": "dp_reshardable"}
    mcore.write(str(tmp_path / "flat"), 3, tensors, common, _cfg(GDN_FLAGS).model)
    argv[3] = str(tmp_path / "flat")
    assert _convert(argv) == 2
    assert "dp_reshardable Adam state of a gated delta net hybrid is not read" in capsys.readouterr().err
    assert _convert([*argv, "--no-optim"]) == 0
