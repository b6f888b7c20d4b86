"""TRL's RewardTrainer as a benchmark peer: the step-1 metrics and token ids it produces for a batch of preference
pairs. One optimizer step of trl.RewardTrainer (trl==1.16.0) on CPU in fp32 with the first --batch-size rows of a
pairs file as the one batch, in file order; writes what TRL logged for that step (loss, accuracy, margin,
min_reward, mean_reward, max_reward, grad_norm: computed before the update) and the token ids of each row. Run it
with the separate TRL venv; bench/reward_vs_trl.py compares it with ours:

  .venv-trl/bin/python bench/trl_reward_peer.py --model DIR --pairs FILE.jsonl --batch-size 8 --max-length 128 \
      --out runs/trl_reward.json [--center-rewards-coefficient 0.01]

DIR: a save_pretrained folder holding a one-output sequence classifier and its tokenizer (loaded offline); every
float config field named *dropout* is set to 0, and TRL's disable_dropout=True zeroes every nn.Dropout.
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
from datasets import Dataset  # noqa: E402
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import RewardConfig, RewardTrainer  # noqa: E402

METRICS = ["loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm"]


class LogCapture(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairs", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--center-rewards-coefficient", type=float, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.pairs, encoding="utf-8") if line.strip()][: args.batch_size]
    config = AutoConfig.from_pretrained(args.model)
    for name, value in config.to_dict().items():
        if isinstance(value, float) and "dropout" in name:
            setattr(config, name, 0.0)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, config=config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    capture = LogCapture()
    with tempfile.TemporaryDirectory() as tmp:
        settings = RewardConfig(
            output_dir=tmp,
            max_length=args.max_length,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=1,
            max_steps=1,
            logging_steps=1,
            learning_rate=1e-6,
            warmup_steps=0,
            max_grad_norm=1.0,
            center_rewards_coefficient=args.center_rewards_coefficient,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            fp16=False,
            train_sampling_strategy="sequential",
            dataloader_drop_last=False,
            disable_tqdm=True,
            seed=0,
        )
        trainer = RewardTrainer(
            model=model,
            args=settings,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[capture],
        )
        prepared = trainer.train_dataset
        trainer.train()
    step = next(log for log in capture.logs if "loss" in log)
    import trl

    result = {
        "trl_version": trl.__version__,
        "metrics": {name: float(step[name]) for name in METRICS},
        "rows": [{"chosen": list(r["chosen_ids"]), "rejected": list(r["rejected_ids"])} for r in prepared],
        "pad_token_id": tokenizer.pad_token_id,
    }
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
