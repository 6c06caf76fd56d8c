"""megatron_zpp/config.py and megatron_zpp/config/arguments.py: validation errors name the flag
to change, derived values, Megatron flags, YAML files, and the CLI's error exit."""

import os
import subprocess
import sys

import pytest

from megatron_zpp.config import Config, ConfigError
from megatron_zpp.config.arguments import build_parser, load_yaml, parse_args, parse_config
from megatron_zpp.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make(**settings) -> Config:
    """A Config with mock data and `section__field=value` settings."""
    cfg = Config()
    cfg.data.mock_data = True
    for key, value in settings.items():
        section, name = key.split("__")
        assert hasattr(getattr(cfg, section), name), key
        setattr(getattr(cfg, section), name, value)
    return cfg


def errors_of(cfg: Config, world: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    return str(info.value).split("\n")


def line_with(lines: list[str], text: str) -> str:
    hits = [ln for ln in lines if text in ln]
    assert hits, f"no error line mentions {text!r}: {lines}"
    return hits[0]


# ------------------------------------------------------------------ valid configs, derived values


def test_defaults_with_mock_data_validate():
    cfg = make()
    assert validate(cfg, 1) is cfg


def test_derived_values_filled():
    cfg = validate(make(train__micro_batch_size=2, model__seq_length=128), 4)
    assert cfg.parallel.world_size == 4
    assert cfg.parallel.data_parallel_size == 4
    assert cfg.train.global_batch_size == 8  # micro x DP
    assert cfg.model.max_position_embeddings == 128  # = seq length
    assert cfg.num_micro_batches == 1


def test_train_samples_and_rampup_derive_the_iterations_and_validate_twice():
    argv = "--mock-data --micro-batch-size 2 --global-batch-size 16 --train-samples 120 --rampup-batch-size 4 4 48"
    cfg = validate(parse_args(argv.split()), 2)
    assert cfg.train.rampup_batch_size == [4, 4, 48] and cfg.train.train_iters == 12  # tests/optim: 8 + 4
    assert [cfg.micro_batches_at(c) for c in (0, 16, 32, 49)] == [1, 2, 3, 4]  # batch / (micro 2 x DP 2)
    assert validate(cfg, 2).train.train_iters == 12  # a validated config stays valid
    assert validate(make(), 1).train.train_iters == 100  # the default without --train-samples


def test_explicit_global_batch_and_positions_kept():
    cfg = validate(make(train__micro_batch_size=2, train__global_batch_size=24, model__max_position_embeddings=1024), 3)
    assert cfg.parallel.data_parallel_size == 3
    assert cfg.train.global_batch_size == 24
    assert cfg.num_micro_batches == 4
    assert cfg.model.max_position_embeddings == 1024


# ------------------------------------------------------------------ each error names its flag

ERROR_CASES = [
    (dict(model__hidden_size=128, model__num_attention_heads=3), 1, ["--num-attention-heads", "--hidden-size"]),
    (
        dict(model__num_attention_heads=4, model__num_query_groups=3, model__group_query_attention=True),
        1,
        ["--num-query-groups"],
    ),
    (
        dict(parallel__tensor_model_parallel_size=4, model__num_attention_heads=2),
        4,
        ["--num-attention-heads", "--tensor-model-parallel-size"],
    ),
    (
        dict(
            parallel__tensor_model_parallel_size=4,
            model__num_attention_heads=8,
            model__num_query_groups=2,
            model__group_query_attention=True,
        ),
        4,
        ["--num-query-groups", "--tensor-model-parallel-size"],
    ),
    (dict(parallel__tensor_model_parallel_size=4, model__ffn_hidden_size=130), 4, ["--ffn-hidden-size"]),
    (
        dict(parallel__pipeline_model_parallel_size=3, model__num_layers=4),
        3,
        ["--num-layers", "--pipeline-model-parallel-size"],
    ),
    (
        dict(
            parallel__pipeline_model_parallel_size=2,
            parallel__num_layers_per_virtual_pipeline_stage=3,
            model__num_layers=4,
        ),
        2,
        ["--num-layers", "--num-layers-per-virtual-pipeline-stage"],
    ),
    (dict(train__micro_batch_size=2, train__global_batch_size=6), 4, ["--global-batch-size", "--micro-batch-size"]),
    (dict(parallel__num_layers_per_virtual_pipeline_stage=1), 1, ["--num-layers-per-virtual-pipeline-stage"]),
    (
        dict(
            parallel__pipeline_model_parallel_size=3, parallel__decoder_first_pipeline_num_layers=1, model__num_layers=4
        ),
        3,
        ["--num-layers"],
    ),
    (
        dict(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True, model__seq_length=66),
        4,
        ["--sequence-parallel"],
    ),
    (dict(parallel__context_parallel_size=3, model__seq_length=256), 3, ["--seq-length", "--context-parallel-size"]),
    (dict(model__attention_type="gla", model__seq_length=100, model__linear_chunk_size=16), 1, ["--linear-chunk-size"]),
    (dict(model__seq_length=512, model__max_position_embeddings=256), 1, ["--seq-length", "--max-position-embeddings"]),
    (dict(model__softmax_attention_every=2), 1, ["--softmax-attention-every", "--attention-type"]),
    (dict(parallel__order="tp-dp-pp"), 1, ["--parallel-order"]),
    (dict(parallel__order="tp-cp-ep-dp-pp"), 1, ["--parallel-order"]),
    (dict(optim__min_lr=1.0, optim__lr=0.1), 1, ["--min-lr", "--lr"]),
    (dict(optim__lr_warmup_iters=-1), 1, ["--lr-warmup-iters"]),
    # sample-based training and the ramp-up (Megatron's rules)
    (dict(train__train_iters=10, train__train_samples=100), 1, ["--train-iters or --train-samples"]),
    (dict(train__rampup_batch_size=[2, 2, 8], train__global_batch_size=8), 1, ["--train-samples"]),
    (dict(train__rampup_batch_size=[2, 2], train__train_samples=99), 1, ["three numbers"]),
    (
        dict(train__rampup_batch_size=[3, 2, 8], train__global_batch_size=8, train__train_samples=99),
        2,
        ["START 3 and INCR 2 must be multiples of --micro-batch-size x DP = 2"],
    ),
    (
        dict(train__rampup_batch_size=[2, 4, 8], train__global_batch_size=8, train__train_samples=99),
        1,
        ["reach it in steps of INCR 4"],
    ),
    (dict(train__train_samples=99, optim__lr_warmup_iters=5), 1, ["--lr-warmup-iters", "--lr-warmup-samples"]),
    (dict(train__train_samples=99, optim__lr_decay_iters=5), 1, ["--lr-decay-iters", "--lr-decay-samples"]),
    (dict(optim__lr_decay_samples=500), 1, ["--lr-decay-samples needs --train-samples"]),
    (dict(optim__lr_warmup_fraction=0.1, optim__lr_warmup_iters=5), 1, ["--lr-warmup-fraction"]),
    (dict(optim__lr_warmup_fraction=1.5), 1, ["--lr-warmup-fraction 1.5"]),
    (dict(train__train_samples=3, train__global_batch_size=4), 1, ["less than one step"]),
    (dict(data__tokenizer_type="SentencePieceTokenizer"), 1, ["--tokenizer-model"]),
    (dict(data__split="90,a,1"), 1, ["--split"]),
    (dict(data__split="1,1,1,1"), 1, ["--split"]),
    (dict(zero__zero_hpz_partition_size=0), 1, ["--zero-hpz-partition-size"]),
    (dict(log__log_interval=0), 1, ["--log-interval"]),
]


@pytest.mark.parametrize(
    "settings,world,flags", ERROR_CASES, ids=[f"{i}:{'+'.join(sorted(c[0]))}" for i, c in enumerate(ERROR_CASES)]
)
def test_error_names_flags(settings, world, flags):
    lines = errors_of(make(**settings), world)
    for flag in flags:
        assert any(flag in ln for ln in lines), (flag, lines)


def test_gdn_takes_any_sequence_length_and_gla_names_no_cp_it_does_not_have():
    """GDN's op pads the last chunk: a sequence (or CP slice) that is not a multiple of the chunk validates; GLA's
    refusal names --seq-length without CP, the sequence per CP rank with it."""
    for cp in (1, 2):
        gdn = dict(model__attention_type="gdn", model__seq_length=100, model__linear_chunk_size=64)
        validate(make(**gdn, parallel__context_parallel_size=cp), cp)  # raises nothing
    gla = dict(model__attention_type="gla", model__seq_length=100, model__linear_chunk_size=16)
    assert errors_of(make(**gla), 1) == ["--seq-length 100 is not divisible by --linear-chunk-size 16 (GLA)"]
    (line,) = errors_of(make(**gla, parallel__context_parallel_size=2), 2)
    assert line == "sequence per CP rank 50 is not divisible by --linear-chunk-size 16 (GLA)"
    kda = dict(model__attention_type="kda", model__seq_length=100, model__linear_chunk_size=16)
    for cp in (1, 2):  # KDA's op pads on one rank, the CP operator each slice
        validate(make(**kda, parallel__context_parallel_size=cp), cp)


@pytest.mark.parametrize(
    "name,flag",
    [
        ("num_layers", "--num-layers"),
        ("hidden_size", "--hidden-size"),
        ("num_attention_heads", "--num-attention-heads"),
        ("seq_length", "--seq-length"),
    ],
)
def test_non_positive_model_sizes(name, flag):
    lines = errors_of(make(**{f"model__{name}": 0}))
    assert line_with(lines, flag).endswith("must be >= 1 (got 0)")


def test_non_positive_parallel_and_train_sizes():
    lines = errors_of(make(parallel__tensor_model_parallel_size=0, train__micro_batch_size=-1, train__train_iters=0))
    line_with(lines, "--tensor-model-parallel-size must be >= 1")
    line_with(lines, "--micro-batch-size must be >= 1 (got -1)")
    line_with(lines, "--train-iters must be >= 1")


def test_world_not_divisible_names_parallel_flags():
    # world 3 with TP 2: the layout error must say which flags to change
    lines = errors_of(make(parallel__tensor_model_parallel_size=2), 3)
    line = line_with(lines, "world size 3")
    assert "not divisible" in line
    assert any(
        f in line for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")
    ), line


def test_odd_head_dim_names_flags():
    # hidden 96 / heads 32 = head dim 3: RoPE needs an even head dim
    lines = errors_of(make(model__hidden_size=96, model__num_attention_heads=32))
    line = line_with(lines, "RoPE")
    assert "--hidden-size" in line or "--num-attention-heads" in line, line


def test_ranks_per_node_not_dividing_world_is_a_config_error():
    # otherwise Topology raises a ValueError after the process group exists (a traceback)
    lines = errors_of(make(parallel__ranks_per_node=3), 4)
    line_with(lines, "--ranks-per-node")


@pytest.mark.parametrize("with_data_path", [False, True])
def test_data_source_both_or_neither(with_data_path):
    cfg = make(data__mock_data=with_data_path, data__data_path=["a"] if with_data_path else [])
    line = line_with(errors_of(cfg), "--data-path")
    assert "--mock-data" in line


def test_multiple_problems_reported_together():
    cfg = make(
        model__num_attention_heads=3,
        train__global_batch_size=5,
        parallel__order="tp-dp",
        data__mock_data=False,
        optim__min_lr=1.0,
    )
    lines = errors_of(cfg, 2)
    for flag in ("--num-attention-heads", "--global-batch-size", "--parallel-order", "--data-path", "--min-lr"):
        line_with(lines, flag)
    assert len(lines) >= 5


def test_save_interval_needs_save():
    line = line_with(errors_of(make(train__save_interval=5), 1), "--save-interval")
    assert "--save DIR" in line
    validate(make(train__save_interval=5, train__save="/tmp/ckpt", train__load="/tmp/ckpt"), 1)


def test_checkpoint_flags_need_their_directory():
    lines = errors_of(make(train__exit_signal_handler=True, train__ckpt_step=4), 1)
    assert "--save DIR" in line_with(lines, "--exit-signal-handler")
    assert "--load DIR" in line_with(lines, "--ckpt-step")


# ------------------------------------------------------------------ command line


def test_parse_args_empty_is_defaults():
    assert parse_args([]) == Config()


def test_parse_args_megatron_flags():
    cfg = parse_args(
        (
            "--num-layers 6 --hidden-size 256 --num-attention-heads 8 --tensor-model-parallel-size 2 "
            "--pipeline-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 64 --lr 1e-3 "
            "--parallel-order tp-dp-cp-pp --zero-hierarchy 2 4 --normalization LayerNorm"
        ).split()
    )
    assert cfg.model.num_layers == 6 and isinstance(cfg.model.num_layers, int)
    assert cfg.model.hidden_size == 256 and cfg.model.num_attention_heads == 8
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.pipeline_model_parallel_size == 2
    assert cfg.train.micro_batch_size == 4 and cfg.train.global_batch_size == 64
    assert cfg.optim.lr == 1e-3
    assert cfg.parallel.order == "tp-dp-cp-pp"
    assert cfg.zero.zero_hierarchy == [2, 4]
    assert cfg.model.normalization == "LayerNorm"


def test_swiglu_alias():
    assert parse_args(["--activation", "gelu"]).model.activation == "gelu"
    assert parse_args(["--activation", "gelu", "--swiglu"]).model.activation == "swiglu"


def test_bf16_flags():
    assert parse_args([]).train.bf16 is False
    assert parse_args(["--bf16"]).train.bf16 is True
    assert parse_args(["--bf16", "--no-bf16"]).train.bf16 is False
    assert parse_args(["--bf16", "--fp32"]).train.bf16 is False


def test_data_path_with_weights_is_a_list():
    cfg = parse_args(["--data-path", "0.3", "/d/a_text_document", "0.7", "/d/b_text_document", "--split", "98,2,0"])
    assert cfg.data.data_path == ["0.3", "/d/a_text_document", "0.7", "/d/b_text_document"]
    assert cfg.data.split == "98,2,0"
    assert parse_args(["--data-path", "/d/a"]).data.data_path == ["/d/a"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--normalization", "BatchNorm"], "--normalization: invalid choice: 'BatchNorm'"),
        (["--num-layers", "six"], "--num-layers: invalid int value: 'six'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--zero-stage", "4"], "--zero-stage: invalid choice: 4"),
        (["--num-layers"], "--num-layers: expected one argument"),
        (["--bf16", "yes"], "unrecognized arguments: yes (after --bf16)"),
    ],
)
def test_bad_cli_values_are_one_line_each(argv, says):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert str(info.value).splitlines() == [str(info.value)] and str(info.value).startswith(says)


