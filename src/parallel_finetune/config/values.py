"""A key's value against its field's type: the types a key accepts, the spellings YAML and shells produce, and the
recipe reader's YAML (which refuses duplicate keys, anchors and aliases and remembers each key's line)."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import yaml

from ..errors import UserError
from .sections import TYPE_HINTS, USER_KEYS


def _options(key: str) -> tuple:
    """The types a field accepts: `int | None` -> (int, NoneType)."""
    hint = TYPE_HINTS[key]
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


# Keys whose value is a string (paths, names, revisions): YAML parsing of `key=value` would cut a path at ` #`, fold
# a newline into a space and read `~` as null, so their override text is kept as written.
TEXT_KEYS = tuple(k for k in USER_KEYS if str in _options(k) and set(_options(k)) <= {str, type(None)})


def coerce(key: str, value: Any, where: str) -> Any:
    """Check `value` against the field's type; accept the spellings YAML and shells produce (e.g. '1e-5')."""
    options = _options(key)
    for option in options:
        ok, converted = _try(option, value)
        if ok:
            return converted
    wanted = " or ".join(_describe(o) for o in options)
    if key in TEXT_KEYS and not isinstance(value, (dict, list, type(None))):  # an unquoted 2024, true, 2024-01-01
        wanted += f' (YAML read the unquoted value as {type(value).__name__}; quote it: {key}: "...")'
    raise UserError(f"{where}: {key}={value!r} is not valid; expected {wanted}")


def _try(option: Any, value: Any) -> tuple[bool, Any]:
    if option is type(None):
        return (value is None or (isinstance(value, str) and value.lower() in ("null", "none"))), None
    if typing.get_origin(option) is Literal:
        return (value in typing.get_args(option)), value
    if option is bool:
        if isinstance(value, bool):
            return True, value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return True, value.lower() == "true"
        return False, None
    if option is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, None
    if option is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if option is str:
        return isinstance(value, str), value
    if option in (dict, list):
        return isinstance(value, option), value
    raise TypeError(f"unsupported config type {option}")


def _describe(option: Any) -> str:
    if option is type(None):
        return "null"
    if typing.get_origin(option) is Literal:
        return "one of " + "|".join(str(a) for a in typing.get_args(option))
    return {
        int: "an integer",
        float: "a number",
        bool: "true|false",
        str: "a string",
        dict: "a mapping",
        list: "a list",
    }[option]


class _Lined(dict):
    """A YAML mapping that remembers the line of each key, so errors can name it."""

    lines: dict


class RecipeRefused(Exception):
    """YAML the recipe loader refuses although YAML allows it; the message starts with the line."""


class _RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping and anchors and aliases, and records each key's
    line. An alias is a reference, so nested ones ("billion laughs") describe an exponentially large value in a few
    hundred bytes; recipes have `extends:` for reuse and need none."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise RecipeRefused(
                f"line {event.start_mark.line + 1}: YAML {'alias' if sign == '*' else 'anchor'} "
                f"{sign}{event.anchor} is not accepted (recipes are plain data); write the value out, "
                "or share settings with extends:"
            )
        return super().compose_node(parent, index)


def _construct_mapping(loader: _RecipeLoader, node: yaml.MappingNode) -> _Lined:
    loader.flatten_mapping(node)
    lines: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in lines:
                raise RecipeRefused(
                    f"line {line}: key '{key}' is given twice (first at line {lines[key]}); YAML would silently "
                    "keep the last one, so say it once"
                )
        except TypeError:  # an unhashable key: construct_mapping's own error names it
            continue
        lines[key] = line
    mapping = _Lined(loader.construct_mapping(node, deep=True))
    mapping.lines = lines
    return mapping


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_recipe_yaml(text: str):
    """yaml.safe_load, refusing duplicate keys, anchors and aliases (raises yaml.YAMLError or RecipeRefused)."""
    return yaml.load(text, Loader=_RecipeLoader)


def plain_value(value: Any) -> Any:
    """A parsed value without line bookkeeping (plain dicts: what yaml.safe_dump writes back)."""
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_value(v) for v in value]
    return value
