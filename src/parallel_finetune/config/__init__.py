"""The run configuration, read from a recipe YAML plus `key=value` overrides.

Each recipe section (`model:`, `data:`, `training:`, `parallel:`, `memory:`, `peft:`, `preference:`, `grpo:`,
`checkpoint:`, `output:`, `logging:`) is a typed dataclass in sections.py, the one place its keys, types, defaults and
meanings are written (the comments become docs/configuration.md; `Continues[...]` marks what may change when a run
continues); `Config` (whole.py) holds every section's keys, flat. A recipe may nest its keys under their section or
write them flat; both mean the same.
A `tiny:` section holds overrides applied only when `size=tiny` (a from-scratch tiny model wants
other hyperparameters than a pretrained 6B one).
`extends: tp.yaml` starts from another recipe (a path relative to this one) and changes only what it lists.
Overrides on the command line win over everything and use the flat key (`lr=1e-4`) or the dotted one
(`training.lr=1e-4`); dictionary keys take a dotted suffix (`model_config.n_layer=4`). An override of a string key
(a path, a name: TEXT_KEYS) is taken as written, not read as YAML; an empty one (`data_dir=`) is null.
A recipe is data: YAML anchors and aliases (`&name`, `*name`), which can expand a few hundred bytes without bound,
are refused, as are keys given twice.

The package by concern: sections.py (the sections and the tables read off them), whole.py (Config), values.py (a
value against its key's type; the recipe YAML reader), loading.py (recipes, `extends:`, `tiny:`, overrides,
parse_config, lr_scaling), checks.py (check_keys: ranges and combinations; a task kind's own keys are checked by
its kind, tasks/kinds/). Import from here.
"""

from .checks import (
    COLLECTIVE_TIMEOUT_RANGE_S,
    COMPILE_AUTO_MIN_STEPS,
    COMPILE_WITH_TP,
    TRACKER_TIMEOUT_RANGE_S,
    BadKey,
    check_keys,
    refuse_compile_with_tp,
)
from .loading import parse_config, parse_override
from .sections import (
    CONTINUATION_MAY_CHANGE,
    CONTINUES,
    FIELDS,
    GRPO_LOSS_TYPES,
    REFERENCE_FREE_LOSSES,
    SECTION_CLASSES,
    SECTIONS,
    USER_KEYS,
    CheckpointSection,
    Continues,
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
from .values import TEXT_KEYS
from .whole import BOOKKEEPING_DEFAULTS, Config

__all__ = [
    "BOOKKEEPING_DEFAULTS",
    "COLLECTIVE_TIMEOUT_RANGE_S",
    "COMPILE_AUTO_MIN_STEPS",
    "COMPILE_WITH_TP",
    "CONTINUATION_MAY_CHANGE",
    "CONTINUES",
    "FIELDS",
    "GRPO_LOSS_TYPES",
    "REFERENCE_FREE_LOSSES",
    "SECTIONS",
    "SECTION_CLASSES",
    "TEXT_KEYS",
    "TRACKER_TIMEOUT_RANGE_S",
    "USER_KEYS",
    "BadKey",
    "CheckpointSection",
    "Config",
    "Continues",
    "DataSection",
    "GRPOSection",
    "LoggingSection",
    "MemorySection",
    "ModelSection",
    "OutputSection",
    "ParallelSection",
    "PeftSection",
    "PreferenceSection",
    "TrainingSection",
    "check_keys",
    "parse_config",
    "parse_override",
    "refuse_compile_with_tp",
]
