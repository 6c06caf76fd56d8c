"""Every flag of Megatron-LM's parser, and what happens to the ones no config field declares.

megatron_flags.json is the list: each argument of Megatron-LM's `add_megatron_arguments` (the
flags its config dataclasses generate included) with its option strings, whether it takes a
value and its Megatron group, and the commit it was read from (tools/extract_megatron_flags.py
writes it; docs/megatron_compat.md says how). A flag that a config field or an alias declares
is that setting's; every other one is classified here:

- a no-op (NOOPS, or VALUED for the values that are one): what it asks for always happens here;
  accepted, and the start-up log lists the no-ops given in one line;
- refused with one line of reason: by name (REFUSED), else by family (FAMILIES, first match),
  else "not built here".

Megatron's gated delta net shape flags are config fields our GDN layer builds (ModelConfig.gdn_heads; its
convolution kernel only at ours: `check_megatron_gdn`, called by validation).

Nothing here is stored twice: whether a flag takes a value comes from the list, and a flag that
a config field declares is skipped by every table (tests/test_megatron_compat.py checks that no
entry is shadowed).
"""

from __future__ import annotations

import json
import os

from .model import ModelConfig
from .shapes import GDN_CONV_KERNEL as CONV_KERNEL
from .shapes import MEGATRON_GDN_DEFAULTS

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_flags.json")) as _f:
    _DATA = json.load(_f)

MEGATRON_COMMIT: str = _DATA["commit"]
# one entry per Megatron argument: (its option strings, takes a value, its group title)
MEGATRON_ARGUMENTS: list[tuple[tuple[str, ...], bool, str]] = [
    (tuple(r["options"]), r["value"], r["group"]) for r in _DATA["flags"]
]

_FUSED = "there is no Megatron fused kernel here to turn off (PyTorch ops, or our own kernels with --kernels)"

