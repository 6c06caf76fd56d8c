"""Train a sentencepiece tokenizer (BPE or unigram) from jsonl, plain text or an HF dataset.

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \
        --model-prefix data_cache/tok --vocab-size 32000 --model-type bpe

The code lives in megatron_zpp/data/tokenizer_training.py (its docstring says what is written),
so that the demo-corpus tool trains with the same functions.
"""

import sys

from megatron_zpp.data.tokenizer_training import main

if __name__ == "__main__":
    sys.exit(main())
