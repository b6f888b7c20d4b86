"""rl/rollout.py on a tiny Llama (families' tiny config, a fixed seed, fp32): greedy decoding with the KV cache
gives transformers' generate's tokens; sampling with the cache gives what a no-cache reference (each completion
alone, its whole prefix forwarded for every token) draws with the same uniforms, for a plain, a LoRA (ours) and
a peft model; stops and truncation; the same completions whatever the batch beside them, and none saved state;
and under layouts (2 gloo ranks, tests/workers/rollout_layouts.py): TP=2 and FSDP DP=2 sample exactly the
completions one process samples."""

from __future__ import annotations

import json

import harness
import numpy as np
import pytest
import torch
from conftest import REPO, subprocess_env
from transformers import LlamaForCausalLM

from parallel_finetune.families import get_family
from parallel_finetune.rl.rollout import SamplingSettings, next_tokens, sample, uniforms

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [3]]
PAD = 0


def tiny_llama(seed: int = 0, dropout: float = 0.0) -> LlamaForCausalLM:
    """The family's tiny config; weights drawn wider than transformers' 0.02 so that the next token's distribution
    is peaked (a greedy choice then does not hang on the last bit of a near tie)."""
    config = get_family("llama").tiny_config(vocab_size=256, max_positions=128)
    config.initializer_range, config.attention_dropout = 0.2, dropout
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def settings(**changes) -> SamplingSettings:
    values = dict(num_generations=2, max_completion_length=10, stop_ids=frozenset({2}), pad_id=PAD, seed=7)
    return SamplingSettings(**{**values, **changes})


def reference(model, prompts, indices, chosen: SamplingSettings, step: int) -> list[list[int]]:
    """Each completion alone, no cache, no padding: the whole prefix forwarded for every token, the same uniforms."""
    out = []
    for prompt, index in zip(prompts, indices):
        for generation in range(chosen.num_generations):
            noise = torch.from_numpy(uniforms(chosen.seed, step, [index], [generation], chosen.max_completion_length))
            ids = list(prompt)
            for t in range(chosen.max_completion_length):
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[:, -1].float()
                token = int(next_tokens(logits, noise[:, t], chosen))
                ids.append(token)
                if token in chosen.stop_ids:
                    break
            out.append(ids[len(prompt) :])
    return out


# ------------------------------------------------------------------------------------------- against generate
@pytest.mark.parametrize("greedy", [dict(temperature=0.0), dict(temperature=1.0, top_k=1)])
def test_greedy_decoding_gives_generates_tokens(greedy):
    model = tiny_llama()
    free = sample(model, PROMPTS, [0, 1, 2, 3], settings(num_generations=1, stop_ids=frozenset(), **greedy), 0)
    stop = free.completion_ids[0, 3].item()  # a token row 0 says fourth: it stops there, others wherever it comes
    chosen = settings(num_generations=1, max_completion_length=12, stop_ids=frozenset({stop}), **greedy)
    ours = sample(model, PROMPTS, [0, 1, 2, 3], chosen, 0)
    width = max(map(len, PROMPTS))
    ids = torch.full((4, width), PAD)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(PROMPTS):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = torch.tensor(prompt), 1
    generated = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[stop], pad_token_id=PAD
    )[:, width:]
    assert ours.completion_ids.tolist() == generated.tolist()
    assert ours.completions()[0][-1] == stop and len(ours.completions()[0]) == 4


# ------------------------------------------------------------------------------------------- against no cache
def tiny_gpt2():
    """Learned absolute positions (no rotary, which shifted positions would not change): the left-padded rows'
    positions must be their unpadded selves'."""
    from transformers import GPT2LMHeadModel

    config = get_family("gpt2").tiny_config(vocab_size=256, max_positions=128)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def lora_llama():
    from parallel_finetune.model import lora
    from parallel_finetune.model.weights import local_tensor, materialize

    model, family = tiny_llama(), get_family("llama")
    names = lora.apply_lora(model, family, lora.LoraSettings(4, 8.0, 0.1, lora.ALL_LINEAR, ()), None)
    materialize(model, torch.device("cpu"))
    torch.manual_seed(1)
    for name in names:  # B is zero at the start of training: draw both, so that the adapters change the answers
        local_tensor(model.get_parameter(name)).detach().normal_(0, 0.1)
    return model


