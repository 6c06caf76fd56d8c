#!/usr/bin/env bash
# The GPU check: one script, at most 8 minutes on one GPU, no network needed there.
#
#   bash bench/gpu_check.sh --fetch-wheels     (here, with network: the peers' wheels into bench/wheels/)
#   bash bench/gpu_check.sh                    (on the GPU box; writes $OUT or bench/gpu_out/)
#
# 1. the machine: GPU name, driver, torch/triton versions (the data-sheet peaks are read from the name)
# 2. bench/kernels.py on the GPU: every kernel checked against its reference at real shapes (max error
#    printed; a mismatch fails the script), then timed beside the reference, torch.compile of it, and the
#    public peer (fla chunk_gla, Liger) with GB/s against the measured copy bandwidth and, for GLA, TFLOP/s
# 3. a 1-GPU GPT step, about 1B parameters, bf16, seq 4096, softmax and hybrid GLA, kernels on vs off, MFU
# The peers come from bench/wheels/ and are installed into $OUT/peers (not into the box's environment).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
PEERS=(fla-core==0.6.0 einops==0.8.2 liger-kernel==0.8.5)  # einops: fla's one dependency beyond torch/triton

if [[ ${1:-} == --fetch-wheels ]]; then
    mkdir -p "$WHEELS"
    python -m pip download --no-deps -d "$WHEELS" "${PEERS[@]}"
    exit 0
fi

OUT=${OUT:-bench/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    $PY -m pip install -q --no-deps --no-index --target "$OUT/peers" "$WHEELS"/*.whl
    export PYTHONPATH="$PWD:$OUT/peers"
else
    echo "gpu_check: no wheels in $WHEELS (bash bench/gpu_check.sh --fetch-wheels first): peers not timed"
    export PYTHONPATH="$PWD"
fi

step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

step "kernels: checks at real shapes, then timings"
timeout 240 $PY bench/kernels.py --device cuda 2>&1 | tee "$OUT/kernels.txt"

step "1-GPU GPT step, ~1B parameters, bf16, seq 4096: kernels on vs off"
GPT1B="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --micro-batch-size 2"
for kind in "softmax" "hybrid"; do
    extra=""
    [[ $kind == hybrid ]] && extra="--attention-type gla --softmax-attention-every 4"
    timeout 100 $PY bench/single_rank.py --device cuda --dtype bf16 $GPT1B $extra --kernels-compare --no-compile \
        --vocab-size 32000 --warmup 2 --steps 6 --max-seconds 40 2>&1 | tee "$OUT/step_$kind.txt"
done
step "done"
