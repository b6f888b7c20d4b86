"""`Config`: a whole run's configuration, one field per section, with the flat view (`config.lr`) for the entry points
(train.py, launch.py, sagemaker_job.py, the tools' CLIs, scripts/); everything else reads the sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .sections import (
    SECTION_CLASSES,
    SECTION_OF,
    SECTIONS,
    CheckpointSection,
    DataSection,
    GRPOSection,
    LoggingSection,
    MemorySection,
    ModelSection,
    OutputSection,
    ParallelSection,
    PeftSection,
    PreferenceSection,
    TrainingSection,
)

# Bookkeeping the loader sets, not users: the recipe's name, and what lr_scaling did (for the log).
BOOKKEEPING_DEFAULTS = {"recipe": "", "lr_note": ""}


@dataclass
class Config:
    """A whole run's configuration: one field per recipe section (`config.training`, `config.parallel`, ...), each
    its section's dataclass, as one typed value. Components receive the sections they use, never this; only the
    entry points, `resolve` and `preflight` read the whole of it, by section (`config.training.lr`). For the entry
    points and the loader a key also reads and writes flat, `config.lr` being `config.training.lr`, except where a
    key has its section's name: `model` (`config.model.source`) and `peft` (`config.peft.method`); nothing else
    reads flat (tests/test_architecture.py)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    peft: PeftSection = field(default_factory=PeftSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    output: OutputSection = field(default_factory=OutputSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    recipe: str = ""
    lr_note: str = ""

    def __getattr__(self, key: str):  # only asked when `key` is no field: a flat key
        section = SECTION_OF.get(key)
        if section is None or key.startswith("__"):
            raise AttributeError(f"Config has no key {key!r}")
        return getattr(self.__dict__[section], key)

    def __setattr__(self, key: str, value) -> None:
        section = SECTION_OF.get(key)
        if section is None or key in SECTION_CLASSES:
            object.__setattr__(self, key, value)
        else:
            setattr(self.__dict__[section], key, value)

    @classmethod
    def from_flat(cls, values: dict) -> Config:
        """A Config from flat keys (a recipe's typed values, a checkpoint's config.yaml); unknown keys: TypeError."""
        unknown = set(values) - set(SECTION_OF) - set(BOOKKEEPING_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown config keys: {', '.join(sorted(unknown))}")
        sections = {
            name: section(**{key: values[key] for key in SECTIONS[name] if key in values})
            for name, section in SECTION_CLASSES.items()
        }
        return cls(**sections, **{key: values[key] for key in BOOKKEEPING_DEFAULTS if key in values})

    def to_dict(self) -> dict:
        """Every key, flat, in the sections' order (config.yaml, checkpoints), then the bookkeeping."""
        flat = {}
        for name in SECTION_CLASSES:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return {**flat, "recipe": self.recipe, "lr_note": self.lr_note}

    def value(self, key: str):
        """A key's value by its flat name (`model` is the model section's `model` key here, not the section)."""
        return getattr(self.__dict__[SECTION_OF[key]], key)

    def replace(self, **changes) -> Config:
        """A copy with flat keys changed (dataclasses.replace for the flat view)."""
        return Config.from_flat({**self.to_dict(), **changes})