# flag -> why it is a no-op (what it asks for always happens here)
NOOPS = {
    "--use-mcore-models": "deprecated in Megatron-LM, which ignores it too",
    "--cross-entropy-loss-fusion": "the vocab-parallel cross-entropy is always fused (one pass per row)",
    "--log-throughput": "tokens/s, TFLOP/s per rank and MFU are always logged",
    "--no-create-attention-mask-in-dataloader": (
        "the data loader never builds an attention mask (causal SDPA; packed documents travel as document ids)"
    ),
    "--tiktoken-pattern": "read only by TikTokenizer (not built here); Megatron ignores it for the others",
    "--no-gradient-accumulation-fusion": "weight gradients are accumulated by autograd: " + _FUSED,
    "--no-masked-softmax-fusion": "softmax attention is PyTorch SDPA: " + _FUSED,
    "--no-bias-swiglu-fusion": _FUSED,
    "--no-bias-dropout-fusion": _FUSED,
    "--no-rope-fusion": _FUSED,
    "--no-persist-layer-norm": _FUSED,
    "--disable-jit-fuser": "no TorchScript/nvFuser JIT is used here",
    "--attention-softmax-in-fp32": (
        "SDPA computes the softmax of bf16/fp16 scores in fp32 (its fused kernels, and its math path by default)"
    ),
    "--apply-query-key-layer-scaling": (
        "an fp16 overflow guard that leaves the function unchanged (scores divided by the layer number, multiplied "
        "back inside an fp32 softmax); SDPA's softmax is fp32 already"
    ),
    "--accumulate-allreduce-grads-in-fp32": (
        "gradients are accumulated over micro-batches and reduced in fp32 here (unless --grad-reduce-in-bf16)"
    ),
    "--local-rank": "the local rank is read from LOCAL_RANK, which torchrun sets",
    "--ddp-average-in-collective": (
        "gradients are divided by the data-parallel size exactly once here; doing it inside the collective "
        "(ReduceOp.AVG) instead changes only the rounding order"
    ),
    **dict.fromkeys(
        ["--defer-embedding-wgrad-compute", "--wgrad-deferral-limit"],
        "a TP comm-overlap schedule of the output layer's weight gradient (needs Megatron's fused gradient "
        "accumulation): the same gradients, computed when autograd reaches them here",
    ),
    "--no-one-logger": "one-logger is never used here",
    "--init-model-with-meta-device": (
        "the model is always built on the meta device; each rank then materializes only what it holds"
    ),
    "--disable-gloo-process-groups": "no gloo groups are built beside NCCL's (on CPU gloo is the backend itself)",
    "--auto-detect-ckpt-format": "a load always reads the checkpoint's own format (meta.json says which)",
    **dict.fromkeys(
        [
            "--ckpt-fully-parallel-save",
            "--no-ckpt-fully-parallel-save",
            "--ckpt-fully-parallel-load",
            "--ckpt-fully-parallel-load-exchange-algo",
            "--ckpt-fully-parallel-load-per-rank-objects",
            "--ckpt-fully-parallel-save-process-group",
            "--ckpt-fully-parallel-load-process-group",
            "--dist-ckpt-workers",
        ],
        "every rank always writes and reads only its own pieces of a checkpoint, in parallel; nothing is exchanged",
    ),
    **dict.fromkeys(
        ["--ckpt-assume-constant-structure", "--ckpt-pg-tensors-cache-path", "--ckpt-pg-tensors-cache-create"],
        "no checkpoint structure is gathered, so there is nothing to cache",
    ),
    "--no-ckpt-load-validate-sharding-integrity": "the checks of a load always run (they are cheap here)",
    "--verify-integrity": "the sha256 of every checkpoint file is always written and checked on load",
    **dict.fromkeys(
        ["--dist-ckpt-optim-fully-reshardable", "--distrib-optim-fully-reshardable-mem-efficient"],
        "optimizer state always reshards across TP, PP, DP and the ZeRO stage",
    ),
    "--load-main-params-from-ckpt": "the fp32 master weights always come from the checkpoint",
    "--no-use-tokenizer-model-from-checkpoint-args": "the tokenizer never comes from the checkpoint",
    "--no-save-tokenizer-assets": "tokenizer files are never saved into checkpoints",
    "--ckpt-drop-redundant-extra-state": "there is no transformer-engine extra state to drop",
    **dict.fromkeys(
        ["--use-persistent-ckpt-worker", "--async-ckpt-cpu-priority", "--async-ckpt-io-priority"],
        "--async-save writes from a thread of the training process (no worker process to keep or tune)",
    ),
    "--no-position-embedding": (
        "deprecated in Megatron-LM, which takes it only with --position-embedding-type rope, where it changes "
        "nothing (RoPE has no position-embedding table); refused with any other type"
    ),
    "--async-ckpt-use-cpu-shm": "--async-save's host copy is made in the training process (no shared memory)",
    # Megatron's MoE kernel switches: transformer-engine's fused kernels of the same math as its unfused path
    # (megatron-core's tests hold the two equal); ours is that unfused math, in PyTorch or our own kernels
    "--moe-permute-fusion": (
        "picks transformer-engine's fused permute/unpermute kernels: the same permutation and fp32 weighting by "
        "the routing probabilities as Megatron's unfused path, which is ours (moe/permute.py)"
    ),
    "--moe-router-fusion": (
        "picks transformer-engine's fused top-k/score and aux-loss kernels: the same routing and losses as "
        "Megatron's unfused path, which ours computes in fp32 (moe/router.py)"
    ),
    "--moe-shared-expert-overlap": (
        "overlaps the shared expert with the token dispatch on another CUDA stream: timing only, the same "
        "output; here the shared expert runs after the routed experts"
    ),
}

