"""The family registry: the only place that knows which model families exist. Everything else (config checks,
the planner's published models, synthetic checkpoints, SageMaker checks, notebooks, test tables) asks it.

A family is a module that defines a `Family` subclass and ends with `register(TheFamily())`: every module of
this package is imported here, and files named in PARALLEL_FINETUNE_FAMILIES (paths separated by ":") are
imported on the first question asked, in every process that asks (the CLI, the planner, --check, each
torchrun worker: they inherit the variable)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
import traceback
from pathlib import Path

from transformers import PretrainedConfig

from ..errors import UserError
from .base import Family

ENVIRONMENT = "PARALLEL_FINETUNE_FAMILIES"
# The order listings show the built-in families in; any other module of this package follows, by name.
LISTING_ORDER = ("gptj", "gpt2", "gptneo", "bert", "llama", "qwen3", "mistral")
AUTO = "auto"  # family: auto = the family of the checkpoint's config.json model_type

_families: dict[str, Family] = {}
_files_loaded: set[Path] = set()


def register(family: Family) -> Family:
    """Add `family` under its `name`; a name registered twice is an error (pick another name)."""
    if not family.name:
        raise UserError(f"{type(family).__name__} has no `name`; a family needs one (what recipes say as family:)")
    if family.name in _families and type(_families[family.name]) is not type(family):
        raise UserError(
            f"family {family.name!r} of {type(family).__module__} is already registered by "
            f"{type(_families[family.name]).__module__}; give it another name"
        )
    _families[family.name] = family
    return family


def register_from_file(path: str | Path) -> list[Family]:
    """Import a Python file that registers families (as PARALLEL_FINETUNE_FAMILIES does); the families it added."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"{ENVIRONMENT}: no such file {str(path)!r} (a Python file that calls register(...))")
    before = set(_families)
    module_name = f"parallel_finetune_family_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except UserError:
        sys.modules.pop(module_name, None)
        raise
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        raise UserError(f"{ENVIRONMENT}: {exc.filename or path}:{exc.lineno}: SyntaxError: {exc.msg}") from None
    except Exception as exc:  # whatever the file's own code raised: where, and what
        sys.modules.pop(module_name, None)
        raise UserError(f"{ENVIRONMENT}: {path}:{_line_in(exc, path)}: importing it raised {_cause(exc)}") from None
    _files_loaded.add(path)
    added = [_families[name] for name in _families if name not in before]
    if not added:
        raise UserError(f"{path} registered no family: end it with register(YourFamily())")
    return added


def _line_in(exc: BaseException, path: Path) -> int | str:
    """The line of `path` that the exception passed through last (the file's own line, not the library's)."""
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if Path(frame.filename) == path]
    return lines[-1] if lines else "?"


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(line.strip() for line in str(exc).splitlines() if line.strip())}"


def _registry() -> dict[str, Family]:
    """The families, once the files the environment names are imported (again when it names new ones)."""
    for entry in os.environ.get(ENVIRONMENT, "").split(os.pathsep):
        if entry.strip() and Path(entry.strip()).expanduser().resolve() not in _files_loaded:
            register_from_file(entry.strip())
    return _families


def get_family(name: str) -> Family:
    """A registered family, or one made from the plans of transformers' model type `name` (e.g. olmo2), registered
    on first use in each process that asks."""
    families = _registry()
    if name in families:
        return families[name]
    for family in families.values():  # a model type a registered family covers (gpt_neo -> gptneo)
        if family.config_class.model_type == name:
            return family
    config_class = _config_class(name)
    if config_class is None:
        raise UserError(
            f"family={name!r} is not known; valid: {', '.join(sorted(families))}, "
            f"or a transformers model type whose config ships a parallel plan (e.g. olmo2, qwen2)"
        )
    from .plans import PlanFamily

    return register(PlanFamily(config_class))


def family_for_model_type(model_type: str, where: str) -> str:
    """The family name for a checkpoint of `model_type` (`where`: its config.json, for the error): the registered
    family of that model type (gpt_neo -> gptneo), else the model type itself when its config has plans."""
    for family in all_families():
        if family.config_class.model_type == model_type:
            return family.name
    config_class = _config_class(model_type)
    if config_class is None:
        raise UserError(f"{where}: model_type={model_type!r} is not a transformers model type this version knows")
    from .plans import plan_problem

    problem = plan_problem(config_class)
    if problem:
        raise UserError(
            f"{where}: {problem}, so family=auto cannot make a parallel plan for it; families: "
            f"{', '.join(family_names())} or any model type whose config ships base_model_tp_plan"
        )
    return model_type


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except (KeyError, ValueError, ImportError):
        return None


def family_of_model_type(model_type: str) -> Family | None:
    """The registered family of a checkpoint's model_type: the built-in ones first, and the files
    PARALLEL_FINETUNE_FAMILIES names imported only when none of those has it (so a command that needs no plugin,
    predict.py on a BERT, runs none of their code)."""
    for families in (lambda: _families.values(), all_families):
        for family in families():
            if family.config_class.model_type == model_type:
                return family
    return None


def all_families() -> list[Family]:
    """Every registered family, in registration order."""
    return list(_registry().values())


def family_names() -> list[str]:
    return list(_registry())


def published_models() -> dict[str, Family]:
    """Every published checkpoint any family knows offline (Hub name -> its family), family by family."""
    return {name: family for family in all_families() for name in family.published}


def published_model(model: str) -> tuple[Family, PretrainedConfig] | None:
    """The family and config of a published checkpoint (any letter case), or None when no family knows it."""
    for family in all_families():
        config = family.published_config(model)
        if config is not None:
            return family, config
    return None


def _import_package_modules() -> None:
    names = [module.name for module in pkgutil.iter_modules(__path__)]
    ranked = sorted(names, key=lambda n: (LISTING_ORDER.index(n) if n in LISTING_ORDER else len(LISTING_ORDER), n))
    for name in ranked:
        importlib.import_module(f"{__name__}.{name}")


_import_package_modules()
