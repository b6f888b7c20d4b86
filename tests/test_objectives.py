"""The objective protocol (interfaces.Objective): a loss's figures come back with the loss from the call that made
them, never through a side channel the callers drain afterwards (issue 55: three callers `take()`-ing a side list
of per-pair records by the loss's concrete type). As an AST rule over src/, and the rule checked on code that
breaks it each way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_architecture import MODULES

# calls that change the object they are called on: a side list or dict filled as a call goes
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear", "remove"}


def _is_self(node: ast.AST) -> bool:
    """`self`, or an attribute or item under it (self.records, self.kept[0])."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _defines_metric_names(cls: ast.ClassDef) -> bool:
    """An objective (or a pair loss): `metric_names` set in its body or on self in a method."""
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Name) and target.id == "metric_names":
                return True
            if isinstance(target, ast.Attribute) and target.attr == "metric_names" and _is_self(target.value):
                return True
    return False


def _classes(modules: dict[str, Path]) -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Every class under src/ by name (a name may be defined in more than one module: each is kept)."""
    found: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((name, node))
    return found


def _lineage(cls: ast.ClassDef, classes: dict) -> list[ast.ClassDef]:
    """The class and its bases defined under src/ (by name), nearest first."""
    chain, todo = [], [cls]
    while todo:
        current = todo.pop(0)
        if current in chain:
            continue
        chain.append(current)
        for base in current.bases:
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            todo.extend(node for _, node in classes.get(name, []))
    return chain


def _methods(chain: list[ast.ClassDef]) -> dict[str, ast.FunctionDef]:
    methods: dict[str, ast.FunctionDef] = {}
    for cls in reversed(chain):  # the nearest definition wins
        methods |= {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}
    return methods


def _reached_from_call(methods: dict[str, ast.FunctionDef]) -> list[ast.FunctionDef]:
    """`__call__` and every method it reaches through `self.method(...)`."""
    reached, todo = [], ["__call__"]
    while todo:
        name = todo.pop()
        if name not in methods or methods[name] in reached:
            continue
        reached.append(methods[name])
        for node in ast.walk(methods[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value):
                if isinstance(node.func.value, ast.Name):  # self.scored(...), not self.pair_loss_of(...)'s insides
                    todo.append(node.func.attr)
    return reached


def _writes(function: ast.FunctionDef) -> list[ast.AST]:
    """What in `function` keeps something past the call: an assignment to self (or under it), a mutating call on
    self's attributes or on a name that is neither a parameter nor a local (a module's list), a `global`."""
    local = {arg.arg for arg in (*function.args.args, *function.args.kwonlyargs)} - {"self"}
    local |= {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    found = []
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
            isinstance(target, (ast.Attribute, ast.Subscript)) and _is_self(target) for target in targets
        ):
            found.append(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            receiver = node.func.value
            if _is_self(receiver) or (isinstance(receiver, ast.Name) and receiver.id not in local):
                found.append(node)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            found.append(node)
    return found


def side_channels(modules: dict[str, Path]) -> list[str]:
    """Under src/: a method `take` with nothing to take but self (a drain of kept figures; Table.take(rows)
    selects rows and stays), a `.take()` call with no argument, an append to a `records` attribute anywhere, and
    in an objective's (or a pair loss's: a class with `metric_names`, or one under such a class) `__call__` and
    the methods it reaches, anything kept past the call (`_writes`). `share_of`, the declared pre-step input,
    `sums` and `metrics` are not reached from the call, so they may keep state."""
    classes, found = _classes(modules), []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "take" and len(node.args.args) <= 1:
                found.append(f"{name}:{node.lineno} def take(self)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver = node.func.value
                if node.func.attr == "take" and not node.args and not node.keywords:
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
                elif node.func.attr in MUTATORS and isinstance(receiver, ast.Attribute) and receiver.attr == "records":
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    for named in classes.values():
        for module, cls in named:
            chain = _lineage(cls, classes)
            if not any(_defines_metric_names(each) for each in chain):
                continue
            for method in _reached_from_call(_methods(chain)):
                for node in _writes(method):
                    found.append(f"{module}:{node.lineno} {cls.name}.{method.name}: {ast.unparse(node)}")
    return sorted(set(found))


def test_no_loss_hands_its_figures_out_through_a_side_channel():
    found = side_channels(MODULES)
    assert not found, f"return the statistics with the loss (interfaces.Objective) instead: {found}"


def test_the_rule_sees_each_way_of_keeping_figures(tmp_path):
    (tmp_path / "losses.py").write_text(
        "class Table:\n"
        "    def take(self, rows):\n"  # 2: selects rows: allowed
        "        return rows\n"
        "class Kept:\n"
        "    def take(self):\n"  # 5: a drain
        "        return 1\n"
        "figures.take()\n"  # 7
        "table.take([1, 2])\n"  # 8: allowed
        "elsewhere.records.append(1)\n"  # 9
        "class Base:\n"
        "    metric_names = ('loss',)\n"
        "    def __call__(self, outputs, target):\n"
        "        return self.scored(outputs), {}\n"
        "    def scored(self, outputs):\n"
        "        self.last = outputs\n"  # 15: reached from __call__
        "        return outputs.sum()\n"
        "    def share_of(self, split, indices):\n"
        "        self.share = 1.0\n"  # 18: the pre-step input: allowed
        "SIDE = []\n"
        "class Derived(Base):\n"  # an objective by its base
        "    def __call__(self, outputs, target):\n"
        "        self.records.append(outputs)\n"  # 22
        "        SIDE.append(outputs)\n"  # 23: a module's list
        "        kept = []\n"
        "        kept.append(outputs)\n"  # 25: a local: allowed
        "        self.seen += 1\n"  # 26
        "        return outputs.sum(), {}\n"
        "class Pair:\n"
        "    def __init__(self):\n"
        "        self.metric_names = ('loss', 'margin')\n"  # an objective by its __init__
        "    def __call__(self, x, y):\n"
        "        global LAST\n"  # 32
        "        self.kept['x'] = x\n"  # 33
        "        return x, {}\n"
        "class NotALoss:\n"
        "    def __call__(self, x):\n"
        "        self.seen = x\n"  # 37: no metric_names: not an objective
    )
    assert side_channels({"losses": tmp_path / "losses.py"}) == sorted(
        [
            "losses:5 def take(self)",
            "losses:7 figures.take()",
            "losses:9 elsewhere.records.append(1)",
            "losses:15 Base.scored: self.last = outputs",
            "losses:22 self.records.append(outputs)",
            "losses:22 Derived.__call__: self.records.append(outputs)",
            "losses:23 Derived.__call__: SIDE.append(outputs)",
            "losses:26 Derived.__call__: self.seen += 1",
            "losses:32 Pair.__call__: global LAST",
            "losses:33 Pair.__call__: self.kept['x'] = x",
        ]
    )


def test_every_objective_answers_the_protocol():
    """What the runners are handed: the plain heads' objectives, the language model's from hidden states, DPO's
    (here from whole logits, engine=deepspeed's path) and the reward model's each have the protocol's attributes
    and methods, and a call returns the summed loss with its statistics (none for a plain head; one value per pair
    for each metric of a pair objective), which `sums` adds up with the unit count last."""
    import inspect
    from types import SimpleNamespace

    import torch

    from parallel_finetune.config import GRPOSection
    from parallel_finetune.interfaces import Objective
    from parallel_finetune.loop import loss as losses
    from parallel_finetune.loop.grpo_loss import GRPOLoss
    from parallel_finetune.loop.kto import KTOObjective
    from parallel_finetune.loop.reward_loss import RewardLoss

    torch.manual_seed(0)
    labels = torch.tensor([1, 2, -100, 0])
    dpo = SimpleNamespace(
        dpo_loss="sigmoid", dpo_beta=0.1, dpo_label_smoothing=0.0, rpo_alpha=0.0, dpo_length_normalized=False
    )
    # two pairs' answer tokens: (label, answer number, reference) at each scored position
    kto = SimpleNamespace(dpo_beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)
    target = torch.tensor([[1, 0, -3.0], [2, 0, -3.0], [3, 1, -4.0], [0, 2, -1.0], [4, 3, -2.0], [5, 3, -2.0]])
    # two completions' tokens: (label, completion, advantage, old, reference) at each scored position
    grpo_target = torch.tensor([[1, 0, 0.5, -1.0, -2.0], [2, 0, 0.5, -1.0, -2.0], [3, 1, -0.5, -1.0, -2.0]])
    cases = [
        (losses.TOKEN_OBJECTIVE, torch.randn(4, 7), labels, 0),
        (losses.CLASS_OBJECTIVE, torch.randn(4, 3), labels, 0),
        (losses.REGRESSION_OBJECTIVE, torch.randn(4, 1), torch.tensor([0.5, float("nan"), 1.0, 2.0]), 0),
        (losses.HiddenTokenLoss(torch.nn.Linear(5, 7), 2), torch.randn(4, 5), labels, 0),
        (losses.PreferenceLoss(None, 0, preference=dpo), None, target, 2),
        (RewardLoss(0.01), torch.randn(4, 1), torch.zeros(4), 2),
        (KTOObjective(None, 0, preference=kto), None, target, 4),  # the same targets as four rows: answers 0 to 3
        (GRPOLoss(torch.nn.Linear(5, 7), 2, grpo=GRPOSection(beta=0.04)), torch.randn(3, 5), grpo_target, 2),
    ]
    protocol = {
        name: list(inspect.signature(member).parameters)
        for name, member in vars(Objective).items()
        if inspect.isfunction(member)
    }
    for objective, outputs, target, units in cases:
        name = type(objective).__name__
        for method in ("share_of", "measured", "sums", "metrics"):
            assert list(inspect.signature(getattr(type(objective), method)).parameters) == protocol[method], name
        assert isinstance(objective.takes_hidden, bool) and isinstance(objective.needs_reference, bool), name
        assert objective.metric_names[0] == "loss", name
        if outputs is None:
            outputs = torch.randn(len(target), 7)
        summed, stats = objective(outputs, target)
        assert summed.ndim == 0 and summed.dtype == torch.float32, name
        # KTO's rewards/margins is made by `metrics` (the chosen rows' mean reward - the rejected rows'): no row has one
        derived = {"rewards/margins"} if isinstance(objective, KTOObjective) else set()
        assert set(objective.metric_names[1:] if units else ()) - derived <= set(stats), name
        assert all(len(stats[metric]) == units for metric in set(objective.metric_names) - derived if units), name
        totals = objective.sums([stats, {}], "cpu")  # {}: a pipeline stage that is not the last adds nothing
        assert totals.dtype == torch.float64 and totals.tolist()[-1] == units, name
        if units:
            assert totals[0].item() == pytest.approx(summed.item(), rel=1e-6), name
