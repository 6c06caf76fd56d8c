"""Set up a run and train it.

run = setup(cfg)     # run.py: groups, model, engine, checkpoint, data (built once)
train(run)           # loop.py: steps (step.py), eval, logging, checkpoint cadence; changes run.state
shutdown()           # distributed.py
"""

from .distributed import init_distributed, shutdown
from .evaluation import evaluate
from .generation import greedy_generate
from .loop import train
from .run import Run, setup
from .state import TrainState
from .step import NonFiniteStepError, train_step

__all__ = [
    "Run",
    "TrainState",
    "setup",
    "train",
    "train_step",
    "NonFiniteStepError",
    "evaluate",
    "greedy_generate",
    "init_distributed",
    "shutdown",
]
