"""--deterministic-mode, as Megatron-LM's (megatron/training/determinism.py): the environment that
NCCL, cuBLAS and transformer-engine read at their first use (so this runs before the process group
and the first kernel), and torch's deterministic algorithms. A value the launcher already set is kept
when it is a deterministic one and refused by name when it is not."""

from __future__ import annotations

import os

import torch

from ..config import ConfigError

# the environment of a bitwise-reproducible run, where the launcher set nothing
ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# what else is deterministic: NCCL algorithms (Tree is not: its reduction order may change between runs)
NCCL_ALGOS = {"Ring", "CollnetDirect", "CollnetChain", "^NVLS"}
EXACT = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": {"0"}, "CUBLAS_WORKSPACE_CONFIG": {":4096:8", ":16:8"}}


def check_environment(env) -> list[str]:
    """Errors, one line each, for environment values that would make the run non-deterministic."""
    errors = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGOS for t in tokens):
            errors.append(
                f"--deterministic-mode: NCCL_ALGO={algo!r} is not deterministic; use one of {sorted(NCCL_ALGOS)}"
            )
    for name, accepted in EXACT.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            errors.append(f"--deterministic-mode: {name}={value!r} is not deterministic; use one of {sorted(accepted)}")
    return errors


def apply_deterministic_mode(env=os.environ) -> str:
    """Set what --deterministic-mode sets; returns the log line that says what."""
    errors = check_environment(env)
    if errors:
        raise ConfigError("\n".join(errors))
    fresh = {k: v for k, v in ENV_DEFAULTS.items() if k not in env}
    env.update(fresh)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    kept = ", ".join(f"{k}={env[k]}" for k in ENV_DEFAULTS if k not in fresh)
    set_ = ", ".join(f"{k}={v}" for k, v in fresh.items())
    return (
        "--deterministic-mode: torch.use_deterministic_algorithms(True), cudnn.deterministic, no cudnn.benchmark"
        + (f"; set {set_}" if set_ else "")
        + (f"; kept {kept}" if kept else "")
    )
