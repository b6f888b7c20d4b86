"""The task-kind registry: the only place that knows which kinds of task exist (classification, which also
serves regression, causal_lm, sft, dpo, reward, kto). A kind is a module that defines a `TaskKind` (base.py
documents every question it answers) and ends with `register(TheKind())`; every module of this folder is
imported here. Callers ask `kind_of(task_key)` (the recipe's `task:`) or `task.kind`, never compare the key or
problem type with a name.
"""

from __future__ import annotations

import importlib
import pkgutil

from ...errors import UserError
from .base import TaskKind

# The order listings show the kinds in; any other module of this folder follows, by name.
LISTING_ORDER = ("classification", "causal_lm", "sft", "dpo", "reward", "kto")

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


def _import_package_modules() -> None:
    names = [module.name for module in pkgutil.iter_modules(__path__) if module.name != "base"]
    ranked = sorted(names, key=lambda n: (LISTING_ORDER.index(n) if n in LISTING_ORDER else len(LISTING_ORDER), n))
    for name in ranked:
        importlib.import_module(f"{__name__}.{name}")


_import_package_modules()
