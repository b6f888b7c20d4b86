"""Task kinds are a registry (tasks/kinds/, as families/ is): a recipe's `task:` key and a Task's problem_type map
to a kind that callers ask, and no module outside the kinds' own compares the task with a kind's name."""

from __future__ import annotations

import ast

import pytest
from test_architecture import MODULES

from parallel_finetune.errors import UserError
from parallel_finetune.tasks.kinds import find_kind, kind_names, kind_of, kind_of_problem
from parallel_finetune.tasks.task import HeadKind, Task

KIND_NAMES = {"classification", "causal_lm", "sft", "dpo", "regression", "single_label_classification"}
KIND_CONSTANTS = {"REGRESSION", "CLASSIFICATION", "CAUSAL_LM", "SFT", "DPO"}
HEAD_NAMES = {"classification", "causal_lm"}  # also HeadKind's values: families' model_classes are keyed by them
# Who may still compare: the kinds themselves, the Task that holds problem_type, config.py (its per-task key checks
# move to the kinds when it is split, issue 55), and metrics/ (whose "classification" and "regression" name metric
# modules, Task.metric, not the task).
ALLOWED = ("tasks.kinds", "tasks.task", "config", "metrics")


def names_kind(node: ast.AST, names: set[str] = KIND_NAMES) -> bool:
    """A kind's name: a string literal, one of the module constants (not HeadKind's members), or a tuple of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(names_kind(item, names) for item in node.elts)
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, ast.Name):
        return node.id in KIND_CONSTANTS
    if isinstance(node, ast.Attribute):
        return node.attr in KIND_CONSTANTS and ast.unparse(node.value) != "HeadKind"
    return False


def kind_comparisons(modules: dict) -> list[str]:
    """Comparisons with a kind's name (`==`, `in (..)`), dispatch tables keyed by a task-only kind name
    ({"sft": ...}), and reads of the retired flag `preference_pairs`, outside the allowed modules."""
    found = []
    for name, path in modules.items():
        if name.split(".")[0] in ALLOWED or any(name == a or name.startswith(a + ".") for a in ALLOWED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(names_kind(x) for x in (node.left, *node.comparators)):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.Dict) and any(
                key is not None and names_kind(key, KIND_NAMES - HEAD_NAMES) for key in node.keys
            ):
                found.append(f"{name}:{node.lineno} {{{ast.unparse(node.keys[0])}: ...}}")
            elif isinstance(node, ast.Attribute) and node.attr == "preference_pairs":
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_outside_the_kinds_compares_the_task_with_a_kind_name():
    found = kind_comparisons(MODULES)
    assert not found, f"ask the task's kind (tasks/kinds/) instead: {found}"


def test_the_rule_sees_each_way_of_comparing(tmp_path):
    (tmp_path / "caller.py").write_text(
        "if task.problem_type == SFT:\n    pass\n"
        "if config.task in ('sft', 'dpo'):\n    pass\n"
        "rows = {DPO: 1}\n"
        "if task.preference_pairs:\n    pass\n"
        "if head is HeadKind.CAUSAL_LM:\n    pass\n"  # the head is a HeadKind, asked by member: allowed
        "model_classes = {'classification': 1, 'causal_lm': 2}\n"  # keyed by head: allowed
    )
    assert kind_comparisons({"caller": tmp_path / "caller.py"}) == [
        "caller:1 task.problem_type == SFT",
        "caller:3 config.task in ('sft', 'dpo')",
        "caller:5 {DPO: ...}",
        "caller:6 task.preference_pairs",
    ]


def test_each_recipe_key_has_a_kind_and_an_unknown_one_is_one_line():
    assert kind_names() == ["classification", "causal_lm", "sft", "dpo", "reward", "kto"]
    assert kind_of("sft").head is HeadKind.CAUSAL_LM and kind_of("classification").head is HeadKind.CLASSIFICATION
    with pytest.raises(UserError, match=r"^task='orpo' is not a task kind; valid: classification, causal_lm, sft, dpo"):
        kind_of("orpo")
    assert find_kind(None) is None and kind_of_problem("multi_label_classification") is None


@pytest.mark.parametrize(
    "problem, key, labels, pairs, chat, regression",
    [
        ("single_label_classification", "classification", True, False, False, False),
        ("regression", "classification", True, False, False, True),
        ("causal_lm", "causal_lm", True, False, False, False),
        ("sft", "sft", False, False, True, False),
        ("dpo", "dpo", False, True, True, False),
        ("reward", "reward", True, True, True, False),
        ("kto", "kto", False, False, True, False),
    ],
)
def test_a_task_answers_through_its_kind(problem, key, labels, pairs, chat, regression):
    task = Task("x", problem, False)
    assert task.kind is kind_of(key)
    assert (task.has_labels, task.kind.pairs, task.kind.chat, task.regression) == (labels, pairs, chat, regression)
    assert task.kind.rows_per_sample == (2 if pairs else 1)
    # dpo's and kto's objectives read the reference (unless dpo's pair loss is free of it); a reward model's none
    assert task.kind.reference is ((pairs and not task.kind.reward_model) or task.kind.unpaired)
    keys = {"sft": "-answers-p", "dpo": "-pairs1", "reward": "-pairs1", "kto": "-kto1"}
    assert task.kind.cache_key("answers") == keys.get(key, "")
