"""Command line and YAML -> Config.

The parser is generated from the config dataclasses (each field names its flag), so a
flag cannot drift from the setting it controls. Precedence: defaults < --config YAML <
command line. YAML keys are flag names with or without dashes (`hidden-size` or
`hidden_size`), flat or nested under the section names of Config.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
import typing

import yaml

from .config import SECTIONS, Config, ConfigError
from .topology import check_node_layout
from .validation import validate

# Megatron-LM spellings accepted as aliases: flag -> (section, field, value).
ALIASES = {
    "--swiglu": ("model", "activation", "swiglu"),
    "--fp32": ("train", "bf16", False),
    "--disable-bias-linear": ("model", "add_bias_linear", False),
    "--use-flash-attn": ("model", "attention_backend", "flash"),
    "--use-rotary-position-embeddings": ("model", "position_embedding_type", "rope"),
}

# Megatron-LM flags accepted without a setting of their own, because what they ask for is what
# always happens here: flag -> (takes a value, why).
NOOPS = {
    "--use-mcore-models": (False, "deprecated in Megatron-LM, which ignores it too"),
    "--cross-entropy-loss-fusion": (False, "the vocab-parallel cross-entropy is always fused (one pass per row)"),
    "--log-throughput": (False, "tokens/s, TFLOP/s per rank and MFU are always logged"),
    "--no-create-attention-mask-in-dataloader": (
        False,
        "the data loader never builds an attention mask (causal SDPA; packed documents travel as document ids)",
    ),
    "--tiktoken-pattern": (True, "read only by TikTokenizer (not built here); Megatron ignores it for the others"),
}

# Megatron-LM flags that are refused by name: flag -> (takes a value, why and what to use). A flag
# that a config field declares is that field's, not refused (so a feature that lands wins).
REFUSED = {
    **{
        f: (v, "FP8 needs transformer-engine, which is not supported here: drop it (use --bf16)")
        for f, v in [
            ("--fp8-format", True),
            ("--fp8-recipe", True),
            ("--fp8-amax-history-len", True),
            ("--fp8-amax-compute-algo", True),
            ("--fp8-param-gather", False),
            ("--fp8-margin", True),
        ]
    },
    "--transformer-impl": (True, "transformer-engine layers are not supported; ours are PyTorch modules: drop it"),
    "--apply-layernorm-1p": (
        False,
        "zero-centred norm weights are not built: drop it (the same function at init; with norms exempt from "
        "weight decay, as here and in Megatron, AdamW trains both alike up to round-off)",
    ),
    "--decoupled-lr": (True, "a separate learning rate for the embedding and output layer is not built: drop it"),
    "--decoupled-min-lr": (True, "a separate learning rate for the embedding and output layer is not built: drop it"),
    "--step-batch-size-schedule": (
        True,
        "not built: use --rampup-batch-size START INCR SAMPLES with --train-samples (Megatron's linear ramp)",
    ),
    "--profile": (False, "torch.profiler traces are not built yet: drop it"),
    "--profile-step-start": (True, "torch.profiler traces are not built yet: drop it"),
    "--profile-step-end": (True, "torch.profiler traces are not built yet: drop it"),
    "--profile-ranks": (True, "torch.profiler traces are not built yet: drop it"),
    "--squared-relu": (False, "not built: use --swiglu or the default gelu"),
    "--quick-geglu": (False, "not built: use --swiglu or the default gelu"),
}


def _field_types(cls) -> dict[str, object]:
    """Field name -> its type (the annotations are strings under `from __future__`)."""
    return typing.get_type_hints(cls)


def _base_type(tp):
    """int | None -> int; list[str] -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT with TP x PP x CP x ZeRO++ DP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # as Megatron: --hidden-s is an error, not --hidden-size
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of settings; command-line flags override it")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        types_of = _field_types(cls)
        for f in dataclasses.fields(cls):
            if "flag" not in f.metadata:
                continue
            meta, dest = f.metadata, f"{section}.{f.name}"
            tp = _base_type(types_of[f.name])
            default = argparse.SUPPRESS  # absent flags do not override YAML
            if tp is bool:
                group.add_argument(
                    meta["flag"],
                    dest=dest,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=meta["help"] + f" (default: {f.default})",
                )
            elif typing.get_origin(tp) is list or tp is list:
                group.add_argument(
                    meta["flag"],
                    dest=dest,
                    nargs=meta.get("nargs", "+"),
                    type=meta.get("type", str),
                    default=default,
                    help=meta["help"],
                    metavar=meta.get("metavar"),
                )
            else:
                group.add_argument(
                    meta["flag"],
                    dest=dest,
                    type=tp,
                    choices=meta.get("choices"),
                    default=default,
                    help=meta["help"] + f" (default: {f.default})",
                )
    for flag, (section, name, value) in ALIASES.items():
        parser.add_argument(
            flag,
            dest=f"{section}.{name}",
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=f"alias of {name}={value} (Megatron-LM spelling)",
        )
    _add_megatron_only(parser)
    return parser


