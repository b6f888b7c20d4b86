"""task: grpo (online RL with verifiable rewards, as TRL's GRPOTrainer): a causal LM trained on completions it
samples itself for each prompt (text, or messages rendered by the chat template with its generation prompt), scored
by reward functions that read the row's other columns (an `answer`, a `solution`); scored on held-out prompts by
their mean reward."""

from __future__ import annotations

import json
import math
import re

from . import register
from .base import WHOLE_SECTION, HeadKind, Sample, TaskKind

GRPO = "grpo"
# rl/rewards.py's BUILTINS (tests/rl/test_grpo.py keeps the two equal): tasks/ is a floor below rl/
BUILTIN_REWARDS = ("accuracy", "format", "length")
# Why task=grpo refuses pipeline stages: a rollout decodes one token at a time, and through stages each token would
# cross every stage boundary twice with the other stages idle; TP and FSDP sample in every rank's own forward.
NO_PIPELINE = (
    "task=grpo samples its completions token by token, which a pipeline would pass through every stage for each "
    "token; use tensor_parallel_degree (TP) or sharding=full (FSDP) instead, with pipeline_parallel_degree=1"
)


class ReinforcementLearning(TaskKind):
    key = GRPO
    rows = "prompts"
    problem_types = (GRPO,)
    head = HeadKind.CAUSAL_LM
    has_labels = False
    chat = True
    prompts = True
    batcher = "grpo"
    objective = "grpo"
    step_source = "rollouts"
    unread_keys = ("glue_task",)  # whatever glue_task's default, a grpo run reads no GLUE task
    reads = {"data": ("chat_template", "prompt_column"), "grpo": WHOLE_SECTION}
    about = "online RL, docs/grpo.md"
    sample = Sample(
        "grpo",
        "arithmetic sample",
        "small sums and products written in words and digits, each with its answer",
        "prompts",
        "grpo-sample-",
    )

    def samples_per_step(self, batch_size: int, grpo) -> int:
        return batch_size // grpo.num_generations  # batch_size counts completions

    def chat_template(self, train) -> bool:
        """Prompts of messages (rendered by a chat template with its generation prompt), not texts."""
        return not isinstance(json.loads(train["prompt"][0]), str)

    def cache_key(self, train_on: str) -> str:
        return "-prompts1"  # the prompts' format version

    def template_note(self, template: str, train_on: str) -> str:
        return f"task=grpo: chat template {template}, each prompt rendered with its generation prompt"

    def check(self, sections, bad) -> None:
        """The `grpo:` section's values in range, its combinations with the run, and its reward functions."""
        section, parallel = sections["grpo"], sections["parallel"]
        if parallel.pipeline_parallel_degree > 1:
            raise bad("pipeline_parallel_degree", NO_PIPELINE)
        if parallel.engine == "deepspeed":
            raise bad(
                "engine", "task=grpo runs on engine=torch (its rollouts and loss use the chunked head); use torch"
            )
        if sections["data"].packing:
            raise bad("packing", "task=grpo pads its completions (it packs none); drop packing")
        if section.num_generations < 2:
            raise bad("num_generations", "must be at least 2 (advantages compare a prompt's completions), e.g. 8")
        if sections["training"].batch_size % section.num_generations:
            raise bad(
                "batch_size",
                f"counts completions, and num_generations={section.num_generations} does not divide it (each "
                "prompt's group of completions is in one step); make batch_size a multiple of num_generations",
            )
        for key in ("max_completion_length", "num_iterations"):
            if getattr(section, key) < 1:
                raise bad(key, "must be at least 1")
        if section.temperature < 0 or not 0 < section.top_p <= 1 or section.top_k < 0:
            key = "temperature" if section.temperature < 0 else "top_p" if not 0 < section.top_p <= 1 else "top_k"
            raise bad(key, "is out of range: temperature >= 0 (0: greedy), 0 < top_p <= 1, top_k >= 0 (0: all)")
        if not section.epsilon > 0 or (section.epsilon_high is not None and section.epsilon_high < section.epsilon):
            key = "epsilon" if not section.epsilon > 0 else "epsilon_high"
            raise bad(key, "must be epsilon > 0 and epsilon_high >= epsilon (or null: epsilon), e.g. 0.2 and 0.28")
        if section.beta < 0:
            raise bad("beta", "must be >= 0 (0: no KL term, TRL's default)")
        if section.beta > 0 and sections["peft"].method != "lora":
            raise bad(
                "beta",
                "> 0 needs a reference model: with peft=lora it is the base with its adapters disabled (no second "
                "copy); full fine-tuning keeps no frozen copy yet, so use peft=lora or beta=0",
            )
        check_rewards(section, bad)


def check_rewards(section, bad) -> None:
    """The `grpo:` section's reward functions: built-in names, path.py:name or model:folder, their weights, and what the
    built-ins read (format's pattern, length's limit)."""
    functions = section.reward_functions
    if not functions or not all(isinstance(f, str) and f for f in functions):
        raise bad(
            "reward_functions",
            f"must list reward functions: {', '.join(BUILTIN_REWARDS)}, path.py:name or model:path/to/folder",
        )
    for name in functions:
        if ":" not in name and name not in BUILTIN_REWARDS:
            raise bad(
                "reward_functions",
                f"names {name!r}, no built-in reward ({', '.join(BUILTIN_REWARDS)}); your own function is "
                "path/to/file.py:function, a reward model model:path/to/folder",
            )
        if name == "model:":
            raise bad("reward_functions", "names a reward model with no folder; write model:path/to/folder")
    weights = section.reward_weights
    if weights is not None and (
        len(weights) != len(functions) or not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights)
    ):
        raise bad("reward_weights", f"must be {len(functions)} finite number(s), one per reward function (or null)")
    if "format" in functions:
        if not section.format_pattern:
            raise bad("format_pattern", "is what reward format matches each completion against; give a regex")
        try:
            re.compile(section.format_pattern)
        except re.error as exc:
            raise bad("format_pattern", f"is no regular expression ({exc})") from None
    if "length" in functions and (section.length_limit is None or section.length_limit < 1):
        raise bad("length_limit", "is where reward length's penalty starts: give a number of tokens >= 1")
    if section.length_ramp is not None and section.length_ramp < 1:
        raise bad("length_ramp", "must be at least 1 (or null: length_limit)")


register(ReinforcementLearning())
