"""KTO (task=kto): the loss is TRL's KTOTrainer formula (loss_type="kto") with its weights and KL estimate, by hand;
the KL rows pair each row's prompt with the previous row's completion in the global batch (TRL's rotation); the
metrics are TRL's names and means; bad rows and keys are one line naming file:line or the key; and a short run on
the shipped preference sample (unpaired) moves the held-out preference as DPO does."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import launch, recipe, tiny_overrides

from parallel_finetune.data.kto import kl_pairs
from parallel_finetune.errors import UserError
from parallel_finetune.loop.kto import KTO_METRICS, KTOObjective

EVALS = "eval.jsonl"
STEP_METRICS = ("loss", *KTO_METRICS[1:])  # TRL's names: kl, rewards/*, logps/*
HELD_OUT = ("eval_loss", *KTO_METRICS[1:])


def kto_overrides(sst2, cache_dir, family: str, *extra: str, **keys) -> list[str]:
    """A short fp32 KTO run of a family's tiny model on the shipped preference sample (unpaired), dropout off."""
    base = {"data_dir": "", "max_length": 128, "dpo_beta": 0.1, **keys}
    return tiny_overrides(sst2, cache_dir, "kto", family, **base) + list(extra)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_the_loss_is_trls_formula_by_hand():
    """Two desirable rows and one undesirable row, their tokens' NLL and reference sums given: each row's loss as
    TRL's KTOTrainer writes it, its weights and the KL estimate z, summed; the metrics are TRL's means per side."""
    preference = SimpleNamespace(dpo_beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    objective = KTOObjective(None, 0, preference=preference)
    objective.kl = 0.3
    # rows: 0 desirable (answer 0: 2 tokens), 1 undesirable (answer 3: 1 token), 2 desirable (answer 4: 1 token)
    nll = torch.tensor([0.5, 1.0, 2.0, 0.25])
    answers = [0, 0, 3, 4]
    reference = [-2.0, -2.0, -1.0, -0.5]
    target = torch.tensor([[7, a, r] for a, r in zip(answers, reference)], dtype=torch.float64)
    loss, stats = objective.answers_loss(nll, target)
    logps = [-1.5, -2.0, -0.25]
    ratios = [logps[0] + 2.0, logps[1] + 1.0, logps[2] + 0.5]
    by_hand = [
        2.0 * (1 - sigmoid(0.5 * (ratios[0] - 0.3))),
        0.5 * (1 - sigmoid(0.5 * (0.3 - ratios[1]))),
        2.0 * (1 - sigmoid(0.5 * (ratios[2] - 0.3))),
    ]
    assert loss.item() == pytest.approx(sum(by_hand), abs=1e-6)
    metrics = objective.metrics(objective.sums([stats], "cpu"))
    assert list(metrics) == list(KTO_METRICS)
    assert metrics["loss"] == pytest.approx(sum(by_hand) / 3, abs=1e-6) and metrics["kl"] == pytest.approx(0.3)
    chosen = (0.5 * ratios[0] + 0.5 * ratios[2]) / 2
    assert metrics["rewards/chosen"] == pytest.approx(chosen, abs=1e-6)
    assert metrics["rewards/rejected"] == pytest.approx(0.5 * ratios[1], abs=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(chosen - 0.5 * ratios[1], abs=1e-6)
    assert metrics["logps/chosen"] == pytest.approx((logps[0] + logps[2]) / 2) and metrics["logps/rejected"] == -2.0
    # a batch of one side only has no metric of the other, nor a margin (as TRL's log)
    only = objective.metrics(objective.sums([{k: v[[0]] for k, v in stats.items()}], "cpu"))
    assert "rewards/rejected" not in only and "rewards/margins" not in only and "rewards/chosen" in only


def test_kl_rows_rotate_the_global_batch_as_trl():
    """TRL's KL completions: [completion_{n-1}] + completions[:-1] over the batch: row j's prompt with row j-1's."""
    assert kl_pairs([5, 2, 9]) == [(5, 9), (2, 5), (9, 2)]


def _load(tmp_path, train_rows: list[dict], validation_rows: list[dict] | None = None, suffix: str = "jsonl"):
    from parallel_finetune.config import DataSection, ModelSection
    from parallel_finetune.tasks import load_task

    files = {}
    for split, rows in (("train", train_rows), ("validation", validation_rows or train_rows)):
        files[split] = tmp_path / f"{split}.{suffix}"
        if suffix == "jsonl":
            text = "".join(json.dumps(row) + "\n" for row in rows)
        else:  # csv: every cell text
            text = "prompt,completion,label\n" + "".join(
                f"{r['prompt']},{r['completion']},{r['label']}\n" for r in rows
            )
        files[split].write_text(text, encoding="utf-8")
    data = DataSection(train_file=str(files["train"]), validation_file=str(files["validation"]))
    return load_task(data=data, model=ModelSection(task="kto", size="tiny"), seed=0, predict=False)


ROWS = [
    {"prompt": "Is it good? great film", "completion": " yes", "label": True},
    {"prompt": "Is it good? dull film", "completion": " yes", "label": False},
    {"prompt": "Is it good? dull film", "completion": " no", "label": True},
]


def test_unpaired_rows_and_pairs_are_read_as_trl_reads_them(tmp_path):
    splits, task, _ = _load(tmp_path, ROWS)
    assert task.problem_type == "kto" and task.name == "unpaired"
    assert splits["train"]["label"] == [True, False, True]
    csv = [row | {"label": str(row["label"]).upper()} for row in ROWS]  # CSV cells: the text true or false
    assert _load(tmp_path, csv, suffix="csv")[0]["train"]["label"] == [True, False, True]
    pairs = [
        {"prompt": "Is it good? great film", "chosen": " yes", "rejected": " no"},
        {"prompt": "Is it good? dull film", "chosen": " no", "rejected": " yes"},
    ]
    splits, task, _ = _load(tmp_path, pairs)  # unpair_preference_dataset: the chosen answers, then the rejected
    assert task.name == "explicit" and splits["train"]["label"] == [True, True, False, False]
    assert [json.loads(c) for c in splits["train"]["completion"]] == [" yes", " no", " no", " yes"]


@pytest.mark.parametrize("label", ["yes", 1, None, "true"])
def test_a_label_that_is_not_a_boolean_names_its_line(tmp_path, label):
    rows = [ROWS[0], ROWS[1] | {"label": label}]  # (in JSON Lines the text "true" is text, not a boolean)
    with pytest.raises(UserError) as error:
        _load(tmp_path, rows)
    said = str(error.value)
    assert "train.jsonl:2: column 'label' holds" in said and "not a boolean" in said and "\n" not in said


def test_a_split_of_one_side_is_refused(tmp_path):
    with pytest.raises(UserError) as error:
        _load(tmp_path, ROWS, [ROWS[0], ROWS[2]])
    said = str(error.value)
    assert "validation.jsonl: every one of the validation split's 2 rows is desirable" in said and "\n" not in said


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["task=dpo", "desirable_weight=2"], "desirable_weight.*is task=kto's"),
        (["task=reward", "undesirable_weight=2"], "undesirable_weight.*is task=kto's"),
        (["task=kto", "rpo_alpha=0.5"], "rpo_alpha.*is task=dpo's .*task=kto does not read it"),
        (["task=kto", "dpo_loss=ipo"], "dpo_loss.*task=kto does not read it; drop it or set task=dpo"),
        (["task=kto", "desirable_weight=0"], "desirable_weight.*must be > 0"),
        (["task=kto", "packing=true"], "packing"),
        (["task=kto", "batch_size=1"], "batch_size.*>= 2"),
        (["task=classification", "completion_column=answer"], "completion_column"),
    ],
)
def test_keys_of_another_task_are_refused(overrides, message):
    from parallel_finetune.resolve import load_config

    with pytest.raises(UserError, match=message):
        load_config(recipe("llama"), ["size=tiny", *overrides])