def _add_megatron_only(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags that have no setting here: accepted no-ops and refused ones."""
    known = set(parser._option_string_actions)
    noops = parser.add_argument_group("Megatron-LM flags accepted as no-ops (what they ask for always happens)")
    for flag, (takes_value, why) in NOOPS.items():
        kind = {"metavar": "VALUE"} if takes_value else {"action": "store_true"}
        noops.add_argument(flag, dest=f"noop.{flag}", default=argparse.SUPPRESS, help=why, **kind)
    refused = parser.add_argument_group("Megatron-LM flags refused (each says why and what to use)")
    for flag, (takes_value, why) in REFUSED.items():
        if flag in known:  # implemented by a config field
            continue
        kind = {"nargs": "*", "metavar": "VALUE"} if takes_value else {"nargs": "?", "const": True, "metavar": "VALUE"}
        refused.add_argument(flag, dest=f"refused.{flag}", default=argparse.SUPPRESS, help=f"refused: {why}", **kind)


def refused_flags(args: dict) -> list[str]:
    """One line per refused Megatron flag given (popped from the parsed `args`)."""
    given = [dest.split(".", 1)[1] for dest in list(args) if dest.startswith("refused.")]
    for dest in [d for d in args if d.startswith(("refused.", "noop."))]:
        args.pop(dest)
    return [f"{flag}: {REFUSED[flag][1]}" for flag in given]


def _coerce(section: str, name: str, value, path: str):
    """A YAML value converted to its field's type and checked against its choices."""
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    tp, meta = _base_type(_field_types(SECTIONS[section])[name]), f.metadata
    where = f"--config {path}: {meta['flag'].lstrip('-')}"
    if value is None:
        return None
    try:
        if tp is bool:
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
        elif typing.get_origin(tp) is list or tp is list:
            items = value if isinstance(value, list) else [value]
            value = [meta.get("type", str)(v) for v in items]
        elif tp is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise ValueError(f"expected an integer, got {value!r}")  # int() would make 32.9 -> 32, true -> 1
        elif tp is float and isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        else:
            value = tp(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: invalid value {value!r} ({e})") from None
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{where}: {value!r} is not one of {meta['choices']}")
    return value


def _flag_index() -> dict[str, tuple[str, str]]:
    """'hidden_size' -> ('model', 'hidden_size'), keyed by flag name without dashes."""
    index = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                index[f.metadata["flag"].lstrip("-").replace("-", "_")] = (section, f.name)
                index[f.name] = (section, f.name)
    return index


def load_yaml(path: str) -> dict[str, object]:
    """YAML -> {'section.field': value}; unknown keys are an error naming them."""
    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings at the top level")
    flat: dict[str, object] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    index, out, unknown = _flag_index(), {}, []
    for key, value in flat.items():
        name = key.split(".")[-1].lstrip("-").replace("-", "_")
        if name not in index:
            unknown.append(key)
            continue
        section, field_name = index[name]
        out[f"{section}.{field_name}"] = _coerce(section, field_name, value, path)
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown {'setting' if len(unknown) == 1 else 'settings'} "
            + ", ".join(f"{key!r}{_did_you_mean(key)}" for key in unknown)
        )
    return out


def _did_you_mean(key: str) -> str:
    """' (did you mean 'hidden-size'?)' for the valid setting nearest to a YAML key, else ''."""
    names = sorted(
        {
            f.metadata["flag"].lstrip("-")
            for cls in SECTIONS.values()
            for f in dataclasses.fields(cls)
            if "flag" in f.metadata
        }
    )
    close = difflib.get_close_matches(str(key).split(".")[-1].lstrip("-").replace("_", "-"), names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _one_line_error(message: str) -> None:
    print(f"error: {message} (pretrain_gpt.py --help lists every flag)", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse argv (and --config YAML) into an unvalidated Config."""
    parser = build_parser()
    parser.error = _one_line_error  # not the usage of every flag: one line, then exit 2 as argparse does
    args = vars(parser.parse_args(argv))
    refused = refused_flags(args)
    if refused:
        raise ConfigError("\n".join(refused))
    values = load_yaml(args.pop("config")) if args.get("config") else {}
    args.pop("config", None)
    values.update(args)
    cfg = Config()
    for dest, value in values.items():
        section, name = dest.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def parse_config(argv: list[str] | None, world_size: int) -> Config:
    """argv -> a validated Config, node layout included: every check that needs no process
    group, so a bad setting costs one error line before any work (raises ConfigError)."""
    cfg = validate(parse_args(argv), world_size)
    check_node_layout(cfg)
    return cfg
