"""Unit tests of the loop's seams, in this process on a gloo world of one (or two forked ranks): the loss and its
division, the loss scaler, the one step-wide reduction, `TorchUpdates` against plain torch, `WholeModel`, and a
checkpoint written and read back. The end-to-end parity tests prove the same things through whole runs; these
name the part that broke, in a second."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re

import harness
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import REPO, subprocess_env
from transformers import GPT2Config, GPT2ForSequenceClassification

from parallel_finetune.config import Config
from parallel_finetune.data.batch import IGNORE, Batch, TokenizedSplit, next_token_labels
from parallel_finetune.loop.loss import (
    CLASS_OBJECTIVE,
    REGRESSION_OBJECTIVE,
    TOKEN_OBJECTIVE,
    objective_for,
    token_loss,
)
from parallel_finetune.loop.runner import WholeModel
from parallel_finetune.loop.updates import TorchUpdates
from parallel_finetune.model.load import parameter_shapes
from parallel_finetune.model.precision import DynamicLossScaler
from parallel_finetune.outputs import checkpoint, integrity
from parallel_finetune.parallel import Parallelized
from parallel_finetune.parallel.gradients import reduce_norm_and_loss
from parallel_finetune.tasks.glue import TASKS
from parallel_finetune.tasks.task import HeadKind, Task

STEPS = 3
NO_SKIP = lambda *_: False  # noqa: E731


def config(**changes) -> Config:
    # Clipping at 0.5 so that it acts; no weight decay, so that a plain AdamW over all parameters is the reference.
    return Config.from_flat(dict(lr=1e-2, weight_decay=0.0, max_grad_norm=0.5, **changes))


def torch_updates(model, layout, settings: Config, precision: str = "fp32") -> TorchUpdates:
    """engine=torch's updates of a whole (unsplit) model, with the `training` and `parallel` sections of `settings`."""
    return TorchUpdates(
        model, layout, Parallelized(), training=settings.training, parallel=settings.parallel, precision=precision
    )


def tiny_classifier() -> GPT2ForSequenceClassification:
    torch.manual_seed(0)
    model_config = GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, num_labels=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2ForSequenceClassification(model_config)


def batches() -> list[Batch]:
    """STEPS right-padded batches of 4 rows of different lengths."""
    generator = torch.Generator().manual_seed(1)
    result = []
    for _ in range(STEPS):
        lengths = torch.tensor([8, 5, 7, 3])
        mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, 50, (4, 8), generator=generator) * mask
        labels = torch.randint(0, 2, (4,), generator=generator)
        result.append(Batch(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), labels))
    return result


