"""Checkpoints: sharded save; load at the same layout (exact resume) or at another one
(resharded). See save.py for the format and the save path, load.py for the load path (one LoadPlan
per load, both formats), files.py for the rank-file codec, reshard.py and layout.py for resharding.

load_checkpoint fills the engine given in its LoadTarget and returns the rest of what it
restored (Restored: the train state, the RNG streams); it writes nothing into the run. The
save side changes only the run's SaveState (the last checkpoint, an --async-save in flight)."""

from .async_save import SaveState
from .files import CheckpointError, read_meta
from .load import LoadTarget, Restored, load_checkpoint
from .save import save_checkpoint

__all__ = ["CheckpointError", "LoadTarget", "Restored", "SaveState", "load_checkpoint", "read_meta", "save_checkpoint"]
