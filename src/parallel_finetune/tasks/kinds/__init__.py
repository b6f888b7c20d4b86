"""The task-kind registry: the only place that knows which kinds of task exist (classification, which also
serves regression, causal_lm, sft, dpo, reward, kto, grpo). A kind is a module that defines a `TaskKind` (base.py
documents every question it answers) and ends with `register(TheKind())`; every module of this folder is
imported here. Callers ask `kind_of(task_key)` (the recipe's `task:`) or `task.kind`, never compare the key or
problem type with a name. `check_task_keys` checks a recipe's kind-owned keys (resolve.validate calls it).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing

from ...errors import UserError
from .base import WHOLE_SECTION, BadKey, TaskKind

# The order listings show the kinds in; any other module of this folder follows, by name.
LISTING_ORDER = ("classification", "causal_lm", "sft", "dpo", "reward", "kto", "grpo")

_kinds: dict[str, TaskKind] = {}


def register(kind: TaskKind) -> TaskKind:
    """Add `kind` under its `key`; a key registered twice by another class is an error."""
    if not kind.key:
        raise UserError(f"{type(kind).__name__} has no `key`; a task kind needs one (what recipes say as task:)")
    if kind.key in _kinds and type(_kinds[kind.key]) is not type(kind):
        raise UserError(
            f"task kind {kind.key!r} of {type(kind).__module__} is already registered by "
            f"{type(_kinds[kind.key]).__module__}; give it another key"
        )
    _kinds[kind.key] = kind
    return kind


def kind_of(task_key: str) -> TaskKind:
    """The kind a recipe's `task:` value names."""
    kind = find_kind(task_key)
    if kind is None:
        raise UserError(f"task={task_key!r} is not a task kind; valid: {', '.join(kind_names())}")
    return kind


def find_kind(task_key) -> TaskKind | None:
    """The kind registered under `task_key`, or None (a file's value that may be anything)."""
    return _kinds.get(task_key) if isinstance(task_key, str) else None


def kind_of_problem(problem_type) -> TaskKind | None:
    """The kind whose Task has this problem_type (labels.json's, a transformers config's), or None."""
    for kind in _kinds.values():
        if problem_type in kind.problem_types:
            return kind
    return None


def problem_types() -> list[str]:
    """Every kind's Task.problem_type values."""
    return [problem for kind in _kinds.values() for problem in kind.problem_types]


def all_kinds() -> list[TaskKind]:
    return list(_kinds.values())


def kind_names() -> list[str]:
    return list(_kinds)


def check_task_keys(task_key: str, sections: typing.Mapping[str, typing.Any], bad: BadKey) -> None:
    """A recipe's keys that kinds own, for a run of `task_key`: first the one rule for every kind, a key some kind
    reads (TaskKind.reads) set away from its default under a kind that does not read it is refused, naming the
    kinds that do; then the kind's own checks of its keys' values (TaskKind.check). `sections`: the recipe's
    section dataclasses by name."""
    kind = kind_of(task_key)
    for name, section in sections.items():
        readers = readers_of(name, section)
        defaults = type(section)() if readers else None
        for key, by in readers.items():
            if kind not in by and getattr(section, key) != getattr(defaults, key):
                raise bad(key, _read_elsewhere(key, by, kind))
    kind.check(sections, bad)


def readers_of(name: str, section) -> dict[str, list[TaskKind]]:
    """The keys of section `name` (a section dataclass) that some kind reads, in the section's order, each with
    the kinds that read it."""
    readers = {}
    for field in dataclasses.fields(section):
        by = [kind for kind in _kinds.values() if _reads(kind, name, field.name)]
        if by:
            readers[field.name] = by
    return readers


def _reads(kind: TaskKind, section: str, key: str) -> bool:
    keys = kind.reads.get(section, ())
    return keys == WHOLE_SECTION or key in keys


def _read_elsewhere(key: str, readers: list[TaskKind], kind: TaskKind) -> str:
    """Why `key`, set, is refused under `kind`: who reads it, and what to do."""
    if len(readers) == 1:
        (reader,) = readers
        whose = f"is task={reader.key}'s ({reader.notes.get(key, reader.about)})"
    else:
        whose = f"is read by task={_listed([r.key for r in readers], 'and')}"
    return (
        f"{whose}, and task={kind.key} does not read it; drop it or set task={_listed([r.key for r in readers], 'or')}"
    )


def _listed(names: list[str], last: str) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def _import_package_modules() -> None:
    names = [module.name for module in pkgutil.iter_modules(__path__) if module.name != "base"]
    ranked = sorted(names, key=lambda n: (LISTING_ORDER.index(n) if n in LISTING_ORDER else len(LISTING_ORDER), n))
    for name in ranked:
        importlib.import_module(f"{__name__}.{name}")


_import_package_modules()
