# Sourced (not run) by the CPU examples: move to the repo root, set up .venv (idempotent,
# tools/setup_env.sh) and build the embedded demo corpus once (tools/make_demo_corpus.py:
# the Python standard library's text -> a 4k BPE sentencepiece tokenizer -> .bin/.idx under
# data_cache/demo/; every step is skipped when its output exists). Then it defines:
#   PY, TORCHRUN      the .venv's python and torchrun
#   DEMO_DATA         the corpus prefix (--data-path), DEMO_TOKENIZER its tokenizer.model
# examples/configs/demo_gdn_cpu.yaml and tiny_cpu.yaml already point at both, so a run needs only --config.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup_env.sh
.venv/bin/python tools/make_demo_corpus.py --output data_cache/demo --build
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # several ranks on a few cores: one thread each
PY=.venv/bin/python
TORCHRUN=.venv/bin/torchrun
DEMO_DATA=data_cache/demo/corpus_text_document
DEMO_TOKENIZER=data_cache/demo/tokenizer.model
