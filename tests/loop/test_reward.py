"""Reward modelling (task=reward): a one-process run on the shipped preference sample trains (its loss moves) and
writes TRL's metric names every step and held out; the loss is TRL's RewardTrainer formula (margin, centring);
bad rows are one line naming file:line; the exported model is a one-output sequence classifier transformers reads
(AutoModelForSequenceClassification and its pipeline), scoring as the run did; and a short run learns the sample
(held-out accuracy above 0.9)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from conftest import launch, recipe, tiny_overrides

from parallel_finetune.errors import UserError

STEP_METRICS = ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward")  # TRL's names
HELD_OUT = ("eval_loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def reward_overrides(sst2, cache_dir, family: str, *extra: str, **keys) -> list[str]:
    """A short fp32 reward run of a family's tiny model on the shipped preference sample, dropout off."""
    # loss_chunk_tokens at its default: a classifier has no language-model head to chunk, and refuses one set
    base = {"data_dir": "", "max_length": 128, "loss_chunk_tokens": 1024, **keys}
    return tiny_overrides(sst2, cache_dir, "reward", family, **base) + list(extra)


@pytest.fixture(scope="module")
def llama_run(sst2, cache_dir, tmp_path_factory):
    """One process, tiny Llama, 6 steps, exported (hf/)."""
    folder = tmp_path_factory.mktemp("reward-llama")
    return launch(1, reward_overrides(sst2, cache_dir, "llama", export="true"), folder, recipe=recipe("llama"))


def test_a_reward_run_trains_and_reports_trls_metrics(llama_run):
    records, summary = llama_run.records, llama_run.summary
    assert len(records) == 6 and records[0]["loss"] != records[-1]["loss"], "the loss must move"
    for record in records:
        assert all(math.isfinite(record[key]) for key in STEP_METRICS), record
        assert 0 <= record["accuracy"] <= 1 and record["min_reward"] <= record["mean_reward"] <= record["max_reward"]
    assert all(math.isfinite(summary[key]) for key in HELD_OUT) and summary["task"] == "reward"
    settings = yaml.safe_load((llama_run.output_dir / "config.yaml").read_text())
    assert settings["task"] == "reward" and "glue_task" not in settings
    assert json.loads((llama_run.output_dir / "labels.json").read_text())["problem_type"] == "reward"
    said = f"| accuracy {records[-1]['accuracy']:.3f} | margin {records[-1]['margin']:.4f}"
    assert any(line.startswith("step 6/6 |") and line.endswith(said) for line in llama_run.output.splitlines())
    assert "task=reward: " in llama_run.output and "task=dpo" not in llama_run.output


def test_the_export_is_a_one_output_classifier_that_scores_as_the_run(llama_run, cache_dir):
    """hf/ loads as AutoModelForSequenceClassification (one output, problem_type regression: transformers' pipeline
    returns the score as it is, no sigmoid); its scores of the held-out pairs give the run's held-out accuracy and
    margin."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    from parallel_finetune.data.prepare import load_prepared

    hf = llama_run.output_dir / "hf"
    model = AutoModelForSequenceClassification.from_pretrained(hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    (cache,) = cache_dir.glob("explicit-dpo-sample-*-reward-len128*")
    validation = load_prepared(cache, None).splits["validation"]
    wins, margins = [], []
    with torch.no_grad():
        for chosen, rejected in zip(validation["input_ids"], validation["rejected_ids"]):
            scores = [model(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids in (chosen, rejected)]
            wins.append(scores[0] > scores[1])
            margins.append(scores[0] - scores[1])
    summary = llama_run.summary
    assert sum(wins) / len(wins) == pytest.approx(summary["accuracy"], abs=1e-6)
    assert sum(margins) / len(margins) == pytest.approx(summary["margin"], abs=1e-5)
    text = "What is the last word of this sentence? a fine film"
    with torch.no_grad():
        raw = model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()
    scored = pipeline("text-classification", model=model, tokenizer=tokenizer)(text)[0]["score"]
    assert scored == pytest.approx(raw, abs=1e-5)


def test_the_export_scores_grpo_completions_as_a_reward_model(llama_run):
    """task=grpo's `model:<run>/hf` (rl/reward_model.py) reads the export as TRL's GRPOTrainer reads a reward
    model: the prompt's messages and the completion as the assistant's turn through the exported chat template, no
    special tokens added, the logit; its metric is named by the folder, as TRL's."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from parallel_finetune.rl.rewards import Rewards, RewardSettings

    hf = llama_run.output_dir / "hf"
    rewards = Rewards(RewardSettings((f"model:{hf}",)))
    prompts = [[{"role": "user", "content": "What is the last word of this sentence? a fine film"}]] * 3
    completions = ["film", "a fine film it is", "fine"]
    got = rewards.score(prompts, completions, [[1]] * 3, {})[:, 0].tolist()
    model = AutoModelForSequenceClassification.from_pretrained(hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    expected = []
    for prompt, completion in zip(prompts, completions):
        text = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}], tokenize=False)
        with torch.no_grad():
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
            expected.append(model(**ids).logits[0, 0].item())
    assert rewards.names == ["hf"] and got == pytest.approx(expected, abs=1e-5) and len(set(expected)) == 3


