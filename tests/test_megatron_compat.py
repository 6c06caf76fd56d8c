"""Megatron-LM's own example scripts (tests/fixtures/megatron_*.args): every flag is accepted with
Megatron's meaning or refused by name with its reason; our defaults are Megatron's except the
deliberate differences docs/megatron_compat.md's table lists; allow_abbrev is off; Megatron's FFN rounding.

Megatron's values below were read from NVIDIA/Megatron-LM d98e8a64dd (megatron/training/arguments.py
and the config dataclasses it builds its parser from), not from our code."""

import os

import numpy as np
import pytest

from megatron_zpp import training
from megatron_zpp.config import ConfigError, ModelConfig
from megatron_zpp.config.arguments import build_parser, parse_args, parse_config
from megatron_zpp.config.megatron_flags import MEGATRON_ARGUMENTS, MEGATRON_COMMIT, NOOPS, REFUSED, VALUED, classify
from megatron_zpp.data.indexed_dataset import IndexedDatasetWriter
from megatron_zpp.validation import validate
from tests.megatron_fixtures import check_flag_by_flag, fixture_lines, tiny_gpt2_files
from tests.old_defaults import OLD_DEFAULTS

FP8 = "FP8/FP4 and transformer-engine are not supported"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# flag -> what happens to it: "ok" (a setting with Megatron's meaning), "noop" (what it asks for always
# happens), or a piece of the one-line reason it is refused with
LLAMA3 = {
    "--use-mcore-models": "noop",
    "--num-layers": "ok",
    "--hidden-size": "ok",
    "--ffn-hidden-size": "ok",
    "--num-attention-heads": "ok",
    "--group-query-attention": "ok",
    "--num-query-groups": "ok",
    "--kv-channels": "ok",
    "--seq-length": "ok",
    "--max-position-embeddings": "ok",
    "--position-embedding-type": "ok",
    "--rotary-base": "ok",
    "--rotary-percent": "ok",
    "--attention-dropout": "ok",
    "--hidden-dropout": "ok",
    "--swiglu": "ok",
    "--normalization": "ok",
    "--init-method-std": "ok",
    "--attention-backend": "ok",
    "--apply-layernorm-1p": "ok",
    "--untie-embeddings-and-output-weights": "ok",
    "--disable-bias-linear": "ok",
    "--micro-batch-size": "ok",
    "--global-batch-size": "ok",
    "--train-samples": "ok",
    "--lr-decay-samples": "ok",
    "--lr-warmup-samples": "ok",
    "--lr": "ok",
    "--min-lr": "ok",
    "--decoupled-lr": "ok",
    "--decoupled-min-lr": "ok",
    "--lr-decay-style": "ok",
    "--clip-grad": "ok",
    "--weight-decay": "ok",
    "--adam-beta1": "ok",
    "--adam-beta2": "ok",
    "--bf16": "ok",
    "--grad-reduce-in-bf16": "ok",
    "--cross-entropy-loss-fusion": "noop",
    "--calculate-per-token-loss": "ok",
    "--manual-gc": "ok",
    "--empty-unused-memory-level": "ok",
    "--exit-duration-in-mins": "ok",
    "--use-distributed-optimizer": "ok",
    "--overlap-grad-reduce": "ok",
    "--overlap-param-gather": "ok",
    "--fp8-format": FP8,
    "--fp8-amax-history-len": FP8,
    "--fp8-amax-compute-algo": FP8,
    "--fp8-param-gather": FP8,
    "--tensor-model-parallel-size": "ok",
    "--context-parallel-size": "ok",
    "--sequence-parallel": "ok",
    "--mock-data": "ok",
    "--tokenizer-type": "ok",
    "--vocab-size": "ok",
    "--data-cache-path": "ok",
    "--tiktoken-pattern": "noop",
    "--split": "ok",
    "--no-create-attention-mask-in-dataloader": "noop",
    "--no-mmap-bin-files": "ok",
    "--num-workers": "ok",
    "--log-interval": "ok",
    "--eval-iters": "ok",
    "--eval-interval": "ok",
    "--save-interval": "ok",
    "--log-throughput": "noop",
    "--profile": "ok",
    "--profile-step-start": "ok",
    "--profile-step-end": "ok",
    "--ckpt-format": "ok",
    "--distributed-timeout-minutes": "ok",
    "--save": "ok",
    "--load": "ok",
    "--tensorboard-dir": "ok",
}
GPT3 = {
    **{f: "ok" for f in "--num-layers --hidden-size --num-attention-heads --seq-length".split()},
    "--max-position-embeddings": "ok",
    "--attention-backend": "ok",
    "--micro-batch-size": "ok",
    "--global-batch-size": "ok",
    "--step-batch-size-schedule": "ok",
    **{f: "ok" for f in "--train-iters --weight-decay --adam-beta1 --adam-beta2 --init-method-std".split()},
    **{f: "ok" for f in "--clip-grad --fp16 --lr --lr-decay-style --min-lr --lr-warmup-fraction".split()},
    **{f: "ok" for f in "--lr-decay-iters --tensor-model-parallel-size --pipeline-model-parallel-size".split()},
    **{f: "ok" for f in "--data-path --vocab-file --merge-file --split --log-interval --save-interval".split()},
    **{f: "ok" for f in "--eval-interval --save --load --eval-iters --tensorboard-dir".split()},
}


