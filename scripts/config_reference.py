"""Writes docs/configuration.md from the `Config` dataclass: every recipe key by section, its type, its default
and the comment written next to it in src/parallel_finetune/config/sections.py, so the reference cannot drift from
the code.

    python scripts/config_reference.py           # rewrite docs/configuration.md (make docs)
    python scripts/config_reference.py --check   # exit 1 if the committed page differs (tests/test_docs.py)
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

from parallel_finetune.config import FIELDS, SECTION_CLASSES, SECTIONS
from parallel_finetune.config import sections as sections_module
from parallel_finetune.errors import OneLineArgumentParser

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"

INTRO = """# Configuration reference

Generated from `Config`'s sections in `src/parallel_finetune/config/sections.py` by `python scripts/config_reference.py`
(`make docs`); `tests/test_docs.py` fails when this page is stale. Do not edit it by hand: change the field or its
comment.

A recipe is YAML. Keys go flat or under the section names below (`training: {lr: 1e-4}` equals `lr: 1e-4`);
a `tiny:` section holds overrides used only with `size=tiny`; `extends: other.yaml` starts from another recipe.
On the command line, `key=value` or `section.key=value` overrides win over the recipe
(`make gptj-tp ARGS="lr=1e-4 max_steps=50"`). An unknown key is an error that names the closest valid one.

An override of a string key (`str` below: paths, names, `revision`, `resume`) is taken exactly as written, never read
as YAML: `output_dir=/runs/run #2` is that folder, and `~`, `null` or `true` are those words (a path's leading `~`
is still your home folder); an empty value (`data_dir=`) sets it to null. Other overrides, and every value in a
recipe, are YAML: there write `output_dir: "runs/run #2"` quoted (unquoted, ` #` starts a comment and `~` is null),
and an unquoted number or `true` for a string key is refused with a hint to quote it. A recipe is data: YAML
anchors and aliases (`&name`, `*name`), with which a few hundred bytes expand without bound, are refused, naming
the line; share settings with `extends:`.
"""


def config_fields(source: str) -> list[ast.AnnAssign]:
    """The fields of every section class (`ModelSection`, ...), as written."""
    names = {section.__name__ for section in SECTION_CLASSES.values()}
    classes = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name in names]
    return [node for cls in classes for node in cls.body if isinstance(node, ast.AnnAssign)]


def field_comments(source: str) -> dict[str, str]:
    """Each field's comment: the comment lines directly above it (not a `# --- section ---` line) plus the comment
    at the end of its own line."""
    lines = source.splitlines()
    comments = {}
    for node in config_fields(source):
        name = node.target.id
        above = []
        row = node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#") and not lines[row].strip().startswith("# ---"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        end = lines[node.end_lineno - 1]
        trailing = end.split("  # ", 1)[1].strip() if "  # " in end else ""
        comments[name] = " ".join(part for part in (" ".join(above), trailing) if part)
    return comments


def type_name(annotation: ast.expr) -> str:
    """`Literal["a", "b"] | None` -> `"a"`, `"b"` or null; `Continues[T]` (a mark, not a type) -> T's name."""
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Continues":
        return type_name(annotation.slice)
    if isinstance(annotation, ast.BinOp):
        return f"{type_name(annotation.left)} or {type_name(annotation.right)}"
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Literal":
        values = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        return ", ".join(f"`{ast.literal_eval(v)}`" for v in values)
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return "null"
    return ast.unparse(annotation)


def default_of(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    else:
        value = field.default_factory()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def render() -> str:
    source = Path(sections_module.__file__).read_text(encoding="utf-8")
    comments = field_comments(source)
    annotations = {node.target.id: node.annotation for node in config_fields(source)}
    fields = FIELDS
    parts = [INTRO]
    for section, keys in SECTIONS.items():
        parts.append(f"\n## `{section}`\n\n| key | type | default | meaning |\n|---|---|---|---|")
        for key in keys:
            meaning = comments.get(key, "").replace("|", "\\|")
            kind = type_name(annotations[key])
            parts.append(f"| `{key}` | {kind} | `{default_of(fields[key])}` | {meaning} |")
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args()
    page = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != page:
            print(f"{PAGE.relative_to(REPO)} is stale: run `make docs` (python scripts/config_reference.py)")
            return 1
        print(f"{PAGE.relative_to(REPO)} is up to date")
        return 0
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