# flag -> (values that are a no-op, why; a refused value's reason comes from REFUSED or FAMILIES)
VALUED = {
    "--async-strategy": (("nvrx", "mcore"), "--async-save has one strategy here: a writer thread"),
    "--dist-ckpt-strictness": (
        (
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ),
        "a load always checks every tensor and refuses a missing or unexpected one by name (raise_all, whatever "
        "the value: a checkpoint of this run's model never has either)",
    ),
    "--transformer-impl": (
        ("local", "transformer_engine"),
        "our layers are PyTorch modules equal to Megatron's local spec, whichever is named (transformer-engine's "
        "fused layers are not used: it does not install on CPU, and a path that cannot be run here is not built)",
    ),
    "--distributed-backend": (("nccl", "gloo"), "the backend follows the device: NCCL on CUDA, gloo on CPU"),
    "--optimizer": (("adam",), "the optimizer is AdamW, as Megatron's adam (decoupled weight decay)"),
    "--cross-entropy-fusion-impl": (
        ("native",),
        "the vocab-parallel cross-entropy is Megatron's native fused one here (one pass per row)",
    ),
    "--num-distributed-optimizer-instances": (
        ("1",),
        "one distributed-optimizer instance: the optimizer state is sharded over the whole data-parallel group",
    ),
}
VALUE_REFUSED = {
    ("--transformer-impl", "inference_optimized"): "the inference-optimized layers are not built: use local",
    ("--distributed-backend", None): "the backend follows the device (NCCL on CUDA, gloo on CPU): drop it",
    ("--optimizer", None): "only AdamW is built (--optimizer adam): drop it",
    ("--cross-entropy-fusion-impl", None): "transformer-engine's cross-entropy is not used here: use native",
    ("--num-distributed-optimizer-instances", None): (
        "one distributed-optimizer instance only: the optimizer state is sharded over the whole data-parallel group "
        "(--use-distributed-optimizer, --zero-stage 1/2/3); Megatron's N instances, each sharding over DP/N ranks "
        "with gradients all-reduced between them, are not built (ZeRO++ hpZ, --zero-hpz-partition-size, keeps the "
        "weight gathers inside a node): drop it"
    ),
}

# refused by name: flag -> why and what to use
REFUSED = {
    "--quick-geglu": "not built: use --swiglu or the default gelu",
    "--batch-size": "deprecated in Megatron-LM: use --micro-batch-size",
    "--warmup": "no longer valid in Megatron-LM either: use --lr-warmup-iters/-samples or --lr-warmup-fraction",
    "--model-parallel-size": "deprecated in Megatron-LM: use --tensor-model-parallel-size",
    "--checkpoint-activations": "deprecated in Megatron-LM: use --recompute-granularity full",
    "--fp16-lm-cross-entropy": "the cross-entropy is always computed in fp32 here: drop it",
    "--save-tokens-per-expert-interval": "not built: the log line carries the MoE layers' expert loads; drop it",
    "--dist-ckpt-format": "deprecated in Megatron-LM: use --ckpt-format",
    **dict.fromkeys(
        [
            "--non-persistent-save-interval",
            "--non-persistent-ckpt-type",
            "--non-persistent-global-ckpt-dir",
            "--non-persistent-local-ckpt-dir",
            "--non-persistent-local-ckpt-algo",
            "--replication",
            "--replication-jump",
            "--replication-factor",
        ],
        "non-persistent and local checkpoints are not built: use --save-interval (with --save-retain-interval)",
    ),
    **dict.fromkeys(
        ["--use-checkpoint-args", "--use-mp-args-from-checkpoint-args"],
        "a checkpoint's settings are not read as flags: give the model and parallel flags (a mismatch is named)",
    ),
    **dict.fromkeys(
        ["--ckpt-convert-format", "--ckpt-convert-save", "--ckpt-convert-update-legacy-dist-opt-format"],
        "use tools/convert_checkpoint.py to convert checkpoints",
    ),
    "--dist-ckpt-save-pre-mcore-014": "Megatron-core's own checkpoint layouts are not written: drop it",
    "--no-strict-fsdp-dtensor-load": "the fsdp_dtensor checkpoint format is not built: drop it",
    **dict.fromkeys(
        ["--save-params-interval", "--save-activations-interval", "--save-wgrads-interval", "--save-dgrads-interval"],
        "debug dumps of tensors are not built: drop it",
    ),
    "--log-progress": "not built (progress.txt needs the FLOPs done so far in the checkpoint): --metrics-file has "
    "tokens and TFLOP/s per step",
    "--log-max-attention-logit": "needs transformer-engine attention (SDPA exposes no logits): drop it",
    "--log-energy": "NVML energy counters are not read here: drop it",
    "--test-mode": "Megatron's in-model self-tests are not built: drop it",
    "--enable-experimental": "megatron-core's experimental code paths are not built: drop it",
    "--pipeline-model-parallel-layout": (
        "Megatron's per-stage layout strings are not built: place layers with --decoder-first-pipeline-num-layers "
        "/ --decoder-last-pipeline-num-layers or --account-for-embedding/loss-in-pipeline-split, or drop it"
    ),
    "--full-validation": "not built: raise --eval-iters to cover the validation set",
    **dict.fromkeys(
        ["--multiple-validation-sets", "--validation-set-names"],
        "the validation split is evaluated as one set: drop it",
    ),
}


