"""DataConfig: datasets, blends, tokenizer, the loader. Re-exported by the config package."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import opt

# --tokenizer-type's values (data/tokenizer.py builds them; GPTSentencePieceTokenizer: Megatron's GPT variant;
# Llama2Tokenizer: Megatron's name for the same sentencepiece tokenizer, end-of-document its eos, as Mixtral's scripts)
TOKENIZER_TYPES = (
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
)


@dataclass
class DataConfig:
    data_path: list[str] = opt(
        [], "--data-path", "dataset prefixes, optionally weighted: [w1] p1 [w2] p2 ...", nargs="+", type=str
    )
    split: str = opt("969,30,1", "--split", "train,valid,test proportions of each dataset")
    mock_data: bool = opt(False, "--mock-data", "synthetic learnable token sequences instead of --data-path")
    tokenizer_type: str | None = opt(
        None,
        "--tokenizer-type",
        "tokenizer (default: inferred from the files given and logged: --vocab-file and --merge-file "
        "GPT2BPETokenizer, as Megatron's GPT-3 example expects; a --tokenizer-model .model file "
        "SentencePieceTokenizer, a directory HuggingFaceTokenizer; none NullTokenizer)",
        choices=list(TOKENIZER_TYPES),
    )
    tokenizer_model: str | None = opt(None, "--tokenizer-model", "sentencepiece .model file or local HF tokenizer dir")
    vocab_file: str | None = opt(None, "--vocab-file", "GPT2BPETokenizer: the vocabulary (GPT-2's vocab.json)")
    merge_file: str | None = opt(None, "--merge-file", "GPT2BPETokenizer: the BPE merges (GPT-2's merges.txt)")
    data_cache_path: str | None = opt(None, "--data-cache-path", "where dataset indices are cached (.npy)")
    mmap_bin_files: bool = opt(
        True,
        "--mmap-bin-files",
        "memory-map the .bin token files (pages read on demand); --no-mmap-bin-files reads each sample's tokens "
        "from the file instead, as Megatron's file reader (for file systems where mapping is slow or refused)",
    )
    reset_position_ids: bool = opt(
        False, "--reset-position-ids", "packed documents: positions restart at 0 after each EOD token"
    )
    reset_attention_mask: bool = opt(
        False,
        "--reset-attention-mask",
        "packed documents: a token sees only its own document (ended by its EOD token): softmax attention "
        "masks other documents, GLA resets its state at each document start",
    )
    eod_mask_loss: bool = opt(False, "--eod-mask-loss", "no loss on the predictions made from EOD input tokens")

    # filled by validate(): why --tokenizer-type was inferred ("" when it was given)
    tokenizer_type_inferred: str = ""

    @property
    def packed_documents(self) -> bool:
        """Whether the model needs the document structure of each sample."""
        return self.reset_position_ids or self.reset_attention_mask

    num_workers: int = opt(
        2,
        "--num-workers",
        "background threads that build micro-batches ahead of the step (pinned on CUDA); 0 = in the step's thread; "
        "any value gives the same batches",
    )
