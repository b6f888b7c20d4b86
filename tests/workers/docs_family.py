"""Trains the fifth family that docs/architecture.md adds, as the page shows it: the page's Python block is run,
the `Family` subclass it defines is registered, then the trainer runs as scripts/train.py would.

... docs_family.py RECIPE key=value ... (the arguments of scripts/train.py)"""

import re
import sys
from pathlib import Path

from parallel_finetune.config import load_config
from parallel_finetune.families import FAMILIES
from parallel_finetune.families.base import Family
from parallel_finetune.trainer import run

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
MARKER = "<!-- fifth family"


def family_source(page: Path) -> str:
    """The first ```python block after the marker comment."""
    text = page.read_text(encoding="utf-8")
    found = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.S)
    return found.group(1)


def register(page: Path = PAGE) -> Family:
    namespace: dict = {"__name__": "docs_family"}
    exec(compile(family_source(page), str(page), "exec"), namespace)
    (cls,) = [
        v for v in namespace.values() if isinstance(v, type) and issubclass(v, Family) and v.__module__ == "docs_family"
    ]
    family = cls()
    FAMILIES[family.name] = family
    return family


def main() -> None:
    register()
    run(load_config(sys.argv[1], sys.argv[2:]))


if __name__ == "__main__":
    main()
