"""Our task=dpo against TRL's DPOTrainer (trl==1.16.0 from PyPI, a benchmark peer only, never a dependency): the
step-1 figures of both on the same tiny Llama, the same pairs, beta and batch, in fp32 on CPU.

`make bench-dpo-trl` (creates .venv-trl: trl installed with --no-deps beside .venv's packages). One starting point:
a Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, untied head, dropout 0) initialised from torch.manual_seed(0)
and saved with save_pretrained, beside a byte-level BPE tokenizer learned from the shipped preference sample
(ChatML's control tokens special, ChatML as its chat template). Pairs: the sample's first 8 rows, conversational
(prompt/chosen/rejected messages, rendered by the template) and the same rows as plain text (the user's content, the
answers' contents; EOS appended to each answer). One batch of all 8 pairs, beta 0.1, max_length 128, one step, for
dpo_loss sigmoid and ipo; and, on the conversational pairs, simpo against CPOTrainer (loss_type="simpo",
cpo_alpha=0, simpo_gamma 0.5) and orpo against ORPOTrainer (also nll_loss, log_odds_ratio, log_odds_chosen), both
fed DPOTrainer's token ids for the rows (bench/trl_peer.py's docstring says how).
Ours: scripts/train.py (recipes/llama/tp.yaml, model=<folder>, one process), its first
metrics.jsonl record; TRL: `bench/trl_peer.py dpo` in .venv-trl, what DPOTrainer logged for step 1.

At step 1 the policy is the reference, so both report rewards 0 and a loss of ln 2 (sigmoid) or 1/(4 beta^2)
(ipo) whatever the code does; the figures that test something are logps/chosen, logps/rejected (sums of the
answers' token log-probabilities, means over the pairs) and grad_norm (the global L2 norm of the gradients before
clipping, on both sides). Each figure must agree within its limit (trl_compare.tolerance); the token ids of every
row are compared too (ours: the data the run trains on; TRL's: the peer's rows), and the first difference is
printed where they differ.

Prints one markdown table (docs/benchmarks.md) and writes runs/bench/dpo-vs-trl/results.json; exit code 1 when a
figure or a token differs (bench/trl_compare.py runs it). tests/loop/test_trl_peers.py runs the same comparison
with this module's functions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # bench/'s scripts import each other by name
    sys.path.append(str(Path(__file__).resolve().parent))
import trl_compare as common  # noqa: E402
from trl_compare import RECIPE, REPO  # noqa: E402

NAME = "dpo"
SAMPLE = REPO / "src" / "parallel_finetune" / "sample_data" / "preference" / "train.jsonl"
PAIRS = 8  # the sample's first rows: the one batch
BETA = 0.1
MAX_LENGTH = 128
FORMATS = ("conversational", "text")
LOSSES = ("sigmoid", "ipo")
# the reference-free losses (TRL's CPOTrainer loss_type=simpo, cpo_alpha=0, simpo_gamma 0.5, and ORPOTrainer), on
# the conversational pairs' token ids (the peer feeds them DPOTrainer's, which the DPO cases check against ours)
FREE_LOSSES = ("simpo", "orpo")
CASES = [(fmt, loss) for fmt in FORMATS for loss in LOSSES] + [("conversational", loss) for loss in FREE_LOSSES]
FIGURES = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "grad_norm",
)
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")
ORPO_FIGURES = ("nll_loss", "log_odds_ratio", "log_odds_chosen")  # ORPO's own, besides FIGURES


def figures_of(loss: str) -> tuple[str, ...]:
    """The figures compared for a loss: FIGURES, and ORPO's own."""
    return FIGURES + ORPO_FIGURES if loss == "orpo" else FIGURES


def _as_text(row: dict) -> dict:
    """A conversational pair as plain text: the user's content, then each answer's assistant content."""
    user = [m["content"] for m in row["prompt"] if m["role"] == "user"]
    return {"prompt": user[-1], "chosen": row["chosen"][-1]["content"], "rejected": row["rejected"][-1]["content"]}


