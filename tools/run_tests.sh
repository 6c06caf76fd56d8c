#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m pytest -q tests "$@"
