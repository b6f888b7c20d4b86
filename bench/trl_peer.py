"""TRL's trainers as benchmark peers (trl==1.16.0, run in the separate TRL venv `make .venv-trl/.installed`): what a
trainer logs for its first steps on CPU in fp32, and the token ids it built for each row, as JSON. One script for
every trainer kind, each a registered function; bench/*_vs_trl.py and tests/loop/test_trl_peers.py compare the
figures with ours (bench/trl_compare.py).

  .venv-trl/bin/python bench/trl_peer.py dpo --model DIR --pairs FILE.jsonl --beta 0.1 --loss-type sigmoid \
      --batch-size 8 --max-length 128 --out runs/trl_dpo.json [--ref-model REF_DIR] [--check]
  .venv-trl/bin/python bench/trl_peer.py reward --model DIR --pairs FILE.jsonl --batch-size 8 --max-length 128 \
      --out runs/trl_reward.json [--center-rewards-coefficient 0.01]
  .venv-trl/bin/python bench/trl_peer.py kto --model DIR --rows FILE.jsonl --batch-size 8 --max-length 128 \
      --steps 2 --lr 1e-3 --out runs/trl_kto.json
  .venv-trl/bin/python bench/trl_peer.py batch '[["dpo", "--model", ...], ["kto", ...], ...]'

`batch` runs several of these in one process, so that the imports of torch, transformers and trl (~6-12 s of CPU,
most of a run's cost) are paid once; a run that fails prints its traceback and the rest still run (exit code 1).

Shared by every kind: DIR is a save_pretrained folder holding the model and its tokenizer (loaded offline); every
float config field named *dropout*/*pdrop* is set to 0 before loading, and TRL's disable_dropout=True (its
default) zeroes every nn.Dropout; the batches are the file's rows in order (sequential sampling), --batch-size per
step; the figures of a step are computed before its update; torch's seed and the trainer's are 0.

dpo: one step of DPOTrainer (loss, rewards/*, logps/*, grad_norm: the global L2 norm of the gradients before
clipping). Rows are plain text {"prompt", "chosen", "rejected"} or conversational (lists of {"role", "content"};
the tokenizer's chat template renders them). The reference is a second, frozen load of DIR (what TRL does with
ref_model=None) or of --ref-model: with the same weights the step-1 rewards are exactly 0 and the loss log 2
(sigmoid) or (1/(2*beta))^2 (ipo) whatever the code does, so only logps/* test anything. Output rows:
prompt_input_ids + chosen_input_ids (resp. rejected_input_ids) is the sequence TRL scores, cut to its first
--max-length tokens by TRL's collator. --loss-type simpo and orpo run CPOTrainer (loss_type="simpo", cpo_alpha=0)
and ORPOTrainer on DPOTrainer's token ids for the rows (run_reference_free). --check recomputes loss and rewards by
hand (plain forward, log-softmax, sum over completion tokens) and adds the largest absolute difference from TRL's.

reward: one step of RewardTrainer on a one-output sequence classifier (loss, accuracy, margin, min/mean/max_reward,
grad_norm; lr 1e-6); rows' chosen and rejected token ids and the pad token id.

kto: --steps steps of KTOTrainer (loss_type="kto"; loss, kl, rewards/*, logps/*, grad_norm at each step), rows
{"prompt", "completion", "label"}, the reference a second frozen load; TRL's KL rows are each batch rotated by one.

A new kind is a function `run(args, tmp) -> dict` registered with `@kind(name, arguments)`, `arguments(parser)`
adding its own options beside the shared --model, --batch-size, --max-length and --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)

# name -> (arguments(parser), run(args, tmp) -> result): the trainer kinds this script runs
KINDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace, str], dict]]] = {}


def kind(name: str, arguments: Callable[[argparse.ArgumentParser], None]):
    """Registers the decorated `run(args, tmp) -> result` as the peer of trainer kind `name` (tmp: a scratch
    folder for the trainer's output_dir); `arguments(parser)` adds the kind's own options."""

    def register(run: Callable[[argparse.Namespace, str], dict]):
        KINDS[name] = (arguments, run)
        return run

    return register


def load_model(path: str, auto_class=AutoModelForCausalLM) -> torch.nn.Module:
    """`path`'s model in fp32, every float *dropout*/*pdrop* config field 0."""
    config = AutoConfig.from_pretrained(path)
    for name, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
    return auto_class.from_pretrained(path, config=config, dtype=torch.float32)


class LogCapture(TrainerCallback):
    """Every dict the trainer logs, in order."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def read_rows(path: str, limit: int | None = None) -> list[dict]:
    """The JSONL file's first `limit` rows (all with None); fewer than `limit` is an error."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:limit]
    if limit is not None and len(rows) < limit:
        raise SystemExit(f"{path} has {len(rows)} rows, fewer than --batch-size {limit}")
    return rows


def settings(config_class, args: argparse.Namespace, tmp: str, **extra):
    """`config_class` (a TRL trainer config) for sequential fp32 CPU steps of --batch-size rows, logged every step,
    nothing saved or reported; `extra` adds or replaces fields."""
    shared = dict(
        output_dir=tmp,
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
        train_sampling_strategy="sequential",
        dataloader_drop_last=False,
        disable_tqdm=True,
        seed=0,
    )
    return config_class(**(shared | extra))


def trainer_of(trainer_class, config, rows: list[dict], tokenizer, **models) -> tuple:
    """(`trainer_class` on `rows` with `models` (model=, ref_model=), the list its logs are appended to as it
    trains)."""
    capture = LogCapture()
    dataset = Dataset.from_list(rows)
    trainer = trainer_class(
        args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[capture], **models
    )
    return trainer, capture.logs


# ---- dpo (and the reference-free simpo and orpo) ----

DPO_METRICS = [
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
FREE_METRICS = {"simpo": DPO_METRICS, "orpo": [*DPO_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"]}


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


def run_reference_free(args, tokenizer, model, prepared, logs: list, tmp: str) -> None:
    """One step of CPOTrainer (simpo) or ORPOTrainer on `prepared`'s token ids (DPOTrainer's), logged to `logs`."""
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

    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    ids = [{"prompt": "p", "chosen": "c", "rejected": "r", **{k: r[k] for k in keys}} for r in prepared]
    common = dict(beta=args.beta, remove_unused_columns=False, gradient_checkpointing=False)
    if args.loss_type == "simpo":
        trainer_class = CPOTrainer
        config = settings(
            CPOConfig, args, tmp, **common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=args.simpo_gamma
        )
    else:
        trainer_class, config = ORPOTrainer, settings(ORPOConfig, args, tmp, **common)
    trainer_class.tokenize_row = tokenize_row
    trainer, step_logs = trainer_of(trainer_class, config, ids, tokenizer, model=model)
    trainer.train()
    logs.extend(step_logs)


def dpo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", required=True, help="JSONL with prompt/chosen/rejected (text or messages)")
    parser.add_argument("--ref-model", help="reference model folder (default: --model, TRL's own default)")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", choices=["sigmoid", "ipo", *REFERENCE_FREE], default="sigmoid")
    parser.add_argument("--simpo-gamma", type=float, default=0.5)
    parser.add_argument("--check", action="store_true", help="also recompute loss and rewards by hand")


@kind("dpo", dpo_arguments)
def run_dpo(args: argparse.Namespace, tmp: str) -> dict:
    from trl import DPOConfig, DPOTrainer

    records = read_rows(args.pairs, args.batch_size)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model)
    ref_dir = args.ref_model or args.model
    ref_model = load_model(ref_dir).eval().requires_grad_(False)
    free = args.loss_type in REFERENCE_FREE
    config = settings(
        DPOConfig,
        args,
        tmp,
        beta=args.beta,
        gradient_checkpointing=False,
        loss_type=["sigmoid" if free else args.loss_type],
    )
    trainer, logs = trainer_of(DPOTrainer, config, records, tokenizer, model=model, ref_model=ref_model)
    prepared = trainer.train_dataset  # tokenized; rows whose prompt alone fills max_length are dropped
    if len(prepared) != args.batch_size:
        raise SystemExit(f"TRL kept {len(prepared)} of {args.batch_size} rows (prompt >= --max-length?)")
    if free:
        run_reference_free(args, tokenizer, model, prepared, logs, tmp)
    else:
        trainer.train()
    step1 = next(log for log in logs if "rewards/chosen" in log)
    keys = {"prompt_input_ids": "prompt_ids", "chosen_input_ids": "chosen_ids", "rejected_input_ids": "rejected_ids"}
    rows = [{ours: r[theirs] for ours, theirs in keys.items()} for r in prepared]
    result = {
        "model": args.model,
        "ref_model": ref_dir,
        "pairs": args.pairs,
        "beta": args.beta,
        "loss_type": args.loss_type,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "metrics": {k: step1[k] for k in (FREE_METRICS[args.loss_type] if free else DPO_METRICS)},
        "all_logged": step1,
        "rows": rows,
    }
    if args.check and not free:
        hand = by_hand(args.model, ref_dir, rows, args.beta, args.loss_type, args.max_length)
        result["check"] = {"by_hand": hand, "max_abs_diff": max(abs(hand[k] - step1[k]) for k in hand)}
    print(json.dumps({"metrics": result["metrics"], **({"check": result["check"]} if "check" in result else {})}))
    return result


# ---- reward ----

REWARD_METRICS = ["loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm"]


def reward_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", required=True, help="JSONL with prompt/chosen/rejected (text or messages)")
    parser.add_argument("--center-rewards-coefficient", type=float, default=None)


@kind("reward", reward_arguments)
def run_reward(args: argparse.Namespace, tmp: str) -> dict:
    from trl import RewardConfig, RewardTrainer

    rows = read_rows(args.pairs)[: args.batch_size]
    model = load_model(args.model, AutoModelForSequenceClassification)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = settings(
        RewardConfig,
        args,
        tmp,
        learning_rate=1e-6,
        warmup_steps=0,
        max_grad_norm=1.0,
        center_rewards_coefficient=args.center_rewards_coefficient,
    )
    trainer, logs = trainer_of(RewardTrainer, config, rows, tokenizer, model=model)
    prepared = trainer.train_dataset
    trainer.train()
    step = next(log for log in logs if "loss" in log)
    return {
        "metrics": {name: float(step[name]) for name in REWARD_METRICS},
        "rows": [{"chosen": list(r["chosen_ids"]), "rejected": list(r["rejected_ids"])} for r in prepared],
        "pad_token_id": tokenizer.pad_token_id,
    }


# ---- kto ----

KTO_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def kto_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", required=True, help="JSONL with prompt/completion/label (text or messages)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--desirable-weight", type=float, default=1.0)
    parser.add_argument("--undesirable-weight", type=float, default=1.0)


@kind("kto", kto_arguments)
def run_kto(args: argparse.Namespace, tmp: str) -> dict:
    from trl import KTOConfig, KTOTrainer

    rows = read_rows(args.rows)
    model, ref_model = load_model(args.model), load_model(args.model).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = settings(
        KTOConfig,
        args,
        tmp,
        beta=args.beta,
        desirable_weight=args.desirable_weight,
        undesirable_weight=args.undesirable_weight,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
    )
    trainer, logs = trainer_of(KTOTrainer, config, rows, tokenizer, model=model, ref_model=ref_model)
    prepared = trainer.train_dataset
    trainer.train()
    steps = [log for log in logs if "loss" in log and "train_runtime" not in log]
    return {
        "steps": [{name: float(log[name]) for name in (*KTO_METRICS, "grad_norm") if name in log} for log in steps],
        "rows": [{"prompt": list(r["prompt_ids"]), "completion": list(r["completion_ids"])} for r in prepared],
    }


# ---- the command line ----


def parser_of() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="kind", required=True)
    batch = commands.add_parser("batch", help="several runs in one process")
    batch.add_argument("requests", help="a JSON list of argument lists, each a kind and its options")
    for name, (arguments, _) in KINDS.items():
        sub = commands.add_parser(name)
        sub.add_argument("--model", required=True, help="save_pretrained folder: the model and its tokenizer")
        sub.add_argument("--batch-size", type=int, required=True, help="rows per step (the file's, in order)")
        sub.add_argument("--max-length", type=int, required=True, help="tokens per row at the most")
        sub.add_argument("--out", required=True, help="the JSON file written")
        arguments(sub)
    return parser


def run(args: argparse.Namespace) -> None:
    """One run of a kind: its result, with TRL's version, written to --out."""
    import trl

    if os.path.exists(args.out):  # a failed run leaves no output behind, not an earlier run's
        os.remove(args.out)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        result = {"trl_version": trl.__version__, **KINDS[args.kind][1](args, tmp)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = parser_of()
    args = parser.parse_args(argv)
    if args.kind != "batch":
        run(args)
        return 0
    failed = 0
    for request in json.loads(args.requests):
        try:
            run(parser.parse_args(request))
        except (Exception, SystemExit):  # the other runs still run; the caller finds this one's --out missing
            failed += 1
            print(f"trl_peer: {' '.join(request)} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
