"""task=grpo: its keys (one line each for what is refused), its prompt rows and tokens, the "grpo" batcher's
labels and columns, and GRPOLoss against TRL's _compute_loss written out densely on the same numbers (per loss
type, token and sequence importance sampling, beta > 0 with and without the KL's bias correction, num_iterations > 1,
masked truncated completions), summed over slices and divided by the global completion count as the Trainer does."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import load_task_of, prepare_data, recipe, tiny_overrides

from parallel_finetune.config import GRPOSection
from parallel_finetune.data.batch import IGNORE
from parallel_finetune.data.batchers import Padding, make_batcher
from parallel_finetune.data.grpo import RolloutSplit
from parallel_finetune.errors import UserError
from parallel_finetune.loop.grpo_loss import GRPOLoss
from parallel_finetune.resolve import load_config
from parallel_finetune.rl.rewards import BUILTINS
from parallel_finetune.rl.steps import RolloutStage
from parallel_finetune.tasks.kinds.grpo import BUILTIN_REWARDS
from parallel_finetune.tasks.sources import SAMPLE_DIR


def grpo_config(*overrides: str):
    return load_config(recipe("llama"), ["size=tiny", "task=grpo", "batch_size=8", "num_generations=4", *overrides])


# ------------------------------------------------------------------------------------------- keys
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["pipeline_parallel_degree=2"], "pipeline_parallel_degree=2 task=grpo samples its completions token by token"),
        (["batch_size=6"], "batch_size=6 counts completions, and num_generations=4 does not divide it"),
        (["reward_functions=[accuracy, speed]"], "names 'speed', no built-in reward (accuracy, format, length)"),
        (["reward_functions=[format]"], "format_pattern=None is what reward format matches"),
        (["reward_weights=[1.0, 2.0]"], "must be 1 finite number(s), one per reward function"),
        (["beta=0.04"], "full fine-tuning keeps no frozen copy yet, so use peft=lora or beta=0"),
        (["num_generations=1", "batch_size=8"], "num_generations=1 must be at least 2"),
        (["epsilon_high=0.1"], "epsilon_high=0.1 must be epsilon > 0 and epsilon_high >= epsilon"),
        (["packing=true"], "task=grpo pads its completions"),
    ],
)
def test_bad_keys_are_one_line(overrides, message):
    with pytest.raises(UserError) as caught:
        grpo_config(*overrides)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_grpo_keys_on_another_task_are_refused_and_the_builtins_agree():
    with pytest.raises(
        UserError, match=r"num_generations=4 is task=grpo's .* task=sft does not read it; drop it or set task=grpo"
    ):
        load_config(recipe("llama"), ["size=tiny", "task=sft", "num_generations=4"])
    assert BUILTIN_REWARDS == BUILTINS  # tasks/ cannot import rl/: the two lists are kept equal here
    config = grpo_config(
        "beta=0.04",
        "peft=lora",
        "loss_type=grpo",
        "reward_functions=[accuracy, format]",
        "format_pattern=.*Answer: \\d+",
    )
    assert (config.grpo.beta, config.grpo.loss_type, config.grpo.reward_functions) == (
        0.04,
        "grpo",
        ["accuracy", "format"],
    )


# ------------------------------------------------------------------------------------------- rows and tokens
def test_the_shipped_sample_is_read_and_rendered_with_the_generation_prompt(tmp_path):
    config = grpo_config(f"cache_dir={tmp_path}", "max_length=96")
    prepared = prepare_data(config)
    assert prepared.task.columns == ("prompt", "answer") and prepared.task.kind.prompts
    train = prepared.splits["train"]
    assert len(train) == 320 and len(prepared.splits["validation"]) == 48
    text = prepared.tokenizer.decode(train[2]["input_ids"])
    assert text.endswith("<|im_start|>assistant\n") and "What is" in text
    assert json.loads(train[2]["columns"]) == {
        "answer": json.loads((SAMPLE_DIR / "grpo" / "train.jsonl").read_text().splitlines()[2])["answer"]
    }


def write_rows(folder: Path, rows: list[dict], name: str = "train.jsonl") -> str:
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


USER = {"role": "user", "content": "What is two plus 2?"}


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "x", "answer": "1"}], "task=grpo needs a column 'prompt'"),
        ([{"prompt": "", "answer": "1"}], "train.jsonl:1: column 'prompt' is empty"),
        ([{"prompt": [USER, {"role": "assistant", "content": "4"}], "answer": "4"}], "ends with an assistant turn"),
        ([{"prompt": [USER], "answer": "4"}, {"prompt": "text", "answer": "4"}], "train.jsonl:2: this prompt is text"),
    ],
)
def test_bad_prompt_rows_are_one_line(tmp_path, rows, message):
    validation = write_rows(tmp_path, [{"prompt": [USER], "answer": "4"}], "validation.jsonl")
    config = grpo_config(f"train_file={write_rows(tmp_path, rows)}", f"validation_file={validation}")
    with pytest.raises(UserError, match=message):
        load_task_of(config)


def test_a_prompt_over_the_budget_names_its_row(tmp_path):
    rows = [{"prompt": [USER], "answer": "4"}, {"prompt": [{"role": "user", "content": "two " * 80}], "answer": "4"}]
    validation = write_rows(tmp_path, rows[:1], "validation.jsonl")
    config = grpo_config(
        f"train_file={write_rows(tmp_path, rows)}",
        f"validation_file={validation}",
        f"cache_dir={tmp_path / 'cache'}",
        "max_length=48",
    )
    with pytest.raises(UserError, match=r"train.jsonl:2: the prompt is \d+ tokens, more than the prompt budget"):
        prepare_data(config)


# ------------------------------------------------------------------------------------------- batches
def test_the_batcher_labels_the_scored_completion_tokens_with_their_columns():
    split = RolloutSplit(
        ids=[[5, 6, 7, 8, 9], [5, 6, 3], [4, 7, 7, 7]],
        prompt_lengths=[2, 2, 1],
        scored=[3, 1, 0],  # the third: a truncated completion, masked
        advantages=[0.5, -1.0, 2.0],
        old_logps=[[-1.0, -2.0, -3.0], [-4.0], [-5.0, -6.0, -7.0]],
    )
    for side in ("right", "left"):
        padding = Padding(pad_id=0, padding_side=side, pad_multiple=1, device=torch.device("cpu"))
        batch = make_batcher("grpo", split, padding).batch([0, 1, 2])
        target = batch.loss_target()
        scored = target[..., 0] != IGNORE
        assert target[scored][:, 0].tolist() == [7, 8, 9, 3]  # the completion tokens, predicted the position before
        assert target[scored][:, 1:4].tolist() == [[0, 0.5, -1], [0, 0.5, -2], [0, 0.5, -3], [1, -1, -4]], side
        assert batch.scored() == 2
        assert split.loss_count([0, 1, 2]) == 3  # each completion counts one; the loss weighs its tokens


def test_an_evaluation_samples_in_pieces_no_larger_than_a_steps_and_as_many_on_every_rank():
    """Held-out prompts are sampled in pieces of a step's prompts per rank (the planner counts a step's rows, and a
    large validation split would not fit at once), and every rank samples as many pieces, an empty one where its
    share ran out, so that FSDP's ranks decode in lockstep. tests/rl/test_rollout.py: a completion does not depend
    on the rows sampled beside it, so the pieces change no completion."""
    stage = RolloutStage(None, None, None, None, None, GRPOSection(), None, None, prompts_per_rank=2)
    bounds = [11 * r // 3 for r in range(4)]  # 11 held-out prompts over 3 data-parallel ranks: 3, 4 and 4
    pieces = [stage.held_out_pieces(list(range(a, b)), largest_share=4) for a, b in zip(bounds, bounds[1:])]
    assert pieces == [[[0, 1], [2]], [[3, 4], [5, 6]], [[7, 8], [9, 10]]]
    assert stage.held_out_pieces([0, 1, 2], largest_share=5) == [[0, 1], [2], []]  # lockstep: 3 pieces each
    whole = RolloutStage(None, None, None, None, None, GRPOSection(), None, None)  # 0: the whole share at once
    assert whole.held_out_pieces([0, 1, 2], largest_share=3) == [[0, 1, 2]]


def kept_stage() -> RolloutStage:
    """A rollout stage holding the rollout step 1 sampled (2 prompts x 2 completions, vocabulary 50) to train on
    again at step 2; only what keeping it reads is real."""
    padding = Padding(pad_id=0, padding_side="right", pad_multiple=1, device=torch.device("cpu"))
    grpo = GRPOSection(num_generations=2, num_iterations=2)
    stage = RolloutStage(None, [None] * 50, None, None, None, grpo, None, padding)
    split = RolloutSplit(
        ids=[[5, 6, 7], [5, 6, 8, 9], [4, 7], [4, 1, 1]],
        prompt_lengths=[2, 2, 1, 1],
        scored=[1, 2, 1, 0],
        advantages=[0.5, -0.5, 1.0, -1.0],
        old_logps=[[-1.25], [-2.0, math.log(0.3)], [-3.0], []],
    )
    stage.kept = (1, (make_batcher("grpo", split, padding), [0, 1, 2, 3], {"reward": 0.5, "rollout_s": 1.5}, []))
    return stage


KEPT_DAMAGE = [
    ({"sampled_step": 3}, "sampled_step is 3, expected the step that sampled step 1's rollout"),
    ({"sampled_step": True}, "sampled_step is True"),
    ({"metrics": {"reward": "high"}}, "metrics must map names to numbers"),
    (
        {"split.ids": [[5, 6, 7], [5, 6, 50], [4, 7], [4, 1, 1]]},
        "split: ids must be lists of token ids from 0 to 49",
    ),
    ({"split.scored": [2, 2, 1, 0]}, "split: a row of 3 tokens cannot hold 2 prompt and 2 scored tokens"),
    ({"split.advantages": [0.5, float("nan"), 1.0, -1.0]}, "split: advantages must be 4 finite numbers"),
    ({"split.old_logps": [[-1.25], [-2.0], [-3.0], []]}, "split: old_logps must be null or 4 lists"),
    ({"split.old_logps": None}, "split: expected the old policy's log-probabilities"),
    ({"split.ids": [[5, 6, 7]] * 3}, "split: prompt_lengths must be 3 counts, one per row"),
]


@pytest.mark.parametrize("change, problem", KEPT_DAMAGE, ids=[next(iter(change)) for change, _ in KEPT_DAMAGE])
def test_a_kept_rollout_is_written_read_back_exactly_and_checked(change, problem):
    """What a checkpoint between a rollout's iterations keeps (rollout.json) reads back as the same split, numbers
    bit for bit through JSON, timings left out; nothing at a rollout boundary; each damage named in one line."""
    stage = kept_stage()
    assert stage.kept_state(2) is None  # step 3 samples the next rollout from its step number
    written = json.loads(json.dumps(stage.kept_state(1)))
    assert written["metrics"] == {"reward": 0.5, "rollout_s": 0.0, "scoring_s": 0.0}
    assert stage.kept_problem(written, 1) is None
    assert "ends its rollout's 2 iterations" in stage.kept_problem(written, 2)
    kept = stage.kept
    stage.restore_kept(written)
    assert (
        stage.kept[0] == 1
        and stage.kept[1][0].split == kept[1][0].split
        and stage.kept[1][1:] == ([0, 1, 2, 3], written["metrics"], [])
    )
    for key, value in change.items():
        *parents, name = key.split(".")
        target = written
        for parent in parents:
            target = target[parent]
        target[name] = value
    found = stage.kept_problem(json.loads(json.dumps(written)), 1)
    assert found is not None and found.startswith(problem) and "\n" not in found, found


# ------------------------------------------------------------------------------------------- the loss vs TRL's
def trl_loss(logps, old, ref, advantages, mask, section: GRPOSection, trained_mask=None):
    """TRL 1.16's GRPOTrainer._compute_loss on dense (B, T) tensors, one process, no accumulation."""
    eps_low, eps_high = section.epsilon, section.epsilon_high or section.epsilon
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    if section.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    adv = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    metrics = {}
    if section.beta:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if section.use_bias_correction_kl:  # TRL's default: times the ratio, whose gradient is not 0 even at 1
            kl = kl * coef_1
        per_token_loss = per_token_loss + section.beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum()).item()
    loss_type = section.loss_type
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * section.max_completion_length)

    def masked(x):
        if x.shape[1] == 1:
            return (x.sum() / x.shape[0]).item()
        return ((x * mask).sum() / mask.sum()).item()

    low = ((coef_1 < 1 - eps_low) & (adv < 0)).float()
    high = ((coef_1 > 1 + eps_high) & (adv > 0)).float()
    metrics |= {
        "clip_ratio/low_mean": masked(low),
        "clip_ratio/high_mean": masked(high),
        "clip_ratio/region_mean": masked(torch.maximum(low, high)),
    }
    return loss, metrics