def reference_training() -> tuple[torch.nn.Module, list[float]]:
    """Plain torch: mean cross-entropy over whole batches, clip_grad_norm_, AdamW."""
    model = tiny_classifier()
    settings = config()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=tuple(settings.adam_betas),
        eps=settings.adam_eps,
        weight_decay=0.0,
        fused=True,
    )
    losses = []
    for batch in batches():
        mask = batch.attention_mask
        logits = model(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
        loss = F.cross_entropy(logits, batch.labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo process group and its Layout in this pytest process; the environment is restored after."""
    from parallel_finetune.parallel.layout import init_distributed

    saved = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    layout = init_distributed("cpu", 1)
    try:
        yield layout
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def test_loss_scaler_halves_and_skips_on_overflow_and_grows_after_clean_steps():
    scaler = DynamicLossScaler(True, initial_scale=1024.0, growth_interval=2)
    assert scaler.update(found_nonfinite=True) and scaler.scale == 512.0
    assert not scaler.update(False) and scaler.scale == 512.0 and scaler.clean_steps == 1
    assert not scaler.update(False) and scaler.scale == 1024.0 and scaler.clean_steps == 0
    off = DynamicLossScaler(False, initial_scale=1024.0, growth_interval=2)
    assert off.scale == 1.0 and not off.update(True) and off.scale == 1.0


def test_causal_lm_labels_are_the_next_real_tokens_and_the_count_is_predicted_tokens():
    ids, mask = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1, 1, 1, 0]])
    labels = next_token_labels(ids, mask)
    assert labels.tolist() == [[6, 7, IGNORE, IGNORE]]  # aligned with the logits: no shift in the loss
    lm = TokenizedSplit(HeadKind.CAUSAL_LM, [[1, 2, 3], [1, 2, 3, 4, 5]], [3, 5], [2, 4])
    classes = TokenizedSplit(HeadKind.CLASSIFICATION, [[1, 2, 3], [1, 2, 3, 4, 5]], [3, 5], [1, 1], labels=[0, 1])
    assert lm.loss_count([0, 1]) == 6 and classes.loss_count([0, 1]) == 2
    logits = torch.randn(1, 4, 9)
    expected = F.cross_entropy(logits[0, :2], torch.tensor([6, 7]), reduction="sum")
    assert torch.allclose(token_loss(logits, labels), expected)
    # the loss is the head's, chosen by the task: no shapes are read
    assert objective_for(Task.language_model("custom", "text")) is TOKEN_OBJECTIVE
    assert objective_for(Task.of_glue(TASKS["stsb"])) is REGRESSION_OBJECTIVE
    assert objective_for(Task.of_glue(TASKS["sst2"])) is CLASS_OBJECTIVE
    assert TOKEN_OBJECTIVE(logits, labels)[0] == token_loss(logits, labels) and TOKEN_OBJECTIVE(logits, labels)[1] == {}


def test_reduce_norm_and_loss_in_a_world_of_one(world_of_one):
    pieces = [(torch.tensor([3.0, 4.0]), 1), (torch.tensor([12.0]), 1)]
    norm, loss, stop = reduce_norm_and_loss(pieces, torch.tensor(2.5), 1, 1, stop_requested=True)
    assert norm == pytest.approx(13.0) and loss == pytest.approx(2.5) and stop
    overflow = reduce_norm_and_loss([(torch.tensor([math.inf]), 1)], torch.tensor(0.0), 1, 1)[0]
    assert not math.isfinite(overflow)


def test_whole_model_slices_give_the_whole_batch_mean_loss_and_gradient(world_of_one):
    batch = batches()[0]
    model = tiny_classifier()
    backward = lambda loss, last: loss.backward()  # noqa: E731
    runner = WholeModel(
        model, HeadKind.CLASSIFICATION, CLASS_OBJECTIVE, contextlib.nullcontext, backward, False, world_of_one.device
    )
    halves = [
        Batch(batch.input_ids[rows], batch.attention_mask[rows], batch.positions[rows], batch.labels[rows])
        for rows in (slice(0, 3), slice(3, 4))
    ]
    total = sum(runner.train(half, count=4, last=True)[0].item() for half in halves)
    sliced = {name: param.grad.clone() for name, param in model.named_parameters()}

    reference = tiny_classifier()
    mask = batch.attention_mask
    logits = reference(batch.input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    mean = F.cross_entropy(logits, batch.labels)
    mean.backward()
    assert total == pytest.approx(mean.item(), abs=1e-6)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(sliced[name], param.grad, atol=1e-6, rtol=1e-5)


def train(model, updates, runner) -> list[float]:
    losses = []
    for batch in batches():
        local, _ = runner.train(batch, count=len(batch.labels), last=True)
        losses.append(updates.step(local, False, NO_SKIP).loss)
    return losses


def test_torch_updates_equal_plain_adamw_with_clipping(world_of_one):
    model = tiny_classifier()
    updates = torch_updates(model, world_of_one, config())
    device = world_of_one.device
    runner = WholeModel(
        model, HeadKind.CLASSIFICATION, CLASS_OBJECTIVE, contextlib.nullcontext, updates.backward, False, device
    )
    losses = train(model, updates, runner)
    reference, reference_losses = reference_training()
    assert losses == pytest.approx(reference_losses, abs=1e-6)
    weights = dict(model.named_parameters())
    # Adam divides by sqrt(v): a 1e-9 difference in a near-zero gradient moves that weight by up to ~lr * 1e-3.
    for name, param in reference.named_parameters():
        torch.testing.assert_close(weights[name], param, atol=2e-5, rtol=1e-5)
    assert updates.adam_step == STEPS
    measured = updates.state_bytes()
    parameters = sum(p.numel() * 4 for p in model.parameters())
    assert measured["params"] == parameters and measured["optimizer"] == 2 * parameters


def test_an_fp16_overflow_skips_the_update_halves_the_scale_and_keeps_the_weights(world_of_one):
    model = tiny_classifier()
    updates = torch_updates(model, world_of_one, config(initial_loss_scale=1024.0), "fp16")
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    logits = model(batches()[0].input_ids).logits
    updates.backward((logits * math.inf).sum())
    outcome = updates.step(torch.tensor(1.0), False, NO_SKIP)
    assert outcome.skipped and outcome.grad_norm is None and outcome.loss_scale == 1024.0
    assert updates.loss_scale == 512.0 and updates.adam_step == 0
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    # nothing left over for the next step (embedding tables keep a zeroed gradient buffer: sparse_embedding_gradients)
    assert all(param.grad is None or not param.grad.any() for param in model.parameters())
    assert any(param.grad is not None for param in model.parameters()) == bool(updates.adamw.embedding_grads)


def training_state(layout, folder_config: Config, step: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    model = tiny_classifier()
    updates = torch_updates(model, layout, folder_config)
    runner = WholeModel(
        model, HeadKind.CLASSIFICATION, CLASS_OBJECTIVE, contextlib.nullcontext, updates.backward, False, layout.device
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(updates.optimizer, lambda s: 1.0 / (1 + s))
    for batch in batches()[:step]:
        updates.step(runner.train(batch, count=4, last=True)[0], False, NO_SKIP)
        scheduler.step()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")))
    return checkpoint.TrainingState(
        step, model, updates, scheduler, folder_config.to_dict(), tokenizer, layout, "gpt2",
        parameter_shapes(model),
    )  # fmt: skip


def test_a_checkpoint_written_and_read_back_restores_every_part(world_of_one, tmp_path):
    settings = config(output_dir=str(tmp_path))
    written = training_state(world_of_one, settings, step=2)
    folder = checkpoint.save(written, tmp_path / "checkpoints")
    assert folder == tmp_path / "checkpoints" / "step-00000002" and integrity.verify(folder) is None
    after_save = torch.rand(3)  # the RNG stream continues from the saved state

    fresh = training_state(world_of_one, settings, step=0)
    assert checkpoint.load(fresh, folder) == 2
    assert torch.equal(torch.rand(3), after_save)
    weights = dict(fresh.model.named_parameters())
    for name, param in written.model.named_parameters():
        assert torch.equal(weights[name], param), name
    moments, expected = fresh.updates.moment_tensors(), written.updates.moment_tensors()
    assert all(torch.equal(moments[n][k], expected[n][k]) for n in expected for k in expected[n])
    assert fresh.updates.adam_step == 2 and fresh.scheduler.last_epoch == 2
    assert fresh.scheduler.get_last_lr() == pytest.approx(written.scheduler.get_last_lr())


def test_a_checkpoint_between_a_rollouts_iterations_keeps_it(world_of_one, tmp_path, caplog):
    """task=grpo, num_iterations 2: a checkpoint of step 1 holds the rollout step 2 trains on again (rollout.json,
    rank 0's, in the manifest) and loading gives it back to the step source; a damaged one is refused in one line
    before anything is restored; one missing (a checkpoint from before they were kept) is said, and the next step
    samples."""
    from test_grpo import kept_stage

    settings = config(output_dir=str(tmp_path))
    written = training_state(world_of_one, settings, step=1)
    written.step_source = kept_stage()
    folder = checkpoint.save(written, tmp_path / "checkpoints")
    assert "rollout.json" in json.loads((folder / "manifest.json").read_text())["files"]
    fresh = training_state(world_of_one, settings, step=0)
    fresh.step_source = kept_stage()
    fresh.step_source.kept = None
    assert checkpoint.load(fresh, folder) == 1
    expected = written.step_source.kept[1]
    assert fresh.step_source.kept[0] == 1 and fresh.step_source.kept[1][0].split == expected[0].split

    kept = json.loads((folder / "rollout.json").read_text())
    for damage, refusal in (
        (lambda: (folder / "rollout.json").write_text(json.dumps(kept | {"sampled_step": 2})), "sampled_step is 2"),
        (lambda: (folder / "rollout.json").write_text("{"), "rollout.json unreadable (JSONDecodeError)"),
    ):
        damage()
        integrity.write_manifest(folder, integrity.describe(folder, integrity.files_in(folder)))
        fresh.step_source.kept = None
        with pytest.raises(integrity.Refused, match=re.escape(refusal)):
            checkpoint.load(fresh, folder)
        assert fresh.step_source.kept is None
    (folder / "rollout.json").unlink()
    integrity.write_manifest(folder, integrity.describe(folder, integrity.files_in(folder)))
    fresh.step_source.kept = (1, None)
    with caplog.at_level("WARNING"):
        assert checkpoint.load(fresh, folder) == 1
    assert "holds no rollout.json (written before checkpoints kept the rollout): step 2 samples" in caplog.text
    assert fresh.step_source.kept is None


def test_a_checkpoint_that_cannot_be_written_is_a_warning_and_the_previous_one_stays(world_of_one, tmp_path, caplog):
    settings = config(output_dir=str(tmp_path))
    root = tmp_path / "checkpoints"
    first = checkpoint.save(training_state(world_of_one, settings, step=1), root)
    (root / ".tmp-step-00000002").write_text("a file where the next checkpoint's folder must go")
    with caplog.at_level("WARNING"):
        assert checkpoint.save(training_state(world_of_one, settings, step=2), root) is None
    assert "checkpoint at step 2 not written" in caplog.text
    assert integrity.verify(first) is None and not (root / "step-00000002").exists()


def test_two_data_parallel_ranks_update_like_one_process_on_whole_batches(tmp_path):
    ranks = harness.run_ranks(2, ["tests/workers/updates_two_ranks.py"], subprocess_env(), REPO, timeout_s=300)
    assert ranks.returncode == 0, ranks.report()
    result = json.loads(ranks.ranks[0].stdout.strip().splitlines()[-1])
    assert result["losses"] == pytest.approx(result["reference_losses"], abs=1e-6)
    assert result["weight_difference"] < 2e-5
    assert result["norm"] == pytest.approx(result["expected_norm"]) and result["loss"] == pytest.approx(1.0)
    assert result["stop"]  # rank 1 asked to stop: both know


def test_data_parallel_gradients_are_summed_while_the_backward_runs():
    """8 buckets of one layer each: every all-reduce is launched (`c10d::allreduce_` in the profiler's events)
    before the backward ends and gloo is already moving bytes (`gloo:all_reduce`) while it runs; the sums equal
    one all-reduce after the backward bit for bit."""
    ranks = harness.run_ranks(2, ["tests/workers/overlap_two_ranks.py"], subprocess_env(), REPO, timeout_s=300)
    assert ranks.returncode == 0, ranks.report()
    result = json.loads(ranks.ranks[0].stdout.strip().splitlines()[-1])
    assert result["buckets"] == result["launches"] == 8
    assert result["launched_before_backward_end"] == 8
    assert result["profiled_launches"] == result["profiled_launches_before_backward_end"] == 8
    assert result["transfers"] == 8 and result["transfers_started_before_backward_end"] >= 1
    assert result["equal"]


# --- issue 27: parallel degrees and modes as one object; typed interfaces in leaf modules; no upward import
PACKAGE = REPO / "src" / "parallel_finetune"
THE_LOOP = {"loop", "model.load", "outputs.checkpoint", "train", "preflight", "selftest"}  # loop: all of loop/


def in_the_loop(name: str) -> bool:
    return name in THE_LOOP or name.split(".")[0] in THE_LOOP


def package_imports(path, types: bool = True) -> set[str]:
    """The package modules `path` imports, anywhere in it (function-level imports too), as dotted names below
    parallel_finetune ("parallel.zero", "updates"); `from . import x` counts as the module x. types=False: only
    what runs, not the imports under `if TYPE_CHECKING:` (names for annotations)."""
    import ast
    from pathlib import PurePosixPath

    package = list(PurePosixPath(path.relative_to(PACKAGE)).parts[:-1])  # where `.` points
    tree = ast.parse(path.read_text())
    if not types:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif (node.module or "").startswith("parallel_finetune"):
                target = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # `from ..model import lora`: the module model.lora
                module = [*target, alias.name]
                is_module = (
                    PACKAGE.joinpath(*module).with_suffix(".py").is_file()
                    or (PACKAGE.joinpath(*module) / "__init__.py").is_file()
                )
                found.add(".".join(module) if is_module or not node.module else ".".join(target))
        elif isinstance(node, ast.Import):
            found.update(".".join(a.name.split(".")[1:]) for a in node.names if a.name.startswith("parallel_finetune."))
    return {name for name in found if name}


def test_no_import_runs_back_up_the_graph():
    """interfaces.py is a leaf; parallel/, layout.py and families/ import nothing of the loop; the two
    implementations of each interface do not import each other's modules (DeepSpeedUpdates once took StepOutcome
    from updates.py, model.py its ZeRO-1 optimizer)."""
    assert package_imports(PACKAGE / "interfaces.py") == set()
    lower = [*(PACKAGE / "parallel").glob("*.py"), *(PACKAGE / "families").glob("*.py")]
    for path in lower:
        upward = {name for name in package_imports(path) if in_the_loop(name)}
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}: an edge back up the graph"
    assert not package_imports(PACKAGE / "model" / "load.py") & {"loop.updates", "loop.runner", "loop.trainer"}
    assert not package_imports(PACKAGE / "loop" / "runner.py") & {"loop.updates", "loop.trainer"}
    assert not package_imports(PACKAGE / "loop" / "updates.py") & {
        "loop.runner",
        "loop.trainer",
        "parallel.deepspeed_engine",
    }


def test_no_module_imports_another_modules_private_names():
    """A module uses another's public API only (export.py once took runfolder's _alive, _holder, _read_holder)."""
    import ast

    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("parallel_finetune")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.relative_to(PACKAGE)} imports {private} from {node.module or '.'}"


def test_families_hold_no_hub_code():
    """Where a model's files come from (a folder, package:, the Hub) is hub.py's; families/ only call
    resolve_model_path (they once held the download itself)."""
    import ast

    hub_names = {"download_model", "resolve_model_path", "check_model_source", "fetch_model", "HUB_FILES"}
    for path in (PACKAGE / "families").glob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {
            t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if hasattr(t, "id")
        }
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not defined & hub_names, f"families/{path.name} defines {sorted(defined & hub_names)}"
        assert not any(name.startswith("huggingface_hub") for name in imported), f"families/{path.name}"


def test_no_checkpoint_function_is_over_80_lines():
    """checkpoint.py is save, load, verify and pick in plain functions (save was one of 103 lines with seven
    nested closures)."""
    import ast

    tree = ast.parse((PACKAGE / "outputs" / "checkpoint.py").read_text())
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert max(lengths.values()) <= 80, {name: lines for name, lines in lengths.items() if lines > 80}


def test_the_checkpoint_manager_writes_on_its_cadence_and_keeps_the_newest_recorded(world_of_one, tmp_path, caplog):
    """CheckpointManager (checkpointer.py) decides when a checkpoint is written: every checkpoint_every steps, at
    the last step and at a stop; none after a non-finite step (no state made, no time counted); after each one,
    rank 0 keeps the newest keep_checkpoints that runs recorded, and leaves a step folder on no record alone."""
    from parallel_finetune.loop.checkpointer import CheckpointManager
    from parallel_finetune.outputs.reporting import PhaseTimer

    settings = config(output_dir=str(tmp_path), checkpoint_every=2, keep_checkpoints=2)
    root, timer = tmp_path / "checkpoints", PhaseTimer()
    states = []

    def state(step):
        states.append(step)
        return training_state(world_of_one, settings, step)

    manager = CheckpointManager(root, checkpoint=settings.checkpoint, enabled=True, timer=timer, state=state)
    assert [step for step in range(1, 8) if manager.due(step, 7, stopping=False)] == [2, 4, 6, 7]
    assert manager.due(3, 7, stopping=True)
    deepspeed_run = CheckpointManager(root, checkpoint=settings.checkpoint, enabled=False, timer=timer, state=state)
    assert not deepspeed_run.due(2, 7, stopping=True)  # updates that cannot be checkpointed
    assert deepspeed_run.resume(output=settings.output) == 0 and not states
    with caplog.at_level("WARNING"):
        assert manager.save(2, [1, 2]) is None
    assert not states, "no state made for a refused checkpoint"
    assert "checkpoint at step 2 not written: the loss or gradient norm of step 2 was not finite" in caplog.text
    assert "checkpoint" not in timer.seconds
    (root / "step-00000001").mkdir(parents=True)  # someone else's: on no record
    for step in (2, 4, 6):
        written = manager.save(step, [])
        assert written == root / f"step-{step:08d}"
    assert states == [2, 4, 6]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001", "step-00000004", "step-00000006"]
    assert timer.seconds["checkpoint"] > 0


# --- issue 35: the Trainer is the loop; the run is assembled in builder.py; no function takes more than 8 inputs
def test_no_function_takes_more_than_eight_parameters():
    """Eight at most (`self`/`cls` not counted): more travel together as a dataclass (RunRecord, Placement,
    Workload, PipelineSettings, SageMakerJob), or are derived where they are needed."""
    import ast

    crowded = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]
                count = len(names) - (1 if args.args and args.args[0].arg in ("self", "cls") else 0)
                if count > 8:
                    crowded.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({count})")
    assert not crowded


def test_no_function_in_src_is_over_80_lines():
    """A function that grows past 80 lines is split into named steps (checkpoint.save was 103 lines with seven
    nested closures, load_model 121)."""
    import ast

    long = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, long


def test_the_sharding_mode_is_asked_by_name_not_compared_as_a_string():
    """No src module compares `sharding` with "none" | "optimizer" | "full" | "hybrid": they ask ParallelDims or
    Sharding (config/sections.py's Literal declares the values)."""
    import ast

    modes = {"none", "optimizer", "full", "hybrid"}

    def mentions_sharding(node) -> bool:
        return any("sharding" in getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node))

    def strings(node) -> set:
        elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}

    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        and any(map(mentions_sharding, [node.left, *node.comparators]))
        and any(strings(side) & modes for side in [node.left, *node.comparators])
    ]
    assert not found, found