def test_the_loss_is_trls_formula_with_margin_and_centring():
    """-log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2 summed over pairs; metrics TRL's: the pairs' means, extremes."""
    from parallel_finetune.loop.reward_loss import RewardLoss

    logits = torch.tensor([[1.0], [0.5], [-0.2], [0.3], [2.0], [-1.0]])
    margins = torch.tensor([0.25, 0.25, 0.0, 0.0, 1.0, 1.0])
    loss = RewardLoss(0.01)
    total, stats = loss(logits, margins)
    chosen, rejected, m = torch.tensor([1.0, -0.2, 2.0]), torch.tensor([0.5, 0.3, -1.0]), torch.tensor([0.25, 0, 1])
    expected = (-torch.nn.functional.logsigmoid(chosen - rejected - m) + 0.01 * (chosen + rejected) ** 2).sum()
    assert total.item() == pytest.approx(expected.item(), abs=1e-6)
    metrics = loss.metrics(loss.sums([stats], "cpu"))
    assert metrics["loss"] == pytest.approx(expected.item() / 3, abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["margin"] == pytest.approx((0.5 - 0.5 + 3) / 3)
    assert metrics["mean_reward"] == pytest.approx(2.6 / 6) and (metrics["min_reward"], metrics["max_reward"]) == (
        -1.0,
        2.0,
    )


def _load(tmp_path, train_rows: list[dict], validation_rows: list[dict] | None = None):
    from parallel_finetune.config import DataSection, ModelSection
    from parallel_finetune.tasks import load_task

    files = {}
    for split, rows in (("train", train_rows), ("validation", validation_rows or train_rows)):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    data = DataSection(train_file=str(files["train"]), validation_file=str(files["validation"]))
    return load_task(data=data, model=ModelSection(task="reward", size="tiny"), seed=0, predict=False), files


PAIRS = [
    {"prompt": "Is it good? great film", "chosen": " yes", "rejected": " no", "margin": 0.5},
    {"prompt": "Is it good? dull film", "chosen": " no", "rejected": " yes", "margin": "1.5"},
]


def test_margins_are_read_as_numbers(tmp_path):
    (splits, task, _), _ = _load(tmp_path, PAIRS)
    assert task.problem_type == "reward" and task.columns[-1] == "margin"
    assert splits["train"]["margin"] == [0.5, 1.5]


def test_a_margin_that_is_not_a_number_names_its_line(tmp_path):
    rows = [*PAIRS, {"prompt": "Is it good? fine", "chosen": " yes", "rejected": " no", "margin": "a lot"}]
    with pytest.raises(UserError) as error:
        _load(tmp_path, rows)
    assert "train.jsonl:3" in str(error.value) and "'a lot', not a number" in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "missing,said",
    [({"rejected": ""}, "column 'rejected' is empty"), ({}, "lacks key(s) rejected")],
    ids=["empty", "absent"],
)
def test_a_row_missing_an_answer_names_its_line(tmp_path, missing, said):
    rows = [PAIRS[0], {"prompt": "Is it good? fine", "chosen": " yes", "margin": 0} | missing]
    with pytest.raises(UserError) as error:
        _load(tmp_path, rows)
    assert "train.jsonl:2: " in str(error.value) and said in str(error.value) and "\n" not in str(error.value)