def case(section: GRPOSection, seed: int = 0):
    """Four completions of up to 5 tokens: random log-probabilities, old ones near them, advantages of both
    signs; the last completion truncated (masked under mask_truncated_completions)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 5])
    mask = (torch.arange(5) < lengths.unsqueeze(1)).float()
    if section.mask_truncated_completions:
        mask[3] = 0
    logps = (torch.rand(4, 5, generator=generator) * -3).requires_grad_()
    old = logps.detach() + torch.randn(4, 5, generator=generator) * 0.3
    ref = logps.detach() + torch.randn(4, 5, generator=generator) * 0.2
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5])
    return logps, old, ref, advantages, mask


def ours(section: GRPOSection, logps, old, ref, advantages, mask, slices=((0, 1, 2, 3),)):
    """GRPOLoss over `slices` of the completions (micro-batches or ranks), summed and divided by the global
    completion count as the Trainer does; the metrics from the summed statistics."""
    objective = GRPOLoss(torch.nn.Identity(), 0, grpo=section)
    split = RolloutSplit([[0] * 6] * 4, [1] * 4, mask.sum(-1).long().tolist(), advantages.tolist())
    objective.share_of(split, [0, 1, 2, 3])
    total, stats = 0, []
    for indices in slices:
        rows = [(i, t) for i in indices for t in range(5) if mask[i, t]]
        if not rows:
            stats.append({})
            continue
        i, t = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
        target = torch.stack(
            [torch.zeros(len(i)), i.double(), advantages[i].double(), old[i, t].double(), ref[i, t].double()], -1
        )
        summed, slice_stats = objective.completion_losses(logps[i, t], target)
        total = total + summed
        stats.append(slice_stats)
    metrics = objective.metrics(objective.sums(stats, "cpu"))
    return total / 4, metrics


SECTIONS = [
    GRPOSection(loss_type="grpo"),
    GRPOSection(loss_type="bnpo"),
    GRPOSection(loss_type="dr_grpo", max_completion_length=5),
    GRPOSection(loss_type="dapo", epsilon_high=0.28),
    GRPOSection(loss_type="dapo", num_iterations=2, epsilon=0.1),
    GRPOSection(loss_type="grpo", num_iterations=2, importance_sampling_level="sequence", epsilon=0.05),
    GRPOSection(loss_type="dapo", num_iterations=2, beta=0.04),
    GRPOSection(loss_type="grpo", beta=0.04, mask_truncated_completions=True),
    GRPOSection(loss_type="grpo", num_iterations=2, importance_sampling_level="sequence", beta=0.04),
    GRPOSection(loss_type="dr_grpo", num_iterations=2, beta=0.04, use_bias_correction_kl=False),
    GRPOSection(loss_type="bnpo", num_iterations=2, mask_truncated_completions=True, epsilon=0.1),
]


@pytest.mark.parametrize(
    "section",
    SECTIONS,
    ids=lambda s: (
        f"{s.loss_type}-it{s.num_iterations}-b{s.beta}"
        f"-{s.importance_sampling_level}-mask{int(s.mask_truncated_completions)}"
        f"{'' if s.use_bias_correction_kl else '-nocorrection'}"
    ),
)
def test_the_loss_and_its_metrics_are_trls_in_any_slicing(section):
    logps, old, ref, advantages, mask = case(section)
    kept_old = old if section.num_iterations > 1 else None
    expected, expected_metrics = trl_loss(logps, kept_old, ref, advantages, mask, section)
    expected_grad = torch.autograd.grad(expected, logps)[0]
    for slices in (((0, 1, 2, 3),), ((0, 2), (1, 3)), ((3,), (1,), (0, 2))):  # one process, ranks, accumulation
        loss, metrics = ours(section, logps, old, ref, advantages, mask, slices)
        assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
        assert torch.allclose(torch.autograd.grad(loss, logps)[0], expected_grad, atol=1e-6)
        mean_over_scored = metrics.pop("loss")  # the Trainer's step loss is `loss` / N; this one's units are scored
        if not section.mask_truncated_completions:
            assert mean_over_scored == pytest.approx(expected.item(), abs=1e-6)
        assert metrics == pytest.approx(expected_metrics, abs=1e-6)
    if section.num_iterations == 1 and not section.beta:  # ratio 1: the loss is minus the mean advantage
        assert expected_metrics["clip_ratio/region_mean"] == 0


@pytest.mark.parametrize("chunk_tokens", [0, 4])
def test_the_policy_is_scored_at_the_sampling_temperature(chunk_tokens):
    """TRL's fused head divides the logits by the sampling temperature before the log-softmax (the policy, the old
    policy and the reference alike): the loss's log-probabilities are the tempered distribution's, with its
    gradient, through the chunked head and the whole logits."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(7, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=generator)
    section = GRPOSection(loss_type="dapo", num_iterations=2, temperature=0.7, epsilon=0.1, beta=0.04)
    objective = GRPOLoss(head, chunk_tokens, grpo=section)
    completion = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    advantages = torch.tensor([1.0, -0.5, 0.3])[completion]
    old, ref = -torch.rand(7, generator=generator) * 3, -torch.rand(7, generator=generator) * 3
    target = torch.stack([labels.double(), completion.double(), advantages.double(), old.double(), ref.double()], -1)
    loss, _ = objective.scored(hidden, target)
    tempered = torch.log_softmax(head(hidden) / 0.7, -1).gather(1, labels[:, None]).squeeze(1)
    expected, _ = objective.completion_losses(tempered, target)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    got_grad = torch.autograd.grad(loss, hidden)[0]
    assert torch.allclose(got_grad, torch.autograd.grad(expected, hidden)[0], atol=1e-6)
    plain = torch.log_softmax(head(hidden), -1).gather(1, labels[:, None]).squeeze(1)
    assert abs(objective.completion_losses(plain, target)[0].item() - loss.item()) > 1e-3  # the test can tell


