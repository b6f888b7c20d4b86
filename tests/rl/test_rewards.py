"""rl/rewards.py: the built-in rewards, a user's file:function, a reward model (model:folder, rl/reward_model.py:
TRL's rendering and logit, its rows split over ranks), every bad input's one line, and TRL's weighting and
group-relative advantages computed by hand on the same numbers (TRL's GRPOTrainer: None -> NaN, weighted nansum,
nanmean and Bessel-corrected nanstd per group or batch, / (std + 1e-4), NaN advantages -> 0)."""

from __future__ import annotations

import json
import math
import statistics
import threading

import pytest
import torch
from conftest import tiny_reward_model

from parallel_finetune.errors import UserError
from parallel_finetune.rl.reward_model import BATCH_ROWS, Placement, RewardModel
from parallel_finetune.rl.rewards import (
    Rewards,
    RewardSettings,
    check_groups,
    group_advantages,
    nanstd,
    reward_metrics,
    weighted_rewards,
)

NAN = float("nan")


def scores(functions, completions, columns=None, ids=None, prompts=None, **settings):
    rewards = Rewards(RewardSettings(tuple(functions), **settings))
    count = len(completions)
    prompts = prompts if prompts is not None else ["What is it?"] * count
    ids = ids if ids is not None else [[1] * 3 for _ in completions]
    return rewards.score(prompts, completions, ids, columns or {}).tolist()


def same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, abs=1e-6), (got, expected)


# ----------------------------------------------------------------------------------------------- built-ins
def test_accuracy_compares_math_with_math_verify_and_text_by_its_last_words():
    completions = [
        "3 + 4 = 7",  # the final number
        "It is 8.",
        r"So the answer is $\boxed{7}$",
        "one half, that is 0.5",  # 1/2 as math
        "The capital is Paris.",
        "Parisian food",
        "anything",
    ]
    answers = ["7", "7", "7", "1/2", "Paris", "paris", ""]  # an empty answer: not scored (None)
    got = [row[0] for row in scores(["accuracy"], completions, {"answer": answers})]
    same(got, [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, NAN])


def test_accuracy_reads_the_answer_column_the_recipe_names():
    got = scores(["accuracy"], ["x = 12"], {"solution": ["12"]}, answer_column="solution")
    assert got == [[1.0]]


def test_format_is_one_on_a_full_match_only():
    pattern = r"<think>.*</think>\s*<answer>\d+</answer>"
    completions = [
        "<think>a\nb</think> <answer>42</answer>",  # `.` spans lines
        "<answer>42</answer>",
        "<think></think><answer>4</answer>!",  # a match, but not of the whole completion
    ]
    got = [row[0] for row in scores(["format"], completions, format_pattern=pattern)]
    assert got == [1.0, 0.0, 0.0]


def test_length_is_dapos_soft_overlong_punishment():
    """limit 4, ramp 4: TRL's get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4), i.e.
    0 up to 4 tokens, (4 - n) / 4 up to 8, -1 beyond."""
    lengths = [1, 4, 5, 6, 8, 12]
    ids = [[7] * n for n in lengths]
    got = [row[0] for row in scores(["length"], ["x"] * 6, ids=ids, length_limit=4, length_ramp=4)]
    expected = [0.0 if n <= 4 else ((8 - 4) - n) / 4 if n <= 8 else -1.0 for n in lengths]
    assert got == pytest.approx(expected)
    # the ramp defaults to the limit
    assert [r[0] for r in scores(["length"], ["x"] * 2, ids=[[1] * 15, [1] * 30], length_limit=10)] == [-0.5, -1.0]


