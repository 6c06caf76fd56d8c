#!/usr/bin/env bash
# The README's demo, the project's own case on a laptop: set up .venv (idempotent), build the embedded
# corpus (the Python standard library's text -> sentencepiece tokenizer -> .bin/.idx; skipped when
# present), then pretrain a Gated DeltaNet hybrid (GDN + softmax layers) on 8 CPU ranks as
# TP 2 (+ sequence parallelism) x CP 2 (ZeCO All-Scan) x DP 2 with ZeRO++ (qwZ + hpZ + qgZ), the ranks
# laid out as 2 emulated nodes of 4 (examples/configs/demo_gdn_cpu.yaml), and then show what it did:
#   1. a greedy sample from the saved checkpoint (tools/generate.py, consolidated to one rank),
#   2. the metrics plot (tools/plot_metrics.py -> metrics.png),
#   3. the communication ledger on one screen (tools/comm_report.py --summary): per axis, intra- and
#      inter-node bytes per rank per step.
# Each run writes a new directory runs/quickstart/<UTC time>/ (nothing is overwritten; RUN=DIR to
# choose it, an empty or new one). Extra arguments go to pretrain_gpt.py (e.g. --train-iters 40).
# PROMPT sets the sample's prompt (default "    def __init__(self,"; no trailing space: it would be a lone
# word-start token), SAMPLE_TOKENS its length (default 40).
set -euo pipefail
case " $* " in
  *" --help "* | *" -h "*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    echo "pretrain_gpt.py's flags: .venv/bin/python pretrain_gpt.py --help"
    exit 0 ;;
esac
source "$(dirname "$0")/demo_env.sh"   # repo root, .venv, data_cache/demo/
RUN=${RUN:-runs/quickstart/$(date -u +%Y%m%dT%H%M%SZ)}
if [ -e "$RUN" ] && [ -n "$(ls -A "$RUN")" ]; then
  echo "error: examples/quickstart_cpu.sh: RUN=$RUN is not empty; give a new directory (nothing is overwritten)" >&2
  exit 2
fi
mkdir -p "$RUN"
"$TORCHRUN" --standalone --nproc-per-node 8 pretrain_gpt.py \
  --config examples/configs/demo_gdn_cpu.yaml \
  --save "$RUN/ckpt" \
  --metrics-file "$RUN/metrics.jsonl" \
  --comm-report "$RUN/comm.json" \
  "$@"
if [ ! -e "$RUN/ckpt/latest" ]; then
  echo "error: examples/quickstart_cpu.sh: pretrain_gpt.py saved no checkpoint in $RUN/ckpt; nothing to sample" >&2
  exit 1
fi
echo
echo "== greedy sample (tools/generate.py --greedy, the checkpoint consolidated to one rank) =="
"$PY" tools/generate.py --load "$RUN/ckpt" --prompt "${PROMPT:-    def __init__(self,}" --greedy \
  --max-new-tokens "${SAMPLE_TOKENS:-40}"
echo
echo "== communication per rank per step (tools/comm_report.py --summary; the full table without it) =="
"$PY" tools/comm_report.py "$RUN/comm.json" --summary
echo
"$PY" tools/plot_metrics.py "$RUN/metrics.jsonl" --labels "GDN hybrid, TP2 x CP2 x DP2, ZeRO++" --smooth 0.8 \
  --output "$RUN/metrics.png"
echo "run directory: $RUN (checkpoint ckpt/, metrics.jsonl, metrics.png, comm.json)"