def test_the_head_kind_is_asked_of_the_task_not_compared_as_a_string():
    """No src module compares a task, head or problem type with "classification" | "causal_lm" | "regression" (or
    CAUSAL_LM, CLASSIFICATION, REGRESSION): they ask the Task (`task.head`, a HeadKind; `task.regression`), except
    tasks/task.py and the kinds (tasks/kinds/), which answer those questions from the problem_type."""
    import ast

    words = {"classification", "causal_lm", "regression", "single_label_classification"}
    constants = {"CAUSAL_LM", "CLASSIFICATION", "REGRESSION"}

    def mentions_the_head(node) -> bool:
        named = (getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node))
        return any(name in ("task", "head", "kind") or "problem_type" in name for name in named)

    def head_words(node) -> set:
        elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        found = {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)} & words
        return found | {e.id for e in elements if isinstance(e, ast.Name)} & constants

    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "tasks" / "task.py" and PACKAGE / "tasks" / "kinds" not in path.parents
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        and any(map(mentions_the_head, [node.left, *node.comparators]))
        and any(head_words(side) for side in [node.left, *node.comparators])
    ]
    assert not found, found


def test_the_tasks_package_is_a_short_face_over_small_modules():
    """tasks/__init__.py is load_task and the names other modules import; no function in tasks/ runs past 80 lines;
    tasks/ imports nothing of the package but errors.py (the loop, data.py and predict.py import it, not back), and
    config/sections.py's sections for their types only (under TYPE_CHECKING: no edge at run time)."""
    import ast

    folder = PACKAGE / "tasks"
    assert len((folder / "__init__.py").read_text().splitlines()) < 60
    for path in folder.glob("*.py"):
        long = [
            f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80
        ]
        assert not long, f"{path.relative_to(PACKAGE)}: {long}"
        running = package_imports(path, types=False)
        outside = {name for name in running if name != "errors" and not name.startswith("tasks.")}
        assert not outside, f"{path.relative_to(PACKAGE)} imports {sorted(outside)}"
        typed = package_imports(path) - running
        assert typed <= {"config"}, f"{path.relative_to(PACKAGE)} imports {sorted(typed)} for types"


