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
from collections.abc import Callable

import yaml

from ..topology import check_node_layout
from ..validation import validate
from . import SECTIONS, Config, ConfigError, flag_of
from .megatron_flags import MEGATRON_ARGUMENTS, VALUED, classify, valued_outcome

# Megatron-LM spellings accepted as aliases: flag -> (section, field, value).
ALIASES = {
    "--swiglu": ("model", "activation", "swiglu"),
    "--squared-relu": ("model", "activation", "squared_relu"),
    "--fp32": ("train", "bf16", False),
    "--disable-bias-linear": ("model", "add_bias_linear", False),
    "--use-flash-attn": ("model", "attention_backend", "flash"),
    "--use-rotary-position-embeddings": ("model", "position_embedding_type", "rope"),
    "--recompute-activations": ("model", "recompute_granularity", "selective"),
    "--use-checkpoint-opt-param-scheduler": ("optim", "use_checkpoint_opt_param_scheduler", True),
    "--override-opt-param-scheduler": ("optim", "override_opt_param_scheduler", True),
    "--use-dist-ckpt": ("train", "ckpt_format", "torch_dist"),  # deprecated in Megatron-LM for --ckpt-format
}


def softmax_period(text: str) -> int:
    """Megatron's --linear-attention-freq N: layer i is softmax attention where (i + 1) % N == 0, the
    rest linear attention, as our --softmax-attention-every N (ModelConfig.layer_kind)."""
    if "[" in text:  # Megatron evals a Python list expression; none is evaluated here
        raise argparse.ArgumentTypeError(
            f"{text!r}: a per-layer list pattern is not read here: give its period N (softmax attention on every "
            "N-th layer), the only hybrid pattern built"
        )
    try:
        period = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if period < 1:
        raise argparse.ArgumentTypeError(f"{period}: must be >= 1 (one softmax layer every N)")
    return period


# Megatron-LM spellings that take a value: flag -> (section, field, Megatron's value -> ours).
VALUE_ALIASES = {"--linear-attention-freq": ("model", "softmax_attention_every", softmax_period)}


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


def _metavar(meta: dict):
    """The flag's own name (NUM_LAYERS), not argparse's dest (MODEL.NUM_LAYERS); choices show as {a,b}."""
    if meta.get("choices") is not None:
        return None
    return meta.get("metavar") or meta["flag"].lstrip("-").upper().replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        usage="%(prog)s [--config FILE.yaml] [--FLAG [VALUE ...] ...]",
        description="Pretrain a GPT with TP x PP x CP x ZeRO++ DP.",
        allow_abbrev=False,  # as Megatron: --hidden-s is an error, not --hidden-size
        exit_on_error=False,  # parse_args collects every error of the command line (one line each)
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of settings; command-line flags override it")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        types_of = _field_types(cls)
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                _add_field(group, f"{section}.{f.name}", f, _base_type(types_of[f.name]))
    aliases = parser.add_argument_group("Megatron-LM spellings of the settings above")
    for flag, (section, name, value) in ALIASES.items():
        aliases.add_argument(
            flag,
            dest=f"{section}.{name}",
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=f"the same as {_spelled(flag_of(section, name), value)}",
        )
    for flag, (section, name, convert) in VALUE_ALIASES.items():
        aliases.add_argument(
            flag,
            dest=f"alias.{flag}",  # _value_aliases sets the setting: both given, they must agree
            type=convert,
            default=argparse.SUPPRESS,
            metavar="N",
            help=f"the same as {flag_of(section, name)} N (giving both with other values is an error)",
        )
    _add_megatron_only(parser)
    return parser


def _spelled(flag: str, value) -> str:
    """How our own flag says `value`: --activation swiglu, --no-bf16."""
    if isinstance(value, bool):
        return flag if value else "--no-" + flag.lstrip("-")
    return f"{flag} {value}"


def _add_field(group, dest: str, f: dataclasses.Field, tp) -> None:
    """One config field's flag (absent flags set nothing, so YAML values stand)."""
    meta, default = f.metadata, argparse.SUPPRESS
    flags = [meta["flag"]] + (["--" + meta["renamed_from"].replace("_", "-")] if "renamed_from" in meta else [])
    shown = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    help_text = meta["help"] if "default" in meta["help"] else f"{meta['help']} (default: {shown})"
    if tp is bool:
        group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
    elif typing.get_origin(tp) is list or tp is list:
        group.add_argument(
            *flags,
            dest=dest,
            nargs=meta.get("nargs", "+"),
            type=meta.get("type", str),
            default=default,
            help=help_text,
            metavar=_metavar(meta),
        )
    else:
        group.add_argument(
            *flags,
            dest=dest,
            type=tp,
            choices=meta.get("choices"),
            default=default,
            help=help_text,
            metavar=_metavar(meta),
        )


