"""Megatron-LM's own `load_checkpoint` (megatron.training, from the megatron-core 0.19.2 wheel) reads what
`tools/convert_checkpoint.py --to megatron` writes.

One single-rank gloo job: for a RoPE Llama-like config and the learned-position GPT one, our checkpoint
(random weights, Adam moments and step) is exported; Megatron-LM's args come from its own parser
(`megatron.training.arguments.parse_args` and `validate_args`) on the command line a user would type for that
model; megatron-core's GPTModel (local spec, built from `core_transformer_config_from_args`), its FP32
optimizer and `get_optimizer_param_scheduler` are loaded by `megatron.training.checkpointing.load_checkpoint`.
The tests compare its logits with ours, its Adam moments and scheduler with what we wrote, and every arg
that `checkpointing.py` reads from a checkpoint's args (found in its source) with the parser's, and with
`--use-checkpoint-args` and no model flag, the model settings its `load_args_from_checkpoint` reads; then the
loaded model, optimizer and scheduler train the remaining 2 iterations as Megatron-LM's step does (test_mcore's
`_mcore_steps`) beside our loop resuming our checkpoint: the same losses and learning rates. The --no-optim
export loads with --no-load-optim (as Megatron-LM's own --no-save-optim checkpoints): the same logits.

Megatron-LM's `training.train_step` itself is not run: on CPU it would need torch's tensor factories
redirected, as megatron-core allocates on a literal 'cuda' in the DDP grad buffers
(param_and_grad_buffer.py: torch.zeros(device="cuda"), torch.cuda.current_stream()), the optimizer's flags and
loss scale (optimizer.py: found_inf, _dummy_overflow_buf, _scale_one, _scale), gradient clipping
(clip_grads.py: total_norm, dummy_overflow_buf), the schedule's token count (schedules.py: total_num_tokens)
and the rerun state machine (rerun_state_machine.py); what would then run is no longer what a GPU runs.
"""

import contextlib
import os
import re
import sys
import types

import numpy as np
import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import mcore
from megatron_zpp.checkpoint.save import save_full_dcp
from megatron_zpp.model import GPT
from tests.checkpoint.test_mcore import (
    GPT_FLAGS,
    LLAMA_FLAGS,
    RUN,
    _cfg,
    _close,
    _cpu_shims,
    _mcore_forward,
    _mcore_steps,
    _our_logits,
    _probe,
    _zero_moments,
)
from tests.dist import run_distributed

ITERATION, CONSUMED = 3, 12
# our flags that Megatron-LM has no flag for (its defaults are them); the flags it requires beside ours
NOT_MEGATRONS = ("--activation", "gelu", "--add-bias-linear")
MEGATRON_ONLY = (
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion --no-rope-fusion "
    "--no-persist-layer-norm --ckpt-format torch_dist"
)
CASES = {"llama": LLAMA_FLAGS + " --max-position-embeddings 16", "gpt": GPT_FLAGS}


def _megatron_lm():
    """megatron.training imports `typing.override` (Python 3.12); this venv runs 3.11."""
    import typing

    import typing_extensions

    typing.override = getattr(typing, "override", typing_extensions.override)
    from megatron.training import arguments, checkpointing, global_vars

    return arguments, checkpointing, global_vars


def _load_shims(checkpointing):
    """Megatron-LM's read_metadata all-reduces the tracker's iteration in a tensor made on 'cuda' (the one
    CUDA-only line its torch_dist load takes on CPU): that tensor is made on the CPU, nothing else changes."""
    read_metadata = checkpointing.read_metadata

    def on_cpu(tracker):
        make = torch.tensor
        torch.tensor = lambda *a, device=None, **k: make(*a, **k)
        try:
            return read_metadata(tracker)
        finally:
            torch.tensor = make

    checkpointing.read_metadata = on_cpu


def _megatron_args(flags: str, load: str, from_checkpoint: bool = False):
    """Megatron-LM's args of `flags` plus --load, from its own parser and validate_args (`from_checkpoint`:
    --use-checkpoint-args, the model's settings read by its load_args_from_checkpoint, as its initialize does)."""
    arguments, checkpointing, global_vars = _megatron_lm()
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    argv = [f for f in (flags + RUN).split() if f not in NOT_MEGATRONS] + MEGATRON_ONLY.split() + ["--load", load]
    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(None):
            args = arguments.parse_args()
            if from_checkpoint:
                args.use_checkpoint_args = True
                args, _ = checkpointing.load_args_from_checkpoint(args)
            arguments.validate_args(args, {})
    finally:
        sys.argv = saved
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    global_vars.set_args(args)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1, False)
    return args


