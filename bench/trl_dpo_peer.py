"""TRL's DPOTrainer as a benchmark peer: the step-1 metrics and token ids it produces for a batch of preference pairs.

Our DPO loss must reproduce TRL's first-step numbers (loss, rewards/chosen, rewards/rejected within 1e-5 in fp32).
This script runs exactly one optimizer step of trl.DPOTrainer (trl==1.16.0) on CPU in fp32 with the first N rows of a
pairs file as the one batch, in file order, and writes what TRL logged for that step (computed before the update:
loss, rewards/*, logps/*, and grad_norm, the global L2 norm of the gradients before clipping) plus the token ids TRL
built for each row; bench/dpo_vs_trl.py compares them with ours. Run it with the separate TRL venv
(`make .venv-trl/.installed`):

  .venv-trl/bin/python bench/trl_dpo_peer.py --model DIR --pairs FILE.jsonl --beta 0.1 --loss-type sigmoid \
      --batch-size 4 --max-length 128 --out runs/trl_dpo.json [--ref-model REF_DIR] [--check]

DIR is a save_pretrained folder holding a causal LM and its tokenizer (loaded offline). Rows are plain text
{"prompt": str, "chosen": str, "rejected": str} or conversational (lists of {"role", "content"} messages; the
tokenizer then needs a chat template).

Dropout: every float config field named *dropout*/*pdrop* is set to 0 before loading, and TRL's disable_dropout=True
(its default) zeroes every nn.Dropout of both models.

Reference model: a second, frozen load of DIR (what TRL itself does with ref_model=None), or of REF_DIR. With the
same weights the step-1 rewards are exactly 0 and the loss is log 2 (sigmoid) or (1/(2*beta))^2 (ipo) whatever the
code does, so only logps/* test anything; a different REF_DIR (same tokenizer) gives non-zero rewards to compare.

Output rows: prompt_input_ids + chosen_input_ids (resp. rejected_input_ids) is the sequence TRL scores, cut to its
first --max-length tokens by TRL's collator. --check recomputes loss and rewards by hand (plain forward, log-softmax,
sum over completion tokens) and adds the largest absolute difference from TRL's values.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

METRICS = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "grad_norm",  # the global L2 norm of the gradients before clipping (the Trainer's clip_grad_norm_)
]

# The reference-free losses' trainers (trl.experimental in 1.16): --loss-type simpo runs CPOTrainer with
# loss_type="simpo", cpo_alpha=0; orpo runs ORPOTrainer. Each is fed DPOTrainer's token ids for the same rows (its
# own tokenize_row replaced by one that lays them out as it would: prompt + answer, the prompt's labels -100), so
# the comparison is of the losses and metrics on the very tokens the DPO cases check against ours.
REFERENCE_FREE = ("simpo", "orpo")
FREE_METRICS = {
    "simpo": METRICS,
    "orpo": [*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"],
}


def load_model(path: str) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(path)
    for name, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)


class LogCapture(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def by_hand(
    model_dir: str, ref_dir: str, rows: list[dict], beta: float, loss_type: str, max_length: int
) -> dict[str, float]:
    """Loss and rewards from TRL's token ids, independently of TRL's collator and fused log-prob head."""
    policy, ref = load_model(model_dir).eval(), load_model(ref_dir).eval()

    def logp(model, prompt, completion):  # sum of log p(token) over the completion tokens that survive truncation
        ids = torch.tensor([(prompt + completion)[:max_length]])
        with torch.no_grad():
            logprobs = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        per_token = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
        n = ids.size(1) - len(prompt)
        return per_token[len(prompt) - 1 :].sum(), n

    losses, chosen_rewards, rejected_rewards = [], [], []
    for row in rows:
        p = row["prompt_input_ids"]
        (pc, nc), (pr, nr) = (logp(policy, p, row["chosen_input_ids"]), logp(policy, p, row["rejected_input_ids"]))
        rc, rr = logp(ref, p, row["chosen_input_ids"])[0], logp(ref, p, row["rejected_input_ids"])[0]
        chosen_rewards.append(beta * (pc - rc))
        rejected_rewards.append(beta * (pr - rr))
        if loss_type == "sigmoid":
            losses.append(-F.logsigmoid(beta * ((pc - rc) - (pr - rr))))
        else:  # ipo: log-ratios averaged over the completion's tokens
            losses.append(((pc - rc) / max(nc, 1) - (pr - rr) / max(nr, 1) - 1 / (2 * beta)) ** 2)
    mean = lambda xs: torch.stack(xs).mean().item()  # noqa: E731
    return {"loss": mean(losses), "rewards/chosen": mean(chosen_rewards), "rewards/rejected": mean(rejected_rewards)}


def one_step_settings(args, tmp: str) -> dict:
    """What every TRL trainer config here shares: one sequential fp32 CPU step of the first --batch-size rows."""
    return dict(
        output_dir=tmp,
        beta=args.beta,
        max_length=args.max_length,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        dataloader_drop_last=False,
        disable_tqdm=True,
        seed=0,
    )


def run_reference_free(args, tokenizer, model, prepared, capture, tmp: str) -> None:
    """One step of CPOTrainer (simpo) or ORPOTrainer on `prepared`'s token ids (DPOTrainer's), logged to
    `capture`."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    def tokenize_row(self, feature, model=None):
        prompt = feature["prompt_ids"]
        row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
        for side in ("chosen", "rejected"):
            ids = (prompt + feature[f"{side}_ids"])[: args.max_length]
            row[f"{side}_input_ids"], row[f"{side}_attention_mask"] = ids, [1] * len(ids)
            row[f"{side}_labels"] = [-100] * len(prompt) + ids[len(prompt) :]
        return row

    ids = Dataset.from_list(
        [
            {
                "prompt": "p",
                "chosen": "c",
                "rejected": "r",
                **{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")},
            }
            for r in prepared
        ]
    )
    common = one_step_settings(args, tmp) | dict(remove_unused_columns=False)
    if args.loss_type == "simpo":
        trainer_class = CPOTrainer
        config = CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=args.simpo_gamma)
    else:
        trainer_class, config = ORPOTrainer, ORPOConfig(**common)
    trainer_class.tokenize_row = tokenize_row
    trainer = trainer_class(
        model=model, args=config, train_dataset=ids, processing_class=tokenizer, callbacks=[capture]
    )
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="save_pretrained folder: causal LM + tokenizer")
    parser.add_argument("--pairs", required=True, help="JSONL with prompt/chosen/rejected (text or messages)")
    parser.add_argument("--ref-model", help="reference model folder (default: --model, TRL's own default)")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", choices=["sigmoid", "ipo", *REFERENCE_FREE], default="sigmoid")
    parser.add_argument("--simpo-gamma", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, required=True, help="the first N rows form the one batch")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--out", required=True)
    parser.add_argument("--check", action="store_true", help="also recompute loss and rewards by hand")
    args = parser.parse_args()

    with open(args.pairs) as f:
        records = [json.loads(line) for line in f if line.strip()][: args.batch_size]
    if len(records) < args.batch_size:
        raise SystemExit(f"{args.pairs} has {len(records)} rows, fewer than --batch-size {args.batch_size}")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model)
    ref_dir = args.ref_model or args.model
    ref_model = load_model(ref_dir).eval().requires_grad_(False)
    capture = LogCapture()
    free = args.loss_type in REFERENCE_FREE
    with tempfile.TemporaryDirectory() as tmp:
        loss_type = ["sigmoid" if free else args.loss_type]
        config = DPOConfig(**one_step_settings(args, tmp), loss_type=loss_type)
        trainer = DPOTrainer(
            model=model,
            ref_model=ref_model,
            args=config,
            train_dataset=Dataset.from_list(records),
            processing_class=tokenizer,
            callbacks=[capture],
        )
        prepared = trainer.train_dataset  # tokenized; rows whose prompt alone fills max_length are dropped
        if len(prepared) != args.batch_size:
            raise SystemExit(f"TRL kept {len(prepared)} of {args.batch_size} rows (prompt >= --max-length?)")
        if free:
            run_reference_free(args, tokenizer, model, prepared, capture, tmp)
        else:
            trainer.train()
    step1 = next(log for log in capture.logs if "rewards/chosen" in log)
    metrics = FREE_METRICS[args.loss_type] if free else METRICS
    rows = [
        {
            "prompt_input_ids": r["prompt_ids"],
            "chosen_input_ids": r["chosen_ids"],
            "rejected_input_ids": r["rejected_ids"],
        }
        for r in prepared
    ]
    result = {
        "trl_version": __import__("trl").__version__,
        "model": args.model,
        "ref_model": ref_dir,
        "pairs": args.pairs,
        "beta": args.beta,
        "loss_type": args.loss_type,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "metrics": {k: step1[k] for k in metrics},
        "all_logged": step1,
        "rows": rows,
    }
    if args.check and not free:
        hand = by_hand(args.model, ref_dir, rows, args.beta, args.loss_type, args.max_length)
        result["check"] = {"by_hand": hand, "max_abs_diff": max(abs(hand[k] - step1[k]) for k in hand)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"metrics": result["metrics"], **({"check": result["check"]} if args.check else {})}, indent=1))


if __name__ == "__main__":
    main()
