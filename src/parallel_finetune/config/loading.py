"""Reading a run's configuration: a recipe file (sections or flat keys, `tiny:`, `extends:`), `key=value`
overrides, and parse_config, which applies them in order (recipe, size=tiny's overrides, the command line) and
lr_scaling's linear rule."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError
from .sections import SECTIONS, TYPE_HINTS, USER_KEYS, TrainingSection
from .values import TEXT_KEYS, RecipeRefused, coerce, plain_value, read_recipe_yaml
from .whole import Config


def _unknown_key(key: str, where: str) -> UserError:
    close = difflib.get_close_matches(key, USER_KEYS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return UserError(f"{where}: unknown key '{key}'; {hint}valid keys: {', '.join(USER_KEYS)}")


def _flatten_recipe(data: dict, where: str) -> tuple[dict, dict]:
    """Split a recipe mapping into (flat keys, tiny-size overrides), accepting section nesting. A key set both
    flat and in its section (or in two places) is an error naming both lines."""
    flat: dict = {}
    tiny: dict = {}
    set_at: dict[str, str] = {}  # key -> where it was set, for the error on a second setting

    def line(mapping, key) -> str:
        number = getattr(mapping, "lines", {}).get(key)
        return f"line {number}" if number else "another place"

    def put(key: str, value, mapping, spelled: str) -> None:
        here = f"{spelled} at {line(mapping, key)}"
        if key in set_at:
            raise UserError(f"{where}: {key} is set twice ({set_at[key]}, {here}); say it once")
        set_at[key] = here
        flat[key] = plain_value(value)

    for key, value in data.items():
        if key == "tiny":
            if not isinstance(value, dict):
                raise UserError(f"{where}: 'tiny' must be a mapping of overrides for size=tiny")
            tiny.update(_flatten_recipe(value, f"{where} (tiny)")[0])
        elif key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                if sub_key not in SECTIONS[key]:
                    raise _unknown_key(sub_key, f"{where} section '{key}'")
                put(sub_key, sub_value, value, f"{key}.{sub_key}")
        elif key in USER_KEYS:
            put(key, value, data, key)
        else:
            raise _unknown_key(key, where)
    return flat, tiny


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` -> (flat key, YAML-parsed value). `model_config.n_layer=4` -> ('model_config', {'n_layer': 4}).
    A TEXT_KEYS value is the text as written (`output_dir=/runs/run #2` is that folder); empty means null."""
    if "=" not in text:
        raise UserError(
            f"override '{text}' must look like key=value (e.g. lr=1e-4); valid keys: {', '.join(USER_KEYS)}"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if parts[0] in SECTIONS and len(parts) > 1:
        if parts[1] not in SECTIONS[parts[0]]:
            raise _unknown_key(parts[1], f"override '{text}'")
        parts = parts[1:]
    if parts[0] not in USER_KEYS:
        raise _unknown_key(parts[0], f"override '{text}'")
    if len(parts) == 1 and parts[0] in TEXT_KEYS:
        return parts[0], raw if raw.strip() else None
    try:
        value = plain_value(read_recipe_yaml(raw)) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    except RecipeRefused as exc:
        raise UserError(f"override '{text}': {exc}") from None
    if len(parts) > 1:
        if TYPE_HINTS[parts[0]] is not dict:
            raise UserError(f"override '{text}': '{parts[0]}' is not a mapping, write {parts[0]}=VALUE")
        nested: Any = value
        for part in reversed(parts[1:]):
            nested = {part: nested}
        return parts[0], nested
    return parts[0], value


def _merge(base: dict, key: str, value: Any) -> None:
    if isinstance(value, dict) and isinstance(base.get(key), dict):
        merged = dict(base[key])
        for k, v in value.items():
            _merge(merged, k, v)
        base[key] = merged
    else:
        base[key] = value


def _forget(tiny: dict, key: str, value: Any) -> None:
    """Drop what a child recipe sets itself from the size=tiny overrides it inherited (a mapping key by key), so
    the parent's tiny value of it no longer wins over the child's own."""
    if isinstance(value, dict) and isinstance(tiny.get(key), dict):
        rest = dict(tiny[key])
        for sub_key, sub_value in value.items():
            _forget(rest, sub_key, sub_value)
        tiny[key] = rest
        if not rest:
            del tiny[key]
    else:
        tiny.pop(key, None)


def _read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict, dict]:
    """(flat keys, tiny-size overrides) of a recipe file, after those of the recipe it `extends`."""
    if not path.is_file():
        where = f"recipe {chain[-1]}: extends {path}" if chain else f"recipe {path}"
        raise UserError(f"{where}: no such file (recipes live in recipes/<family>/*.yaml)")
    if path.resolve() in chain:
        raise UserError(f"recipe {path}: extends itself through {' -> '.join(str(p) for p in chain)}")
    try:
        data = read_recipe_yaml(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"recipe {path}: not valid YAML ({first})") from None
    except RecipeRefused as exc:
        raise UserError(f"recipe {path} {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path}: must be a mapping of keys to values")
    values: dict = {}
    tiny: dict = {}
    base = data.pop("extends", None)
    if base is not None:
        if not isinstance(base, str):
            raise UserError(f"recipe {path}: extends must be the path of another recipe, e.g. extends: tp.yaml")
        values, tiny = _read_recipe(path.parent / base, (*chain, path.resolve()))
    own_values, own_tiny = _flatten_recipe(data, f"recipe {path}")
    for key, value in own_values.items():
        _merge(values, key, value)
        _forget(tiny, key, value)  # inherited tiny values yield to the child's own (its own tiny: wins again)
    for key, value in own_tiny.items():
        _merge(tiny, key, value)
    return values, tiny