def _from_checkpoint_diff(load: str, full) -> dict[str, tuple]:
    """{name: (Megatron-LM's arg, the full command line's)} for each model setting load_args_from_checkpoint
    reads that differs, the command line giving only data, training and implementation flags."""
    names = sorted(n for n in _read_names()["set"] - set(RUN_STATE) if hasattr(full, n))  # Megatron-LM's flags
    args = _megatron_args("--mock-data --vocab-size 100 --make-vocab-size-divisible-by 32 ", load, True)
    _megatron_lm()[2].set_args(full)
    return {n: (getattr(args, n, None), getattr(full, n)) for n in names if getattr(args, n, None) != getattr(full, n)}


def _read_names() -> dict[str, set[str]]:
    """The args Megatron-LM's checkpointing.py reads from a checkpoint's args, from its source:
    {"compared": check_checkpoint_args' (an attribute that must be there), "set": load_args_from_checkpoint's
    (absent: the command line's stays), "read": those load_checkpoint reads with a default}."""
    _, checkpointing, _ = _megatron_lm()
    with open(checkpointing.__file__) as f:
        src = f.read()
    names = {
        "compared": set(re.findall(r"_compare\('(\w+)'", src)),
        "set": set(re.findall(r"_set_arg\('(\w+)'", src)),
        "read": set(re.findall(r"getattr\((?:ckpt_args|checkpoint_args|state_dict\['args'\]), '(\w+)'", src)),
    }
    assert {"num_layers", "add_position_embedding"} <= names["compared"], "Megatron-LM's check_checkpoint_args moved"
    assert {"swiglu", "num_query_groups", "position_embedding_type"} <= names["set"], "load_args_from_checkpoint moved"
    return names