def config_takers(paths, sections: set[str], sole_positional: bool = False) -> list[str]:
    """Functions in `paths` that take the whole Config (a parameter named `config` or typed Config), or one of
    `sections` positionally (`sole_positional`: allowed where it is the function's only parameter)."""
    import ast

    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
            positional = [a for a in [*node.args.posonlyargs, *node.args.args] if a.arg not in ("self", "cls")]
            arguments = [*positional, *node.args.kwonlyargs]
            for argument in arguments:
                kind = ast.unparse(argument.annotation) if argument.annotation is not None else None
                if argument.arg == "config" or kind == "Config":
                    found.append(f"{where} takes the Config ({argument.arg})")
                elif kind in sections and argument in positional and not (sole_positional and len(arguments) == 1):
                    found.append(f"{where}: {argument.arg} is positional")
    return found


def test_the_data_side_receives_its_sections_not_the_config():
    """tasks/ and data.py take the sections they read (`data: DataSection`, `model: ModelSection`) and resolved
    values, keyword-only; none takes the whole Config (only entry points, resolve.py and preflight.py do)."""
    paths = [*(PACKAGE / "tasks").glob("*.py"), *(PACKAGE / "data").glob("*.py")]
    found = config_takers(paths, {"DataSection", "ModelSection"})
    assert not found, found