# ------------------------------------------------------------------------------------------- a run
def test_a_tiny_run_samples_scores_and_reports_trls_metrics(sst2, cache_dir, tmp_path):
    """One process on the shipped sample, completions sampled: each step's TRL metrics and time split, the
    completions with their rewards and advantage in generations.jsonl, the held-out reward at the end. Its rewards:
    accuracy, length and a reward model (model:folder, TRL's rewards/<folder name>/mean)."""
    from conftest import launch, tiny_reward_model

    reward_model = tiny_reward_model(tmp_path / "tiny-rm")
    keys = {"data_dir": "", "max_length": 96, "max_steps": 2, "batch_size": 8, "export": "false"}
    grpo = ["num_generations=4", "max_completion_length=8"]
    grpo += [f"reward_functions=[accuracy, length, model:{reward_model}]"]
    overrides = tiny_overrides(sst2, cache_dir, "grpo", "llama", **keys) + grpo + ["length_limit=3"]
    run = launch(1, [*overrides, "tensor_parallel_degree=1"], tmp_path / "run", recipe=recipe("llama"))
    records = run.records
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in ("reward", "reward_std", "rewards/accuracy/mean", "rewards/length/mean", "completions/mean_length"):
            assert math.isfinite(record[key]), (key, record)
        assert 1 <= record["completions/mean_length"] <= 8 and 0 <= record["completions/clipped_ratio"] <= 1
        assert record["rollout_s"] > 0 and record["scoring_s"] > 0 and record["update_s"] > 0
        assert record["rewards/tiny-rm/std"] > 0  # the reward model scores each completion its own
    written = [json.loads(line) for line in (run.output_dir / "generations.jsonl").read_text().splitlines()]
    assert len(written) == 2 * 8 and set(written[0]) == {"step", "prompt", "answer", "rewards", "advantage"}
    assert set(written[0]["rewards"]) == {"accuracy", "length", "tiny-rm"}
    step = [row for row in written if row["step"] == 1]
    model_scores = [row["rewards"]["tiny-rm"] for row in step]
    assert sum(model_scores) / len(model_scores) == pytest.approx(records[0]["rewards/tiny-rm/mean"], abs=1e-5)
    assert (
        run.summary["family"] == "llama"
        and math.isfinite(run.summary["eval_reward"])
        and "eval_rewards/length/mean" in run.summary
        and math.isfinite(run.summary["eval_rewards/tiny-rm/mean"])
    )
    assert "Loading weights" not in run.output  # transformers' progress bar, per rank, stays out of the log