def peft_llama():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    return model


@pytest.mark.parametrize(
    "build", [tiny_llama, tiny_gpt2, lora_llama, peft_llama], ids=["llama", "gpt2", "llama-lora", "llama-peft"]
)
def test_sampling_with_the_cache_draws_what_a_no_cache_reference_draws(build):
    model = build()
    chosen = settings(temperature=0.9, top_p=0.95, top_k=50, num_generations=3, max_completion_length=6)
    prompts = PROMPTS[:3]  # the longest, the shortest but one, and one between: every row padded differently
    ours = sample(model, prompts, [4, 5, 6], chosen, step=3)
    assert ours.completions() == reference(model, prompts, [4, 5, 6], chosen, step=3)
    assert ours.prompt_indices.tolist() == [4, 4, 4, 5, 5, 5, 6, 6, 6]
    assert ours.generations.tolist() == [0, 1, 2] * 3
    assert len({tuple(c) for c in ours.completions()}) > 5  # sampled: a prompt's generations differ


def test_the_model_samples_in_eval_mode_and_gets_its_mode_back():
    model = lora_llama()  # LoRA dropout 0.1: in training mode the forwards would differ
    modes = []
    model.model.layers[0].register_forward_hook(lambda module, *_: modes.append(module.training))
    model.train()
    trained = sample(model, PROMPTS, [0, 1, 2, 3], settings(), 0)
    assert model.training and not any(modes)
    model.eval()
    assert sample(model, PROMPTS, [0, 1, 2, 3], settings(), 0).completions() == trained.completions()
    assert not model.training


# ------------------------------------------------------------------------------------------- stops, truncation
def test_rows_stop_at_a_stop_token_and_the_others_are_truncated():
    model = tiny_llama()
    free = sample(model, PROMPTS, [0, 1, 2, 3], settings(stop_ids=frozenset(), max_completion_length=6), 0)
    assert free.truncated.all() and free.completion_mask.sum(-1).tolist() == [6] * 8
    first = free.completion_ids[0].tolist()
    stops = {first[2], 999}  # a token row 0 draws third, and one nobody draws (as EOS and end-of-turn: a set)
    ours = sample(model, PROMPTS, [0, 1, 2, 3], settings(stop_ids=frozenset(stops), max_completion_length=6), 0)
    for row, full in zip(ours.completions(), free.completions()):
        # every row is the free row up to its first stop token, that token included
        cut = next((i + 1 for i, token in enumerate(full) if token in stops), len(full))
        assert row == full[:cut]
    assert ours.completions()[0] == first[:3]
    lengths = ours.completion_mask.sum(-1)
    ends = [row[-1] for row in ours.completions()]
    assert ours.truncated.tolist() == [end not in stops for end in ends]
    assert ((lengths < 6) <= ~ours.truncated).all()  # shorter than the limit: stopped
    padded = ours.completion_ids.masked_select(ours.completion_mask == 0)
    assert (padded == PAD).all() and ours.completion_ids.shape[1] == int(lengths.max())


# ------------------------------------------------------------------------------------------- randomness
def test_a_completion_is_the_same_whatever_is_sampled_beside_it():
    model = tiny_llama()
    chosen = settings(temperature=1.0)
    whole = sample(model, PROMPTS, [0, 1, 2, 3], chosen, step=5).completions()
    assert sample(model, PROMPTS, [0, 1, 2, 3], chosen, step=5).completions() == whole  # no state carried
    alone = sample(model, [PROMPTS[2]], [2], chosen, step=5).completions()
    assert alone == whole[4:6]
    assert sample(model, PROMPTS[::-1], [3, 2, 1, 0], chosen, step=5).completions() == [
        c for pair in (whole[6:8], whole[4:6], whole[2:4], whole[0:2]) for c in pair
    ]
    assert sample(model, PROMPTS, [0, 1, 2, 3], chosen, step=6).completions() != whole  # a new step, new draws
    other_seed = SamplingSettings(**{**chosen.__dict__, "seed": 8})
    assert sample(model, PROMPTS, [0, 1, 2, 3], other_seed, step=5).completions() != whole


