"""task: causal_lm: next-token prediction on one text column, scored by perplexity; no test split."""

from __future__ import annotations

from . import register
from .base import HeadKind, TaskKind

CAUSAL_LM = "causal_lm"


class CausalLM(TaskKind):
    key = CAUSAL_LM
    problem_types = (CAUSAL_LM,)
    head = HeadKind.CAUSAL_LM
    objective = "tokens"


register(CausalLM())