def _add_megatron_only(parser: argparse.ArgumentParser) -> None:
    """Every Megatron-LM argument that no setting or alias declares: a no-op or refused by reason
    (megatron_flags.py classifies them); none reaches argparse's "unrecognized". The parser keeps
    each one's class in parser.megatron: dest -> (kind, why, Megatron group)."""
    known = set(parser._option_string_actions)
    noops = parser.add_argument_group("Megatron-LM flags accepted as no-ops (what they ask for always happens)")
    refused = parser.add_argument_group(
        "Megatron-LM flags refused",
        "every other flag of Megatron-LM's parser is known and refused with one line saying why "
        "(docs/megatron_compat.md; megatron_zpp/config/megatron_flags.py)",
    )
    parser.megatron = {}
    for options, takes_value, group in MEGATRON_ARGUMENTS:
        options = tuple(o for o in options if o not in known)
        if not options:  # a setting or an alias takes it
            continue
        kind, why = classify(options, group)
        dest = f"megatron.{options[0]}"
        parser.megatron[dest] = (kind, why, group)
        value = {"nargs": "*", "metavar": "VALUE"} if takes_value else {"action": "store_const", "const": True}
        if kind == "valued":
            values, reason = VALUED[why]
            help_text = f"{' or '.join(values)}: a no-op ({reason}); other values are refused"
            noops.add_argument(*options, dest=dest, default=argparse.SUPPRESS, metavar="VALUE", help=help_text)
        elif kind == "noop":
            noops.add_argument(*options, dest=dest, default=argparse.SUPPRESS, help=why, **value)
        else:
            refused.add_argument(*options, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **value)


def megatron_only(args: dict, table: dict) -> tuple[list[str], list[str]]:
    """(refused lines, no-op flags given) of the Megatron-only flags in the parsed `args` (popped
    from it); `table` is the parser's dest -> (kind, why, group)."""
    lines, noops = [], []
    for dest in [d for d in args if d.startswith("megatron.")]:
        (kind, why, group), flag, value = table[dest], dest.split(".", 1)[1], args.pop(dest)
        if kind == "valued":
            is_noop, why = valued_outcome(why, value, group)
            kind, flag = ("noop" if is_noop else "refused"), f"{flag} {value}"
        if kind == "noop":
            noops.append(flag)
        else:
            lines.append(f"{flag}: {why}")
    return lines, noops


