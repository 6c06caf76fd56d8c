#!/usr/bin/env bash
# Stop a training run and resume it with the same command; the steps after the checkpoint
# are bitwise identical to those of a run that was never interrupted.
#
#   bash examples/resume.sh          (from anywhere; about 3 minutes on 2 CPU cores)
#
# 1. Launch the demo's small hybrid GPT (GLA + softmax layers) on 4 CPU ranks, TP 2 x DP 2
#    with ZeRO-3, for 60 steps, saving every 20 (--save DIR --save-interval 20). The command
#    also carries --load DIR from the start: with no checkpoint there yet it starts from
#    scratch, so the very same command line serves the first launch and every restart.
# 2. Stop it with SIGTERM, as a preempting scheduler would, once it is past step 30. With
#    --exit-signal-handler every rank finishes the step it is in and saves it (torchrun
#    passes the signal on to its ranks), so nothing is lost. (A kill -9 would lose the
#    steps since the last --save-interval checkpoint, step 20, and nothing else.)
# 3. Run the same command again: --load finds DIR/latest and restores every rank's shard
#    (ZeRO-3 weight and fp32 master shards, AdamW state, every RNG stream, the iteration and
#    the data position), then it trains the remaining steps.
# 4. Run the same training once more without --save/--load, uninterrupted, and compare the
#    per-step metrics (--metrics-file JSONL) of every step: loss, grad norm and lr must be
#    equal to the last bit.
# 5. Resume the stopped run's checkpoint at another layout (TP 1 x PP 2 x DP 2, no ZeRO): the
#    checkpoint is resharded on load, and the losses follow the uninterrupted run's to fp32
#    round-off (other reduction orders).
set -euo pipefail
source "$(dirname "$0")/demo_env.sh"   # repo root, .venv, the demo corpus and tokenizer

OUT=runs/resume
CKPT=$OUT/ckpt
rm -rf "$OUT"
mkdir -p "$OUT"

ITERS=60          # the LR schedule (warm-up, cosine decay) is laid out over these steps
KILL_AFTER=30     # stop the first launch once it has logged this many steps
TRAINING=(--config examples/configs/tiny_cpu.yaml      # model, data, optimizer: see the file
          --tensor-model-parallel-size 2 --zero-stage 3  # 4 ranks = TP 2 x DP 2, ZeRO-3 over DP
          --train-iters "$ITERS" --log-interval 10 --generate-tokens 0)
# The command a job script would hold. It is never edited between restarts.
RUN=("$TORCHRUN" --standalone --nproc-per-node 4 pretrain_gpt.py "${TRAINING[@]}"
     --save "$CKPT" --save-interval 20 --load "$CKPT" --exit-signal-handler
     --metrics-file "$OUT/metrics.jsonl")

echo "=== 1. launch (no checkpoint in $CKPT yet: starts from scratch) ==="
echo "${RUN[*]}"
"${RUN[@]}" &
pid=$!
# --metrics-file gets one line per step: wait until the run is past step $KILL_AFTER.
until [ -f "$OUT/metrics.jsonl" ] && [ "$(wc -l < "$OUT/metrics.jsonl")" -ge "$KILL_AFTER" ]; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "error: the first launch ended before step $KILL_AFTER" >&2
    exit 1
  fi
  sleep 0.2
done

echo "=== 2. SIGTERM at step $(wc -l < "$OUT/metrics.jsonl") (to torchrun, which passes it to its 4 ranks) ==="
echo "(torchrun reports the signal with a SignalException traceback: expected)"
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
echo "torchrun exited with status $rc (signalled, as intended)"
RESUME_FROM=$(cat "$CKPT/latest")
echo "newest complete checkpoint: $CKPT/$RESUME_FROM  (ls $CKPT: $(ls "$CKPT" | tr '\n' ' '))"
# The restart keeps the metrics file's lines up to the checkpoint and appends its own; keep
# a copy of the killed launch's lines to compare them too.
cp "$OUT/metrics.jsonl" "$OUT/metrics.killed.jsonl"

echo "=== 3. resume: the same command ==="
"${RUN[@]}"

echo "=== 4. the same training, uninterrupted (no --save/--load) ==="
"$TORCHRUN" --standalone --nproc-per-node 4 pretrain_gpt.py "${TRAINING[@]}" \
  --metrics-file "$OUT/metrics.uninterrupted.jsonl"