def test_uniforms_depend_on_their_own_key_only():
    table = uniforms(3, 10, [0, 1, 2], [0, 1, 0], 50)
    assert table.shape == (3, 50) and (table >= 0).all() and (table < 1).all()
    assert np.array_equal(table[1], uniforms(3, 10, [1], [1], 50)[0])  # the row alone
    assert np.array_equal(table[:, :20], uniforms(3, 10, [0, 1, 2], [0, 1, 0], 20))  # a prefix of the positions
    assert not np.array_equal(table[0], table[2, :])  # another prompt, same generation
    assert not np.array_equal(table[0], uniforms(3, 11, [0], [0], 50)[0])  # another step
    assert not np.array_equal(table[0], uniforms(4, 10, [0], [0], 50)[0])  # another seed
    many = uniforms(0, 0, range(100), [0] * 100, 100)
    assert abs(many.mean() - 0.5) < 0.01 and abs(many.var() - 1 / 12) < 0.005


def test_the_inverse_cdf_draws_the_filtered_distribution():
    """Over an even grid of uniforms each token is drawn in proportion to its probability after temperature,
    top-k and top-p, and tokens filtered out are never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, 3.0]])
    grid = (torch.arange(6000, dtype=torch.float64) + 0.5) / 6000

    def counts(**changes) -> list[float]:
        chosen = settings(**changes)
        drawn = next_tokens(logits.expand(len(grid), -1), grid, chosen)
        return (torch.bincount(drawn, minlength=6).double() / len(grid)).tolist()

    assert counts(temperature=0.5) == pytest.approx((logits[0] / 0.5).softmax(-1).tolist(), abs=1e-3)
    top3 = torch.tensor([3.0, 3.0, 2.0]).softmax(-1).tolist()  # ties keep the vocabulary's order: 4, 5, then 0
    assert counts(top_k=3) == pytest.approx([top3[2], 0, 0, 0, top3[0], top3[1]], abs=1e-3)
    probs = logits[0].softmax(-1)
    # 4 and 5 hold 0.73 of the mass: top_p=0.7 keeps them (and the first token past 0.7 is not needed)
    kept = probs[[4, 5]] / probs[[4, 5]].sum()
    assert counts(top_p=0.7) == pytest.approx([0, 0, 0, 0, kept[0].item(), kept[1].item()], abs=1e-3)
    assert counts(temperature=0.0) == [0, 0, 0, 0, 1.0, 0]  # greedy: the first of the tied best


# ------------------------------------------------------------------------------------------- layouts
def test_tp2_and_fsdp_dp2_sample_what_one_process_samples():
    """Two gloo ranks: TP=2 (the family's plan) samples on both ranks exactly one process's completions; FSDP over 2
    ranks, rank 0 with one prompt and rank 1 with three, samples each prompt's completions exactly as one process
    does, every rank running the same number of forwards though rank 0's rows end first."""
    ranks = harness.run_ranks(2, ["tests/workers/rollout_layouts.py"], subprocess_env(), REPO, timeout_s=300)
    assert ranks.returncode == 0, ranks.report()
    result = json.loads(ranks.ranks[0].stdout.strip().splitlines()[-1])
    assert result["tp_equal"] == [True, True], result
    assert result["fsdp_equal"], result
    assert result["fsdp_forwards"][0] == result["fsdp_forwards"][1], result
    assert result["fsdp_own_steps"][0] < result["fsdp_own_steps"][1], result  # rank 0 was done first, and waited
    assert result["distinct"] > 4, result  # sampled, not one repeated answer


def test_the_speed_bench_runs_both_sides_on_the_same_rows(tmp_path):
    """bench/rollout_speed.py (its figures are the report's), shrunk to seconds: both sides make every token."""
    from conftest import load_bench

    result = load_bench("rollout_speed").main(
        ["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "128", "--prompts", "2", "--generations", "2",
         "--prompt-length", "10", "--new-tokens", "4", "--repeats", "1", "--out", str(tmp_path / "speed.json")]
    )  # fmt: skip
    assert result["rows"] == 4 and set(result["tokens_per_s"]) == {"rl/rollout.py sample", "transformers generate"}
    assert json.loads((tmp_path / "speed.json").read_text())["ratio"] == pytest.approx(result["ratio"])
