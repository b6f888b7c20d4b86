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
# Who may still compare: the kinds themselves, the Task that holds problem_type, and metrics/ (whose
# "classification" and "regression" name metric modules, Task.metric, not the task). config/ may not: each kind
# checks its own keys (TaskKind.reads, TaskKind.check; issue 55).
ALLOWED = ("tasks.kinds", "tasks.task", "metrics")


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
    assert kind_names() == ["classification", "causal_lm", "sft", "dpo", "reward", "kto", "grpo"]
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
        ("grpo", "grpo", False, False, True, False),
    ],
)
def test_a_task_answers_through_its_kind(problem, key, labels, pairs, chat, regression):
    task = Task("x", problem, False)
    assert task.kind is kind_of(key)
    assert (task.has_labels, task.kind.pairs, task.kind.chat, task.regression) == (labels, pairs, chat, regression)
    assert task.kind.rows_per_sample == (2 if pairs else 1)
    # dpo's and kto's objectives read the reference (unless dpo's pair loss is free of it); a reward model's none
    assert task.kind.reference is ((pairs and not task.kind.reward_model) or task.kind.unpaired)
    keys = {"sft": "-answers-p", "dpo": "-pairs1", "reward": "-pairs1", "kto": "-kto1", "grpo": "-prompts1"}
    assert task.kind.cache_key("answers") == keys.get(key, "")


# ------------------------------------------------- a kind owns its batcher and objective (issue 55)
ASSEMBLY = ("loop.builder", "loop.assembly", "loop.data_stage", "loop.model_stage", "loop.evaluation")
# The batchers and objectives by class: only the registries (data/batchers.py, loop/objectives.py) make them.
CONCRETE = {"PaddedBatcher", "PackedBatcher", "PreferenceBatcher", "RewardBatcher", "PreferenceLoss", "RewardLoss"}
CONCRETE |= {"HiddenTokenLoss", "objective_for"}