def test_llama3_8b_fixture_every_flag_and_run(tmp_path):
    paths = dict(cache=tmp_path / "cache", ckpt=tmp_path / "ckpt", tb=tmp_path / "tb")
    kept = check_flag_by_flag(fixture_lines("megatron_llama3_8b.args", **paths), LLAMA3)
    argv = [tok for ln in kept for tok in ln] + ["--exit-interval", "2", "--device", "cpu", "--peak-tflops", "1"]
    # the script's --profile is an nsys range, CUDA only (refused by name on CPU: tests/test_tracking.py);
    # here torch.profiler's window instead (Megatron's steps 10-12: past this run's 2 steps)
    argv += ["--use-pytorch-profiler"]
    cfg = parse_config(argv, 1)
    m, t = cfg.model, cfg.train
    # Megatron's meaning of the accepted flags
    assert (m.kv_heads, m.head_dim, m.ffn_size, m.activation, m.normalization) == (2, 16, 224, "swiglu", "RMSNorm")
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear and m.rotary_base == 1e6
    assert cfg.data.split == "'99,1,0'" and "--no-create-attention-mask-in-dataloader" in cfg.megatron_noops
    assert m.attention_backend == "fused" and m.hidden_dropout == 0.0
    assert cfg.zero.zero_stage == 1  # --use-distributed-optimizer: optimizer state sharded over DP
    assert t.train_iters == 1953125000 // 4 and t.train_iters_from_samples and t.manual_gc
    assert cfg.optim.weight_decay == 0.1 and cfg.optim.adam_beta2 == 0.95 and cfg.optim.lr_decay_style == "cosine"
    # the script runs: two steps, then --exit-interval 2 stops it after a checkpoint
    run = training.setup(cfg)
    history = training.train(run)
    assert len(history) == 2 and run.state.stopped_by == "interval"
    assert os.path.isfile(tmp_path / "ckpt" / "latest")
    assert all(np.isfinite(h["loss"]) for h in history)


