"""The benches' one rule for a target's verdict: a target compared against a peer is judged only when
every peer it names ran. A best-of-the-peers target judged against the peers that happened to be
installed flatters us (bench/zero.py without DeepSpeed judged ZeRO++ against FSDP2 alone, 4.04x where
DeepSpeed's ZeRO-3 gives 2.26x), so an absent peer turns the verdict into "not judged: <peer> did not
run (<why>); <fix>" and the bench's exit status non-zero, unless --allow-missing-peers makes it a
warning. bench/zero.py and bench/gla.py use it; tests/bench/test_verdict.py tests it as a unit."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BENCH_SETUP = "bash bench/setup.sh"  # the one command that installs the benches' peers (the [bench] extra)
INSTALL_FIX = f"install with {BENCH_SETUP}"
MET, NOT_MET, NOT_JUDGED = "MET", "NOT MET", "not judged"
EXIT_NOT_JUDGED = 3  # a requested target could not be judged (argparse errors exit 2)
ALLOW_FLAG = "--allow-missing-peers"
ALLOW_HELP = (
    "a target whose peer did not run (not installed, failed, not selected) is printed 'not judged' and the "
    f"bench exits {EXIT_NOT_JUDGED}; with this flag it exits 0 and prints a warning instead"
)


@dataclass(frozen=True)
class Absent:
    """A peer a target is judged against that did not run: its label, why, and what would make it run."""

    peer: str
    why: str
    fix: str = INSTALL_FIX


def not_judged(absent: Sequence[Absent]) -> str:
    """One line: "not judged: A, B did not run (why); fix" per distinct (why, fix), in order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for a in absent:
        groups.setdefault((a.why, a.fix), []).append(a.peer)
    parts = [f"{', '.join(peers)} did not run ({why}); {fix}" for (why, fix), peers in groups.items()]
    return f"{NOT_JUDGED}: " + "; ".join(parts)


def verdict(met: bool | None, absent: Sequence[Absent] = (), unmeasured: str = "not measured") -> str:
    """MET / NOT MET when every peer ran and the value exists; "not judged: ..." when a peer is absent
    (whatever the value: a missing peer may be the faster one); `unmeasured` when there is no value."""
    if absent:
        return not_judged(absent)
    if met is None:
        return unmeasured
    return MET if met else NOT_MET


def is_not_judged(v: str) -> bool:
    return v.startswith(NOT_JUDGED + ":")


def exit_status(verdicts: Iterable[str], allow_missing_peers: bool) -> int:
    """0, or EXIT_NOT_JUDGED when a target was not judged for an absent peer and the flag is off; says
    which on stderr either way (after the report, so it is the last thing a reader sees)."""
    unjudged = [v for v in verdicts if is_not_judged(v)]
    if not unjudged:
        return 0
    head = f"{len(unjudged)} target(s) not judged: a peer they are judged against did not run (see the targets above)"
    if allow_missing_peers:
        print(f"WARNING: {head}; exit status 0 ({ALLOW_FLAG})", file=sys.stderr)
        return 0
    print(f"error: {head}; exit status {EXIT_NOT_JUDGED} ({ALLOW_FLAG} makes this a warning)", file=sys.stderr)
    return EXIT_NOT_JUDGED
