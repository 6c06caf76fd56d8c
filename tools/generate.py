"""Generate text from a sharded checkpoint of any parallel layout, in one process.

    python tools/generate.py --load ckpt --prompt "def main(" --max-new-tokens 64 --top-p 0.9
    python tools/generate.py --load ckpt --prompt "1 2 3" --greedy      # NullTokenizer: ids

The checkpoint is consolidated into single-rank weights (megatron_zpp.checkpoint.consolidate),
a single-rank GPT is built from its saved config, and tokens are sampled one at a time
(no KV cache: each step re-reads the last --seq-length tokens). The tokenizer defaults to
the one the run was trained with. Tokens past the tokenizer's vocabulary (padding) are
never sampled.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_zpp import generation
from megatron_zpp.checkpoint.consolidate import config_from_dict, consolidate
from megatron_zpp.data.tokenizer import build_tokenizer
from megatron_zpp.model import GPT


def load_model(state: dict, config: dict) -> tuple[GPT, object]:
    """A single-rank GPT in eval mode holding the consolidated weights, and its Config."""
    cfg = config_from_dict(config)
    model = GPT(cfg.model, state["embedding.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg


def generate(
    model: GPT, prompt_ids: list[int], max_new_tokens: int, context: int, vocab_size: int, **sampling
) -> list[int]:
    """New token ids after `prompt_ids` from a single-rank model (sampling: see
    megatron_zpp.generation.generate)."""

    def next_logits(ids: list[int]) -> torch.Tensor:
        return model(tokens=torch.tensor([ids[-context:]]))[0, -1, :vocab_size]

    return generation.generate(next_logits, prompt_ids, max_new_tokens, **sampling)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", required=True, help="checkpoint directory (with `latest`) or an iter_XXXXXXX dir")
    ap.add_argument("--prompt", default="", help="text to continue (NullTokenizer: space-separated ids)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--greedy", action="store_true", help="argmax decoding (deterministic)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ap.add_argument("--stop-at-eod", action="store_true", help="stop after the end-of-document token")
    ap.add_argument("--tokenizer-type", default=None, help="default: the one the run trained with")
    ap.add_argument("--tokenizer-model", default=None, help="default: the one the run trained with")
    args = ap.parse_args(argv)

    state, config = consolidate(args.load)
    model, cfg = load_model(state, config)
    m, d = cfg.model, cfg.data
    tok = build_tokenizer(
        args.tokenizer_type or d.tokenizer_type,
        args.tokenizer_model or d.tokenizer_model,
        m.vocab_size,
        m.make_vocab_size_divisible_by,
        1,
        d.vocab_file,
        d.merge_file,
    )
    prompt = tok.tokenize(args.prompt) if args.prompt else []
    if not prompt:  # start a new document
        prompt = [tok.bos if tok.bos is not None else tok.eod]
    new = generate(
        model,
        prompt,
        args.max_new_tokens,
        m.seq_length,
        tok.vocab_size,
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eod=tok.eod if args.stop_at_eod else None,
        seed=args.seed,
    )
    print(completion_text(tok, prompt if args.prompt else [], new))
    return 0


def completion_text(tok, prompt: list[int], new: list[int]) -> str:
    """The prompt and the new tokens decoded as one sequence, as transformers' `tok.decode(generate(...)[0])`
    (decoding the two apart can differ at the seam: a sentencepiece word-start mark, merged bytes)."""
    return tok.detokenize(list(prompt) + list(new))


if __name__ == "__main__":
    sys.exit(main())