def _starts(*prefixes: str):
    return lambda flag, group: flag.startswith(prefixes)


def _named(*flags: str):
    names = set(flags)
    return lambda flag, group: flag in names


def _groups(*titles: str):
    return lambda flag, group: group in titles


def _any(*matchers):
    return lambda flag, group: any(m(flag, group) for m in matchers)


# (family, reason, matcher(flag, group)): the first family that matches a flag refuses it
FAMILIES = [
    (
        "CUDA graphs",
        "CUDA graphs are not built: drop it",
        _any(_starts("--cuda-graph", "--enable-cuda-graph", "--external-cuda-graph", "--inference-cuda-graph")),
    ),
    (
        "MoE",
        "this option of Megatron's mixture of experts is not built (those in --help are): drop it",
        _any(
            _groups("moe"),
            _starts("--moe-", "--num-experts", "--expert-", "--inference-moe-", "--ep-overlap-"),
            _named(
                "--overlap-moe-expert-parallel-comm",
                "--overlap-dispatch-backward-with-experts-wgrad",
                "--use-grouped-gemm-for-shared-expert",
                "--use-grouped-gemm-for-dense-mlp",
                "--high-priority-a2a-comm-stream",
                "--rl-inference-expert-model-parallel-size",
                "--rl-inference-expert-tensor-model-parallel-size",
            ),
        ),
    ),
    (
        "FP8/transformer-engine",
        "FP8/FP4 and transformer-engine are not supported here (ours are PyTorch modules): drop it (use --bf16)",
        _any(
            _groups("Transformer-Engine"),
            _starts("--fp8-", "--fp4-", "--te-", "--tp-comm-", "--no-tp-comm-", "--disable-tp-comm-"),
            _starts("--no-fp8-", "--disable-fp8-", "--num-layers-at-", "--kitchen-", "--use-kitchen-"),
            _named(
                "--use-te-activation-func",
                "--use-transformer-engine-op-fuser",
                "--first-last-layers-bf16",
                "--keep-fp8-transpose-cache",
                "--reuse-grad-buf-for-mxfp8-param-ag",
            ),
        ),
    ),
    (
        "Mamba/hybrid",
        "Mamba and Megatron's hybrid layer patterns are not built (ours: --attention-type gla|gdn|kda with "
        "--softmax-attention-every; Megatron's gated delta net is read as ours: --experimental-attention-variant "
        "gated_delta_net with --linear-attention-freq N): drop it",
        _any(
            _starts("--mamba-", "--hybrid-", "--gdp-", "--mtp-hybrid-"),
            _named("--is-hybrid-model", "--disable-mamba-mem-eff-path", "--spec"),
        ),
    ),
    (
        "MLA/sparse attention",
        "multi-latent attention and DeepSeek sparse attention are not built: drop it",
        _any(_groups("mla"), _starts("--dsa-", "--mla-"), _named("--multi-latent-attention", "--cache-mla-latents")),
    ),
    ("multi-token prediction", "multi-token prediction is not built: drop it", _starts("--mtp-")),
    (
        "BERT/T5/vision/retrieval",
        "only the GPT model is built (no BERT, T5, vision, biencoder or retrieval models): drop it",
        _any(
            _groups("vision", "biencoder"),
            _starts("--bert-", "--encoder-", "--decoder-seq-length", "--decoder-num-layers", "--mrope-"),
            _named("--output-bert-embeddings", "--mask-prob", "--short-seq-prob", "--vocab-extra-ids"),
        ),
    ),
    (
        "RL",
        "reinforcement learning (GRPO and its rollouts) is not built: drop it",
        _any(_groups("rl"), _starts("--rl-", "--grpo-", "--langrl-"), _named("--perform-rl-step", "--refit-method")),
    ),
    (
        "inference server",
        "the inference engine and server are not built (tools/generate.py decodes greedily): drop it",
        _any(_groups("inference"), _starts("--inference-"), _named("--flash-decode", "--nccl-all-reduce-for-prefill")),
    ),
    (
        "fine-tuning/distillation",
        "supervised fine-tuning and logit distillation are not built (pretraining only): drop it",
        _any(_groups("sft", "Logits Distillation"), _starts("--logits-")),
    ),
    (
        "resiliency packages",
        "in-process restart, fault-tolerance, straggler detection, rerun checks and fault injection are not built "
        "(a failed rank exits with one line; resume with --load): drop it",
        _groups("In-process restart", "ft_package", "straggler", "rerun engine", "fault injector", "autoresume"),
    ),
    (
        "telemetry",
        "one-logger, OpenTelemetry and the workload inspector are not used here: drop it",
        _groups("one logger", "opentelemetry", "workload inspector"),
    ),
    (
        "object storage",
        "the multi-storage client is not built (checkpoints and data are local paths): drop it",
        _groups("msc"),
    ),
    (
        "FSDP",
        "Megatron-FSDP and torch FSDP2 are not used here: shard with --zero-stage 1/2/3 (ZeRO++): drop it",
        _any(
            _starts("--megatron-fsdp", "--fsdp-", "--use-megatron-fsdp", "--use-torch-fsdp2", "--torch-fsdp2-"),
            _named(
                "--data-parallel-sharding-strategy",
                "--outer-dp-sharding-strategy",
                "--enable-full-sharding-in-hsdp",
                "--suggested-communication-unit-size",
            ),
        ),
    ),
    (
        "offloading",
        "CPU offloading is not built: drop it",
        _any(
            _starts("--cpu-offloading-", "--optimizer-offload", "--offload-", "--fine-grained-"),
            _named(
                "--optimizer-cpu-offload",
                "--use-torch-optimizer-for-cpu-offload",
                "--overlap-cpu-optimizer-d2h-h2d",
                "--min-offloaded-tensor-size",
                "--delay-offload-until-cuda-graph",
                "--delta-offload-bytes-across-pp-ranks",
                "--activation-offload-fraction",
                "--no-pin-cpu-grads",
                "--no-pin-cpu-params",
            ),
        ),
    ),
    (
        "other optimizers",
        "only AdamW is built: drop it",
        _starts("--sgd-", "--muon-", "--lion-", "--use-precision-aware-optimizer", "--exp-avg", "--main-"),
    ),
    ("muP", "the muP parametrization is not built: drop it", _starts("--use-mup", "--mup-")),
    (
        "attention/position variants",
        "this attention or position-embedding variant is not built (causal softmax attention or GLA, full RoPE): "
        "drop it",
        _any(
            _starts("--window-", "--yarn-", "--no-yarn-", "--relative-attention-", "--rope-", "--no-rope-freq"),
            _starts("--qk-", "--rotary-seq-len-", "--rotary-interleaved", "--use-rope-scaling", "--softmax-type"),
        ),
    ),
    (
        "data variants",
        "fill-in-the-middle data, per-split data paths and data-argument files are not built: use --data-path "
        "with --split: drop it",
        _any(
            _starts("--fim-", "--train-data-path", "--valid-data-path", "--test-data-path", "--per-split-data-"),
            _named("--data-args-path", "--per-dataset-sequences-path", "--phase-transition-iterations"),
        ),
    ),
    (
        "process-group tuning",
        "NCCL and process-group tuning is not built (the groups follow --parallel-order): drop it",
        _any(
            _starts("--nccl-", "--use-sharp", "--sharp-", "--flight-recorder-", "--no-flight-recorder-", "--gtp-"),
            _starts("--use-nccl-ub", "--high-priority-stream-groups", "--hierarchical-context-parallel-sizes"),
            _named(
                "--disable-symmetric-registration",
                "--create-all-gather-group",
                "--symmetric-ar-type",
                "--fake-process-group",
                "--distributed-timeout-seconds-after-init",
                "--lazy-mpu-init",
                "--use-tp-pp-dp-mapping",
                "--tensor-parallel-num-weight-shards",
                "--pipeline-model-parallel-comm-backend",
                "--cp-comm-type",
            ),
        ),
    ),
]
OTHER_REASON = "not built here: drop it"


