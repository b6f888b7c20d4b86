"""TRL's KTOTrainer as a benchmark peer: the figures it logs for the first steps of unpaired rows. Two optimizer
steps of trl.KTOTrainer (trl==1.16.0, loss_type="kto") on CPU in fp32, the rows of a JSONL file (prompt,
completion, label; text or messages) in file order, --batch-size rows per step (sequential sampling: TRL's KL rows
are each batch rotated by one, in this order), the reference a second frozen load of the model; writes what TRL
logged at each step (loss, kl, rewards/*, logps/*, grad_norm; figures computed before that step's update) and each
row's token ids (prompt, completion). Run it with the separate TRL venv; bench/kto_vs_trl.py compares it with ours:

  .venv-trl/bin/python bench/trl_kto_peer.py --model DIR --rows FILE.jsonl --batch-size 8 --max-length 128 \
      --steps 2 --lr 1e-3 --out runs/trl_kto.json

DIR: a save_pretrained folder holding a causal LM and its tokenizer (loaded offline); every float config field named
*dropout* is set to 0, and TRL's disable_dropout=True zeroes every nn.Dropout.
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import KTOConfig, KTOTrainer  # noqa: E402

METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


class LogCapture(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def load_model(path: str):
    config = AutoConfig.from_pretrained(path)
    for name, value in config.to_dict().items():
        if isinstance(value, float) and "dropout" in name:
            setattr(config, name, 0.0)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--desirable-weight", type=float, default=1.0)
    parser.add_argument("--undesirable-weight", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.rows, encoding="utf-8") if line.strip()]
    torch.manual_seed(0)
    model, ref_model = load_model(args.model), load_model(args.model).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    capture = LogCapture()
    with tempfile.TemporaryDirectory() as tmp:
        settings = KTOConfig(
            output_dir=tmp,
            beta=args.beta,
            desirable_weight=args.desirable_weight,
            undesirable_weight=args.undesirable_weight,
            max_length=args.max_length,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=1,
            max_steps=args.steps,
            logging_steps=1,
            learning_rate=args.lr,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
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
        trainer = KTOTrainer(
            model=model,
            ref_model=ref_model,
            args=settings,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[capture],
        )
        prepared = trainer.train_dataset
        trainer.train()
    steps = [log for log in capture.logs if "loss" in log and "train_runtime" not in log]
    import trl

    result = {
        "trl_version": trl.__version__,
        "steps": [{name: float(log[name]) for name in (*METRICS, "grad_norm") if name in log} for log in steps],
        "rows": [{"prompt": list(r["prompt_ids"]), "completion": list(r["completion_ids"])} for r in prepared],
    }
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