def test_a_margin_in_one_split_only_is_refused(tmp_path):
    without = [{k: v for k, v in row.items() if k != "margin"} for row in PAIRS]
    with pytest.raises(UserError, match="validation.jsonl: no column 'margin'"):
        _load(tmp_path, PAIRS, without)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["task=reward", "dpo_beta=0.5"], "dpo_beta"),
        (["task=dpo", "center_rewards_coefficient=0.01"], "center_rewards_coefficient.*is task=reward's"),
        (["task=reward", "center_rewards_coefficient=-1"], "must be >= 0"),
        (["task=reward", "packing=true"], "packing"),
    ],
)
def test_keys_of_another_task_are_refused(overrides, message):
    from parallel_finetune.resolve import load_config

    with pytest.raises(UserError, match=message):
        load_config(recipe("llama"), ["size=tiny", *overrides])


def test_reward_learns_the_preference_sample(sst2, cache_dir, tmp_path):
    """A tiny Llama from scratch on the sample's 400 pairs, 200 steps of 16 pairs at lr 1e-3 (no warm-up): held-out
    accuracy 0.5 or so before (a random head), at least 0.9 at the end, the held-out margin grown."""
    run = launch(
        1,
        reward_overrides(sst2, cache_dir, "llama", max_steps=200, eval_every=100, warmup_ratio=0, lr="1e-3"),
        tmp_path / "learn",
        recipe=recipe("llama"),
    )
    halfway = json.loads((run.output_dir / "eval.jsonl").read_text().splitlines()[0])
    after = run.summary
    print(
        f"held-out accuracy: {halfway['accuracy']:.3f} at step 100, {after['accuracy']:.3f} at 200 (margin "
        f"{halfway['margin']:.3f}, {after['margin']:.3f}); step 1's batch: {run.records[0]['accuracy']:.3f}"
    )
    assert after["accuracy"] >= 0.9 and after["margin"] > 0


def test_predict_scores_pairs_as_the_run_did(llama_run, tmp_path):
    """scripts/predict.py on the run folder and the sample's held-out pairs: index, both scores and the preferred
    answer per pair, whose share of "chosen" is the run's held-out accuracy."""
    from parallel_finetune.tasks import PREFERENCE_SAMPLE_DIR
    from parallel_finetune.tools.inference import main

    out = tmp_path / "scores.tsv"
    assert main([str(llama_run.output_dir), str(PREFERENCE_SAMPLE_DIR / "validation.jsonl"), "--output", str(out)]) == 0
    header, *rows = out.read_text().splitlines()
    assert header == "index\tchosen\trejected\tpreferred" and len(rows) == 64
    preferred = [row.split("\t")[3] for row in rows]
    assert preferred.count("chosen") / 64 == pytest.approx(llama_run.summary["accuracy"], abs=1e-6)


def test_reward_recipes_have_make_and_sagemaker_targets(cache_dir, tmp_path):
    """make FAMILY-reward (-reward-lora, and their -sagemaker jobs) runs the recipe as the dpo targets do; a job
    without DATA reads the preference sample its code channel carries (only its tokenized cache is staged)."""
    from conftest import make_commands

    from parallel_finetune.resolve import load_config
    from parallel_finetune.sagemaker_job import stage_data

    for target, recipe_path in (
        ("llama-reward", "recipes/llama/reward.yaml"),
        ("qwen3-reward-lora", "recipes/qwen3/reward_lora.yaml"),
    ):
        commands = make_commands(target)
        assert any(recipe_path in command and "--check" in command for command in commands), commands
        (job,) = make_commands(f"{target}-sagemaker")
        assert job[1:3] == ["scripts/launch_sagemaker.py", recipe_path], job
    config = load_config("recipes/llama/reward.yaml", ["size=tiny", f"cache_dir={cache_dir}"])
    assert config.task == "reward" and config.family == "llama"
    keys, cache = stage_data(config, tmp_path / "training")
    assert keys == {} and "dpo-sample-" in cache and "-reward-" in cache