def family_of(flag: str, group: str) -> tuple[str, str]:
    """(family, reason) of a refused flag."""
    if flag in REFUSED:
        return "by name", REFUSED[flag]
    for family, reason, matches in FAMILIES:
        if matches(flag, group):
            return family, reason
    return "other", OTHER_REASON


def classify(options: tuple[str, ...], group: str) -> tuple[str, str]:
    """What happens to a Megatron argument that no config field declares: ('noop', why),
    ('valued', first option: decided by its value), ('pending', why) or ('refused', why)."""
    flag = options[0]
    if any(o in VALUED for o in options):
        return "valued", next(o for o in options if o in VALUED)
    if any(o in NOOPS for o in options):
        return "noop", NOOPS[next(o for o in options if o in NOOPS)]
    return "refused", family_of(flag, group)[1]


def valued_outcome(flag: str, value: str, group: str) -> tuple[bool, str]:
    """(is a no-op, why) for a VALUED flag given `value`."""
    noop_values, why = VALUED[flag]
    if value in noop_values:
        return True, why
    reason = VALUE_REFUSED.get((flag, value)) or VALUE_REFUSED.get((flag, None))
    return False, reason or family_of(flag, group)[1]


def check_megatron_noops(m: ModelConfig, noops: list[str]) -> list[str]:
    """The no-ops that are one only beside some settings (Megatron refuses them otherwise)."""
    if "--no-position-embedding" in noops and m.position_embedding_type != "rope":
        return [
            f"--no-position-embedding with --position-embedding-type {m.position_embedding_type}: deprecated in "
            "Megatron-LM, which refuses it but with rope: use --position-embedding-type none (or rope)"
        ]
    return []


