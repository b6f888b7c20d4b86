"""generate_every: a tiny instruction-tuned Llama's greedy answers to held-out prompts, written to generations.jsonl,
equal transformers' generate(do_sample=False) on the exported hf/ model, and a tensor-parallel and a pipeline run
write the same answers as one process. The lr is tiny, so the barely trained model answers with many tokens of
near-random text: every token of every answer is compared, not only an early end of turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, launch, tiny_overrides

SFT = REPO / "recipes" / "llama" / "sft.yaml"
NEW_TOKENS = 8


def generation_overrides(sst2: Path, cache_dir: Path, **extra) -> list[str]:
    """3 steps of the sft recipe's tiny Llama (packed batches) on the chat sample, generations at steps 2 and 3."""
    values = {
        "data_dir": "",
        "max_length": 128,
        "lr": 1e-5,
        "max_steps": 3,
        "generate_every": 2,
        "generate_prompts": 3,
        "generate_max_new_tokens": NEW_TOKENS,
        **extra,
    }
    return tiny_overrides(sst2, cache_dir, "sft", "llama", **values)


def generations(run_folder: Path) -> list[dict]:
    return [json.loads(line) for line in (run_folder / "generations.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(sst2, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("generate") / "single"
    launch(1, generation_overrides(sst2, cache_dir, export="true"), out, recipe=SFT)
    return out


def test_generations_equal_transformers_generate_on_the_exported_model(one_process):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parallel_finetune.data.chat import stop_ids

    written = generations(one_process)
    assert [g["step"] for g in written] == [2, 2, 2, 3, 3, 3]
    assert [g["prompt"] for g in written[:3]] == [g["prompt"] for g in written[3:]]
    assert all(g["prompt"].endswith("<|im_start|>assistant\n") for g in written)  # the generation prompt
    model = AutoModelForCausalLM.from_pretrained(one_process / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(one_process / "hf")
    stops = sorted(stop_ids(tokenizer))
    assert tokenizer.convert_ids_to_tokens(stops) == ["<|endoftext|>", "<|im_end|>"]  # EOS and ChatML's end of turn
    # the export stops there by itself: generate below is given no eos_token_id
    assert model.generation_config.eos_token_id == stops
    lengths = []
    for record in written[3:]:
        ids = tokenizer(record["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
            )
        new = [token for token in out[0, ids.shape[1] :].tolist() if token not in stops]
        assert record["answer"] == tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        lengths.append(len(new))
    assert max(lengths) == NEW_TOKENS  # at least one answer ran to max_new_tokens: many tokens compared


@pytest.mark.parametrize(
    "nproc,layout",
    [(2, ["tensor_parallel_degree=2"]), (2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"])],
    ids=["tp2", "pp2"],
)
def test_every_layout_writes_the_answers_of_one_process(nproc, layout, one_process, sst2, cache_dir, tmp_path):
    out = tmp_path / "run"
    launch(nproc, generation_overrides(sst2, cache_dir) + layout, out, recipe=SFT)
    assert generations(out) == generations(one_process)


def test_generate_every_is_refused_outside_sft(sst2, cache_dir):
    from parallel_finetune.errors import UserError
    from parallel_finetune.resolve import load_config

    refused = r"generate_every=5 is task=sft's \(it answers the validation conversations' prompts\), and task="
    with pytest.raises(UserError, match=refused + r"classification does not read it; drop it or set task=sft$"):
        load_config(REPO / "recipes" / "llama" / "tp.yaml", ["size=tiny", "generate_every=5"])
    with pytest.raises(UserError, match=r"generate_max_new_tokens=0 must be at least 1"):
        load_config(SFT, ["size=tiny", "generate_max_new_tokens=0"])