def test_the_parallel_side_receives_its_sections_not_the_config():
    """parallel/, updates.py, lora.py and model.py take the sections they read (`training: TrainingSection`,
    `parallel: ParallelSection`, `peft: PeftSection`; a run's Placement carries those of the split) and resolved
    values (precision, dtypes, micro-batches), keyword-only but for a one-parameter `AdamWSettings.of(training)`;
    none takes the whole Config."""
    names = ("loop/updates.py", "model/lora.py", "model/load.py")
    paths = [*(PACKAGE / "parallel").glob("*.py"), *(PACKAGE / name for name in names)]
    sections = {"TrainingSection", "ParallelSection", "MemorySection", "PeftSection", "ModelSection"}
    found = config_takers(paths, sections, sole_positional=True)
    assert not found, found


def test_the_outputs_side_receives_its_sections_not_the_config():
    """checkpoint.py, checkpointer.py, runfolder.py, export.py and families/ take the sections they read
    (`checkpoint: CheckpointSection`, `output: OutputSection`, `model: ModelSection`, ...), the flat settings a
    checkpoint records and compares, and resolved values (`resolved: Resolved`: the export dtype, the model's
    name), keyword-only; none takes the whole Config, and TrainingState holds none."""
    import ast

    found = []
    paths = [*(PACKAGE / "outputs").glob("*.py"), "loop/checkpointer.py", *(PACKAGE / "families").glob("*.py")]
    for path in [PACKAGE / name for name in paths]:
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PACKAGE)}:{node.lineno if hasattr(node, 'lineno') else 0}"
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "config":
                found.append(f"{where} holds a config")
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            positional = [*node.args.posonlyargs, *node.args.args]
            for argument in [*positional, *node.args.kwonlyargs]:
                kind = ast.unparse(argument.annotation) if argument.annotation is not None else ""
                if kind == "Config" or (argument.arg == "config" and not kind):  # a PretrainedConfig is no recipe
                    found.append(f"{where} {node.name} takes the Config ({argument.arg})")
                elif (kind.endswith("Section") or kind == "Resolved") and argument in positional:
                    found.append(f"{where} {node.name}: {argument.arg} is positional")
    assert not found, found


