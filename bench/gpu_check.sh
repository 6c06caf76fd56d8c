#!/usr/bin/env bash
# The GPU check: one script, at most 8 minutes on one GPU (a timeout per stage), no network needed there.
#
#   bash bench/gpu_check.sh --fetch-wheels     (here, with network: the peers' wheels into bench/wheels/,
#                                               ignored by git; the device run carries that folder)
#   bash bench/gpu_check.sh                    (on the GPU box; writes $OUT or bench/gpu_out/)
#
# 1. the machine: GPU name, driver, torch/triton versions (the data-sheet peaks are read from the name)
# 2. bench/gpu_shapes.py: the ahead-of-time compile test's shapes (bench/compile_gpu.py --ci: each kernel's
#    default configuration and the shapes at risk, > 2^31 elements, > 65535 GLA chunks) run for real, each
#    kernel against its PyTorch reference, max error printed (over tolerance: the stage fails)
# 3. bench/kernels.py: every kernel checked again at its benchmark shape, then timed beside the reference,
#    torch.compile of it and the public peer (fla chunk_gla, Liger), GB/s against the measured copy
#    bandwidth and, for GLA, TFLOP/s
# 4. a 1-GPU GPT step, about 1B parameters, bf16, seq 4096, softmax and hybrid GLA, kernels on vs off, MFU
# The peers come from bench/wheels/ and are installed into a temporary folder outside $OUT (nothing of
# theirs comes back with the results, nor goes into the box's environment).
# Budget (one H100, cold Triton cache): stage 2 190 s (its first launch of each kernel includes the JIT),
# stage 3 110 s, stage 4 2 x 70 s: 440 s of stages, under 8 minutes with the set-up.
# Every stage runs (a failing one does not stop the next); the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
PEERS=(fla-core==0.6.0 einops==0.8.2 liger-kernel==0.8.5)  # einops: fla's one dependency beyond torch/triton

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi
if [[ -n ${1:-} && ${1:-} != --fetch-wheels ]]; then
    echo "gpu_check: unknown argument '$1' (--help lists the two uses)" >&2
    exit 2
fi
if [[ ${1:-} == --fetch-wheels ]]; then
    mkdir -p "$WHEELS"
    "${PYTHON:-python}" -m pip download --no-deps -d "$WHEELS" "${PEERS[@]}"
    exit $?
fi

OUT=${OUT:-bench/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    PEERS_DIR=$(mktemp -d)  # outside $OUT: the peers' files must not come back as results
    trap 'rm -rf "$PEERS_DIR"' EXIT
    $PY -m pip install -q --no-deps --no-index --target "$PEERS_DIR" "$WHEELS"/*.whl
    export PYTHONPATH="$PWD:$PEERS_DIR"
else
    echo "gpu_check: no wheels in $WHEELS (bash bench/gpu_check.sh --fetch-wheels first): peers not timed"
    export PYTHONPATH="$PWD"
fi

FAILED=()
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }
# stage NAME SECONDS LOG COMMAND...: run it under a timeout, its output teed to $OUT/LOG; a failure is noted
stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        FAILED+=("$name (exit $rc$( ((rc == 124)) && echo ", past its ${limit}s"))")
    fi
}

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

step "kernels at the compile test's shapes, against their references"
stage "gpu_shapes" 190 gpu_shapes.txt $PY -m bench.gpu_shapes --device cuda

step "kernels: checks at benchmark shapes, then timings vs reference, torch.compile, fla, Liger, copy bandwidth"
stage "kernels" 110 kernels.txt $PY bench/kernels.py --device cuda

step "1-GPU GPT step, ~1B parameters, bf16, seq 4096: kernels on vs off"
GPT1B=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --micro-batch-size 2)
for kind in softmax hybrid; do
    extra=()
    [[ $kind == hybrid ]] && extra=(--attention-type gla --softmax-attention-every 4)
    stage "step_$kind" 70 "step_$kind.txt" $PY bench/single_rank.py --device cuda --dtype bf16 "${GPT1B[@]}" \
        "${extra[@]}" --kernels-compare --no-compile --vocab-size 32000 --warmup 2 --steps 6 --max-seconds 25
done

step "done in ${SECONDS}s"
if ((${#FAILED[@]})); then
    printf 'gpu_check: FAILED %s\n' "${FAILED[@]}"
    exit 1
fi
echo "gpu_check: every stage passed"
