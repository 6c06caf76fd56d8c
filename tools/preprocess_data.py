"""Tokenize a jsonl corpus, plain-text files (or an HF dataset) into Megatron's `.bin/.idx` pairs, streaming.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --json-keys text --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --append-eod --workers 4

The code lives in megatron_zpp/data/preprocess.py (its docstring says what is written and how),
so that the demo-corpus tool and the preprocessing bench call the same `main`.
"""

import sys

from megatron_zpp.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
