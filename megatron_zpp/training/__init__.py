"""Set up a run and train it.

run = setup(cfg)     # run.py: groups, model, engine, checkpoint, data
train(run)           # loop.py: steps (step.py), eval, logging, checkpoint cadence
shutdown()           # distributed.py
"""

from .distributed import init_distributed, shutdown
from .evaluation import evaluate
from .generation import greedy_generate
from .loop import train
from .run import Run, setup
from .step import NonFiniteStepError, train_step

__all__ = [
    "Run",
    "setup",
    "train",
    "train_step",
    "NonFiniteStepError",
    "evaluate",
    "greedy_generate",
    "init_distributed",
    "shutdown",
]
