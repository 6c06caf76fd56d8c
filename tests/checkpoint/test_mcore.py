"""megatron-core (0.19.2, the test extra) torch_dist checkpoints, both ways, against megatron-core itself.

One 2-rank gloo job imports megatron-core once (about 4 s a rank) and runs every case; the tests below
assert on what it returns:

* logits: our GPT and megatron-core's GPTModel (local spec, fp32) with the same weights, moved through
  the converter's mapping both ways (our writer -> megatron-core's `dist_checkpointing.load`;
  megatron-core's `dist_checkpointing.save` -> our reader), for a GPT config (LayerNorm, gelu, learned
  positions, biases, tied embedding), a Llama one (RMSNorm, SwiGLU, RoPE, GQA, untied, no biases), and the
  Llama one with q/k norms and interleaved RoPE or with Qwen3-Next's output gate and partial RoPE;
* a run: megatron-core's GPTModel at TP2 trains 2 steps (AdamW over megatron-core's own parameter groups,
  its OptimizerParamScheduler) and saves with `dist_checkpointing.save` (model, optimizer, scheduler,
  args); the converter imports it, our loop resumes it at TP1 x DP2 with ZeRO-1 for 3 steps and saves;
  the converter exports that, and megatron-core loads it (model and optimizer) at TP1. The reference is
  megatron-core resuming its own checkpoint for the same 3 steps on the same samples: its losses, logits
  and Adam moments must be ours.

megatron-core 0.19 hard-wires CUDA (and a few other things a daemonic CPU rank lacks) where this run
passes: `_cpu_shims` stands in for them without touching what is computed or written. Its FP32Optimizer
allocates its loss scale on 'cuda' in __init__: the test builds that optimizer without that line
(MegatronOptimizer.__init__) and uses megatron-core's own `sharded_state_dict` and `load_state_dict` of it.
"""

import argparse
import contextlib
import importlib.util
import os
import queue

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_zpp import training
from megatron_zpp.checkpoint import mcore
from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.data.mock import MockGPTDataset
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.validation import validate
from tests.dist import run_distributed

SMALL = "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 100 "
GPT_FLAGS = SMALL + (
    "--max-position-embeddings 24 --make-vocab-size-divisible-by 32 --position-embedding-type learned_absolute "
    "--add-bias-linear --normalization LayerNorm --activation gelu"
)
LLAMA_FLAGS = SMALL + (
    "--make-vocab-size-divisible-by 32 --normalization RMSNorm --swiglu --ffn-hidden-size 48 "
    "--position-embedding-type rope --group-query-attention --num-query-groups 2 "
    "--untie-embeddings-and-output-weights --disable-bias-linear"
)
# Megatron's per-head query/key norm and GPT-J's interleaved RoPE pairs, on the Llama config
QK_FLAGS = LLAMA_FLAGS + " --qk-layernorm --rotary-interleaved"
# Qwen3-Next's softmax attention: the output gate (linear_qkv's gate rows per query group), partial RoPE, q/k norms
GATE_FLAGS = LLAMA_FLAGS + " --qk-layernorm --attention-output-gate --rotary-percent 0.5"
RUN = (
    " --hidden-dropout 0 --attention-dropout 0 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 1 "
    "--lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --train-iters 5 --global-batch-size 4 "
    "--micro-batch-size 1 --seed 7"
)
MEGATRON_ITERS, SEQ, ROWS = 2, 16, 128
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(flags: str, world: int = 1):
    return validate(parse_args(flags.split()), world)