def test_check_renders_the_prompts_and_refuses_a_pipeline(tmp_path):
    """--check (preflight) renders a sample of the prompts as the run does, and says the pipeline line."""
    from conftest import REPO, check

    grpo_recipe = REPO / "recipes" / "llama" / "grpo.yaml"
    ok = check("size=tiny", f"cache_dir={tmp_path}", recipe=grpo_recipe)
    assert ok.returncode == 0 and "task grpo" in ok.stdout, ok.stdout + ok.stderr
    refused = check("size=tiny", "pipeline_parallel_degree=2", "tensor_parallel_degree=1", recipe=grpo_recipe)
    assert refused.returncode != 0 and "use tensor_parallel_degree (TP) or sharding=full (FSDP)" in refused.stderr


# ------------------------------------------------------------------------------------------- bad rewards, as said
BAD_REWARDS = """
NOT_A_FUNCTION = 3


def raising(completions, **kwargs):
    return [1 / 0 for _ in completions]


def too_few(completions, **kwargs):
    return [1.0]


def nan(completions, **kwargs):
    return [float("nan")] * len(completions)
"""


def one_error_line(stderr: str) -> str:
    """The one `error:` line a refused command prints, and nothing else of the failure (no traceback)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    "rewards, message",
    [
        ("[missing.py:f]", r"reward_functions: 'missing.py:f': no such file missing.py \(relative to the current"),
        ("[{file}:NOT_A_FUNCTION]", r"rewards.py:NOT_A_FUNCTION is not a function \(int\)"),
        ("[{file}:absent]", r"rewards.py has no function 'absent'; its functions: \['nan', 'raising', 'too_few'\]"),
        ("[acuracy]", r"names 'acuracy', no built-in reward \(accuracy, format, length\)"),
        ("[model:{tmp}/absent]", r"'model:.*absent': no such folder '.*absent'"),
        ("[model:{tmp}/causal]", r"causal/config.json is a LlamaForCausalLM, not a sequence classifier"),
        ("[accuracy]", r"the training rows \(.*train.jsonl.*\): reward accuracy compares completions with the column"),
    ],
    ids=[
        "missing-file",
        "not-a-function",
        "no-such-function",
        "unknown-builtin",
        "no-model",
        "not-a-classifier",
        "no-answer-column",
    ],
)
def test_check_says_a_reward_that_cannot_be_had_in_one_line(tmp_path, rewards, message):
    """--check (what make runs before torchrun) makes the run's rewards: a file or function that is not there, a
    reward model that is not one, and the answer column accuracy reads but the rows lack, each one line, exit 2."""
    from conftest import check
    from transformers import LlamaConfig

    (tmp_path / "rewards.py").write_text(BAD_REWARDS)
    LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "causal")
    rows = [{"prompt": [USER], "solution": "4"}] * 8  # no `answer` column
    files = [f"train_file={write_rows(tmp_path, rows)}", f"validation_file={write_rows(tmp_path, rows, 'v.jsonl')}"]
    keys = ["size=tiny", "task=grpo", "batch_size=8", "num_generations=4", f"cache_dir={tmp_path / 'cache'}"]
    chosen = rewards.format(file=tmp_path / "rewards.py", tmp=tmp_path)
    refused = check(*keys, *files, f"reward_functions={chosen}", nproc=1, recipe=recipe("llama"))
    assert refused.returncode == 2 and re.search(message, one_error_line(refused.stderr)), refused.stderr[-3000:]


@pytest.mark.parametrize(
    "function, message",
    [
        ("raising", r"reward function .*rewards.py:raising raised ZeroDivisionError: division by zero"),
        ("too_few", r"reward function .*rewards.py:too_few returned 1 rewards for 8 completions"),
        ("nan", r"reward function .*rewards.py:nan returned NaN for completion 0; return None where it does not"),
    ],
    ids=["raising", "wrong-count", "nan"],
)
def test_a_reward_function_that_misbehaves_in_a_run_stops_it_in_one_line(sst2, cache_dir, tmp_path, function, message):
    """What the function returns is seen only once it scores a step's completions: the run (2 processes) stops at
    its first step with one `error:` line naming the function and what is wrong, exit 2."""
    from conftest import launch

    (tmp_path / "rewards.py").write_text(BAD_REWARDS)
    keys = {"data_dir": "", "max_length": 96, "max_steps": 1, "batch_size": 8, "export": "false"}
    grpo = ["num_generations=4", "max_completion_length=4", f"reward_functions=[{tmp_path / 'rewards.py'}:{function}]"]
    overrides = tiny_overrides(sst2, cache_dir, "grpo", "llama", **keys) + grpo + ["tensor_parallel_degree=2"]
    run = launch(2, overrides, tmp_path / "run", recipe=recipe("llama"), check=False)
    assert run.returncode == 2 and re.search(message, one_error_line(run.output)), run.output[-3000:]


# ------------------------------------------------------------------------------------------- resume
TIMINGS = (
    "samples_per_s",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "step_time_s",
    "rollout_s",
    "scoring_s",
    "update_s",
)


def without_timings(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in TIMINGS}


def resume_overrides(sst2, cache_dir, prompts: Path, *extra: str) -> list[str]:
    """4 sampled steps of 8 completions, each rollout trained on twice, attention dropout on; the format reward
    (an "e" somewhere in 3 tokens) differs within groups, so the advantages and the loss move. `prompts`: a folder
    of the shipped sample's first rows (`few_prompts`)."""
    from conftest import tiny_overrides

    keys = {"data_dir": "", "max_length": 96, "max_steps": 4, "batch_size": 8, "lr": 2e-2}
    keys |= {"train_file": prompts / "train.jsonl", "validation_file": prompts / "validation.jsonl"}
    grpo = ["num_generations=4", "max_completion_length=3", "reward_functions=[format]", "format_pattern=.*e.*"]
    dropout = ["model_config.attention_dropout=0.1", "num_iterations=2", "tensor_parallel_degree=1"]
    return tiny_overrides(sst2, cache_dir, "grpo", "llama", **keys) + grpo + dropout + list(extra)