def test_every_error_of_a_command_line_in_one_pass(tmp_path):
    """Unknown flags (with the nearest flag), bad values, refused Megatron flags, YAML errors and the
    checks' errors: all in one ConfigError, one line each, so a user reruns once."""
    yaml_file = write(tmp_path, "hidden-size: wide\nnum-layers: 2.5\nhiden: 3\n")
    argv = ["--mock-data", "--num-layrs", "2", "--seq-length", "x", "--moe-use-upcycling"]
    argv += ["--fp8-format", "hybrid", "--config", yaml_file, "--num-attention-heads", "3", "--zero-stage", "9"]
    with pytest.raises(ConfigError) as info:
        parse_config(argv, 1)
    lines = str(info.value).splitlines()
    expect = [
        "unrecognized arguments: --num-layrs (did you mean --num-layers?)",
        "--seq-length: invalid int value: 'x'",
        "--zero-stage: invalid choice: 9",
        "--moe-use-upcycling: this option of Megatron's mixture of experts is not built",
        "--fp8-format: FP8/FP4 and transformer-engine are not supported",
        f"--config {yaml_file}: unknown setting 'hiden' (did you mean 'hidden-size'?)",
        f"--config {yaml_file}: hidden-size: invalid value 'wide'",
        f"--config {yaml_file}: num-layers: invalid value 2.5",
        "--hidden-size 128 is not divisible by --num-attention-heads 3",  # validate(), same pass
    ]
    assert len(lines) == len(expect) and all(ln.startswith(e) for ln, e in zip(lines, expect)), lines