# ----------------------------------------------------------------------------------------------- a user's file
USER_FILE = '''
def first_letter(prompts, completions, completion_ids, letter, **kwargs):
    """TRL's signature: one entry per completion in every list; None where it does not apply."""
    out = []
    for prompt, completion, ids, wanted in zip(prompts, completions, completion_ids, letter):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        out.append(None if wanted is None else float(text.startswith(wanted)) + 0.1 * len(ids))
    return out


def conversational(prompts, completions, **kwargs):
    assert isinstance(prompts[0], list) and completions[0] == [{"role": "assistant", "content": "hi"}]
    return [1.0] * len(completions)


def raising(completions, **kwargs):
    return [1 / 0 for _ in completions]


def too_few(completions, **kwargs):
    return [1.0]


def nan(completions, **kwargs):
    return [float("nan")] * len(completions)


def words(completions, **kwargs):
    return ["good"] * len(completions)


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_a_users_function_gets_trls_arguments_and_its_none_is_nan(user_file):
    columns = {"letter": ["a", "b", None]}
    ids = [[1, 2], [3], [4, 5, 6]]
    got = scores([f"{user_file}:first_letter", "format"], ["apple", "apple", "b"], columns, ids, format_pattern="a.*")
    same([r[0] for r in got], [1.2, 0.1, NAN])
    assert [r[1] for r in got] == [1.0, 1.0, 0.0]
    rewards = Rewards(RewardSettings((f"{user_file}:first_letter", "length"), length_limit=1))
    assert rewards.names == ["first_letter", "length"]  # the metrics' rewards/<name>/mean


def test_conversational_prompts_get_completions_as_trl_hands_them(user_file):
    prompts = [[{"role": "user", "content": "hello"}]]
    assert scores([f"{user_file}:conversational"], ["hi"], prompts=prompts) == [[1.0]]


# ----------------------------------------------------------------------------------------------- a reward model
@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return tiny_reward_model(tmp_path_factory.mktemp("reward-model") / "tiny-rm")


def trl_scores(folder, prompts: list, completions: list[str]) -> list[float]:
    """TRL's GRPOTrainer on a reward model, one row at a time (no padding): prompt + completion, or the prompt's
    messages and the completion as the assistant's through the chat template, tokenized with no special tokens,
    the model's logit 0."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for prompt, completion in zip(prompts, completions):
        if isinstance(prompt, str):
            text = prompt + completion
        else:
            turns = prompt + [{"role": "assistant", "content": completion}]
            text = tokenizer.apply_chat_template(turns, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out.append(model(**ids).logits[0, 0].item())
    return out


# completions of many lengths, more than one batch of the reward model's (BATCH_ROWS)
COMPLETIONS = [("Answer: " + "seven " * (i % 9)).strip() + ("!" * (i % 4)) for i in range(BATCH_ROWS + 8)]


@pytest.mark.parametrize("conversational", [False, True])
def test_a_reward_model_scores_as_trl_renders_and_reads_it(reward_model, conversational):
    prompts = [f"Question {i}: what is three plus {i % 5}? " for i in range(len(COMPLETIONS))]
    if conversational:
        prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in prompts]
    rewards = Rewards(RewardSettings(("length", f"model:{reward_model}"), weights=(1.0, 0.5), length_limit=100))
    assert rewards.names == ["length", "tiny-rm"]  # TRL's name: the model path's last part -> rewards/tiny-rm/mean
    ids = [[1] * 3 for _ in COMPLETIONS]
    table = rewards.score(prompts, COMPLETIONS, ids, {"answer": ["3"] * len(COMPLETIONS)})
    expected = trl_scores(reward_model, prompts, COMPLETIONS)
    assert table[:, 1].tolist() == pytest.approx(expected, abs=1e-5)
    assert statistics.stdev(expected) > 0.01  # the scores differ: the test would see rows swapped or misread
    assert weighted_rewards(table, rewards.weights).tolist() == pytest.approx([0.5 * e for e in expected], abs=1e-5)


def test_a_reward_models_rows_are_split_over_the_ranks_and_gathered(reward_model):
    """Two ranks (threads, a barrier for the all-gather): each scores its contiguous share, both return every
    completion's score, one process's."""
    prompts = ["Say it: "] * 7
    completions = COMPLETIONS[:7]
    alone = RewardModel(f"model:{reward_model}", Placement())(prompts, completions)
    barrier, shares, results = threading.Barrier(2, timeout=60), [None, None], [None, None]

    def gather_of(r: int):
        def gather(mine):
            shares[r] = mine
            barrier.wait()
            return list(shares)

        return gather

    # Loaded here, one after the other: from_pretrained swaps PreTrainedModel.tie_weights for a no-op while it builds
    # (transformers' init.no_tie_weights, a class attribute), so two threads loading at once can leave the no-op in
    # place for the rest of the process, and every later model of this pytest worker untied. Ranks are processes.
    models = [RewardModel(f"model:{reward_model}", Placement(rank=r, ranks=2, gather=gather_of(r))) for r in (0, 1)]

    def rank(r: int):
        results[r] = models[r](prompts, completions)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(share) for share in shares] == [3, 4]  # contiguous shares: 7 * r // 2
    assert results[0] == results[1] and results[0] == pytest.approx(alone, abs=1e-6)


def test_a_reward_model_that_cannot_be_had_is_one_line(reward_model, tmp_path):
    from transformers import LlamaConfig

    def refused(folder, message, placement=Placement()):
        with pytest.raises(UserError, match=message) as caught:
            Rewards(RewardSettings((f"model:{folder}",)), placement)
        assert "\n" not in str(caught.value)

    refused(tmp_path / "absent", r"'model:.*absent': no such folder '.*absent' \(relative to the current folder\)")
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    refused(run, r"run holds no config.json; it holds a run's hf/: give model:.*run/hf")
    causal = tmp_path / "causal"
    LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(causal)
    refused(causal, r"config.json is a LlamaForCausalLM, not a sequence classifier; a reward model is a")
    labels = tmp_path / "labels"
    LlamaConfig(architectures=["LlamaForSequenceClassification"], num_labels=2).save_pretrained(labels)
    refused(labels, r"config.json is a classifier of 2 labels; a reward model has one output")
    weightless = tmp_path / "weightless"
    config = json.loads((reward_model / "config.json").read_text())
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps(config))
    Rewards(RewardSettings((f"model:{weightless}",)), placement=None)  # --check reads config.json only
    refused(weightless, r"'model:.*weightless': the model cannot be loaded \(")
    with pytest.raises(UserError, match=r"two functions share a name \(\['tiny-rm', 'tiny-rm'\]\)"):
        Rewards(RewardSettings((f"model:{reward_model}", f"model:{reward_model}/")))


def test_conversations_need_the_reward_models_chat_template(reward_model, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(reward_model, plain)
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    rewards = Rewards(RewardSettings((f"model:{plain}",)))
    assert rewards.score(["text "], ["x"], [[1]], {}).shape == (1, 1)  # text prompts need no template
    with pytest.raises(UserError, match=r"the prompts are conversations and .*plain's tokenizer has no chat template"):
        rewards.score([[{"role": "user", "content": "hi"}]], ["x"], [[1]], {})


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "function,message",
    [
        ("raising", r"reward function .*my_rewards.py:raising raised ZeroDivisionError: division by zero$"),
        ("too_few", r"reward function .*my_rewards.py:too_few returned 1 rewards for 2 completions \(one float"),
        ("nan", r"reward function .*my_rewards.py:nan returned NaN for completion 0; return None where"),
        ("words", r"reward function .*my_rewards.py:words returned 'good' for completion 0; return a float or None"),
    ],
)
def test_a_users_function_that_misbehaves_is_one_line_naming_it(user_file, function, message):
    with pytest.raises(UserError, match=message) as caught:
        scores([f"{user_file}:{function}"], ["a", "b"])
    assert "\n" not in str(caught.value)


def test_a_reward_file_that_cannot_be_had_is_one_line(tmp_path, user_file):
    with pytest.raises(UserError, match=r"'missing.py:f': no such file missing.py"):
        Rewards(RewardSettings(("missing.py:f",)))
    with pytest.raises(UserError, match=r"my_rewards.py:NOT_A_FUNCTION is not a function \(int\)"):
        Rewards(RewardSettings((f"{user_file}:NOT_A_FUNCTION",)))
    with pytest.raises(UserError, match=r"my_rewards.py has no function 'absent'; its functions: \['conversational'"):
        Rewards(RewardSettings((f"{user_file}:absent",)))
    broken = tmp_path / "broken.py"
    broken.write_text("import os\n\nVALUE = 1 / 0\n")
    with pytest.raises(UserError, match=r"broken.py could not be loaded: ZeroDivisionError: division by zero \(line 3"):
        Rewards(RewardSettings((f"{broken}:f",)))
    broken.write_text("def f(:\n")
    with pytest.raises(UserError, match=r"broken.py could not be loaded: SyntaxError: .* \(line 1\)"):
        Rewards(RewardSettings((f"{broken}:f",)))


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(functions=("acuracy",)), r"unknown reward 'acuracy'; the built-ins are accuracy, format, length, or"),
        (dict(functions=("format",)), r"reward format needs format_pattern"),
        (dict(functions=("format",), format_pattern="(unclosed"), r"format_pattern '\(unclosed' is not a regular"),
        (dict(functions=("length",)), r"reward length needs length_limit .*got None"),
        (dict(functions=("length",), length_limit=5, length_ramp=0), r"length_ramp > 0 or unset .*got 0\)"),
        (dict(functions=("accuracy", "format"), weights=(1.0,), format_pattern="x"), r"reward_weights has 1 values"),
        (dict(functions=("accuracy", "accuracy")), r"two functions share a name"),
        (dict(functions=()), r"reward_functions is empty"),
    ],
)
def test_bad_reward_settings_are_one_line(settings, message):
    with pytest.raises(UserError, match=message):
        Rewards(RewardSettings(**settings))


def test_an_answer_column_the_accuracy_reward_needs_but_the_rows_lack_is_named():
    rewards = Rewards(RewardSettings(("accuracy",)))
    with pytest.raises(UserError, match=r"train.jsonl: reward accuracy .* column 'answer', .*their columns: prompt, x"):
        rewards.check_columns(["prompt", "x"], "train.jsonl")
    with pytest.raises(UserError, match=r"column 'answer', which the rows lack"):
        rewards.score(["p"], ["c"], [[1]], {"solution": ["1"]})
    rewards.check_columns(["prompt", "answer"], "train.jsonl")  # present: no complaint


def test_a_batch_that_num_generations_does_not_divide_is_one_line():
    with pytest.raises(UserError, match=r"the batch holds 6 completions, not whole groups of num_generations=4"):
        group_advantages(torch.zeros(6), 4, "group")
    with pytest.raises(UserError, match=r"batch_size=10 holds 10 completions, not whole groups of num_generations=4"):
        check_groups(10, 4, "batch_size=10")
    with pytest.raises(UserError, match=r"scale_rewards='grup'; valid: group, batch, none"):
        group_advantages(torch.zeros(4), 2, "grup")


# ----------------------------------------------------------------------------------------------- TRL's arithmetic
PER_FUNCTION = torch.tensor(
    [
        [1.0, 0.5],
        [0.0, NAN],  # the second function did not apply: nansum of the rest
        [1.0, 1.0],
        [NAN, NAN],  # no function scored it: NaN reward, out of its group's statistics, advantage 0
        [0.0, 0.0],
        [0.0, 0.0],
        [0.0, 0.0],
        [1.0, -1.0],
    ]
)
WEIGHTS = torch.tensor([1.0, 0.5])


def by_hand_rewards() -> list[float]:
    out = []
    for row in PER_FUNCTION.tolist():
        kept = [w * r for w, r in zip(WEIGHTS.tolist(), row) if not math.isnan(r)]
        out.append(sum(kept) if kept else NAN)
    return out


def test_weighting_is_a_nansum_and_unscored_completions_are_nan():
    got = weighted_rewards(PER_FUNCTION, WEIGHTS).tolist()
    same(got, [1.25, 0.0, 1.5, NAN, 0.0, 0.0, 0.0, 0.5])
    same(got, by_hand_rewards())


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_relative_advantages_are_trls(scale):
    rewards = by_hand_rewards()
    result = group_advantages(torch.tensor(rewards), 4, scale)
    kept = [r for r in rewards if not math.isnan(r)]
    expected, stds = [], []
    for start in (0, 4):
        group = rewards[start : start + 4]
        values = [r for r in group if not math.isnan(r)]
        mean = statistics.fmean(values)
        std = statistics.stdev(kept) if scale == "batch" else statistics.stdev(values)
        for r in group:
            advantage = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
            expected.append(0.0 if math.isnan(r) else advantage)
            stds.append(std)
    assert result.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert result.std.tolist() == pytest.approx(stds, abs=1e-6)
    # the second group's rewards are 0, 0, 0, 0.5: no zero std; a group of equal rewards has one
    assert result.zero_std.tolist() == [False] * 8
    assert group_advantages(torch.ones(4), 2, scale).zero_std.tolist() == [True] * 4
    assert group_advantages(torch.ones(4), 2, "group").advantages.tolist() == [0.0] * 4


def test_one_generation_has_a_zero_std_as_trl_gives_it():
    result = group_advantages(torch.tensor([1.0, 2.0]), 1, "group")
    assert result.std.tolist() == [0.0, 0.0] and result.advantages.tolist() == pytest.approx([0.0, 0.0])


def test_nanstd_is_bessel_corrected_and_nan_below_two_values():
    assert nanstd(torch.tensor([1.0, NAN, 3.0, 5.0])).item() == pytest.approx(2.0)
    assert math.isnan(nanstd(torch.tensor([1.0, NAN])).item())
    assert nanstd(torch.tensor([[1.0, 3.0], [2.0, NAN]]), dim=1).tolist()[0] == pytest.approx(math.sqrt(2))


def test_reward_metrics_have_trls_names_and_values():
    zero = group_advantages(weighted_rewards(PER_FUNCTION, WEIGHTS), 4, "group").zero_std
    metrics = reward_metrics(PER_FUNCTION, WEIGHTS, ["accuracy", "format"], zero)
    first = [r[0] for r in PER_FUNCTION.tolist() if not math.isnan(r[0])]
    second = [r[1] for r in PER_FUNCTION.tolist() if not math.isnan(r[1])]
    rewards = [r for r in by_hand_rewards() if not math.isnan(r)]
    assert metrics == pytest.approx(
        {
            "rewards/accuracy/mean": statistics.fmean(first),
            "rewards/accuracy/std": statistics.stdev(first),
            "rewards/format/mean": statistics.fmean(second),
            "rewards/format/std": statistics.stdev(second),
            "reward": statistics.fmean(rewards),
            "reward_std": statistics.stdev(rewards),
            "frac_reward_zero_std": 0.0,
        }
    )


def test_advantages_and_metrics_equal_trls_own_code_on_the_same_numbers():
    """bench/grpo_advantages_vs_trl.py runs TRL's own lines (read from GRPOTrainer's source in .venv-trl, made as
    test_trl_peers makes it) beside ours on 600 random cases: the same advantages and zero-std flags, the same
    reward metrics within 1e-6."""
    import json
    import subprocess

    from conftest import REPO, subprocess_env

    trl_python = REPO / ".venv-trl" / "bin" / "python"
    env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    if not trl_python.exists():
        command = ["make", "-o", ".venv/.installed", ".venv-trl/.installed"]
        make = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert make.returncode == 0, f"make .venv-trl/.installed failed:\n{(make.stdout + make.stderr)[-6000:]}"
    peer = [str(trl_python), str(REPO / "bench" / "grpo_advantages_vs_trl.py")]
    done = subprocess.run(peer, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cases"] == 600 and not result["differences"], result
    assert result["largest_advantage_difference"] <= 1e-6, result