def test_gpt3_175b_fixture_every_flag(tmp_path):
    vocab, merges, _ = tiny_gpt2_files(tmp_path)
    writer = IndexedDatasetWriter(str(tmp_path / "d.bin"), np.uint16)
    writer.add_document(np.arange(100) % 250)
    writer.finalize(str(tmp_path / "d.idx"))
    paths = dict(data=tmp_path / "d", vocab=vocab, merges=merges, ckpt=tmp_path / "ckpt", tb=tmp_path / "tb")
    kept = check_flag_by_flag(fixture_lines("megatron_gpt3_175b.args", **paths), GPT3)
    cfg = parse_config([tok for ln in kept for tok in ln], 128)  # TP 8 x PP 16
    m, t, o = cfg.model, cfg.train, cfg.optim
    assert (m.activation, m.normalization, m.ffn_size, m.kv_heads) == ("gelu", "LayerNorm", 512, 8)
    assert m.hidden_dropout == m.attention_dropout == 0.1  # Megatron's default dropout
    assert t.fp16 and t.loss_scale is None and t.initial_loss_scale == 2.0**32 and t.hysteresis == 2
    assert o.lr_warmup_fraction == 0.001 and cfg.data.tokenizer_type == "GPT2BPETokenizer"  # from the files
    assert cfg.parallel.data_parallel_size == 1 and t.global_batch_size == 1536
    # the step schedule's thresholds are tokens (seq length 64): 2.4B tokens = 37.5M samples at batch 16
    assert t.batch_steps[:2] == [(0, 16), (2_400_000_000 // 64, 320)] and t.global_batch_at(37_499_999) == 16
    assert t.global_batch_at(37_500_000) == 320 and t.global_batch_at(10**12) == 1536


# Megatron-LM's defaults of the flags we share (d98e8a64dd). Ours must equal them but for DIFFERENT.
MEGATRON_DEFAULTS = {
    "--ffn-hidden-size": None,
    "--max-position-embeddings": None,
    "--make-vocab-size-divisible-by": 128,
    "--normalization": "LayerNorm",
    "--norm-epsilon": 1e-5,
    "--rotary-base": 10000,
    "--untie-embeddings-and-output-weights": False,
    "--hidden-dropout": 0.1,
    "--attention-dropout": 0.1,
    "--init-method-std": 0.02,
    "--group-query-attention": False,
    "--kv-channels": None,
    "--rotary-percent": 1.0,
    "--attention-backend": "auto",
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--context-parallel-size": 1,
    "--sequence-parallel": False,
    "--distributed-timeout-minutes": 10,
    "--use-distributed-optimizer": False,
    "--overlap-param-gather": False,
    "--ddp-bucket-size": None,
    "--min-lr": 0.0,
    "--lr-warmup-iters": 0,
    "--lr-warmup-samples": 0,
    "--lr-warmup-fraction": None,
    "--lr-decay-style": "linear",
    "--lr-wsd-decay-style": "exponential",
    "--lr-wsd-decay-iters": None,
    "--lr-wsd-decay-samples": None,
    "--lr-warmup-init": 0.0,
    "--decoupled-lr": None,
    "--decoupled-min-lr": None,
    "--weight-decay-incr-style": "constant",
    "--start-weight-decay": None,
    "--end-weight-decay": None,
    "--use-checkpoint-opt_param-scheduler": False,
    "--override-opt_param-scheduler": False,
    "--weight-decay": 0.01,
    "--adam-beta1": 0.9,
    "--adam-beta2": 0.999,
    "--adam-eps": 1e-8,
    "--clip-grad": 1.0,
    "--num-workers": 2,
    "--eval-iters": 100,
    "--seed": 1234,
    "--bf16": False,
    "--fp16": False,
    "--loss-scale": None,
    "--initial-loss-scale": 2**32,
    "--min-loss-scale": 1.0,
    "--loss-scale-window": 1000,
    "--hysteresis": 2,
    "--exit-interval": None,
    "--exit-duration-in-mins": None,
    "--exit-signal-handler": False,
    "--calculate-per-token-loss": False,
    "--manual-gc": False,
    "--manual-gc-interval": 0,
    "--empty-unused-memory-level": 0,
    "--log-interval": 100,
    "--train-iters": None,
    "--train-samples": None,
    "--global-batch-size": None,
    "--mock-data": False,
    "--reset-position-ids": False,
    "--reset-attention-mask": False,
    "--eod-mask-loss": False,
    "--position-embedding-type": "learned_absolute",
    "--add-bias-linear": True,
    "--apply-layernorm-1p": False,
    "--add-qkv-bias": False,
    # deliberate differences (docs/megatron_compat.md's table): Megatron's value, ours
    "--overlap-grad-reduce": False,
    "--num-layers": None,
    "--hidden-size": None,
    "--num-attention-heads": None,
    "--seq-length": None,
    "--micro-batch-size": None,
    "--vocab-size": None,
    "--lr": None,
    "--tokenizer-type": None,  # here: NullTokenizer, or GPT2BPETokenizer with --vocab-file/--merge-file
}
DIFFERENT = {
    "--overlap-grad-reduce": True,
    "--num-layers": 4,
    "--hidden-size": 128,
    "--num-attention-heads": 4,
    "--seq-length": 256,
    "--micro-batch-size": 1,
    "--vocab-size": 512,
    "--lr": 3e-4,
}


def test_defaults_are_megatrons_but_the_listed_differences():
    defaults = {}
    for action in build_parser()._actions:
        for flag in action.option_strings:
            defaults[flag] = action.dest
    cfg = parse_args([])
    for flag, megatron in MEGATRON_DEFAULTS.items():
        section, name = defaults[flag].split(".")
        ours = getattr(getattr(cfg, section), name)
        assert ours == DIFFERENT.get(flag, megatron), (flag, ours, megatron)
    # Megatron: biases in every linear layer (--disable-bias-linear turns them off), SwiGLU needs --swiglu,
    # GQA --group-query-attention
    m = cfg.model
    assert m.add_bias_linear and m.activation == "gelu" and m.kv_heads == m.num_attention_heads
    assert not parse_args(["--disable-bias-linear"]).model.add_bias_linear
    with open(os.path.join(ROOT, "docs", "megatron_compat.md")) as f:
        page = f.read()
    table = page[page.index("| flag | Megatron-LM | here |") :]
    table = table[: table.index("\n\n")]
    for flag in [*DIFFERENT, "--num-query-groups"]:
        assert f"`{flag}`" in table, f"docs/megatron_compat.md's table of deliberate differences lacks {flag}"


def test_abbreviations_are_refused_with_the_nearest_flag():
    with pytest.raises(ConfigError) as info:
        parse_args(["--hidden-s", "256"])
    assert str(info.value) == "unrecognized arguments: --hidden-s (did you mean --hidden-size?)"


def test_gqa_and_unbuilt_values_are_refused_by_name():
    def errors(argv):
        with pytest.raises(ConfigError) as info:
            validate(parse_args(["--mock-data", *argv]), 1)
        return str(info.value)

    assert "needs --group-query-attention" in errors(["--num-query-groups", "2"])
    assert parse_config(["--mock-data", "--group-query-attention"], 1).model.kv_heads == 1  # Megatron: 1 group
    for kind, why in [("yarn", "YaRN"), ("mrope", "multimodal RoPE"), ("relative", "T5-style relative")]:
        assert f"--position-embedding-type {kind}: {why}" in errors(["--position-embedding-type", kind])
    assert "--kv-channels 0: the head dim must be at least 1" in errors(["--kv-channels", "0"])
    assert "--rotary-percent 0.1: rotates 3 of the 32" in errors(["--rotary-percent", "0.1"])  # Megatron's int()
    assert "either --fp16 or --bf16" in errors(["--fp16", "--bf16"])
    assert "give --ffn-hidden-size" in errors(["--hidden-size", "16", "--num-attention-heads", "2", "--swiglu"])
    assert "needs --vocab-file" in errors(["--tokenizer-type", "GPT2BPETokenizer"])
    assert "16-bit inputs" in errors(["--use-flash-attn"])  # Megatron's alias of --attention-backend flash


def test_swiglu_ffn_rounds_down_as_megatron():
    # Megatron: int(4 h 2/3 / 64) * 64 (values worked by hand)
    for hidden, ffn in [(2048, 5440), (4096, 10880), (1024, 2688), (64, 128), (96, 256)]:
        assert ModelConfig(hidden_size=hidden, activation="swiglu").ffn_size == ffn
    assert ModelConfig(hidden_size=96, activation="gelu").ffn_size == 384


def test_exit_duration_stops_after_the_step_that_passes_it(tmp_path):
    argv = (
        OLD_DEFAULTS
        + (
            "--mock-data --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --vocab-size 128 "
            "--make-vocab-size-divisible-by 32 --train-iters 50 --device cpu --peak-tflops 1 "
            "--exit-duration-in-mins 1e-9"
        ).split()
    )
    run = training.setup(parse_config(argv + ["--save", str(tmp_path / "ckpt")], 1))
    history = training.train(run)
    assert len(history) == 1 and run.state.stopped_by == "duration"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000001"


# ------------------------------------------------------------------ the flag list (megatron_flags.py)


def test_every_megatron_flag_is_known_and_none_is_unrecognized():
    parser = build_parser()
    options = [o for opts, _, _ in MEGATRON_ARGUMENTS for o in opts]
    assert len(options) > 800 and not [o for o in options if o not in parser._option_string_actions]
    argv = []
    for o in options:  # each with a value where our parser's action takes one
        argv += [o] if parser._option_string_actions[o].nargs == 0 else [o, "1"]
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert not [ln for ln in str(info.value).splitlines() if "unrecognized" in ln]


def test_no_table_entry_is_shadowed_by_a_setting_and_the_commit_is_recorded():
    parser = build_parser()
    megatron = {o for opts, _, _ in MEGATRON_ARGUMENTS for o in opts}
    for table in (NOOPS, VALUED, REFUSED):
        for flag in table:
            assert flag in megatron, f"{flag} is no flag of Megatron-LM {MEGATRON_COMMIT[:10]}"
            dest = parser._option_string_actions[flag].dest
            assert dest.startswith("megatron."), f"{flag} is a setting's ({dest}): its table entry is dead"
    assert MEGATRON_COMMIT == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def test_value_dependent_flags_and_the_noops_given():
    cfg = parse_args(["--transformer-impl", "local", "--distributed-backend", "nccl", "--no-rope-fusion"])
    assert cfg.megatron_noops == ["--transformer-impl local", "--distributed-backend nccl", "--no-rope-fusion"]
    te = parse_args(["--transformer-impl", "transformer_engine"])  # Megatron's default: our local layers, logged
    assert te.megatron_noops == ["--transformer-impl transformer_engine"]
    with pytest.raises(ConfigError) as info:
        parse_args(["--transformer-impl", "inference_optimized", "--optimizer", "sgd", "--distributed-backend", "ucc"])
    assert str(info.value).splitlines() == [
        "--transformer-impl inference_optimized: the inference-optimized layers are not built: use local",
        "--optimizer sgd: only AdamW is built (--optimizer adam): drop it",
        "--distributed-backend ucc: the backend follows the device (NCCL on CUDA, gloo on CPU): drop it",
    ]


def test_refusals_by_family():
    cases = {
        "--moe-input-jitter-eps": "mixture of experts is not built",
        "--moe-apply-probs-on-input": "mixture of experts is not built",
        "--fp8-recipe": "transformer-engine",
        "--tp-comm-overlap": "transformer-engine",
        "--mamba-state-dim": "Mamba",
        "--hybrid-layer-pattern": "hybrid layer patterns are not built",
        "--multi-latent-attention": "multi-latent attention",
        "--img-h": "only the GPT model is built",
        "--grpo-group-size": "reinforcement learning",
        "--inference-max-requests": "inference engine",
        "--inprocess-restart": "in-process restart",
        "--use-megatron-fsdp": "--zero-stage",
        "--enable-cuda-graph": "CUDA graphs",
    }
    group_of = {o: group for opts, _, group in MEGATRON_ARGUMENTS for o in opts}
    for flag, why in cases.items():
        kind, reason = classify((flag,), group_of[flag])
        assert kind == "refused" and why in reason and "drop it" in reason, (flag, reason)


def test_split_is_read_as_megatron_reads_it():
    from megatron_zpp.data.builder import parse_split

    # Megatron: re.findall(r"[.0-9]+", split), padded to three, normalized
    for text, numbers in [("'99,1,0'", (99, 1, 0)), ("99,1,0", (99, 1, 0)), ("969, 30, 1", (969, 30, 1))]:
        assert parse_split(text) == pytest.approx([n / sum(numbers) for n in numbers])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_config(["--mock-data", "--split", "'99,1,0'"], 1).data.split == "'99,1,0'"
    for bad in ("-1,2", "9x,1"):  # a sign or a letter: refused (Megatron would drop them silently)
        with pytest.raises(ConfigError, match=f"--split '{bad}'"):
            parse_config(["--mock-data", f"--split={bad}"], 1)


def test_help_is_grouped_without_doubled_defaults_or_section_metavars():
    text = build_parser().format_help()
    for heading in ("model:", "parallel:", "zero:", "optim:", "data:", "train:", "log:", "no-ops"):
        assert f"\n{heading}" in text or heading in text, heading
    assert "--num-layers NUM_LAYERS" in text and "MODEL." not in text and "TRAIN." not in text
    assert not [ln for ln in text.splitlines() if ln.count("(default") > 1]
    assert text.count("(default:") > 50


def test_start_up_log_lists_the_noops_given_in_one_line(capsys, monkeypatch):
    import pretrain_gpt

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    tiny = "--mock-data --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128"
    tiny += " --make-vocab-size-divisible-by 32 --train-iters 1 --device cpu --peak-tflops 1 --num-workers 0"
    pretrain_gpt.main(OLD_DEFAULTS + tiny.split() + ["--no-rope-fusion", "--transformer-impl", "local"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "no-ops" in ln]
    assert len(lines) == 1 and lines[0].endswith(": --no-rope-fusion, --transformer-impl local"), lines


def test_the_extractor_records_each_arguments_options_value_and_group():
    """tools/extract_megatron_flags.py (run by hand on a Megatron-LM tree): the record of each argument."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract", os.path.join(ROOT, "tools", "extract_megatron_flags.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("moe")
    group.add_argument("--num-experts", type=int)
    group.add_argument("--moe-grouped-gemm", "--moe-gg", action="store_true")
    parser.add_argument("--split", action=argparse.BooleanOptionalAction)
    assert tool.flag_records(parser) == [
        {"options": ["--num-experts"], "value": True, "group": "moe"},
        {"options": ["--moe-grouped-gemm", "--moe-gg"], "value": False, "group": "moe"},
        {"options": ["--split", "--no-split"], "value": False, "group": "options"},
    ]


SPLIT = "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --hidden-size 64 --num-attention-heads 4 "
SPLIT += "--seq-length 32 --micro-batch-size 1 --global-batch-size 4 --pipeline-model-parallel-size 2"


@pytest.mark.parametrize(
    "flags, layers",
    [
        # Megatron: V virtual stages per rank = layers / (PP x V) layers per virtual stage
        ("--num-layers 8 --num-virtual-stages-per-pipeline-rank 2", [2, 2, 2, 2]),
        ("--num-layers 8 --num-virtual-stages-per-pipeline-rank 1", [4, 4]),
        # the embedding / the loss counted as one layer of the first / last stage's even share
        ("--num-layers 7 --account-for-embedding-in-pipeline-split", [3, 4]),
        ("--num-layers 7 --account-for-loss-in-pipeline-split", [4, 3]),
        ("--num-layers 6 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", [3, 3]),
    ],
)
def test_megatron_split_flags_place_layers_as_megatron(flags, layers):
    from megatron_zpp.validation import chunk_layer_counts

    assert chunk_layer_counts(parse_config((SPLIT + " " + flags).split(), 2, run=False)) == layers


@pytest.mark.parametrize(
    "flags, line",
    [
        ("--num-layers 8 --num-virtual-stages-per-pipeline-rank 3", "--num-layers 8 is not divisible by PP x"),
        (
            "--num-layers 8 --num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 1",
            "give one of --num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage",
        ),
        ("--num-layers 6 --account-for-embedding-in-pipeline-split", "--num-layers 6 + 1 is not divisible by PP 2"),
        (
            "--num-layers 8 --num-virtual-stages-per-pipeline-rank 2 --account-for-loss-in-pipeline-split",
            "--account-for-loss-in-pipeline-split: not built with interleaving",
        ),
    ],
)
def test_megatron_split_flags_refused_where_they_cannot_map(flags, line):
    with pytest.raises(ConfigError) as info:
        parse_config((SPLIT + " " + flags).split(), 2, run=False)
    assert line in str(info.value).splitlines()[0]


# ------------------------------------------------------------------ Megatron's gated delta net flags

GDN_BASE = "--mock-data --num-layers 7 --hidden-size 64 --num-attention-heads 4 --normalization RMSNorm"  # head dim 16
GDN_SHAPES = "--linear-key-head-dim 16 --linear-value-head-dim 16 --linear-num-key-heads 4 --linear-num-value-heads 4"
MEGATRON_GDN = f"--experimental-attention-variant gated_delta_net {GDN_SHAPES} --linear-conv-kernel-dim 4"


def gdn_errors(flags: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(f"{GDN_BASE} {flags}".split(), 1)
    return str(info.value).splitlines()


def test_megatron_gdn_hybrid_is_ours_with_megatrons_layer_pattern_and_defaults():
    """--experimental-attention-variant gated_delta_net --linear-attention-freq 3 places softmax attention where
    megatron-core does (its own get_linear_attention_pattern: 1 = GDN, 0 = softmax); the defaults we hold the
    shapes to are megatron-core's TransformerConfig's."""
    import dataclasses
    from types import SimpleNamespace

    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_zpp.config.shapes import MEGATRON_GDN_DEFAULTS

    for freq in (1, 3, 4, 8):
        m = parse_config(f"{GDN_BASE} {MEGATRON_GDN} --linear-attention-freq {freq}".split(), 1).model
        assert m.attention_type == "gdn" and m.softmax_attention_every == freq
        megatron = SimpleNamespace(
            linear_attention_freq=freq, num_layers=7, experimental_attention_variant="gated_delta_net"
        )
        kinds = ["gdn" if la else "softmax" for la in get_linear_attention_pattern(megatron)]
        assert [m.layer_kind(i) for i in range(7)] == kinds, freq
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    assert MEGATRON_GDN_DEFAULTS == {name: defaults[name] for name in MEGATRON_GDN_DEFAULTS}


def test_megatron_gdn_shape_flags_build_with_megatrons_meaning():
    """--linear-num-key-heads / --linear-num-value-heads / --linear-key-head-dim / --linear-value-head-dim shape the
    layer (grouped value heads, K != V); not given: ours (--num-attention-heads heads of the head dim) for
    --attention-type gdn, megatron-core's TransformerConfig defaults (16/32/128/128) with its variant."""
    from megatron_zpp.config.shapes import GdnHeads

    given = "--linear-num-key-heads 2 --linear-num-value-heads 6 --linear-key-head-dim 8 --linear-value-head-dim 24"
    m = parse_config(f"{GDN_BASE} --attention-type gdn {given}".split(), 1).model
    assert m.gdn_heads == GdnHeads(2, 6, 8, 24)
    shape = m.mixer_of_kind("gdn")
    assert shape.sections == (16, 16, 144, 144, 6, 6) and shape.conv_channels == 176 and shape.out_width == 144
    assert (shape.heads, shape.key_heads, shape.state_per_head, shape.transition_per_head) == (6, 2, 8 * 24, 64)
    assert parse_config(f"{GDN_BASE} --attention-type gdn".split(), 1).model.gdn_heads == GdnHeads(4, 4, 16, 16)
    variant = "--experimental-attention-variant gated_delta_net --linear-attention-freq 4"
    assert parse_config(f"{GDN_BASE} {variant}".split(), 1).model.gdn_heads == GdnHeads(16, 32, 128, 128)
    (line,) = gdn_errors("--attention-type gdn --linear-conv-kernel-dim 3")
    assert line == (
        "--linear-conv-kernel-dim 3: our GDN's causal convolution has kernel 4; other kernels are not built: give "
        "--linear-conv-kernel-dim 4"
    )


@pytest.mark.parametrize(
    "flags, world, line",
    [
        ("--linear-num-key-heads 4 --linear-num-value-heads 6", 1,
         "--linear-num-value-heads 6 is not a multiple of --linear-num-key-heads 4 (each key head is read by a whole "
         "group of value heads)"),
        ("--linear-num-key-heads 1 --linear-num-value-heads 4 --tensor-model-parallel-size 2", 2,
         "--linear-num-key-heads 1 is not divisible by --tensor-model-parallel-size 2"),
    ],
)  # fmt: skip
def test_gdn_heads_refused_in_one_line(flags, world, line):
    with pytest.raises(ConfigError) as info:
        parse_config(f"{GDN_BASE} --attention-type gdn {flags}".split(), world, run=False)
    assert str(info.value).splitlines() == [line]


@pytest.mark.parametrize(
    "flags, line",
    [
        ("--experimental-attention-variant dsa", "--experimental-attention-variant dsa: DeepSeek sparse attention is"),
        (f"--attention-type gla {MEGATRON_GDN}", "--experimental-attention-variant gated_delta_net (our --attention"),
        # megatron-core's GDN output norm follows --apply-layernorm-1p; a plain RMSNorm would be another layer
        (
            f"{MEGATRON_GDN} --apply-layernorm-1p --gdn-out-norm rmsnorm",
            "--experimental-attention-variant gated_delta_net with --gdn-out-norm rmsnorm and --normalization RMSNorm "
            "--apply-layernorm-1p: megatron-core's GDN output norm follows",
        ),
        # a shape flag without GDN layers would shape nothing (Megatron ignores it)
        ("--linear-num-key-heads 4", "--linear-num-key-heads: shapes Megatron's gated delta net layers only"),
        (f"{MEGATRON_GDN} --linear-attention-freq [1,1,0]", "--linear-attention-freq: '[1,1,0]': a per-layer list"),
        (f"{MEGATRON_GDN} --linear-attention-freq 0", "--linear-attention-freq: 0: must be >= 1"),
    ],
)
def test_megatron_gdn_refusals(flags, line):
    (got,) = gdn_errors(flags)
    assert got.startswith(line), got
