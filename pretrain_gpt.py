"""Pretrain a GPT.  Launch with torchrun (or SLURM's srun setting the same variables):

    torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --mock-data --train-iters 50

`--help` lists every flag. The configuration is checked before any process group is
created: an invalid layout costs one clear error, not a failed job.
"""
import os
import sys

from megatron_zpp.arguments import parse_args
from megatron_zpp.config import ConfigError, validate
from megatron_zpp.logging_utils import fail, log


def main(argv=None):
    try:
        cfg = validate(parse_args(argv), int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as e:
        fail(str(e).replace("\n", "\nerror: "))

    from megatron_zpp import training
    run = training.setup(cfg)
    training.train(run)
    if cfg.train.generate_tokens:  # every rank decodes: TP ranks must take part in each forward
        prompt = run.tokenizer.tokenize(cfg.train.generate_prompt)
        out = training.greedy_generate(run, prompt, cfg.train.generate_tokens)
        log(f"greedy sample: {cfg.train.generate_prompt!r} -> {run.tokenizer.detokenize(out)!r}", run.rank)
    training.shutdown()
    log("done", run.rank)


if __name__ == "__main__":
    main(sys.argv[1:])