def write_fixture(folder: Path) -> Path:
    """`folder`/model (a tiny Llama and its tokenizer, save_pretrained) and `folder`/<format>/{train,validation}
    .jsonl for each of FORMATS (validation: the first 4 pairs). Returns `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from parallel_finetune.data.chat import CHATML
    from parallel_finetune.data.prepare import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    sentences = [m["content"] for row in rows for key in ("prompt", "chosen", "rejected") for m in row[key]]
    model_dir = folder / "model"
    tokenizer = train_tokenizer("bpe", sentences, 600, folder / "tokenizer", specials=CHATML_SPECIALS)
    tokenizer.chat_template = CHATML
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=2 * MAX_LENGTH,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    pairs = {"conversational": rows[:PAIRS], "text": [_as_text(row) for row in rows[:PAIRS]]}
    for fmt, chosen in pairs.items():
        (folder / fmt).mkdir(exist_ok=True)
        for split, split_rows in (("train", chosen), ("validation", chosen[:4])):
            text = "".join(json.dumps(row) + "\n" for row in split_rows)
            (folder / fmt / f"{split}.jsonl").write_text(text, encoding="utf-8")
    return folder


def ours_overrides(folder: Path, case: tuple[str, str], cache_dir: Path) -> list[str]:
    """scripts/train.py's overrides (after RECIPE) for one case: one step of one batch of PAIRS pairs."""
    fmt, loss = case
    settings = dict(batch_size=PAIRS, max_length=MAX_LENGTH, dpo_loss=loss, dpo_beta=BETA)
    return common.ours_overrides("dpo", folder / "model", folder / fmt, cache_dir, **settings)


def ours_tokens(folder: Path, case: tuple[str, str], cache_dir: Path) -> list[dict]:
    """The rows our run trains on (the run's own data preparation, from the cache the run filled): for each pair,
    prompt_length and the chosen and rejected rows' token ids, in file order."""
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    config = load_config(RECIPE, ours_overrides(folder, case, cache_dir))
    train = prepare_data(config).splits["train"]
    rows = sorted(zip(train["index"], train["prompt_length"], train["input_ids"], train["rejected_ids"]))
    return [{"prompt_length": p, "chosen": list(c), "rejected": list(r)} for _, p, c, r in rows]


def trl_request(folder: Path, case: tuple[str, str], cache_dir: Path, out: Path) -> list[str]:
    """The peer's arguments for one case."""
    fmt, loss = case
    pairs = folder / fmt / "train.jsonl"
    settings = dict(beta=BETA, loss_type=loss, batch_size=PAIRS, max_length=MAX_LENGTH, out=out)
    return common.peer_request("dpo", model=folder / "model", pairs=pairs, **settings)


def read_trl(out: Path) -> dict:
    """The peer's output: `trl_version`, its step-1 figures (`steps`: one) and its `rows`, as ours_tokens gives
    ours."""
    result = json.loads(out.read_text())
    rows = [
        {
            "prompt_length": len(row["prompt_input_ids"]),
            "chosen": (row["prompt_input_ids"] + row["chosen_input_ids"])[: result["max_length"]],
            "rejected": (row["prompt_input_ids"] + row["rejected_input_ids"])[: result["max_length"]],
        }
        for row in result["rows"]
    ]
    figures = {figure: float(result["metrics"][figure]) for figure in figures_of(result["loss_type"])}
    return {"trl_version": result["trl_version"], "steps": [figures], "rows": rows}


def compared(folder: Path, case: tuple[str, str], cache_dir: Path, ours_dir: Path, trl_out: Path, decode=None) -> dict:
    """One case: our run in `ours_dir` against the peer's `trl_out`, figure by figure and token by token."""
    fmt, loss = case
    trl, figures = read_trl(trl_out), figures_of(loss)
    limit = lambda figure: common.tolerance(figure, loss)  # noqa: E731
    rows = common.compare(common.read_ours(ours_dir, figures), trl["steps"], figures, limit)
    differences = common.token_differences(ours_tokens(folder, case, cache_dir), trl["rows"], decode)
    return common.result_of({"format": fmt, "loss": loss}, trl, rows, differences)


def table(results: list[dict]) -> str:
    """Ours vs TRL per figure, one row per figure and case."""
    title = (
        f"Step 1 of task=dpo vs TRL {results[0]['trl_version']} DPOTrainer: tiny Llama, {PAIRS} pairs of the shipped "
        f"preference sample in one batch, beta {BETA}, max_length {MAX_LENGTH}, fp32, CPU."
    )
    return common.markdown_table(title, {"pairs": "format", "dpo_loss": "loss"}, results)


if __name__ == "__main__":
    sys.exit(common.main(sys.modules[__name__]))