def test_parallel_dims_resolve_each_mode_once_and_answer_by_name():
    from parallel_finetune.errors import UserError
    from parallel_finetune.parallel.layout import ParallelDims, Sharding, resolve_dims

    # 16 processes, 8 per node, tp=2: 8 data-parallel ranks, split as each mode says
    none, zero1, full, hybrid = (resolve_dims(16, 8, 2, mode, None) for mode in ("none", "optimizer", "full", "hybrid"))
    assert (none.dp_replicate, none.dp_shard) == (zero1.dp_replicate, zero1.dp_shard) == (8, 1)
    assert (full.dp_replicate, full.dp_shard) == (1, 8) and (hybrid.dp_replicate, hybrid.dp_shard) == (2, 4)
    assert [d.dp for d in (none, zero1, full, hybrid)] == [8] * 4 and hybrid.world_size == 16
    assert [(d.sharded, d.zero1, d.fsdp, d.hybrid) for d in (none, zero1, full, hybrid)] == [
        (False, False, False, False),
        (True, True, False, False),
        (True, False, True, False),
        (True, False, True, True),
    ]
    assert [d.optimizer_shards for d in (none, zero1, full, hybrid)] == [1, 8, 8, 4]
    assert hybrid.dp_replicate_enabled and hybrid.dp_shard_enabled and hybrid.tp_enabled and not hybrid.pp_enabled
    assert not full.dp_replicate_enabled and full.dp_shard_enabled and not none.dp_shard_enabled
    # FSDP is the mode, not a degree: sharding=full on one process still applies it
    single = resolve_dims(1, 1, 1, "full", None)
    assert single.fsdp and not single.dp_shard_enabled and not single.dp_enabled
    assert resolve_dims(8, 8, 1, "hybrid", 2, pp=2).pp_enabled
    # the config's value, typed: equal to its string, shown as it, and nothing else is one
    assert full.sharding is Sharding.FULL and Sharding.FULL == "full" and f"{Sharding.HYBRID}" == "hybrid"
    assert ParallelDims(4, 1, 1, 1, "optimizer").zero1
    assert ParallelDims.split(4, 1, 1, "hybrid", 2) == ParallelDims(2, 2, 1, 1, Sharding.HYBRID)
    with pytest.raises(UserError, match="sharding='zero2' is not valid; expected none, optimizer, full, hybrid"):
        resolve_dims(2, 2, 1, "zero2", None)