def _cpu_shims():
    """megatron-core 0.19's CUDA-only calls on the CPU path: RoPE moves its frequencies to
    torch.cuda.current_device(), the save strategy calls torch.cuda.synchronize(), and its writer
    measures its memory with psutil (not a dependency) for a log line and collects its writer threads'
    results through a multiprocessing Manager (a server process, which a daemonic rank may not start: a
    thread queue does); attention forks the CUDA RNG tracker for its dropout (0 here)."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    writer._process_memory = lambda: 0
    writer.get_write_results_queue = lambda *a, **k: queue.Queue()


def _mcore_model(cfg, tp: int = 1, stage: int | None = None):
    """megatron-core's GPTModel (local spec, fp32) of our config, of one of 2 pipeline `stage`s when given;
    the caller seeds torch's generator."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    swiglu = m.activation == "swiglu"
    tc = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_heads,
        ffn_hidden_size=m.ffn_size,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        qk_layernorm=m.qk_layernorm,
        rotary_interleaved=m.rotary_interleaved,
        attention_output_gate=m.attention_output_gate,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        bias_activation_fusion=m.gelu_approximate == "tanh",  # megatron's fused bias-gelu is the tanh form
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_bias_linear or m.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1 if stage is None else 2,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        init_method_std=0.05,  # larger than the default, so that every weight matters in the logits
    )
    return GPTModel(
        tc,
        get_gpt_layer_local_spec(normalization=m.normalization, qk_layernorm=m.qk_layernorm),
        vocab_size=ROWS,
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        position_embedding_type=m.position_embedding_type,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        rotary_base=int(m.rotary_base),
        rotary_percent=m.rotary_percent,
        parallel_output=False,
        pre_process=stage in (None, 0),
        post_process=stage in (None, 1),
    )


def _mcore_forward(model, tokens):
    """Logits [b, s, V], the causal mask given (megatron-core's default one is built on 'cuda')."""
    s = tokens.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    return model(tokens, torch.arange(s).expand_as(tokens), mask)


def _probe():
    return torch.randint(0, 100, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _our_logits(cfg, weights):
    model = GPT(cfg.model, ROWS)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(_probe())


def _mcore_load(model, root):
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, mcore.iteration_dir(root))
    model.load_state_dict(loaded["model"])


def _logits_both_ways(rank, root, name, flags):
    """(our logits, megatron-core's) with our weights written by our writer, then with megatron-core's
    weights read by our reader."""
    from megatron.core import dist_checkpointing

    cfg = _cfg(flags)
    ours = GPT(cfg.model, ROWS)
    init_weights(ours, 3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ours.parameters():  # biases and norms off their init, so that the mapping of each shows
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    weights = {n: p.detach().clone() for n, p in ours.named_parameters()}
    there = os.path.join(root, f"{name}-to")
    if rank == 0:
        mcore.write(there, 0, mcore.to_mcore(weights, cfg), {}, cfg.model.num_layers)
    torch.distributed.barrier()
    torch.manual_seed(1)
    theirs = _mcore_model(cfg).eval()
    _mcore_load(theirs, there)
    with torch.no_grad():
        out = [(_our_logits(cfg, weights), _mcore_forward(theirs, _probe()))]
    torch.manual_seed(2)  # a fresh megatron-core model: its weights, our reader
    theirs = _mcore_model(cfg).eval()
    back = os.path.join(root, f"{name}-from")
    dist_checkpointing.save(theirs.sharded_state_dict(), _fresh(back), validate_access_integrity=False)
    with torch.no_grad():
        got = mcore.from_mcore(mcore.read_tensors(back), cfg)
        out.append((_our_logits(cfg, got), _mcore_forward(theirs, _probe())))
    return out


def _fresh(path):
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    return path


# ---- the run ------------------------------------------------------------------------------
def _megatron_args(cfg):
    """The args Megatron-LM's save_checkpoint pickles, under its own names (written out here, not by
    the converter's export)."""
    m, o = cfg.model, cfg.optim
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads, group_query_attention=True, num_query_groups=m.kv_heads,
        kv_channels=m.head_dim, normalization="RMSNorm", norm_epsilon=m.norm_epsilon, swiglu=True,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=100, make_vocab_size_divisible_by=32,
        padded_vocab_size=ROWS, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
        lr=o.lr, min_lr=o.min_lr, lr_warmup_iters=o.lr_warmup_iters, lr_decay_style=o.lr_decay_style,
        weight_decay=o.weight_decay, clip_grad=o.clip_grad, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps, train_iters=cfg.train.train_iters, global_batch_size=4, micro_batch_size=1,
        seed=7, bf16=False, fp16=False, ckpt_format="torch_dist", use_distributed_optimizer=False,
        consumed_train_samples=MEGATRON_ITERS * 4, iteration=MEGATRON_ITERS, num_experts=None,
    )  # fmt: skip