echo "=== compare the per-step metrics ==="
"$PY" - "$OUT" "${RESUME_FROM#iter_}" "$ITERS" <<'EOF'
import json, sys

out, resumed_from, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def steps(name):
    with open(f"{out}/{name}") as f:
        return {r["iteration"]: r for r in map(json.loads, f)}
killed, resumed, ref = steps("metrics.killed.jsonl"), steps("metrics.jsonl"), steps("metrics.uninterrupted.jsonl")

# The metrics file holds each step once: the first launch's up to the checkpoint, then the restart's.
assert sorted(resumed) == list(range(1, iters + 1)), sorted(resumed)
resumed = {it: r for it, r in resumed.items() if it > resumed_from}
assert sorted(ref) == list(range(1, iters + 1)), sorted(ref)
print(f"first launch: steps 1..{max(killed)} (killed); checkpoint at step {resumed_from}; "
      f"restart: steps {min(resumed)}..{max(resumed)}")
print(f"{'step':>5} {'run':>12} {'loss':>20} {'uninterrupted':>20}")
for it in [1, resumed_from, resumed_from + 1, resumed_from + 2, iters]:
    run, r = ("killed", killed[it]) if it <= resumed_from else ("resumed", resumed[it])
    print(f"{it:5d} {run:>12} {r['loss']:20.17f} {ref[it]['loss']:20.17f}")

# JSON round-trips Python floats exactly, so == is a bitwise comparison.
keys = ("loss", "grad_norm", "lr", "consumed_samples")
bad = [(it, k, r[k], ref[it][k]) for it, r in sorted(resumed.items()) for k in keys if r[k] != ref[it][k]]
bad += [(it, k, r[k], ref[it][k]) for it, r in sorted(killed.items()) for k in keys if r[k] != ref[it][k]]
if bad:
    for it, k, a, b in bad[:10]:
        print(f"MISMATCH step {it} {k}: {a!r} != uninterrupted {b!r}")
    sys.exit(f"FAIL: {len(bad)} metrics differ from the uninterrupted run")
print(f"resumed losses are bitwise equal to the uninterrupted run "
      f"(steps {resumed_from + 1}..{iters}: loss, grad norm, lr; and steps 1..{max(killed)} of the killed launch)")
EOF


echo "=== 5. resume $RESUME_FROM at another layout: TP 1 x PP 2 x DP 2, plain DP ==="
# Later flags override earlier ones: the same training at another layout. --load reshards
# the ZeRO-3 TP-2 shards (weights, fp32 masters, AdamW moments and step) to this layout;
# --ckpt-step picks the stopped run's checkpoint although `latest` now names step 60.
"$TORCHRUN" --standalone --nproc-per-node 4 pretrain_gpt.py "${TRAINING[@]}" \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --zero-stage 0 \
  --load "$CKPT" --ckpt-step "${RESUME_FROM#iter_}" --metrics-file "$OUT/metrics.resharded.jsonl"

"$PY" - "$OUT" "${RESUME_FROM#iter_}" <<'EOF'
import json, sys

out, resumed_from = sys.argv[1], int(sys.argv[2])
def steps(name):
    with open(f"{out}/{name}") as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f)}
resharded, ref = steps("metrics.resharded.jsonl"), steps("metrics.uninterrupted.jsonl")
rel = {it: abs(loss - ref[it]) / ref[it] for it, loss in resharded.items()}
print(f"{'step':>5} {'resharded':>20} {'uninterrupted':>20} {'relative diff':>14}")
for it in sorted(resharded)[:3] + sorted(resharded)[-1:]:
    print(f"{it:5d} {resharded[it]:20.17f} {ref[it]:20.17f} {rel[it]:14.2e}")
# Other reduction orders (TP, pipeline micro-batches) change the last bits, not more.
first = [rel[it] for it in sorted(rel)[:5]]
if max(first) > 1e-5:
    sys.exit(f"FAIL: the resharded run's first steps differ by up to {max(first):.1e} (more than fp32 round-off)")
print(f"resharded resume: steps {min(resharded)}..{min(resharded) + 4} within {max(first):.1e} of the "
      f"uninterrupted run (fp32 round-off), all {len(rel)} steps within {max(rel.values()):.1e}")
EOF
