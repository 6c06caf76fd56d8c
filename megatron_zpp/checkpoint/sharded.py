"""The old import path of the save side (save.py), for the callers outside checkpoint/ that still name it
(training/loop.py, tools/convert_checkpoint.py, checkpoint/mcore.py, tests): no code of its own; the
format is described in save.py, its reading in load.py."""

from .save import finish_async_save, save_checkpoint, save_full_dcp, save_weights

__all__ = ["finish_async_save", "save_checkpoint", "save_full_dcp", "save_weights"]