def _mcore_trainer(cfg, tp):
    """megatron-core's GPTModel, AdamW over its parameter groups (FP32Optimizer around it) and its
    OptimizerParamScheduler, as Megatron-LM builds them for these flags."""
    from megatron.core.optimizer import (
        FP32Optimizer,
        MegatronOptimizer,
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(11)
    model = _mcore_model(cfg, tp)
    o, g = cfg.optim, cfg.train.global_batch_size
    betas = {"adam_beta1": o.adam_beta1, "adam_beta2": o.adam_beta2, "adam_eps": o.adam_eps}
    oc = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, **betas)
    groups = _get_param_groups([model], oc, get_standard_config_overrides(oc))
    adam = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    opt = FP32Optimizer.__new__(FP32Optimizer)  # its __init__ allocates a loss scale on 'cuda'
    MegatronOptimizer.__init__(opt, adam, oc, _zero_moments)
    opt.is_stub_optimizer = False  # the rest of FP32Optimizer.__init__
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_iters * g,
        lr_decay_steps=cfg.train.train_iters * g, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
        end_wd=o.weight_decay, wd_incr_steps=cfg.train.train_iters * g, wd_incr_style="constant",
    )  # fmt: skip
    return model, opt, sched


def _zero_moments(adam, config=None):
    """get_megatron_optimizer's init_state_fn for Adam: zero moments, the structure a load fills."""
    for group in adam.param_groups:
        for p in group["params"]:
            if not adam.state[p]:
                adam.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def _mcore_steps(cfg, model, opt, sched, first: int, last: int) -> list[tuple[float, float]]:
    """Megatron-LM's train step on the whole global batch of each iteration in [first, last): the mean
    per-token cross-entropy of megatron-core's logits, backward, gradient clipping, AdamW, then the
    scheduler by a global batch of samples. Returns each step's (loss, lr)."""
    g, vocab = cfg.train.global_batch_size, 100
    data = MockGPTDataset(last * g, SEQ, vocab, cfg.train.seed)
    steps = []
    for it in range(first, last):
        sample = torch.from_numpy(np.stack([data[i] for i in range(it * g, (it + 1) * g)]))
        logits = _mcore_forward(model, sample[:, :-1])  # the whole vocabulary (parallel_output=False)
        loss = F.cross_entropy(logits.reshape(-1, ROWS), sample[:, 1:].reshape(-1))
        lr = opt.optimizer.param_groups[0]["lr"]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
        opt.optimizer.step()
        sched.step(increment=g)
        steps.append((loss.item(), lr))
    return steps


def _mcore_save(cfg, model, opt, sched, root, iteration):
    from megatron.core import dist_checkpointing

    sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd)
    sd.update(args=_megatron_args(cfg), checkpoint_version=3.0, iteration=iteration,
              opt_param_scheduler=sched.state_dict(), num_floating_point_operations_so_far=0)  # fmt: skip
    dist_checkpointing.save(sd, _fresh(os.path.join(root, f"iter_{iteration:07d}")))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, mcore.TRACKER), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def _mcore_resume(cfg, root):
    """megatron-core's model, optimizer and scheduler at TP1 from its torch_dist checkpoint `root`, loaded
    as Megatron-LM's load_checkpoint does."""
    from megatron.core import dist_checkpointing

    model, opt, sched = _mcore_trainer(cfg, 1)
    path = mcore.iteration_dir(root)
    sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=True)
    loaded = dist_checkpointing.load(sd, path)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["opt_param_scheduler"])
    return model, opt, sched, loaded["iteration"]


def _moments(opt) -> dict:
    """{(parameter index, kind): tensor} of the AdamW state, in the optimizer's parameter order."""
    params = [p for group in opt.optimizer.param_groups for p in group["params"]]
    return {(i, k): opt.optimizer.state[p][k].clone() for i, p in enumerate(params) for k in mcore.MOMENTS}


def _global_layer(key: str, first: int) -> str:
    """A stage's state-dict key with its local layer number made global."""
    parts = key.split(".")
    if key.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + first)
    return ".".join(parts)