def test_each_implementation_has_its_interfaces_signatures():
    """Runner: WholeModel, Pipeline; Updates: TorchUpdates, DeepSpeedUpdates; one `full_state_dict` signature,
    and `checkpointable` true exactly where the checkpoint methods exist."""
    import inspect

    from parallel_finetune.interfaces import CheckpointableUpdates, Runner, Updates
    from parallel_finetune.parallel.deepspeed_engine import DeepSpeedUpdates
    from parallel_finetune.parallel.pipeline import Pipeline

    def methods(protocol) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(member).parameters)
            for name, member in vars(protocol).items()
            if inspect.isfunction(member) and not name.startswith("_")
        }

    for protocol, implementations in ((Runner, (WholeModel, Pipeline)), (Updates, (TorchUpdates, DeepSpeedUpdates))):
        for implementation in implementations:
            for name, parameters in methods(protocol).items():
                assert list(inspect.signature(getattr(implementation, name)).parameters) == parameters, (
                    implementation.__name__,
                    name,
                )
    extra = methods(CheckpointableUpdates)
    for implementation in (TorchUpdates, DeepSpeedUpdates):
        assert implementation.checkpointable == all(hasattr(implementation, name) for name in extra)
    assert TorchUpdates.checkpointable and not DeepSpeedUpdates.checkpointable


def test_torch_updates_are_checkpointable_updates(world_of_one):
    from parallel_finetune.interfaces import CheckpointableUpdates, Runner

    model = tiny_classifier()
    updates = torch_updates(model, world_of_one, config())
    device = world_of_one.device
    runner = WholeModel(
        model, HeadKind.CLASSIFICATION, CLASS_OBJECTIVE, contextlib.nullcontext, updates.backward, False, device
    )
    assert isinstance(updates, CheckpointableUpdates) and isinstance(runner, Runner)
    assert runner.pad_multiple == 1  # data.pad_to_multiple_of's default: each batch as long as its longest row


