#!/usr/bin/env bash
# Export a trained model to Hugging Face (Llama) and decode the same prompt with
# `transformers` and with our own tools/generate.py: greedy decoding gives the same text.
# Then the same for a hybrid GLA + softmax model, exported as our transformers remote code.
#
#   bash examples/hf_export.sh       (from anywhere; about 4 minutes on 2 CPU cores)
#
# 1. Train a small softmax-attention GPT (RMSNorm, SwiGLU, RoPE, GQA, tied embeddings: what
#    a LlamaForCausalLM can represent) on the demo corpus, on 4 CPU ranks as TP 2 x DP 2
#    with ZeRO-3, and save a sharded checkpoint (--save).
# 2. tools/convert_checkpoint.py --to hf gathers the shards of any layout into single-rank
#    weights and writes a Llama directory: config.json, model.safetensors and, with
#    --tokenizer-model, our sentencepiece model as tokenizer.model.
# 3. Load it with AutoModelForCausalLM + AutoTokenizer and generate greedily (HF generate).
# 4. Generate from our own checkpoint with tools/generate.py --greedy and compare.
# 5. Convert the HF directory back into a checkpoint of ours, check that it decodes the same
#    text, and continue pretraining from it at another layout (2 pipeline stages).
# 6. Train the demo's hybrid model (GLA layers, softmax attention every 2nd layer), export it:
#    Llama cannot hold GLA, so the directory gets our remote code (configuration_*.py and
#    modeling_*.py, plain PyTorch) that AutoModelForCausalLM loads with trust_remote_code=True;
#    greedy generate gives tools/generate.py's text again, and the import back decodes it too.
set -euo pipefail
source "$(dirname "$0")/demo_env.sh"   # repo root, .venv, the demo corpus and tokenizer

OUT=runs/hf_export
CKPT=$OUT/ckpt
HF=$OUT/hf
PROMPT='def __init__(self'
NEW_TOKENS=32     # prompt + new tokens stay within --seq-length 128 (HF's max_position_embeddings)
rm -rf "$OUT"

echo "=== 1. train a softmax-attention model and save it ==="
# tiny_cpu.yaml is the demo's hybrid (GLA + softmax); Llama has only softmax attention, so:
# --attention-type softmax --softmax-attention-every 0. Its block is the Llama one
# (--normalization RMSNorm, --activation swiglu, RoPE, no linear biases); add --untie-embeddings-and-output-weights
# for a separate output layer (exported as lm_head.weight).
"$TORCHRUN" --standalone --nproc-per-node 4 pretrain_gpt.py \
  --config examples/configs/tiny_cpu.yaml \
  --attention-type softmax --softmax-attention-every 0 \
  --tensor-model-parallel-size 2 --zero-stage 3 \
  --train-iters 200 --log-interval 50 --generate-tokens 0 \
  --save "$CKPT"

echo "=== 2. convert to HF Llama ==="
# A GLA or hybrid model, LayerNorm or GeLU is not a Llama: it is written as our remote-code
# model instead (step 6).
"$PY" tools/convert_checkpoint.py --load "$CKPT" --to hf --output "$HF" --tokenizer-model "$DEMO_TOKENIZER"
ls -l "$HF"
cat "$HF/config.json"; echo
"$PY" - "$HF/model.safetensors" <<'EOF'
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as f:
    names = sorted(f.keys())
    print(f"model.safetensors: {len(names)} tensors (our fused qkv and gate/up rows split out; tied "
          f"embeddings, so no lm_head.weight); layers 1.. repeat layer 0:")
    for n in names:
        if not n.startswith("model.layers.") or n.startswith("model.layers.0."):
            print(f"  {n:48s} {list(f.get_slice(n).get_shape())}")
EOF

echo "=== 3. greedy continuation in transformers ==="
# Only tokenizer.model is exported (and, for our remote-code models of step 6, a
# tokenizer_config.json naming Llama's tokenizer class): AutoTokenizer builds a Llama tokenizer
# from it that gives the same ids as our sentencepiece tokenizer (checked below on the prompt). Our tools/generate.py adds no BOS token, so neither do we here
# (add_special_tokens=False). Both stop after the end-of-document token </s> if it comes.
hf_greedy() {  # hf_greedy HF_DIR: the prompt and its greedy continuation in transformers
"$PY" - "$1" "$PROMPT" "$NEW_TOKENS" "$DEMO_TOKENIZER" <<'EOF'
import sys
import sentencepiece as spm
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

hf_dir, prompt, new_tokens, spm_model = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# trust_remote_code: a Llama directory has no code (transformers' own classes run); a GLA/hybrid
# one has ours, which config.json's auto_map names (its tokenizer is Llama's: tokenizer_config.json)
tok = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
enc = tok(prompt, add_special_tokens=False, return_tensors="pt")
ours = spm.SentencePieceProcessor(model_file=spm_model).encode(prompt)
print(f"{type(model).__name__} + {type(tok).__name__}; prompt ids: HF {enc.input_ids[0].tolist()}, "
      f"ours {ours}", file=sys.stderr)
if enc.input_ids[0].tolist() != ours:
    sys.exit("error: the HF tokenizer splits the prompt differently from our sentencepiece tokenizer")
with torch.no_grad():
    out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
print(prompt + tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True))
EOF
}
HF_TEXT=$(hf_greedy "$HF")
printf 'transformers: %s\n' "$HF_TEXT"

