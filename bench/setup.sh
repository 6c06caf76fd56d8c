#!/usr/bin/env bash
# What the benches need, in one command:   bash bench/setup.sh   (--dry-run: what pip would install)
# Sets up .venv as the README says (tools/setup_env.sh: idempotent, unchanged), then installs the
# [bench] extra of pyproject.toml into it: DeepSpeed 0.19.8, the peer of bench/zero.py's DeepSpeed
# ZeRO-3 and hpZ rows. DS_BUILD_OPS=0: no CUDA op is built at install time (there may be no CUDA);
# DeepSpeed builds its CPU shm comm op on first use, which bench/zero.py does once before its launches.
# Skipped when every pin of the extra is already installed. Without it a bench whose target needs
# DeepSpeed prints "not judged: ... did not run" and exits 3 (megatron_zpp/testing/verdict.py).
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=(--quiet)
case "${1:-}" in
  "") ;;
  --dry-run) dry_run=(--dry-run) ;;
  *) echo "error: bench/setup.sh: unknown argument '$1' (usage: bash bench/setup.sh [--dry-run])" >&2; exit 2 ;;
esac
bash tools/setup_env.sh
# every name==version pin of the [bench] extra already installed: nothing to do
if [ "${dry_run[0]}" = --quiet ] && .venv/bin/python - <<'EOF'
import re, sys
from importlib import metadata
text = open("pyproject.toml").read()
pins = re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', re.search(r"^bench = \[(.*?)\]", text, re.M | re.S).group(1))
def have(name, version):
    try:
        return metadata.version(name) == version
    except metadata.PackageNotFoundError:
        return False
sys.exit(0 if pins and all(have(n, v) for n, v in pins) else 1)
EOF
then
  echo "bench peers ready (the [bench] extra is installed in .venv)"
  exit 0
fi
DS_BUILD_OPS=0 .venv/bin/python -m pip install --disable-pip-version-check "${dry_run[@]}" -e ".[bench]"
if [ "${dry_run[0]}" != --dry-run ]; then
  version=$(.venv/bin/python -c 'from importlib import metadata; print(metadata.version("deepspeed"))')
  echo "bench peers ready: deepspeed $version"
fi