def _refuse_model_at_tiny_size(values: dict, parsed: list[tuple[str, Any]], where: str) -> None:
    """A `model=` override with size=tiny: a tiny model is built from the family's config and reads no checkpoint,
    so the model the user named would be passed over in silence (make on a CPU passes size=tiny). A recipe's own
    `model:` is its full-size checkpoint, which size=tiny replaces by design, so only the command line's counts."""
    named = [value for key, value in parsed if key == "model"]
    if values.get("size") != "tiny" or not named or named[-1] is None:
        return
    model = named[-1]
    raise UserError(
        f"{where}: model={model!r} with size=tiny: a tiny model is built from the family's config and would not load "
        f"{model!r}; to fine-tune it pass size=full (make: SIZE=full, on a CPU too), or drop model= for the tiny model"
    )


def parse_config(recipe: str | Path | None, overrides: list[str] = ()) -> tuple[Config, str]:
    """Read a recipe (or none: defaults only) and apply overrides (types checked); returns the Config and the name
    errors give its source (`where`). resolve.load_config calls this, then check_keys and the checks that need a
    model family, a tracker or an engine; every error names the file or key."""
    values: dict = {}
    tiny: dict = {}
    name = ""
    if recipe is not None:
        values, tiny = _read_recipe(Path(recipe))
        # named as the make target that runs it (the run folder runs/<name>-<time>, --check's line, a SageMaker
        # job's name): tp_pp.yaml -> gptj-tp-pp, sft_lora.yaml -> llama-sft-lora
        name = Path(recipe).stem.replace("_", "-")
    parsed = [parse_override(text) for text in overrides]
    for key, value in parsed:
        if key == "size":
            values["size"] = value
    if values.get("size") == "tiny":
        for key, value in tiny.items():
            _merge(values, key, value)
    recipe_batch, recipe_lr = values.get("batch_size", TrainingSection.batch_size), values.get("lr", TrainingSection.lr)
    for key, value in parsed:
        _merge(values, key, value)
    where = f"recipe {recipe}" if recipe is not None else "config"
    _refuse_model_at_tiny_size(values, parsed, where)
    typed = {key: coerce(key, value, where) for key, value in values.items()}
    config = Config.from_flat(typed)
    config.recipe = name  # resolve.load_config prefixes the family, once family=auto is resolved
    if config.lr_scaling == "linear":
        _scale_lr(
            config,
            where,
            coerce("batch_size", recipe_batch, where),
            coerce("lr", recipe_lr, where),
            lr_overridden=any(key == "lr" for key, _ in parsed),
        )
    if config.engine == "deepspeed" and config.tensor_parallel_degree == "auto":
        config.tensor_parallel_degree = 1  # DeepSpeed runs data parallel only: every process is a replica
    return config, where


def _scale_lr(config: Config, where: str, recipe_batch: int, recipe_lr: float, lr_overridden: bool) -> None:
    """The linear rule: the recipe's lr was tuned for its batch_size; a k times larger batch gets k times the lr."""
    if config.batch_size == recipe_batch:
        config.lr_note = f"lr_scaling=linear: batch_size {config.batch_size} is the recipe's, lr {config.lr:g} kept"
        return
    if lr_overridden:
        raise UserError(
            f"{where}: lr_scaling=linear scales the recipe's lr (tuned for batch_size={recipe_batch}) "
            f"to batch_size={config.batch_size}; drop the lr override or set lr_scaling=none"
        )
    config.lr = recipe_lr * config.batch_size / recipe_batch
    config.lr_note = (
        f"lr_scaling=linear: lr {recipe_lr:g} x batch_size {config.batch_size} / recipe batch_size "
        f"{recipe_batch} = {config.lr:g}"
    )