# ------------------------------------------------------------------ YAML


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_nested_by_section(tmp_path):
    path = write(
        tmp_path,
        """
model:
  num-layers: 6
  hidden_size: 256
parallel:
  tensor-model-parallel-size: 2
  parallel-order: tp-dp-cp-pp
train:
  bf16: true
  micro_batch_size: 2
data:
  data-path: [0.5, /d/a, 0.5, /d/b]
""",
    )
    cfg = parse_args(["--config", path])
    assert cfg.model.num_layers == 6 and cfg.model.hidden_size == 256
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.order == "tp-dp-cp-pp"
    assert cfg.train.bf16 is True and cfg.train.micro_batch_size == 2
    assert [str(x) for x in cfg.data.data_path] == ["0.5", "/d/a", "0.5", "/d/b"]


def test_yaml_flat_dash_and_underscore_keys(tmp_path):
    path = write(tmp_path, "num-layers: 6\nhidden_size: 256\n--seq-length: 512\nmock-data: true\norder: dp-tp-cp-pp\n")
    cfg = parse_args(["--config", path])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (6, 256, 512)
    assert cfg.data.mock_data is True
    assert cfg.parallel.order == "dp-tp-cp-pp"


def test_cli_overrides_yaml(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 6\n  hidden_size: 256\n  activation: gelu\ntrain:\n  bf16: true\n")
    cfg = parse_args(["--config", path, "--num-layers", "8", "--no-bf16", "--swiglu"])
    assert cfg.model.num_layers == 8  # CLI wins
    assert cfg.model.hidden_size == 256  # YAML kept where the CLI is silent
    assert cfg.train.bf16 is False
    assert cfg.model.activation == "swiglu"
    # flag before --config: still overrides
    cfg = parse_args(["--num-layers", "2", "--config", path])
    assert cfg.model.num_layers == 2


def test_yaml_unknown_keys_named(tmp_path):
    path = write(tmp_path, "hiden_size: 256\nmodel:\n  num_layers: 2\n  foo-bar: 1\nnum_layers: 3\n")
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", path])
    msg = str(info.value)
    assert "hiden_size" in msg and "foo-bar" in msg


def test_yaml_fields_without_flags_are_unknown(tmp_path):
    # derived fields are not settings
    with pytest.raises(ConfigError, match="data_parallel_size"):
        load_yaml(write(tmp_path, "data_parallel_size: 4\n"))


@pytest.mark.parametrize("text,match", [("- a\n- b\n", "mapping"), ("model: [unclosed\n", "invalid YAML")])
def test_yaml_bad_files(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(["--config", write(tmp_path, text)])


def test_yaml_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        parse_args(["--config", str(tmp_path / "nope.yaml")])


def test_yaml_empty_file_is_defaults(tmp_path):
    assert parse_args(["--config", write(tmp_path, "")]) == Config()


def test_yaml_values_get_the_field_type(tmp_path):
    # PyYAML reads 3e-4 (no dot) as a string; a Megatron-style YAML writes learning rates so
    path = write(tmp_path, "lr: 3e-4\nmin_lr: 3e-5\nmock_data: true\n")
    cfg = parse_args(["--config", path])
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == pytest.approx(3e-4)
    assert isinstance(cfg.optim.min_lr, float)
    validate(cfg, 1)


def test_yaml_choices_checked(tmp_path):
    # the CLI refuses --activation relu; the same value from YAML must not slip through
    path = write(tmp_path, "activation: relu\nmock_data: true\n")
    with pytest.raises(ConfigError, match="activation"):
        validate(parse_args(["--config", path]), 1)


# ------------------------------------------------------------------ the entry point


def test_pretrain_gpt_config_error_exits_2_without_traceback():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--mock-data", "--num-attention-heads", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert any("--num-attention-heads" in ln for ln in err_lines), proc.stderr
    assert "Traceback" not in proc.stdout


def test_packed_document_flags_are_accepted_with_megatrons_names():
    cfg = validate(parse_args("--mock-data --reset-position-ids --reset-attention-mask --eod-mask-loss".split()), 1)
    d = cfg.data
    assert d.reset_position_ids and d.reset_attention_mask and d.eod_mask_loss and d.packed_documents
    assert not validate(parse_args(["--mock-data", "--eod-mask-loss"]), 1).data.packed_documents


def test_gdn_context_parallelism_needs_the_convolution_halo():
    # each CP rank's slice must hold the 3 tokens the next rank's convolution reads
    argv = "--mock-data --attention-type gdn --context-parallel-size 16 --seq-length 32 --gla-chunk-size 2"
    assert "shorter than the convolution's 3 tokens" in line_with(errors_of(parse_args(argv.split()), 16), "gdn")
    validate(parse_args("--mock-data --attention-type gdn --context-parallel-size 2".split()), 2)


def test_linear_chunk_size_keeps_its_former_name(tmp_path):
    # --gla-chunk-size, the YAML key gla_chunk_size and a checkpoint's config saved with it all set linear_chunk_size;
    # the former and the current name together are a setting given twice
    from megatron_zpp.checkpoint.layout import config_from_dict

    for argv in (["--linear-chunk-size", "8"], ["--gla-chunk-size", "8"]):
        assert parse_args(argv).model.linear_chunk_size == 8, argv
    assert load_yaml(write(tmp_path, "model:\n  gla_chunk_size: 8\n")) == {"model.linear_chunk_size": 8}
    with pytest.raises(ConfigError, match="a second time"):
        load_yaml(write(tmp_path, "gla_chunk_size: 8\nlinear_chunk_size: 16\n"))
    assert config_from_dict({"model": {"gla_chunk_size": 8}}).model.linear_chunk_size == 8
    assert "--linear-chunk-size LINEAR_CHUNK_SIZE, --gla-chunk-size" in " ".join(build_parser().format_help().split())
