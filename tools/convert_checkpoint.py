"""Convert a sharded megatron_zpp checkpoint (any parallel layout) to one file or to HF, and back.

    python tools/convert_checkpoint.py --load ckpt --to consolidated --output model.pt
        one file {"config": the run's config dict, "model": {name: fp32 tensor}}, loadable
        with torch.load(..., weights_only=True); "model" is a single-rank GPT's state dict (its weights and
        persistent buffers: the routers' expert bias), which its load_state_dict(strict=True) takes
    python tools/convert_checkpoint.py --load ckpt --to hf --output hf_dir [--tokenizer-model tok.model]
                                       [--hf-architecture CLASS]
        Megatron's default GPT (softmax attention, LayerNorm, gelu, learned absolute positions, linear
        biases, no GQA): a GPT2LMHeadModel directory (megatron_zpp/checkpoint/formats/gpt2.py);
        softmax-attention models with RMSNorm, SwiGLU and RoPE, no biases: a LlamaForCausalLM directory,
        config.json + model.safetensors (+ tokenizer.model); models with experts (--num-experts): transformers'
        own Qwen3MoeForCausalLM (with --qk-layernorm) or MixtralForCausalLM (every layer sparse), the experts one
        per expert as the hub's files hold them (formats/qwen3_moe.py, mixtral.py); GDN/softmax hybrids built as
        OLMo Hybrid (--reordered-norms softmax --qk-layernorm --qk-layernorm-full-width --linear-norm-epsilon 1e-5):
        transformers' own OlmoHybridForCausalLM (formats/olmo_hybrid.py); GDN hybrids with gated softmax
        attention, zero-centred norms and query/key norms: transformers' own Qwen3NextForCausalLM (with experts and a
        gated shared expert), Qwen3_5ForCausalLM (dense) or, with --hf-architecture, Qwen3_5MoeForCausalLM
        (formats/qwen3_next.py, qwen3_5.py; docs/checkpoints.md); every other model (GLA, hybrid,
        LayerNorm, GeLU; RoPE or no positions, no biases): the same files plus our remote code (megatron_zpp/hf_remote/:
        configuration_megatron_zpp_gla.py, modeling_megatron_zpp_gla.py, plain PyTorch; with a
        tokenizer, tokenizer_config.json naming Llama's), loaded with
        AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)
    python tools/convert_checkpoint.py --from hf --load hf_dir --to sharded --output ckpt
        a HF directory of any of these kinds (model.safetensors or its sharded index; Qwen3-MoE, Mixtral, Qwen3-Next
        and Qwen3.5 directories as save_pretrained writes them, or a hub checkpoint's files) -> a weights-only
        checkpoint of ours (iteration 0, no optimizer state); pretrain_gpt.py --load ckpt
        reshards it to any layout (pass the model flags that match; a mismatch is named)

    python tools/convert_checkpoint.py --from megatron --load mlm_ckpt --to sharded --save ckpt [--no-optim]
        a megatron-core torch_dist checkpoint (Megatron-LM's --ckpt-format torch_dist, any TP/PP; Adam's
        state of the non-distributed optimizer, or of --use-distributed-optimizer in either format:
        fully_reshardable and dp_reshardable, any TP/PP/DP with the layers split evenly) -> our --ckpt-format
        torch_dist checkpoint: weights (the fp32 masters in bf16/fp16 runs), Adam's moments and step (the
        checkpoint's own), iteration and consumed samples (the LR schedule's position); the model
        settings are read from the checkpoint's args
    python tools/convert_checkpoint.py --load ckpt --to megatron --save mlm_ckpt [--no-optim]
                                       [--use-distributed-optimizer] [--transformer-impl local]
        ours (any format and layout) -> a megatron-core torch_dist checkpoint that Megatron-LM's
        --load (any TP/PP) and megatron-core's dist_checkpointing.load read: weights, Adam's moments and
        step, the scheduler's state, iteration and args (megatron_zpp/checkpoint/mcore.py); with
        --use-distributed-optimizer, Adam's state as megatron-core's DistributedOptimizer keeps it
        (fully_reshardable: any TP/PP/DP of a run with --use-distributed-optimizer loads it). Models with
        experts (--num-experts): the weights both ways (router, expert bias, routed and shared experts under
        megatron-core's SequentialMLP/TEGroupedMLP sharded keys; --transformer-impl names the MoE layers' pre-MLP
        norm), and Adam's state of the non-distributed optimizer (one optimizer, or at --expert-model-parallel-size
        > 1 megatron-core's ChainedOptimizer of the dense and the experts' groups); the distributed one's refused.
        Gated DeltaNet hybrids (--attention-type gdn, Megatron's --experimental-attention-variant gated_delta_net):
        both ways, megatron-core's GatedDeltaNet keys (in_proj and conv1d per section, docs/checkpoints.md)

The output is never overwritten or mixed with another format: an --output that is --load, holds it, lies
in an iteration directory, exists (a file, a non-empty HF directory) or, as a checkpoint root, holds the
iteration written, a newer `latest` or the other format is refused before any tensor is read; the result
is written under a fresh .tmp and renamed into place at the end (megatron_zpp/checkpoint/convert_output.py).

The conversions live in megatron_zpp/checkpoint/formats/ (one module per format, one protocol: base.py;
the HF directories: formats/hf.py); this script parses the flags and calls them. The vocabulary is the
padded one (the rows past the tokenizer's vocabulary are never predicted in training; HF sees them as ordinary tokens).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_zpp.checkpoint import CheckpointError, mcore
from megatron_zpp.checkpoint.consolidate import consolidate
from megatron_zpp.checkpoint.convert_output import check_output, staged
from megatron_zpp.checkpoint.files import find_checkpoint, os_error_line
from megatron_zpp.checkpoint.formats import gpt2 as hf_gpt2
from megatron_zpp.checkpoint.formats import remote as hf_gla
from megatron_zpp.checkpoint.formats.base import ConversionError
from megatron_zpp.checkpoint.formats.hf import architectures as hf_architectures
from megatron_zpp.checkpoint.formats.hf import export_hf, import_hf
from megatron_zpp.checkpoint.formats.llama import config_from_hf, from_hf_state, hf_unsupported, to_hf_state

# reached through this module by tests (tests/test_fuzz_inputs.py, tests/test_progress.py, test_convert.py)
__all__ = ["ConversionError", "config_from_hf", "export_hf", "from_hf_state", "hf_gla", "hf_gpt2",
           "hf_unsupported", "import_hf", "main", "to_hf_state"]  # fmt: skip


def _megatron(args, stage: str) -> str:
    """--from megatron / --to megatron: megatron-core's torch_dist checkpoints (checkpoint/mcore.py), written
    as a whole root under `stage`; the line to print."""
    if args.source == "megatron":
        out, done = mcore.import_checkpoint(args.load, stage, with_optimizer=not args.no_optim)
    else:
        out, done = mcore.export_checkpoint(
            args.load,
            stage,
            not args.no_optim,
            distributed_optimizer=args.use_distributed_optimizer,
            impl=args.transformer_impl or "transformer_engine",
            expert_parallel=args.expert_model_parallel_size,
        )
    line = ""
    if done.get("dropped"):  # RNG streams restart from the seeds, as on any change of layout
        line = (f"dropped {len(done['dropped'])} pickled objects (_extra_state: Transformer Engine's FP8 scales, "
                f"None in the local spec; rng_state): {', '.join(done['dropped'][:2])}, ...\n")  # fmt: skip
    what = "weights and Adam state" if done["optimizer"] else "weights only"
    adam = f", Adam step {done['step']:g} ({done['optimizer_format']})" if done.get("step") is not None else ""
    final = os.path.join(args.output, os.path.basename(out))
    bias = f", the expert bias of {done['buffers']} routers" if done.get("buffers") else ""
    return line + f"wrote {final} ({what}: {done['tensors']} tensors{bias}, iteration {done['iteration']}{adam})"


def _from_hf(args, stage: str) -> str:
    state, out = import_hf(args.load, stage)
    n = sum(t.numel() for t in state.values())
    final = os.path.join(args.output, os.path.basename(out))
    return f"wrote {final} (weights-only checkpoint: {len(state)} tensors, {n / 1e6:.2f}M parameters)"


def _from_ours(args, stage: str) -> str:
    """--to consolidated or hf: the full single-rank weights of our checkpoint, written to `stage`."""
    try:
        state, config = consolidate(args.load)
    except CheckpointError as e:  # no checkpoint there, or a damaged one: one line
        raise CheckpointError(f"--load {e}") from None
    what = args.to
    if args.to == "consolidated":
        torch.save({"config": config, "model": state}, stage)
    else:
        what = f"hf {export_hf(state, config, stage, args.tokenizer_model, args.hf_architecture)}"
    n = sum(t.numel() for t in state.values())
    return f"wrote {args.output} ({what}: {len(state)} tensors, {n / 1e6:.2f}M parameters)"


VALID_PAIRS = {
    ("megatron_zpp", "consolidated"): _from_ours,
    ("megatron_zpp", "hf"): _from_ours,
    ("megatron_zpp", "megatron"): _megatron,
    ("hf", "sharded"): _from_hf,
    ("megatron", "sharded"): _megatron,
}
OUTPUT_KIND = {"consolidated": "file", "hf": "hf", "sharded": "ours", "megatron": "megatron"}


def pair_error(source: str, to: str) -> str:
    """Why --from `source` --to `to` is no conversion here, with the pairs that are."""
    named = {"megatron_zpp": "our checkpoint", "hf": "a HF directory", "megatron": "a megatron-core checkpoint"}
    if source == "megatron_zpp":  # the only wrong pair from ours: --to sharded
        why = "our checkpoints are sharded already (pretrain_gpt.py --load reshards them to any layout)"
    elif to == source:
        why = f"--load is {named[source]} already"
    else:
        why = f"{named[source]} converts to our sharded checkpoint only (--to sharded; convert that one on)"
    valid = "--from megatron_zpp --to consolidated|hf|megatron, --from hf --to sharded, --from megatron --to sharded"
    return f"--from {source} --to {to}: {why}; the conversions are {valid}"


def iteration_written(args) -> int | None:
    """The iteration a conversion to a checkpoint root writes, read before any tensor (None: not a root, or
    known only once the conversion read it: a megatron-core `release` directory)."""
    if args.to == "sharded" and args.source == "hf":
        return 0
    if args.to == "sharded":
        name = os.path.basename(os.path.normpath(mcore.iteration_dir(args.load)))
        return int(name[len("iter_") :]) if name.startswith("iter_") and name[5:].isdigit() else None
    if args.to == "megatron":
        return int(find_checkpoint(args.load)[1]["iteration"])
    return None


def convert(args) -> int:
    """Check the output, convert into a fresh .tmp, put it in place (checkpoint/convert_output.py)."""
    kind = OUTPUT_KIND[args.to]
    try:
        check_output(args.load, args.output, kind, iteration_written(args))
        with staged(args.load, args.output, kind) as stage:
            line = VALID_PAIRS[(args.source, args.to)](args, stage)
    except (ConversionError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {os_error_line(e, args.output)}", file=sys.stderr)
        return 2
    print(line)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--from",
        dest="source",
        default="megatron_zpp",
        choices=["megatron_zpp", "hf", "megatron"],
        help="what --load is: our sharded checkpoint (default), a HF directory (Llama, GPT-2, OLMo Hybrid, "
        "Qwen3-MoE, Mixtral, Qwen3-Next, Qwen3.5's text models, or our GLA/hybrid export) or a megatron-core "
        "torch_dist checkpoint (Megatron-LM's --ckpt-format torch_dist)",
    )
    ap.add_argument(
        "--load",
        required=True,
        help="checkpoint directory (with `latest`), an iter_XXXXXXX dir, or a HF directory (--from hf)",
    )
    ap.add_argument(
        "--to",
        required=True,
        choices=["consolidated", "hf", "sharded", "megatron"],
        help="sharded: our checkpoint format (only --from hf or megatron); megatron: megatron-core's torch_dist",
    )
    ap.add_argument(
        "--output",
        "--save",
        required=True,
        help="FILE.pt for consolidated, a directory for hf, a checkpoint root for sharded and megatron; never "
        "overwritten: a new path, or a root of the same format that lacks the iteration written",
    )
    _megatron_options(ap)
    ap.add_argument(
        "--tokenizer-model",
        default=None,
        help="--to hf: the sentencepiece .model to copy as tokenizer.model (default: the run's)",
    )
    ap.add_argument(
        "--hf-architecture",
        default=None,
        choices=hf_architectures(),
        help="--to hf: the transformers class to write (default: the first that holds the model, in this order), "
        "e.g. Qwen3_5MoeForCausalLM for a Qwen3-Next-shaped model whose every layer is sparse",
    )
    return ap


def _megatron_options(ap: argparse.ArgumentParser) -> None:
    """The options of the megatron-core conversions (--from megatron, --to megatron)."""
    ap.add_argument(
        "--no-optim",
        action="store_true",
        help="--from megatron, --to megatron: the weights only (no Adam state; the iteration is kept)",
    )
    ap.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="--to megatron: Adam's state as megatron-core's DistributedOptimizer keeps it (fully_reshardable), "
        "for a Megatron-LM run with --use-distributed-optimizer",
    )
    ap.add_argument(
        "--transformer-impl",
        default=None,
        choices=["transformer_engine", "local"],
        help="--to megatron: the --transformer-impl of the Megatron-LM run that loads it (default transformer_engine, "
        "Megatron-LM's): it names an MoE layer's pre-MLP norm (pre_mlp_layernorm.weight with Transformer Engine, "
        "mlp.linear_fc1.layer_norm_weight with the local spec); dense layers are named alike by both",
    )
    ap.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=None,
        help="--to megatron, a model with experts: the --expert-model-parallel-size of the Megatron-LM run that "
        "loads it (default: ours). Above 1 its Adam is a ChainedOptimizer of the dense and the experts' parameters, "
        "at 1 one optimizer: the export's optimizer state is written for that run (the tensors are the same)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if (args.source, args.to) not in VALID_PAIRS:
        ap.error(pair_error(args.source, args.to))
    if args.no_optim and "megatron" not in (args.source, args.to):
        ap.error("--no-optim goes with --from megatron or --to megatron")
    if args.expert_model_parallel_size is not None and (args.to != "megatron" or args.expert_model_parallel_size < 1):
        ap.error("--expert-model-parallel-size goes with --to megatron and is at least 1")
    if args.hf_architecture and (args.to != "hf" or args.source != "megatron_zpp"):
        ap.error("--hf-architecture goes with --to hf (an import reads the class from config.json)")
    if args.transformer_impl and args.to != "megatron":
        ap.error("--transformer-impl goes with --to megatron (an import reads either spec's names)")
    if args.use_distributed_optimizer and (args.to != "megatron" or args.no_optim):
        ap.error("--use-distributed-optimizer goes with --to megatron, without --no-optim (it names Adam's format)")
    return convert(args)


if __name__ == "__main__":
    sys.exit(main())