def check_megatron_gdn(m: ModelConfig) -> list[str]:
    """Megatron's gated delta net flags: accepted where they say what our GDN layer is."""
    variant = m.experimental_attention_variant
    if variant == "dsa":
        return ["--experimental-attention-variant dsa: DeepSeek sparse attention is not built: drop it"]
    if variant == "gated_delta_net" and m.attention_type != "gdn":
        return [
            f"--experimental-attention-variant gated_delta_net (our --attention-type gdn) conflicts with "
            f"--attention-type {m.attention_type}: give one"
        ]
    if variant == "gated_delta_net" and m.gdn_norm != (m.normalization, m.apply_layernorm_1p):
        given = f"--normalization {m.normalization}" + (" --apply-layernorm-1p" if m.apply_layernorm_1p else "")
        return [
            f"--experimental-attention-variant gated_delta_net with --gdn-out-norm rmsnorm and {given}: "
            "megatron-core's GDN output norm follows --normalization and --apply-layernorm-1p: drop --gdn-out-norm "
            "rmsnorm, or give --attention-type gdn for a plain RMSNorm output norm"
        ]
    ours = {  # field -> (our value, what it is here); the head counts and dims build (ModelConfig.gdn_heads)
        "linear_conv_kernel_dim": (
            CONV_KERNEL,
            f"our GDN's causal convolution has kernel {CONV_KERNEL}; other kernels are not built",
        ),
    }
    shapes = ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
    lines = []
    for name in (*ours, *shapes):
        given = getattr(m, name)
        value = MEGATRON_GDN_DEFAULTS[name] if given is None and variant else given
        flag = "--" + name.replace("_", "-")
        if given is not None and m.attention_type != "gdn":
            lines.append(
                f"{flag}: shapes Megatron's gated delta net layers only (--experimental-attention-variant "
                "gated_delta_net, ours --attention-type gdn), and this model has none: drop it"
            )
        elif name in ours and value is not None and value != ours[name][0]:
            want, why = ours[name]
            default = " (Megatron's default with --experimental-attention-variant)" if given is None else ""
            lines.append(f"{flag} {value}{default}: {why}: give {flag} {want}")
    return lines