echo "=== 4. greedy continuation from our own checkpoint (tools/generate.py) ==="
# It consolidates the shards and runs a single-rank GPT (no KV cache), argmax over the
# tokenizer's real vocabulary (here 4096, equal to the padded one, so HF sees the same rows).
OUR_TEXT=$("$PY" tools/generate.py --load "$CKPT" --prompt "$PROMPT" --greedy \
  --max-new-tokens "$NEW_TOKENS" --stop-at-eod)
printf 'megatron_zpp: %s\n' "$OUR_TEXT"

if [ "$HF_TEXT" = "$OUR_TEXT" ]; then
  echo "the greedy continuations agree: transformers on the exported model = tools/generate.py on our checkpoint"
else
  echo "FAIL: the greedy continuations differ" >&2
  exit 1
fi

echo "=== 5. and back: HF -> a megatron_zpp checkpoint, trained further at another layout ==="
# --from hf --to sharded reads config.json + model.safetensors (or a sharded HF checkpoint's
# index) and writes a weights-only checkpoint of ours: iteration 0, no optimizer state.
# --load reshards it to whatever layout the run asks for; the model flags must match the
# HF config (a mismatch is refused with the differing settings named).
BACK=$OUT/from_hf
"$PY" tools/convert_checkpoint.py --from hf --load "$HF" --to sharded --output "$BACK"
BACK_TEXT=$("$PY" tools/generate.py --load "$BACK" --prompt "$PROMPT" --greedy \
  --max-new-tokens "$NEW_TOKENS" --stop-at-eod)
printf 'imported:     %s\n' "$BACK_TEXT"
if [ "$BACK_TEXT" != "$OUR_TEXT" ]; then
  echo "FAIL: the imported checkpoint decodes differently" >&2
  exit 1
fi
echo "the imported checkpoint decodes the same text (its weights are the exported ones, bitwise)"
# Continue pretraining from it on 2 ranks as 2 pipeline stages (a fresh optimizer: HF
# checkpoints carry none); the first loss is that of the trained model, not of a new one.
"$TORCHRUN" --standalone --nproc-per-node 2 pretrain_gpt.py \
  --config examples/configs/tiny_cpu.yaml \
  --attention-type softmax --softmax-attention-every 0 \
  --pipeline-model-parallel-size 2 --load "$BACK" \
  --train-iters 5 --lr-warmup-iters 1 --eval-interval 0 --log-interval 1 --generate-tokens 0

echo "=== 6. a hybrid GLA + softmax model: our transformers remote code ==="
# tiny_cpu.yaml as written: GLA at layers 0 and 2, softmax attention at 1 and 3.
HYB=$OUT/hybrid_ckpt
HYB_HF=$OUT/hybrid_hf
"$TORCHRUN" --standalone --nproc-per-node 4 pretrain_gpt.py \
  --config examples/configs/tiny_cpu.yaml \
  --tensor-model-parallel-size 2 --zero-stage 3 \
  --train-iters 200 --log-interval 50 --generate-tokens 0 \
  --save "$HYB"
"$PY" tools/convert_checkpoint.py --load "$HYB" --to hf --output "$HYB_HF" --tokenizer-model "$DEMO_TOKENIZER"
ls -l "$HYB_HF"   # + configuration_megatron_zpp_gla.py, modeling_megatron_zpp_gla.py, tokenizer_config.json
grep -A3 '"auto_map"' "$HYB_HF/config.json"
grep -A5 '"layer_types"' "$HYB_HF/config.json"
# HF's generate keeps transformers' cache: a recurrent state per GLA layer, keys/values per softmax layer
HF_TEXT=$(hf_greedy "$HYB_HF")
printf 'transformers: %s\n' "$HF_TEXT"
OUR_TEXT=$("$PY" tools/generate.py --load "$HYB" --prompt "$PROMPT" --greedy \
  --max-new-tokens "$NEW_TOKENS" --stop-at-eod)
printf 'megatron_zpp: %s\n' "$OUR_TEXT"
if [ "$HF_TEXT" != "$OUR_TEXT" ]; then
  echo "FAIL: the greedy continuations of the hybrid model differ" >&2
  exit 1
fi
echo "the hybrid's greedy continuations agree: transformers (remote code) = tools/generate.py"
"$PY" tools/convert_checkpoint.py --from hf --load "$HYB_HF" --to sharded --output "$OUT/hybrid_from_hf"
BACK_TEXT=$("$PY" tools/generate.py --load "$OUT/hybrid_from_hf" --prompt "$PROMPT" --greedy \
  --max-new-tokens "$NEW_TOKENS" --stop-at-eod)
if [ "$BACK_TEXT" != "$OUR_TEXT" ]; then
  echo "FAIL: the imported hybrid checkpoint decodes differently" >&2
  exit 1
fi
echo "the imported hybrid checkpoint decodes the same text"
