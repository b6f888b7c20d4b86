"""The import graph as docs/architecture.md draws it: every import of src/ (function-level ones too) points down
its layers or stays in its layer, and the graph has no cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "src" / "parallel_finetune"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py") if module_name(path)}


def imported(path: Path, root: Path = PACKAGE, modules: dict | None = None) -> set[str]:
    """The package modules `path` imports anywhere in it (`root`: the package folder); `from . import x` and
    `from .x import y` name the module x (or its package when y is no module)."""
    modules = MODULES if modules is None else modules
    package = list(path.relative_to(root).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "parallel_finetune":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                name = ".".join([*base, alias.name])
                found.add(name if name in modules else ".".join(base))
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("parallel_finetune.")}
    own = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    return {name for name in found if name in modules} - {own}


GRAPH = {name: imported(path) for name, path in MODULES.items()}


def documented_layers() -> dict[str, int]:
    page = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"## Import graph and words\n.*?```text\n(.*?)```", page, re.S).group(1)
    layers, layer = {}, None
    for line in block.splitlines():
        head = re.match(r"(\d+) [^:]+:", line)
        if head:
            layer = int(head.group(1))
            line = line[head.end() :]
        for name in line.split():
            assert name not in layers, f"{name} is in two layers of docs/architecture.md"
            layers[name] = layer
    return layers


def test_the_documented_layers_name_every_module_once():
    layers = documented_layers()
    assert set(layers) == set(MODULES), (
        f"missing from docs/architecture.md: {sorted(set(MODULES) - set(layers))}; "
        f"no such module: {sorted(set(layers) - set(MODULES))}"
    )


def test_every_import_points_down_the_layers_or_stays_in_its_layer():
    layers = documented_layers()
    upward = [
        f"{module} (layer {layers[module]}) imports {target} (layer {layers[target]})"
        for module, targets in GRAPH.items()
        for target in targets
        if layers[target] > layers[module]
    ]
    assert not upward, upward


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> imported modules), as a path back to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_finds_a_circle_made_of_function_level_imports(tmp_path):
    """The walker itself, on a package of three modules whose circle closes inside a function (as the last one
    on main did: runfolder imported checkpoint.NAME inside functions)."""
    files = {
        "a.py": "from .b import thing\n",
        "b.py": "import os\n\n\ndef later():\n    from .c import other\n    return other\n",
        "c.py": "def later():\n    from . import a\n    return a\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    modules = {name.removesuffix(".py"): tmp_path / name for name in files}
    graph = {name: imported(path, tmp_path, modules) for name, path in modules.items()}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


# Who may read the whole Config: the entry points (a run's assembly and its whole run, the CLI, SageMaker, the
# notebooks, the selftest), `resolve` (what a recipe means) and `preflight` (--check); config/ checks its own keys.
# Every other function receives the sections and resolved values it uses (NeMo AutoModel's recipes keep the same
# rule), no dataclass holds a Config, and no component reads `self.config`.
WHOLE_CONFIG_READERS = {
    "config",
    "config.whole",
    "config.loading",
    "config.checks",
    "resolve",
    "preflight",
    "loop.builder",
    "loop.run",
    "train",
    "sagemaker_job",
    "tools.notebook",
    "selftest",
}


def whole_config_takers(modules: dict[str, Path]) -> list[str]:
    found = []
    for name, path in modules.items():
        if name in WHOLE_CONFIG_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) in ("Config", "'Config'"):
                found.append(f"{name}: a field {ast.unparse(node.target)}: Config")
            if isinstance(node, ast.Attribute) and node.attr == "config" and ast.unparse(node.value) == "self":
                found.append(f"{name}:{node.lineno} reads self.config")
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for argument in arguments:
                kind = ast.unparse(argument.annotation) if argument.annotation is not None else None
                takes = kind in ("Config", "'Config'") or (argument.arg == "config" and kind is None)
                if takes:
                    found.append(f"{name}.{node.name}({argument.arg})")
    return found


def test_only_entry_points_resolve_and_preflight_take_the_whole_config(tmp_path):
    found = whole_config_takers(MODULES)
    assert not found, f"these take or hold the whole Config; pass them the sections they read: {found}"
    # the rule sees an untyped `config` parameter as well as a typed one, a field, and a read of self.config
    (tmp_path / "component.py").write_text(
        "def load(config):\n    pass\n\n\ndef build(x, *, settings: Config):\n    pass\n\n\n"
        "class Parts:\n    config: Config\n\n    def run(self):\n        return self.config.lr\n"
    )
    assert whole_config_takers({"component": tmp_path / "component.py"}) == [
        "component.load(config)",
        "component.build(settings)",
        "component: a field config: Config",
        "component:13 reads self.config",
    ]


# The flat facade (`config.lr` for `config.training.lr`, config/whole.py) is for the entry points: the recipe's flat
# keys are what a user writes on a command line. Everywhere else code reads the section (`config.training.lr`), or
# better takes the sections it reads, so a reader sees which part of the recipe a module depends on (issue 55).
# Entry points that may read flat: train.py, launch.py, sagemaker_job.py and the tools' CLIs (a `main` in tools/);
# scripts/ and notebooks/ are outside the package. None of them reads flat today.
FLAT_READERS = {"train", "launch", "sagemaker_job"}
CONFIG_NAMES = ("config", "cfg", "conf")


def flat_reads(modules: dict[str, Path]) -> list[str]:
    """`<config>.<key>` where key is a recipe key (not a section's name) and <config> is `config`, `cfg`, `conf` or
    `self.config` (reads and writes alike), outside config/ and the entry points."""
    from parallel_finetune.config.sections import SECTION_CLASSES, SECTION_OF

    flat_keys = set(SECTION_OF) - set(SECTION_CLASSES)
    found = []
    for name, path in modules.items():
        if name == "config" or name.startswith("config.") or name in FLAT_READERS:
            continue
        tree = ast.parse(path.read_text())
        exempt = set()  # the tools' CLIs: main() reads the recipe as its user wrote it
        if name.startswith("tools."):
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name == "main":
                    exempt |= {id(inner) for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in flat_keys or id(node) in exempt:
                continue
            receiver = node.value
            if (isinstance(receiver, ast.Name) and receiver.id in CONFIG_NAMES) or (
                isinstance(receiver, ast.Attribute)
                and receiver.attr in CONFIG_NAMES
                and isinstance(receiver.value, ast.Name)
                and receiver.value.id == "self"
            ):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_flat_config_reads_outside_config_and_the_entry_points(tmp_path):
    found = flat_reads(MODULES)
    assert not found, f"read the section (config.training.lr), or take the sections as parameters: {found}"
    # the rule sees config.lr, self.config.lr and cfg.lr, writes too; a section's read, another object's attribute
    # of a key's name (hf_config.num_labels) and a tool's main() pass
    (tmp_path / "component.py").write_text(
        "def a(config, cfg, hf_config):\n    return config.lr, cfg.seed, config.training.lr, hf_config.num_labels\n\n\n"
        "class B:\n    def run(self):\n        self.config.packing = True\n        return self.config.model.task\n"
    )
    (tmp_path / "cli.py").write_text(
        "def main(config):\n    return config.lr\n\n\ndef other(config):\n    return config.lr\n"
    )
    assert flat_reads({"component": tmp_path / "component.py", "tools.cli": tmp_path / "cli.py"}) == [
        "component:2 config.lr",
        "component:2 cfg.seed",
        "component:7 self.config.packing",
        "tools.cli:6 config.lr",
    ]
    assert flat_reads({"train": tmp_path / "component.py", "config.whole": tmp_path / "component.py"}) == []


# ---------------------------------------------------------------- the loop's inputs as components (issue 46)
def class_of(module: str, name: str) -> ast.ClassDef:
    tree = ast.parse(MODULES[module].read_text())
    (found,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    return found


def test_the_trainer_receives_components_and_holds_no_config():
    """The Trainer is a dataclass of built components (at most 250 lines): no field is a Config or a bag of run
    parts; the evaluator, the generator and the checkpoint manager each decide `due(step)`."""
    trainer = class_of("loop.trainer", "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 250
    fields = {node.target.id: ast.unparse(node.annotation) for node in trainer.body if isinstance(node, ast.AnnAssign)}
    assert {"sampler", "batcher", "runner", "updates", "evaluator", "generator", "checkpoints", "reporter"} <= set(
        fields
    )
    assert not [name for name, kind in fields.items() if "Config" in kind or "Parts" in kind or name == "config"]
    methods = {node.name for node in trainer.body if isinstance(node, ast.FunctionDef)}
    assert {"fit", "train_step"} <= methods
    for module, name in (
        ("loop.evaluation", "Evaluator"),
        ("loop.generation", "Generator"),
        ("loop.checkpointer", "CheckpointManager"),
    ):
        assert "due" in {node.name for node in class_of(module, name).body if isinstance(node, ast.FunctionDef)}
    assert "resume" in {n.name for n in class_of("loop.checkpointer", "CheckpointManager").body if hasattr(n, "name")}


# The run's assembly in typed stages (issue 55): RunBuilder (the entry), the data stage, the model stage and the
# loop's assembly, and the registries they ask a task's kind through; none of their classes is a new centre of
# gravity (RunBuilder alone was ~450 lines).
ASSEMBLY_MODULES = ("loop.builder", "loop.data_stage", "loop.model_stage", "loop.assembly", "loop.objectives")
ASSEMBLY_MODULES += ("data.batchers",)


def test_the_assemblys_largest_class_is_at_most_250_lines():
    sizes = {
        f"{module}.{node.name}": node.end_lineno - node.lineno + 1
        for module in ASSEMBLY_MODULES
        for node in ast.parse(MODULES[module].read_text()).body
        if isinstance(node, ast.ClassDef)
    }
    assert {"loop.builder.RunBuilder", "loop.builder.BuiltRun", "loop.model_stage.ModelStage"} <= set(sizes)
    largest = max(sizes, key=sizes.get)
    assert sizes[largest] <= 250, f"{largest} is {sizes[largest]} lines; split it into stages"


def test_a_batch_says_its_kind_and_the_loss_reads_no_shapes():
    """No module asks a batch whether a key is in it (`"position_ids" in batch`): a Batch's kind is a field. The
    loss picks its function by the task, not by the labels' ndim, dtype or shape."""
    asked = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
        and isinstance(node.left, ast.Constant)
        and node.left.value in ("position_ids", "labels", "target_mask", "token_type_ids")
        and "batch" in ast.unparse(node.comparators[0])
    ]
    assert not asked, asked
    sniffed = [
        f"loop.loss:{node.lineno} .{node.attr}"
        for node in ast.walk(ast.parse(MODULES["loop.loss"].read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("ndim", "shape", "dtype", "is_floating_point", "dim")
    ]
    assert not sniffed, sniffed


def test_a_parameter_named_task_is_a_task():
    """One word per idea: `task` is a tasks.Task; the model's last layer is `head: HeadKind`, a GLUE task
    `glue: GlueTask`, the recipe's key `task_key`."""
    misnamed = [
        f"{name}:{node.lineno} {node.name}(task: {ast.unparse(argument.annotation) if argument.annotation else None})"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for argument in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        if argument.arg == "task"
        and (argument.annotation is None or ast.unparse(argument.annotation) not in ("Task", "Task | None"))
    ]
    assert not misnamed, misnamed


def test_derived_values_are_computed_in_resolve_only():
    """The pretrained model's name (the family's default), the head a recipe's `task:` names and the LoRA settings
    are derived in resolve.py only (ModelChoice, Resolved); --check, an export and a SageMaker job read them."""
    derived = [
        f"{name}:{node.lineno} {ast.unparse(node)[:60]}"
        for name, path in MODULES.items()
        if name not in ("resolve", "tasks", "tasks.task")
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("head_of", "_lora_settings"))
        or (isinstance(node, ast.Attribute) and node.attr == "default_model" and not name.startswith("families"))
    ]
    assert not derived, derived


def test_the_folders_show_the_floors():
    """At most 12 modules at the package's top (the entry points and the spine: config, resolve, errors,
    interfaces); every other module lives in a folder with a short face (its __init__ says what it holds)."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    for folder in ("config", "data", "model", "parallel", "loop", "outputs", "tools", "tasks", "families", "rl"):
        face = PACKAGE / folder / "__init__.py"
        assert face.is_file() and ast.get_docstring(ast.parse(face.read_text())), folder
    tests = REPO / "tests"
    for folder in ("data", "model", "parallel", "loop", "outputs", "tools", "rl"):
        assert list((tests / folder).glob("test_*.py")), f"tests/{folder}/ mirrors src/parallel_finetune/{folder}/"
    assert (tests / "test_parity.py").is_file()  # the front door stays where a reader looks first


def test_the_recipe_keys_that_repeat_their_section_are_no_code_paths():
    """`model.model` and `peft.peft` stay recipe keys; code reads `config.model.source` and `config.peft.method`."""
    traps = [
        f"{name}:{node.lineno} {ast.unparse(node)}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and (node.attr, node.value.attr) in (("model", "model"), ("peft", "peft"))
    ]
    assert not traps, traps


def test_the_config_is_split_by_concern():
    """config/ is a package of modules by concern (issue 55: sections, loading and overrides, checks), none longer
    than 400 lines, so a key's checks or the loader's rules are read in a module of their own, not in one long file."""
    modules = sorted((PACKAGE / "config").glob("*.py"))
    assert {path.stem for path in modules} >= {"__init__", "sections", "loading", "checks"}
    long = {path.name: n for path in modules if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"config modules over 400 lines: {long}"
