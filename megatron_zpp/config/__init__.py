"""Typed configuration: the one source of truth for every setting.

Each field carries its command-line flag (Megatron-LM's name where Megatron has the
concept, DeepSpeed's for ZeRO) and its help text; `arguments.py` builds the parser from
these dataclasses, so a setting is declared exactly once. validation/ derives the values
that follow from others and checks every section against the world size before any
process group exists. Each section lives in a module of its own (model.py with its mixer and FFN
shapes, parallel.py, optim.py, data.py, train.py) and is re-exported here with `Config`, the whole:
import every config name from this package. The sections import nothing of ours but fields.py,
shapes.py and batch_schedule.py (the config leaves).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .data import TOKENIZER_TYPES, DataConfig
from .fields import ConfigError, opt
from .model import ModelConfig, default_linear_chunk_size
from .optim import OptimConfig
from .parallel import ParallelConfig, ZeroConfig
from .train import LogConfig, TrainConfig

__all__ = [
    "SECTIONS",
    "TOKENIZER_TYPES",
    "Config",
    "ConfigError",
    "DataConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "ZeroConfig",
    "default_linear_chunk_size",
    "flag_of",
    "former_names",
    "opt",
]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches of a full global batch (after any ramp-up; evaluation always uses it)."""
        batch = self.train.global_batch_size
        assert batch is not None, "read before validation.derive filled it"
        return batch // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def micro_batches_at(self, consumed_samples: int) -> int:
        """Micro-batches per DP rank of the step that starts after `consumed_samples` samples."""
        per_round = self.train.micro_batch_size * self.parallel.data_parallel_size
        return self.train.global_batch_at(consumed_samples) // per_round


SECTIONS = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


def flag_of(section: str, name: str) -> str:
    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == name:
            return f.metadata["flag"]
    raise KeyError(name)


def former_names(section: str) -> dict[str, str]:
    """{former name: field name} of a section's renamed settings (opt's `renamed_from`): the former flag, YAML key
    and checkpoint config key still set the field."""
    return {
        f.metadata["renamed_from"]: f.name
        for f in dataclasses.fields(SECTIONS[section])
        if "renamed_from" in f.metadata
    }
