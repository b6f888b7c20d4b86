"""Model families by recipe name. Adding a family = one module here with a `Family` subclass."""

from .base import Family
from .bert import Bert
from .gpt2 import GPT2
from .gptj import GPTJ
from .gptneo import GPTNeo

FAMILIES: dict[str, Family] = {family.name: family for family in (GPTJ(), GPT2(), GPTNeo(), Bert())}


def get_family(name: str) -> Family:
    return FAMILIES[name]
