"""Write megatron_zpp/config/megatron_flags.json: every option string of Megatron-LM's real parser.

Run by hand (not in CI) against a Megatron-LM source tree, e.g. from a bare mirror:

    mkdir -p /tmp/mlm && git -C MIRROR archive COMMIT megatron | tar -x -C /tmp/mlm
    python tools/extract_megatron_flags.py /tmp/mlm --commit COMMIT

The tree's `megatron.training.arguments.add_megatron_arguments` builds the parser (the flags its
config dataclasses generate included), so the list is what Megatron accepts, not a reading of its
source. The fetched code is imported from its own directory; nothing of it is copied here. It needs
torch (our environment has it); transformer-engine and apex are optional for Megatron's imports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import typing
import warnings

OUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_zpp", "config", "megatron_flags.json"
)


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own parser (its package importable: this runs with PYTHONPATH = its tree)."""
    if not hasattr(typing, "override"):  # Megatron imports typing.override (Python 3.12); a no-op here
        typing.override = lambda f: f
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments

        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_megatron_arguments(parser)
    return parser


def flag_records(parser: argparse.ArgumentParser) -> list[dict]:
    """One record per argument: its option strings, whether it takes a value, its group's title."""
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    records = []
    for action in parser._actions:
        if not action.option_strings or "--help" in action.option_strings:
            continue
        records.append(
            {
                "options": list(action.option_strings),
                "value": action.nargs != 0,
                "group": group_of.get(id(action), ""),
            }
        )
    return records


def source_commit(source: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a Megatron-LM source tree (holding megatron/training/arguments.py)")
    ap.add_argument("--commit", help="the tree's commit (default: git rev-parse HEAD in the tree)")
    ap.add_argument("--out", default=OUT, help="the JSON to write")
    ap.add_argument("--records", action="store_true", help=argparse.SUPPRESS)  # the child run: print them
    args = ap.parse_args(argv)
    if args.records:
        json.dump(flag_records(megatron_parser()), sys.stdout)
        return
    commit = args.commit or source_commit(args.source)
    if not commit:
        ap.error("the tree is no git checkout: give --commit")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(args.source)}  # Megatron's package from its tree
    child = [sys.executable, os.path.abspath(__file__), args.source, "--records"]
    records = json.loads(subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout)
    data = {"commit": commit, "source": "megatron/training/arguments.py (add_megatron_arguments)", "flags": records}
    with open(args.out, "w") as f:
        head = json.dumps({k: v for k, v in data.items() if k != "flags"})[:-1]
        f.write(head + ', "flags": [\n' + ",\n".join(json.dumps(r) for r in records) + "\n]}\n")  # a line each
    print(f"{sum(len(r['options']) for r in records)} option strings of {len(records)} arguments -> {args.out}")


if __name__ == "__main__":
    main()