def _run_both_ways(rank, world, root):
    """megatron-core writes at TP2 -> import -> our loop at TP1 x DP2 (ZeRO-1) -> export -> megatron-core
    reads at TP1 and at PP2; beside it, megatron-core resumes its own checkpoint (the reference)."""
    from megatron.core import parallel_state

    cfg = _cfg(LLAMA_FLAGS + RUN)
    written, imported, ours, back = (os.path.join(root, d) for d in ("megatron", "imported", "ours", "back"))
    parallel_state.initialize_model_parallel(2, 1)
    model, opt, sched = _mcore_trainer(cfg, 2)
    _mcore_steps(cfg, model, opt, sched, 0, MEGATRON_ITERS)
    _mcore_save(cfg, model, opt, sched, written, MEGATRON_ITERS)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)  # the readers: TP1 (DP2, each rank the whole batch)
    ref_model, ref_opt, ref_sched, _ = _mcore_resume(cfg, written)
    reference = _mcore_steps(cfg, ref_model, ref_opt, ref_sched, MEGATRON_ITERS, cfg.train.train_iters)
    out = {"imported": mcore.import_checkpoint(written, imported)[1] if rank == 0 else None}
    torch.distributed.barrier()
    run = training.setup(
        _cfg(f"{LLAMA_FLAGS}{RUN} --zero-stage 1 --ckpt-format torch_dist --save {ours} --load {imported}", world)
    )
    out["resumed_at"] = run.state.iteration
    history = training.train(run)
    out["steps"] = ([(h["loss"], h["lr"]) for h in history], reference)
    if rank == 0:
        mcore.export_checkpoint(ours, back)
    torch.distributed.barrier()
    model, opt, sched, out["iteration"] = _mcore_resume(cfg, back)
    with torch.no_grad():
        out["logits"] = {"exported": _mcore_forward(model.eval(), _probe()),
                         "reference": _mcore_forward(ref_model.eval(), _probe()),
                         "ours": _our_logits(cfg, consolidate(ours)[0])}  # fmt: skip
    out["moments"] = (_moments(opt), _moments(ref_opt))
    out["num_steps"] = (sched.num_steps, ref_sched.num_steps)
    out["pp"] = _stage_equals(cfg, rank, back, model)
    return out


def _stage_equals(cfg, rank, root, whole) -> dict[str, bool]:
    """megatron-core at PP2 loads `root`: {key: this stage's tensor equals the `whole` (TP1) model's}."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    stage = _mcore_model(cfg, 1, rank)
    _mcore_load(stage, root)
    first, want = rank * cfg.model.num_layers // 2, whole.state_dict()
    return {
        _global_layer(k, first): torch.equal(v, want[_global_layer(k, first)])
        for k, v in stage.state_dict().items()
        if "_extra_state" not in k
    }


def _all_cases(rank, world, root):
    _cpu_shims()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    logits = {
        name: _logits_both_ways(rank, root, name, flags)
        for name, flags in (("gpt", GPT_FLAGS), ("llama", LLAMA_FLAGS), ("llama_qk", QK_FLAGS), ("gated", GATE_FLAGS))
    }
    parallel_state.destroy_model_parallel()
    return {"logits": logits, "run": _run_both_ways(rank, world, root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ranks = run_distributed(_all_cases, 2, str(tmp_path_factory.mktemp("mcore")), timeout=300)
    return ranks[0] | {"pp": [r["run"]["pp"] for r in ranks]}  # each pipeline stage's own


def _close(a, b, tol=1e-6):
    scale = b.abs().max().item()
    return (a - b).abs().max().item() <= tol * max(scale, 1.0)


@pytest.mark.parametrize("name", ["gpt", "llama", "llama_qk", "gated"])
def test_logits_equal_megatron_core_gptmodel_both_ways(results, name):
    for ours, theirs in results["logits"][name]:
        assert ours.shape == theirs.shape == (2, SEQ, ROWS)
        assert _close(ours, theirs), (ours - theirs).abs().max().item()


def test_megatron_checkpoint_resumes_here_and_returns(results):
    r = results["run"]
    assert {k: v for k, v in r["imported"].items() if k != "dropped"} == {
        "iteration": 2,
        "consumed_samples": 8,
        "tensors": 15,
        "optimizer": True,
        "step": 2.0,  # the checkpoint's state.common_step
        "optimizer_format": "none",  # the non-distributed optimizer
        "buffers": 0,  # a dense model: no router's expert bias
    }
    assert len(r["imported"]["dropped"]) == 4 * 2  # the four linears' extra states of two layers
    assert r["resumed_at"] == MEGATRON_ITERS and r["iteration"] == 5
    ours, reference = r["steps"]
    assert len(ours) == len(reference) == 3
    assert np.allclose(ours, reference, rtol=1e-6, atol=0), (ours, reference)  # losses and the LR schedule
    logits = r["logits"]
    assert _close(logits["exported"], logits["ours"]) and _close(logits["ours"], logits["reference"], 1e-5)
    exported, ref = r["moments"]
    assert exported.keys() == ref.keys()
    for k in ref:
        assert _close(exported[k], ref[k], 1e-4), k
    assert r["num_steps"] == (20, 20)


# ---- the tool (no megatron-core needed) ---------------------------------------------------
def _convert(argv):
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(ROOT, "tools/convert_checkpoint.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


@pytest.mark.parametrize("dtype", ["--fp32", "--bf16"])
def test_tool_round_trip_keeps_weights_moments_and_position(dtype, tmp_path, capsys):
    """Ours -> --to megatron -> --from megatron: the weights, Adam's moments and step, the iteration and
    samples come back bitwise (in bf16, the fp32 masters travel as megatron's fp32_param)."""
    from megatron_zpp.checkpoint.save import save_full_dcp

    cfg = _cfg(LLAMA_FLAGS + RUN + " " + dtype)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, ROWS).named_parameters()}
    moments = {n: {k: torch.rand(w.shape, generator=gen) for k in mcore.MOMENTS} for n, w in weights.items()}
    save_full_dcp(str(tmp_path / "ours"), cfg, weights, moments, 7.0, 7, 28)
    assert _convert(["--load", str(tmp_path / "ours"), "--to", "megatron", "--save", str(tmp_path / "mlm")]) == 0
    path = mcore.iteration_dir(str(tmp_path / "mlm"))
    saved = mcore.read_tensors(path)
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert saved[qkv].dtype == (torch.bfloat16 if dtype == "--bf16" else torch.float32)
    assert (f"optimizer.state.fp32_param.{qkv}" in saved) == (dtype == "--bf16")
    common = mcore.read_common(path)
    assert common["iteration"] == 7 and common["opt_param_scheduler"]["num_steps"] == 28
    assert common["args"].swiglu and common["args"].num_query_groups == 2
    back = ["--from", "megatron", "--load", str(tmp_path / "mlm"), "--to", "sharded", "--save", str(tmp_path / "back")]
    assert _convert(back) == 0
    assert "weights and Adam state: 15 tensors, iteration 7" in capsys.readouterr().out
    got, got_moments, step, meta = mcore.our_full_state(str(tmp_path / "back"))
    assert (meta["iteration"], meta["consumed_samples"], step) == (7, 28, 7.0)
    assert all(torch.equal(got[n], w) for n, w in weights.items()) and got.keys() == weights.keys()
    assert all(torch.equal(got_moments[n][k], moments[n][k]) for n in weights for k in mcore.MOMENTS)


def test_export_schedule_of_a_sample_based_run_and_none(tmp_path, capsys):
    """--train-samples: opt_param_scheduler's steps are Megatron's sample-based ones (get_optimizer_param_scheduler:
    lr_decay_steps = --lr-decay-samples or --train-samples, lr_warmup_steps = --lr-warmup-samples, wd_incr_steps =
    --train-samples). A config with neither --train-iters nor --train-samples: one line naming both, nothing
    written; --no-optim exports its weights."""
    from megatron_zpp.checkpoint.save import save_full_dcp

    run = RUN.replace("--train-iters 5", "--train-samples 40").replace("--lr-warmup-iters 1", "--lr-warmup-samples 8")
    gen = torch.Generator().manual_seed(0)
    for name, flags in [("samples", run), ("decay", run + " --lr-decay-samples 32"), ("none", RUN)]:
        cfg = _cfg(LLAMA_FLAGS + flags)
        if name == "none":  # as a hand-written Megatron args Namespace imports
            cfg.train.train_iters = None
        weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, ROWS).named_parameters()}
        moments = {n: {k: torch.rand(w.shape, generator=gen) for k in mcore.MOMENTS} for n, w in weights.items()}
        save_full_dcp(str(tmp_path / name), cfg, weights, moments, 3.0, 3, 12)
        out = str(tmp_path / f"{name}_mlm")
        rc = _convert(["--load", str(tmp_path / name), "--to", "megatron", "--save", out])
        if name == "none":
            err = capsys.readouterr().err.strip()
            assert rc == 2 and len(err.splitlines()) == 1 and not os.path.exists(out)
            assert "gives neither --train-iters nor --train-samples" in err and "--no-optim" in err
            assert _convert(["--load", str(tmp_path / name), "--to", "megatron", "--save", out, "--no-optim"]) == 0
            continue
        assert rc == 0
        sched = mcore.read_common(mcore.iteration_dir(out))["opt_param_scheduler"]
        decay = 32 if name == "decay" else 40
        assert (sched["lr_decay_steps"], sched["lr_warmup_steps"], sched["wd_incr_steps"]) == (decay, 8, 40)
        assert sched["num_steps"] == 12