def _coerce(section: str, name: str, value, path: str):
    """A YAML value converted to its field's type and checked against its choices."""
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    tp, meta = _base_type(_field_types(SECTIONS[section])[name]), f.metadata
    where = f"--config {path}: {meta['flag'].lstrip('-')}"
    if value is None:
        if type(None) in typing.get_args(_field_types(SECTIONS[section])[name]):
            return None
        raise ConfigError(f"{where}: has no value (null): give one or drop the key")
    try:
        if isinstance(value, dict) or (isinstance(value, list) and typing.get_origin(tp) is not list):
            raise ValueError(f"expected a single value, got a {type(value).__name__}")
        if tp is bool:
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
        elif typing.get_origin(tp) is list or tp is list:
            items = value if isinstance(value, list) else [value]
            if any(v is None or isinstance(v, (dict, list)) for v in items):
                raise ValueError("expected a list of plain values")
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
                if "renamed_from" in f.metadata:  # a former name (YAML files written before the rename)
                    index[f.metadata["renamed_from"]] = (section, f.name)
    return index


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else []:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable) or key == "<<":
                continue  # an unhashable key: the base class refuses it; merge keys may repeat
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: str):
    """The YAML document of `path` (None when empty): unreadable, not UTF-8 or invalid is one line."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"--config {path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark else path
        why = " ".join(" ".join(filter(None, (e.context, e.problem))).split())
        raise ConfigError(f"--config {where}: invalid YAML: {why}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: invalid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"--config {path}: invalid YAML: nested too deeply") from None


def load_yaml(path: str) -> dict[str, object]:
    """YAML -> {'section.field': value}; unknown, non-string and repeated keys are errors naming them."""
    raw = _read_yaml(path)
    if raw is None:
        return {}  # an empty file sets nothing
    if not isinstance(raw, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of settings at the top level (YAML read {type(raw).__name__})"
        )
    flat: dict[str, object] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({f"{key}.{k}" if isinstance(k, str) else k: v for k, v in value.items()})
        else:
            flat[key] = value
    index, out, unknown, errors = _flag_index(), {}, [], []
    for key, value in flat.items():
        if not isinstance(key, str):
            errors.append(
                f"--config {path}: key {key!r} is not a setting name (YAML read it as {type(key).__name__}, not str)"
            )
            continue
        name = key.split(".")[-1].lstrip("-").replace("-", "_")
        if name not in index:
            unknown.append(key)
            continue
        section, field_name = index[name]
        if f"{section}.{field_name}" in out:
            errors.append(f"--config {path}: {key!r} sets {flag_of(section, field_name)} a second time")
            continue
        try:
            out[f"{section}.{field_name}"] = _coerce(section, field_name, value, path)
        except ConfigError as e:  # every bad value of the file, one line each
            errors.append(str(e))
    if unknown:
        errors.insert(
            0,
            f"--config {path}: unknown {'setting' if len(unknown) == 1 else 'settings'} "
            + ", ".join(f"{key!r}{_did_you_mean(key)}" for key in unknown),
        )
    if errors:
        raise ConfigError("\n".join(errors))
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


def _chunks(argv: list[str]) -> list[list[str]]:
    """argv cut before each flag: each piece is parsed alone, so one bad flag does not hide the next."""
    pieces: list[list[str]] = []
    for token in argv:
        if token.startswith("--") or not pieces:
            pieces.append([token])
        else:
            pieces[-1].append(token)
    return pieces


def _unknown(extra: list[str], piece: list[str], flags: list[str]) -> str:
    """The line for what argparse left over from one piece of the command line."""
    if extra[0] == piece[0] and piece[0].startswith("-"):
        name = piece[0].split("=", 1)[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
        return f"unrecognized arguments: {name}" + (f" (did you mean {close[0]}?)" if close else "")
    where = f" (after {piece[0]})" if piece[0].startswith("-") and extra[0] != piece[0] else ""
    return f"unrecognized arguments: {' '.join(extra)}{where}"


def _value_aliases(args: dict) -> list[str]:
    """The VALUE_ALIASES given, moved onto their settings in the parsed `args`; one line where a setting is
    also given under its own flag with another value (argparse would keep the later one silently)."""
    errors = []
    for flag, (section, name, _) in VALUE_ALIASES.items():
        if f"alias.{flag}" not in args:
            continue
        value, dest = args.pop(f"alias.{flag}"), f"{section}.{name}"
        if dest in args and args[dest] != value:
            errors.append(
                f"{flag} {value} and {flag_of(section, name)} {args[dest]} disagree (the same setting): give one"
            )
        args[dest] = value
    return errors


def _parse(argv: list[str] | None) -> tuple[Config, list[str]]:
    """argv (and --config YAML) -> (an unvalidated Config, every error line). A value that fails
    its type or choices leaves its setting at the default and is one error line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        sys.exit(0)
    args, errors = argparse.Namespace(), []
    flags = sorted(o for o in parser._option_string_actions if o.startswith("--"))
    for piece in _chunks(argv):
        try:
            args, extra = parser.parse_known_args(piece, args)
        except argparse.ArgumentError as e:
            errors.append(str(e).removeprefix("argument "))
            continue
        if extra:
            errors.append(_unknown(extra, piece, flags))
    args = vars(args)
    refused, noops = megatron_only(args, parser.megatron)
    errors += refused + _value_aliases(args)
    values = {}
    if args.get("config"):
        try:
            values = load_yaml(args["config"])
        except ConfigError as e:
            errors += str(e).splitlines()
    args.pop("config", None)
    values.update(args)
    cfg = Config()
    for dest, value in values.items():
        section, name = dest.split(".")
        setattr(getattr(cfg, section), name, value)
    if cfg.model.experimental_attention_variant == "gated_delta_net" and cfg.model.attention_type == "softmax":
        cfg.model.attention_type = "gdn"  # Megatron's spelling of ours (validation refuses it beside gla)
    cfg.megatron_noops = noops  # the Megatron no-op flags given, for the start-up log's one line
    return cfg, errors


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse argv (and --config YAML) into an unvalidated Config; ConfigError lists every unknown
    or refused flag and every bad value, one line each."""
    cfg, errors = _parse(argv)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def parse_config(
    argv: list[str] | None, world_size: int, run: bool = True, inputs: Callable[[Config], None] | None = None
) -> Config:
    """argv -> a validated Config, node layout included: every check that needs no process
    group, so a bad setting costs one error line before any work. The flags' errors and the
    checks' (`inputs` too: the input files' check of a launch, run where the settings pass) come
    in one ConfigError, so a user reruns once. run=False: the planning tools' checks (validate's,
    without what only a run reads or writes)."""
    cfg, errors = _parse(argv)
    try:
        validate(cfg, world_size, run=run)
        check_node_layout(cfg)
        if inputs is not None:  # the settings it reads are valid (a refused flag set nothing)
            inputs(cfg)
    except ConfigError as e:
        errors += str(e).splitlines()
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg
