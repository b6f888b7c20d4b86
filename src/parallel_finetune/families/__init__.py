"""Model families by recipe name. Adding a family = one module here with a `Family` subclass."""

from .base import Family
from .gptj import GPTJ

FAMILIES: dict[str, Family] = {family.name: family for family in (GPTJ(),)}


def get_family(name: str) -> Family:
    return FAMILIES[name]
