"""Unit tests of the loop's seams, in this process on a gloo world of one (or two forked ranks): the loss and its
division, the loss scaler, the one step-wide reduction, `TorchUpdates` against plain torch, `WholeModel`, and a
checkpoint written and read back. The end-to-end parity tests prove the same things through whole runs; these
name the part that broke, in a second."""

from __future__ import annotations

import contextlib
import json
import math
import os

import harness
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import REPO, subprocess_env
from transformers import GPT2Config, GPT2ForSequenceClassification

from parallel_finetune import checkpoint, integrity
from parallel_finetune.config import Config
from parallel_finetune.loss import IGNORE, loss_count, summed_loss, targets
from parallel_finetune.parallel import Parallelized
from parallel_finetune.parallel.gradients import reduce_norm_and_loss
from parallel_finetune.precision import DynamicLossScaler
from parallel_finetune.runner import WholeModel
from parallel_finetune.updates import TorchUpdates

STEPS = 3
NO_SKIP = lambda *_: False  # noqa: E731


def config(**changes) -> Config:
    # Clipping at 0.5 so that it acts; no weight decay, so that a plain AdamW over all parameters is the reference.
    return Config(lr=1e-2, weight_decay=0.0, max_grad_norm=0.5, **changes)


def tiny_classifier() -> GPT2ForSequenceClassification:
    torch.manual_seed(0)
    model_config = GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, num_labels=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2ForSequenceClassification(model_config)


def batches() -> list[dict[str, torch.Tensor]]:
    """STEPS right-padded batches of 4 rows of different lengths."""
    generator = torch.Generator().manual_seed(1)
    result = []
    for _ in range(STEPS):
        lengths = torch.tensor([8, 5, 7, 3])
        mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, 50, (4, 8), generator=generator) * mask
        labels = torch.randint(0, 2, (4,), generator=generator)
        result.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
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
        mask = batch["attention_mask"]
        logits = model(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
        loss = F.cross_entropy(logits, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo process group and its Layout in this pytest process; the environment is restored after."""
    from parallel_finetune.layout import init_distributed

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


def test_causal_lm_targets_are_the_next_real_tokens_and_the_count_is_predicted_tokens():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    assert targets(batch, "causal_lm").tolist() == [[6, 7, IGNORE]]
    assert loss_count([3, 5], "causal_lm") == 6 and loss_count([3, 5], "classification") == 2
    logits = torch.randn(1, 4, 9)
    expected = F.cross_entropy(logits[0, :2], torch.tensor([6, 7]), reduction="sum")
    assert torch.allclose(summed_loss(logits, targets(batch, "causal_lm")), expected)


def test_reduce_norm_and_loss_in_a_world_of_one(world_of_one):
    pieces = [(torch.tensor([3.0, 4.0]), 1), (torch.tensor([12.0]), 1)]
    norm, loss, stop = reduce_norm_and_loss(pieces, torch.tensor(2.5), 1, 1, stop_requested=True)
    assert norm == pytest.approx(13.0) and loss == pytest.approx(2.5) and stop
    overflow = reduce_norm_and_loss([(torch.tensor([math.inf]), 1)], torch.tensor(0.0), 1, 1)[0]
    assert not math.isfinite(overflow)


def test_whole_model_slices_give_the_whole_batch_mean_loss_and_gradient(world_of_one):
    batch = batches()[0]
    model = tiny_classifier()
    runner = WholeModel(model, "classification", contextlib.nullcontext, lambda loss, last: loss.backward(), False,
                        world_of_one.device)  # fmt: skip
    halves = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 3), slice(3, 4))]
    total = sum(runner.train(half, count=4, last=True).item() for half in halves)
    sliced = {name: param.grad.clone() for name, param in model.named_parameters()}

    reference = tiny_classifier()
    mask = batch["attention_mask"]
    logits = reference(batch["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    mean = F.cross_entropy(logits, batch["labels"])
    mean.backward()
    assert total == pytest.approx(mean.item(), abs=1e-6)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(sliced[name], param.grad, atol=1e-6, rtol=1e-5)


def train(model, updates, runner) -> list[float]:
    losses = []
    for batch in batches():
        local = runner.train(batch, count=len(batch["labels"]), last=True)
        losses.append(updates.step(local, False, NO_SKIP).loss)
    return losses


def test_torch_updates_equal_plain_adamw_with_clipping(world_of_one):
    model = tiny_classifier()
    updates = TorchUpdates(model, world_of_one, config(), "fp32", Parallelized())
    runner = WholeModel(model, "classification", contextlib.nullcontext, updates.backward, False, world_of_one.device)
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
    updates = TorchUpdates(model, world_of_one, config(initial_loss_scale=1024.0), "fp16", Parallelized())
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    logits = model(batches()[0]["input_ids"]).logits
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
    updates = TorchUpdates(model, layout, folder_config, "fp32", Parallelized())
    runner = WholeModel(model, "classification", contextlib.nullcontext, updates.backward, False, layout.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(updates.optimizer, lambda s: 1.0 / (1 + s))
    for batch in batches()[:step]:
        updates.step(runner.train(batch, count=4, last=True), False, NO_SKIP)
        scheduler.step()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")))
    return checkpoint.TrainingState(
        step, model, updates, scheduler, folder_config, tokenizer, layout, "gpt2",
        checkpoint.parameter_shapes(model),
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