def few_prompts(folder: Path) -> Path:
    """The shipped sample's first 32 training and 4 held-out prompts: the end's held-out sampling costs little."""
    folder.mkdir()
    for name, rows in (("train.jsonl", 32), ("validation.jsonl", 4)):
        lines = (SAMPLE_DIR / "grpo" / name).read_text(encoding="utf-8").splitlines(keepends=True)
        (folder / name).write_text("".join(lines[:rows]), encoding="utf-8")
    return folder


def test_a_resumed_run_repeats_the_uninterrupted_one(sst2, cache_dir, tmp_path):
    """One process, sampled completions, dropout on, num_iterations 2, checkpoints after every step: resumed
    from step 1 (between a rollout's two iterations: the checkpoint keeps the rollout, rollout.json) and from step
    2 (a rollout boundary: nothing kept, step 3 samples from the step number), every later step's loss and every
    metric but the timings equal the uninterrupted run's bit for bit, and so do the completions and rewards that
    step 3 sampled."""
    from conftest import launch

    prompts = few_prompts(tmp_path / "prompts")
    whole = launch(
        1,
        resume_overrides(sst2, cache_dir, prompts, "checkpoint_every=1", "keep_checkpoints=4"),
        tmp_path / "whole",
        recipe=recipe("llama"),
    )
    expected = whole.records
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert len({r["loss"] for r in expected}) > 1 and any(r["clip_ratio/region_mean"] > 0 for r in expected[1::2])
    checkpoints = whole.output_dir / "checkpoints"
    assert (checkpoints / "step-00000001" / "rollout.json").is_file()
    assert not (checkpoints / "step-00000002" / "rollout.json").exists()
    sampled = [json.loads(line) for line in (whole.output_dir / "generations.jsonl").read_text().splitlines()]
    for step in (1, 2):
        run = launch(
            1,
            resume_overrides(sst2, cache_dir, prompts, f"resume={checkpoints / f'step-{step:08d}'}"),
            tmp_path / f"from{step}",
            recipe=recipe("llama"),
        )
        assert run.summary["resumed_from"] == str(checkpoints / f"step-{step:08d}")
        for mine, theirs in zip(run.records, expected[step:], strict=True):
            assert without_timings(mine) == without_timings(theirs)
        again = [json.loads(line) for line in (run.output_dir / "generations.jsonl").read_text().splitlines()]
        assert again == [r for r in sampled if r["step"] > step] and {r["step"] for r in again} == {3}
        assert run.summary["eval_reward"] == whole.summary["eval_reward"]