@pytest.mark.parametrize("requested,padded", [(1, 8), (8, 8), (3, 24), (16, 16)])
def test_a_pipeline_pads_to_a_multiple_of_8_and_of_pad_to_multiple_of(requested, padded):
    """Its receive buffers have fixed shapes (one schedule per shape), so at least 8; a requested step is kept."""
    from types import SimpleNamespace

    from parallel_finetune.parallel.pipeline import Pipeline, PipelineSettings

    settings = PipelineSettings("1f1b", 2, HeadKind.CLASSIFICATION, CLASS_OBJECTIVE, pad_multiple=requested)
    layout = SimpleNamespace(pp=2, pp_rank=0)
    pipeline = Pipeline(None, None, [], layout, settings, contextlib.nullcontext, lambda: 1.0)
    assert pipeline.pad_multiple == padded


def test_a_recipe_is_resolved_once_into_the_values_components_receive():
    """resolve.py: `model` falls back to the family's default once (None at size=tiny), `microbatches` to 2 per
    stage, precision `auto` to the device's, dtypes from the names; the trackers get them beside the config."""
    from parallel_finetune.model.precision import cpu_has_bf16
    from parallel_finetune.parallel.layout import ParallelDims
    from parallel_finetune.resolve import load_config, resolve

    dims = ParallelDims(1, 2, 1, 2, "optimizer")
    full = resolve(load_config(REPO / "recipes/llama/pp.yaml", ["export_dtype=bfloat16"]), torch.device("cpu"), dims)
    assert full.model_name == "meta-llama/Llama-3.1-8B" and full.family.name == "llama"
    assert full.microbatches == 4 and full.export_dtype == torch.bfloat16
    assert full.precision == ("bf16" if cpu_has_bf16() else "fp32")  # auto, decided for this CPU
    tiny = resolve(
        load_config(REPO / "recipes/gptj/pp.yaml", ["size=tiny", "microbatches=6", "precision=fp32"]),
        torch.device("cpu"),
        dims,
    )
    assert tiny.model_name is None and tiny.microbatches == 6
    assert tiny.compute_dtype == torch.float32 and tiny.autocast_dtype is None
    assert tiny.as_params() == {
        "resolved.model": None,
        "resolved.precision": "fp32",
        "resolved.degrees": {"pp": 2, "dp": 2, "tp": 1},
        "resolved.sharding": "optimizer",
        "resolved.microbatches": 6,
    }


def test_a_small_held_out_split_or_a_short_run_is_said_with_the_count_and_what_to_change(tmp_path, cache_dir):
    """2 held-out pairs (an accuracy of 0, 0.5 or 1) or 3 steps ran silently; now one line each, with the count and
    the key to change: the held-out share where the split is drawn from train, the validation file where it is
    given; max_steps, or epochs where the run counts them. The shipped sample (64 held-out pairs) at 10 steps: none.
    (RunBuilder.build says them on rank 0 alone; conftest.assert_one_line_per_event counts the short run's.)"""
    from conftest import prepare_data
    from test_preference_data import dpo_config

    from parallel_finetune.loop.builder import small_run_warnings

    def pairs(name: str, count: int) -> str:
        path = tmp_path / name
        rows = [{"prompt": f"Film {i}:", "chosen": " good", "rejected": " bad"} for i in range(count)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        return str(path)

    carved = dpo_config(f"train_file={pairs('train.jsonl', 20)}", "max_steps=3", cache_dir=cache_dir)
    assert small_run_warnings(carved, prepare_data(carved), 3, 18) == [
        "the held-out split has 2 pairs: a metric over so few moves in steps of 1/2 and says little; raise "
        "validation_split_percentage (now 10% of the training rows) for at least 32",
        "the run trains 3 step(s) (max_steps=3): too few for its loss or metrics to show a trend; raise max_steps "
        "to 10 or more",
    ]
    given = dpo_config(
        f"train_file={tmp_path / 'train.jsonl'}", f"validation_file={pairs('dev.jsonl', 3)}", cache_dir=cache_dir
    )
    assert small_run_warnings(given, prepare_data(given), 10, 10) == [
        "the held-out split has 3 pairs: a metric over so few moves in steps of 1/3 and says little; give a "
        "validation split of more rows (validation_file=) for at least 32"
    ]
    sample = dpo_config("epochs=1", "batch_size=64", cache_dir=cache_dir)
    prepared = prepare_data(sample)
    assert small_run_warnings(sample, prepared, 10, 10) == []
    assert small_run_warnings(sample, prepared, 6, 6) == [
        "the run trains 6 step(s) (epochs=1 of 6 step(s) of batch_size 64): too few for its loss or metrics to show "
        "a trend; raise epochs (or give more training rows) for 10 steps or more"
    ]