def test_tool_refuses_what_has_no_counterpart_by_name(tmp_path, capsys):
    cfg = _cfg(LLAMA_FLAGS)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, ROWS).named_parameters()}
    q_down = "decoder.layers.self_attention.linear_q_down_proj.weight"
    tensors = mcore.to_mcore(weights, cfg) | {q_down: torch.zeros(2, 4, 4)}
    args = mcore.args_from_config(cfg, 3, 12, ROWS)
    args.multi_latent_attention = True
    mcore.write(str(tmp_path / "mla"), 3, tensors, {"args": args, "iteration": 3}, cfg.model.num_layers)
    argv = ["--from", "megatron", "--load", str(tmp_path / "mla"), "--to", "sharded", "--save", str(tmp_path / "x")]
    assert _convert(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot convert ")
    assert "--multi-latent-attention True: multi-latent attention is not built here" in err
    assert q_down in err
    assert _convert(["--from", "megatron", "--load", str(tmp_path), "--to", "sharded", "--save", "y"]) == 2
    assert "no megatron-core torch_dist checkpoint" in capsys.readouterr().err
    # an optimizer state that is not per parameter (the distributed optimizer's flat buffers): weights only
    args = mcore.args_from_config(cfg, 3, 12, ROWS)
    common = {"args": args, "iteration": 3, "optimizer": {"param_state_sharding_type": "dp_reshardable"}}
    mcore.write(str(tmp_path / "flat"), 3, mcore.to_mcore(weights, cfg), common, cfg.model.num_layers)
    argv = ["--from", "megatron", "--load", str(tmp_path / "flat"), "--to", "sharded", "--save", str(tmp_path / "w")]
    assert _convert(argv) == 2
    assert "has no flat buffers" in capsys.readouterr().err
    assert _convert([*argv, "--no-optim"]) == 0
    assert "(weights only: 15 tensors, iteration 3)" in capsys.readouterr().out


def test_exported_checkpoint_loads_at_two_pipeline_stages(results):
    """megatron-core at PP2 loads the export: each stage's tensors are the TP1 reader's of its layers."""
    first, last = results["pp"]
    assert first and last and all(first.values()) and all(last.values())
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert "decoder.layers.0.mlp.linear_fc1.weight" in first and "decoder.layers.1.mlp.linear_fc1.weight" in last


def test_megatrons_gdn_args_are_read_only_with_its_variant():
    """Megatron-LM's args hold its GDN shape defaults whatever the model (megatron-core's TransformerConfig
    fields): a GPT checkpoint's import ignores them, as Megatron does (GDN hybrids: test_mcore_gdn.py); another
    variant is refused by name."""
    from megatron_zpp.config.megatron_flags import check_megatron_gdn

    cfg = _cfg(LLAMA_FLAGS)
    args = mcore.args_from_config(cfg, 3, 12, ROWS)
    shapes = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128)
    vars(args).update(shapes, linear_num_key_heads=16, linear_num_value_heads=32)
    back = mcore.config_from_args(args, ROWS)
    assert back.model.linear_key_head_dim is None and back.model.linear_num_value_heads is None
    assert check_megatron_gdn(back.model) == [] and mcore._refusals(args, {}, {}, back) == []
    args.experimental_attention_variant = "dsa"
    assert mcore._refusals(args, {}, {}, back) == [
        "--experimental-attention-variant dsa: only gated_delta_net is built here"
    ]
