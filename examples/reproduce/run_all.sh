#!/usr/bin/env bash
# The four sweeps on the emulated cluster, one after the other (as root, for the shaped links), at
# the lowest priority; each writes its JSONL + PNG under examples/reproduce/results/. Extra arguments
# go to every script (e.g. --steps 5). See docs/reproducing.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
for s in zeropp_bandwidth hierarchy cp_scan weak_scaling; do
  nice -n 19 "$PY" "examples/reproduce/$s.py" "$@"
done
