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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_zpp.checkpoint.consolidate import config_from_dict, consolidate  # noqa: E402
from megatron_zpp.data.tokenizer import build_tokenizer  # noqa: E402
from megatron_zpp.model import GPT  # noqa: E402


def load_model(state: dict, config: dict) -> tuple[GPT, object]:
    """A single-rank GPT in eval mode holding the consolidated weights, and its Config."""
    cfg = config_from_dict(config)
    model = GPT(cfg.model, state["embedding.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg


def next_token(logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None = None) -> int:
    """One token id from 1-D logits (already restricted to the real vocabulary)."""
    if greedy or temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, context: int, vocab_size: int,
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eod: int | None = None, seed: int = 0) -> list[int]:
    """New token ids after `prompt_ids` (stops early at `eod` when given)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(tokens=torch.tensor([ids[-context:]]))[0, -1, :vocab_size]
        tok = next_token(logits, greedy, temperature, top_k, top_p, gen)
        ids.append(tok)
        if eod is not None and tok == eod:
            break
    return ids[len(prompt_ids):]


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
    tok = build_tokenizer(args.tokenizer_type or d.tokenizer_type, args.tokenizer_model or d.tokenizer_model,
                          m.vocab_size, m.make_vocab_size_divisible_by, 1)
    prompt = tok.tokenize(args.prompt) if args.prompt else []
    if not prompt:  # start a new document
        prompt = [tok.bos if tok.bos is not None else tok.eod]
    new = generate(model, prompt, args.max_new_tokens, m.seq_length, tok.vocab_size, greedy=args.greedy,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   eod=tok.eod if args.stop_at_eod else None, seed=args.seed)
    print(args.prompt + (" " if d.tokenizer_type == "NullTokenizer" and args.prompt else "") + tok.detokenize(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
