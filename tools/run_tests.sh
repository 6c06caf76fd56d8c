#!/usr/bin/env bash
# Set up .venv (idempotent), check lint, format, types and the pre-commit hooks, and run the tests on CPU.
#   bash tools/run_tests.sh                 the whole suite (CI runs exactly this)
#   bash tools/run_tests.sh tests/data      only that path (any number of paths or node ids)
#   bash tools/run_tests.sh -k topology     pytest options pass through; no path given: all of tests/
# RUN_TESTS_DRY_RUN=1 prints the pytest arguments it would use and exits (no setup, no lint).
set -euo pipefail
cd "$(dirname "$0")/.."

# pytest options whose value is the next argument (a value is never taken for a path)
takes_value=" -k -m -p -c -o -W -r -n --deselect --ignore --ignore-glob --maxfail --tb --durations \
--rootdir --confcutdir --basetemp --junitxml --log-level --log-file --import-mode --capture \
--override-ini "
has_path=0
prev=""
for arg in "$@"; do
  if [[ "$arg" != -* && "$takes_value" != *" $prev "* ]]; then
    has_path=1
  fi
  prev="$arg"
done
args=("$@")
[ "$has_path" = 1 ] || args=(tests "$@")

# the whole suite: one pytest worker per core (at most 4; TEST_WORKERS overrides, 0 runs in this process), a test
# file per worker (--dist loadfile: a module's fixtures, e.g. the AOT compiles, are built once); a single-rank test
# uses one core, so on CI's 2 cores two files run side by side (multi-rank tests share the cores as they would)
if [ "$has_path" = 0 ] && [[ " $* " != *" -n "* && " $* " != *" --numprocesses"* ]]; then
  cores=$(nproc 2>/dev/null || echo 2)
  workers=${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
  [ "$workers" -gt 1 ] && args=(-n "$workers" --dist loadfile "${args[@]}")
fi
if [ "${RUN_TESTS_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${args[@]}"
  exit 0
fi
bash tools/setup_env.sh
.venv/bin/python -m ruff check --quiet .
.venv/bin/python -m ruff format --check --quiet .
.venv/bin/python -m mypy  # the files of [tool.mypy] in pyproject.toml
# the other hooks of .pre-commit-config.yaml (ruff ran above, as a check): large files, whitespace, end of file
SKIP=ruff-check,ruff-format .venv/bin/pre-commit run --all-files --show-diff-on-failure
if [ "$has_path" = 0 ]; then  # the whole suite: the HF tests first on the lowest supported transformers too
  echo "HF tests on transformers $(PYTHONPATH=.venv/transformers-lowest .venv/bin/python -c \
    'import transformers; print(transformers.__version__)') (the lowest supported; the suite below has the newest)"
  PYTHONPATH=.venv/transformers-lowest .venv/bin/python -m pytest -q tests/checkpoint/test_convert.py \
    tests/checkpoint/test_hf_gpt2.py tests/data/test_tokenizer.py tests/data/test_tokenizer_files.py
fi
exec .venv/bin/python -m pytest -q "${args[@]}"