def test_kto_learns_the_preference_sample(sst2, cache_dir, tmp_path):
    """A tiny Llama from scratch on the sample's 400 pairs unpaired (800 rows), 30 steps of 16 rows: the held-out
    rows' rewards/margins rise above 0 and keep rising, as DPO's do; step 1 is the policy against its reference
    (loss 1/2, kl 0, margin 0); every step and the end report TRL's metrics."""
    run = launch(
        1,
        kto_overrides(sst2, cache_dir, "llama", max_steps=30, eval_every=15, warmup_ratio=0, lr="3e-3"),
        tmp_path / "learn",
        recipe=recipe("llama"),
    )
    first = run.records[0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6) and first["kl"] == 0 and first["rewards/margins"] == 0
    for record in run.records:
        assert all(math.isfinite(record[key]) for key in STEP_METRICS if key in record), record
    halfway = json.loads((run.output_dir / EVALS).read_text().splitlines()[0])
    after = run.summary
    print(
        f"held-out rewards/margins: 0 before, {halfway['rewards/margins']:.4f} at step 15, "
        f"{after['rewards/margins']:.4f} at 30; kl {halfway['kl']:.4f}, {after['kl']:.4f}"
    )
    assert all(math.isfinite(after[key]) for key in HELD_OUT) and after["task"] == "kto"
    assert after["rewards/margins"] > halfway["rewards/margins"] > 0
    last = run.records[-1]
    said = f"| kl {last['kl']:.4f} | rewards/margins {last['rewards/margins']:.4f}"
    assert any(line.startswith("step 30/30 |") and line.endswith(said) for line in run.output.splitlines())
    assert "task=kto: " in run.output and "reference log-probabilities of" in run.output
