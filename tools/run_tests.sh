#!/usr/bin/env bash
# Set up .venv (idempotent), check lint and format, and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
.venv/bin/python -m ruff check --quiet .
.venv/bin/python -m ruff format --check --quiet .
exec .venv/bin/python -m pytest -q tests "$@"