def assembly_branches(modules: dict) -> list[str]:
    """Reads of a kind's flags that choose a batcher or an objective (`.pairs`, `.reward_model`), and names of a
    concrete batcher or loss, in the run's assembly."""
    found = []
    for name in ASSEMBLY:
        for node in ast.walk(ast.parse(modules[name].read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("pairs", "reward_model"):
                found.append(f"{name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Name) and node.id in CONCRETE:
                found.append(f"{name}:{node.lineno} {node.id}")
            if isinstance(node, ast.ImportFrom):
                found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if a.name in CONCRETE]
    return found


def test_the_assembly_asks_the_kind_for_its_batcher_and_objective_by_name():
    found = assembly_branches(MODULES)
    assert not found, f"ask kind.batcher / kind.objective (data/batchers.py, loop/objectives.py): {found}"


def test_each_kind_names_a_registered_batcher_and_objective():
    from parallel_finetune.data.batchers import BATCHERS, make_batcher
    from parallel_finetune.loop.objectives import OBJECTIVES, make_objective

    named = {key: (kind_of(key).batcher, kind_of(key).objective) for key in kind_names()}
    assert named == {
        "classification": ("rows", "classifier"),
        "causal_lm": ("rows", "tokens"),
        "sft": ("rows", "tokens"),
        "dpo": ("pairs", "pairs"),
        "reward": ("reward_pairs", "reward"),
        "kto": ("kto", "kto"),
        "grpo": ("grpo", "grpo"),
    }
    assert {batcher for batcher, _ in named.values()} == set(BATCHERS)
    assert {objective for _, objective in named.values()} == set(OBJECTIVES)
    registered = "registered .*: rows, pairs, reward_pairs, kto, grpo"
    with pytest.raises(UserError, match=f"no batcher named 'triples'; {registered}"):
        make_batcher("triples", None, None)
    registered = "registered .*: classifier, tokens, pairs, reward, kto, grpo"
    with pytest.raises(UserError, match=f"no objective named 'ppo'; {registered}"):
        make_objective("ppo", None)


def test_the_registries_make_what_the_kinds_batches_and_losses_are():
    """Each name's maker, called as the assembly and the Evaluator call it (split, padding, shape, reference)."""
    import torch

    from parallel_finetune.config import PreferenceSection
    from parallel_finetune.data.batch import PairReference, TokenizedSplit
    from parallel_finetune.data.batchers import Padding, make_batcher
    from parallel_finetune.data.packing import PackedShape
    from parallel_finetune.loop.loss import CLASS_OBJECTIVE, REGRESSION_OBJECTIVE, TOKEN_OBJECTIVE
    from parallel_finetune.loop.objectives import ObjectiveInputs, make_objective
    from parallel_finetune.parallel.layout import Engine

    pairs = TokenizedSplit(
        HeadKind.CAUSAL_LM, [[5, 6, 7], [5, 8]], [6, 4], [2, 2], prompt_lengths=[2, 1], rejected_ids=[[5, 6, 9], [5, 3]]
    )
    padding = Padding(pad_id=0, padding_side="right", pad_multiple=1, device=torch.device("cpu"))
    reference = PairReference([(-1.0, -2.0), (-3.0, -4.0)], [True, True])
    batch = make_batcher("pairs", pairs, padding, None, reference).batch([1, 0])
    assert batch.input_ids.tolist() == [[5, 8, 0], [5, 3, 0], [5, 6, 7], [5, 6, 9]]  # pair by pair: chosen, rejected
    assert make_batcher("pairs", pairs, padding, PackedShape(capacity=8), reference).batch([0]).packed
    labelled = [make_batcher("pairs", pairs, padding, score_prompts=s).batch([0]).labels.ne(-100).sum() for s in (0, 1)]
    assert labelled == [2, 3]  # ORPO's: the chosen row's prompt token too
    rewards = make_batcher("reward_pairs", pairs, padding, PackedShape(capacity=8))  # never packed
    assert not rewards.batch([0]).packed and rewards.batch([0]).labels.tolist() == [0.0, 0.0]
    rows = TokenizedSplit(HeadKind.CLASSIFICATION, [[1, 2, 3], [4]], [3, 1], [1, 1], labels=[1, 0])
    assert make_batcher("rows", rows, padding).batch([0, 1]).input_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert make_batcher("rows", rows, padding, PackedShape(capacity=4)).batch([0, 1]).input_ids.tolist() == [
        [1, 2, 3, 4]
    ]

    def objective(name, task, engine=Engine.TORCH, chunk=0, **preference):
        inputs = ObjectiveInputs(task, None, task.head, engine, chunk, False, PreferenceSection(**preference))
        return make_objective(name, inputs)

    classes, values = Task("custom", "single_label_classification", False), Task("custom", "regression", False)
    assert objective("classifier", classes) is CLASS_OBJECTIVE
    assert objective("classifier", values) is REGRESSION_OBJECTIVE
    assert (
        objective("tokens", Task("custom", "causal_lm", False)) is TOKEN_OBJECTIVE
    )  # loss_chunk_tokens=0, no pipeline: logits
    reward = objective("reward", Task("custom", "reward", False), center_rewards_coefficient=0.01)
    assert reward.center == 0.01 and reward.metric_names[1:] and not reward.needs_reference
    model = torch.nn.Linear(2, 2)
    model.config = None  # no final_logit_softcapping
    section = PreferenceSection(dpo_beta=0.2, desirable_weight=3.0)
    task = Task("custom", "kto", False)
    kto = make_objective("kto", ObjectiveInputs(task, model, task.head, Engine.DEEPSPEED, 0, False, section))
    assert (kto.beta, kto.weights, kto.needs_reference, kto.takes_hidden) == (0.2, (3.0, 1.0), True, False)

    # kto's rows (answer 2r desirable, 2r + 1 not) and, with max_length, the KL rows of a global batch for the passes
    unpaired = TokenizedSplit(
        HeadKind.CAUSAL_LM,
        [[5, 6, 7], [5, 8]],
        [3, 2],
        [1, 1],
        prompt_lengths=[1, 1],
        desirable=[True, False],
        completion_ids=[[6, 7], [8]],
    )
    rows = make_batcher("kto", unpaired, padding, PackedShape(capacity=8), max_length=3)
    batch = rows.batch([1, 0])
    assert not batch.packed and batch.answers.max(dim=1).values.tolist() == [1, 2]
    assert rows.reference_units([[1, 0]]) == [0, 1, (1, 0), (0, 1)]
    assert [rows.kl_ids(*pair)[0] for pair in rows.kl_units([1, 0])] == [[5, 6, 7], [5, 8]]


# ------------------------------------------------- a kind owns its keys and their checks (issue 55)
def sections() -> dict:
    from parallel_finetune.config import SECTION_CLASSES

    return {name: section() for name, section in SECTION_CLASSES.items()}


def refusal(task_key: str, sections: dict) -> str | None:
    from parallel_finetune.tasks.kinds import check_task_keys

    try:
        check_task_keys(task_key, sections, lambda key, why: UserError(f"{key} {why}"))
    except UserError as exc:
        return str(exc)
    return None


def test_each_kind_reads_keys_its_sections_have():
    """A kind's `reads` names sections and keys of them (a misspelt key would never be refused)."""
    from parallel_finetune.config import SECTIONS
    from parallel_finetune.tasks.kinds import all_kinds
    from parallel_finetune.tasks.kinds.base import WHOLE_SECTION

    for kind in all_kinds():
        for name, keys in kind.reads.items():
            assert name in SECTIONS, f"task={kind.key} reads section {name!r}, which the recipe has not"
            assert keys == WHOLE_SECTION or set(keys) <= set(SECTIONS[name]), (kind.key, name, keys)
    assert kind_of("grpo").reads["grpo"] == WHOLE_SECTION and not kind_of("classification").reads


def test_a_key_some_kind_reads_is_refused_under_every_kind_that_does_not():
    """Every (kind, key) pair: set away from its default, a key is refused exactly where its kind does not read it,
    in one line naming the kinds that do."""
    import dataclasses

    from parallel_finetune.tasks.kinds import readers_of

    checked = 0
    for name, section in sections().items():
        for key, readers in readers_of(name, section).items():
            changed = {**sections(), name: dataclasses.replace(section, **{key: object()})}
            names = [reader.key for reader in readers]
            for task_key in set(kind_names()) - set(names):  # (a reader's own checks read the value)
                said = refusal(task_key, changed)
                checked += 1
                assert said.startswith(f"{key} is") and f"and task={task_key} does not read it; drop it" in said
                assert all(n in said.split("; drop it")[0] for n in names) and "\n" not in said, said
    assert checked > 150  # the data columns, the preference and grpo sections, generate_every, under 7 kinds


@pytest.mark.parametrize(
    "task_key, key, value, says",
    [
        # one reader: named with what it trains on (before: "is task=dpo's pair loss", wrong for this key)
        (
            "kto",
            "center_rewards_coefficient",
            0.01,
            "is task=reward's (reward modelling, docs/reward.md), and task=kto does not read it; drop it or set "
            "task=reward",
        ),
        # several readers: all of them (before: "is task=dpo's pair loss, and task=reward reads none")
        (
            "reward",
            "dpo_beta",
            0.2,
            "is read by task=dpo and kto, and task=reward does not read it; drop it or set task=dpo or kto",
        ),
        (
            "dpo",
            "generate_every",
            5,
            "is task=sft's (it answers the validation conversations' prompts), and task=dpo does not read it; drop "
            "it or set task=sft",
        ),
    ],
)
def test_the_refusal_names_the_kinds_that_read_the_key(task_key, key, value, says):
    import dataclasses

    from parallel_finetune.config.sections import SECTION_OF

    changed = sections()
    changed[SECTION_OF[key]] = dataclasses.replace(changed[SECTION_OF[key]], **{key: value})
    assert refusal(task_key, changed) == f"{key} {says}"


def test_a_kind_checks_its_own_keys_only_when_it_runs():
    """kto's batch-size floor is kto's check: the same sections pass under dpo."""
    import dataclasses

    small = sections()
    small["training"] = dataclasses.replace(small["training"], batch_size=1)
    assert refusal("dpo", small) is None
    assert refusal("kto", small).startswith("batch_size must be >= 2 under task=kto")
