#!/usr/bin/env bash
# Create or reuse .venv at the repo root with everything the project needs.
# Idempotent: a stamp of the dependency files skips pip when nothing changed.
# CPU-only machines get the CPU wheel torch==2.13.0 (never a CUDA build); machines
# with an NVIDIA driver keep the torch they have (NGC image) or get PyPI's default.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.megatron_zpp_setup
want=$(cat pyproject.toml tools/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" torch
  elif ls /opt/wheels/torch-${TORCH_VERSION}+cpu-* >/dev/null 2>&1; then
    "${pip[@]}" "torch==${TORCH_VERSION}"   # the CPU wheel on disk (pip's find-links)
  else
    "${pip[@]}" "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"${pip[@]}" -e ".[data,logging,plot,dev]"
# the test extra "megatron" (megatron-core, pure Python) declares Python>=3.12; it runs on ours
"${pip[@]}" --ignore-requires-python -e ".[megatron]"
# the lowest transformers pyproject allows, beside the venv's newest: tools/run_tests.sh runs the HF tests on
# both. Only transformers and the two packages it pins go in (the rest is the venv's).
TRANSFORMERS_LOWEST=5.24.0
lowest=.venv/transformers-lowest
rm -rf "$lowest"
"${pip[@]}" --target "$lowest" "transformers==${TRANSFORMERS_LOWEST}"
find "$lowest" -mindepth 1 -maxdepth 1 -not -name 'transformers*' -not -name 'tokenizers*' \
    -not -name 'huggingface_hub*' -not -name 'hf_xet*' -exec rm -rf {} +
echo "$want" > "$stamp"
echo "environment ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