def _megatron_model(args):
    """megatron-core's GPTModel as Megatron-LM's model provider builds it with --transformer-impl local."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        parallel_output=False,
    )


def _megatron_optimizer(args, model):
    """AdamW over Megatron's parameter groups, in its FP32Optimizer (whose __init__ allocates a loss scale
    on 'cuda': built without that line, as in test_mcore), and its scheduler from the args."""
    from megatron.core.optimizer import FP32Optimizer, MegatronOptimizer, _get_param_groups
    from megatron.training.training import get_megatron_optimizer_config, get_optimizer_param_scheduler

    oc, overrides = get_megatron_optimizer_config(args)
    groups = _get_param_groups([model], oc, overrides)
    adam = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, adam, oc, _zero_moments)
    opt.is_stub_optimizer = False
    return opt, get_optimizer_param_scheduler(opt)


def _ours(root, flags):
    """Our checkpoint of random weights and moments (biases and norms off their init), exported."""
    cfg = _cfg(flags + RUN)
    gen = torch.Generator().manual_seed(3)
    weights = {n: 0.1 * torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, 128).named_parameters()}
    moments = {n: {k: torch.rand(w.shape, generator=gen) for k in mcore.MOMENTS} for n, w in weights.items()}
    save_full_dcp(os.path.join(root, "ours"), cfg, weights, moments, float(ITERATION), ITERATION, CONSUMED)
    mcore.export_checkpoint(os.path.join(root, "ours"), os.path.join(root, "mlm"))
    return cfg, weights, moments


def _load_case(root, flags):
    from megatron.core import parallel_state

    _, checkpointing, _ = _megatron_lm()
    cfg, weights, moments = _ours(root, flags)
    args = _megatron_args(flags, os.path.join(root, "mlm"))
    exported = mcore.read_common(mcore.iteration_dir(os.path.join(root, "mlm")))["args"]
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1)
    model = _megatron_model(args)
    opt, sched = _megatron_optimizer(args, model)
    with contextlib.redirect_stdout(None):
        iteration, _ = checkpointing.load_checkpoint([model], opt, sched)
    out = {"iteration": (iteration, args.consumed_train_samples, sched.num_steps), "args": _args_diff(exported, args)}
    out["from_checkpoint"] = _from_checkpoint_diff(os.path.join(root, "mlm"), args)
    with torch.no_grad():
        out["logits"] = (_our_logits(cfg, weights), _mcore_forward(model.eval(), _probe()))
    out["moments"] = _moments_by_mcore_key(model, opt, moments, cfg)
    theirs = _mcore_steps(cfg, model.train(), opt, sched, ITERATION, cfg.train.train_iters)
    out["steps"] = (_our_resume(root, flags), theirs)
    out["weights_only"] = _weights_only(root, flags, cfg, weights)
    parallel_state.destroy_model_parallel()
    return out


def _weights_only(root, flags, cfg, weights):
    """The --no-optim export, loaded as Megatron-LM loads its own --no-save-optim checkpoints (with
    --no-load-optim: its load_checkpoint reads the optimizer otherwise): the weights, Adam's moments left as they
    were (none: a fresh Adam). ((ours, its logits), the moments' largest value)."""
    _, checkpointing, _ = _megatron_lm()
    there = os.path.join(root, "weights")
    mcore.export_checkpoint(os.path.join(root, "ours"), there, with_optimizer=False)
    args = _megatron_args(flags + " --no-load-optim", there)
    torch.manual_seed(2)
    model = _megatron_model(args)
    opt, sched = _megatron_optimizer(args, model)
    with contextlib.redirect_stdout(None):
        checkpointing.load_checkpoint([model], opt, sched)
    with torch.no_grad():
        logits = (_our_logits(cfg, weights), _mcore_forward(model.eval(), _probe()))
    moments = [s[k].abs().max().item() for s in opt.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return logits, max(moments, default=0.0)  # none at all: a fresh Adam


def _our_resume(root, flags) -> list[tuple[float, float]]:
    """Our loop resuming our checkpoint to --train-iters: each step's (loss, lr)."""
    run = training.setup(_cfg(f"{flags}{RUN} --ckpt-format torch_dist --load {root}/ours --save {root}/resumed", 1))
    return [(h["loss"], h["lr"]) for h in training.train(run)]


def _moments_by_mcore_key(model, opt, moments, cfg):
    """{(megatron-core's checkpoint key, layer): (its loaded exp_avg, ours moved to its layout)}, each
    parameter's key read off megatron-core's own sharded_state_dict, its layer off its name."""
    ours = mcore.to_mcore({n: m["exp_avg"] for n, m in moments.items()}, cfg)
    keys = {
        sh.data.data_ptr(): sh.key
        for sh in model.sharded_state_dict().values()
        if isinstance(getattr(sh, "data", None), torch.Tensor)
    }
    layers = {p.data_ptr(): re.match(r"decoder\.layers\.(\d+)\.", n) for n, p in model.named_parameters()}
    out = {}
    for p in (p for group in opt.optimizer.param_groups for p in group["params"]):
        key, layer = keys[p.data_ptr()], layers[p.data_ptr()]
        want = ours[key][int(layer.group(1))] if layer else ours[key]
        out[(key, layer and int(layer.group(1)))] = (opt.optimizer.state[p]["exp_avg"].clone(), want)
    return out


def _args_diff(exported, parsed) -> dict[str, tuple]:
    """{name: (exported, the parser's)} for each arg Megatron-LM reads that differs; one that check_checkpoint_args
    does not compare may be absent where its absence reads as the parser's value (None, or an arg that
    load_args_from_checkpoint only sets: the command line's then stays)."""
    names = _read_names()
    diff = {}
    for name in sorted(set().union(*names.values())):
        if not hasattr(parsed, name) or name in RUN_STATE:
            continue
        mine = getattr(exported, name, _ABSENT)
        if mine is _ABSENT and name not in names["compared"]:
            if getattr(parsed, name) is None or name not in names["read"]:
                continue  # read as None, or the command line's stays
        if mine != getattr(parsed, name):
            diff[name] = (mine, getattr(parsed, name))
    return diff


_ABSENT = types.SimpleNamespace()
RUN_STATE = {  # args that describe the saving run's state, not the model: the export's own values
    "consumed_train_samples": "the samples the run consumed",
    "no_save_rng": "True: the export holds no RNG state",
    "ckpt_fully_parallel_save": "the distributed optimizer's format; the export's optimizer is not distributed",
}


def _all_cases(rank, world, root):
    _cpu_shims()
    _load_shims(_megatron_lm()[1])
    out = {}
    for name, flags in CASES.items():
        os.makedirs(os.path.join(root, name))
        out[name] = _load_case(os.path.join(root, name), flags)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all_cases, 1, str(tmp_path_factory.mktemp("mlm")), timeout=300)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_lm_load_checkpoint_reads_our_export(results, name):
    r = results[name]
    assert r["args"] == {} and r["from_checkpoint"] == {}
    assert r["iteration"] == (ITERATION, CONSUMED, CONSUMED)
    ours, theirs = r["logits"]
    assert ours.shape == theirs.shape and _close(ours, theirs), (ours - theirs).abs().max().item()
    assert r["moments"] and all(torch.equal(a, b) for a, b in r["moments"].values())
    (ours, theirs), moments = r["weights_only"]  # the --no-optim export: weights, no Adam state
    assert _close(ours, theirs) and moments == 0.0
    ours, theirs = r["steps"]  # megatron-core's model and optimizer as loaded, stepped as Megatron-LM does
    assert len(ours) == len(theirs) == 2 and np.allclose(ours, theirs, rtol=1e-6, atol=0), (ours, theirs)
