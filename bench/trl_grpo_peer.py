"""TRL's GRPOTrainer as a benchmark peer, on completions GIVEN rather than sampled: for each run of a spec file,
trl.GRPOTrainer (trl==1.16.0) on CPU in fp32, dropout off, trains on the spec's prompts with its generation replaced
by the spec's completion token ids, and the figures TRL logged at each step are written out with the token ids each
rollout trained on. Run it with the separate TRL venv; bench/grpo_vs_trl.py writes the spec and compares:

  .venv-trl/bin/python bench/trl_grpo_peer.py SPEC.json OUT.json

What is replaced is the narrowest step that makes completion ids, GRPOTrainer._generate_single_turn (prompt token
ids in, completion token ids out): everything around it is TRL's own, the chat template's prompt tokens, the
decoding of the completions, the reward calls, the advantages, the reference and old log-probabilities, the loss,
the metrics and the optimizer. The k-th occurrence of a prompt in a rollout gets that prompt's k-th given
completion (TRL shuffles and repeats prompts; the groups are the same whatever the order).

SPEC: {"model": a save_pretrained folder (a causal LM and its tokenizer), "prompts": [the dataset's prompt values],
"completions": [rollout][prompt][generation] token ids, "reward_file": a .py file, "reward_function": a name in it,
"reward_weights": [length's, the function's], "length_limit", "length_ramp" (the length reward: TRL's
get_soft_overlong_punishment(limit + ramp, ramp), named "length"), "num_generations", "max_completion_length",
"steps", "lr", "epsilon", "epsilon_high", "temperature", "seed", "lora": {"rank", "alpha", "targets"},
"runs": [{"name", "loss_type", "beta", "num_iterations", "lora": bool}]}. With lora, each adapter's A is set to the
value our run initialises it with (parallel_finetune.model.lora.initial_value from the seed, by our parameter name;
B is zero on both sides), so that both start from the same adapter; the reference is then the base with its
adapters disabled, TRL's own path for a new adapter.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's package, for the LoRA init
from parallel_finetune.model.lora import initial_value  # noqa: E402


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


def reward_functions(spec: dict) -> list:
    length = get_soft_overlong_punishment(spec["length_limit"] + spec["length_ramp"], spec["length_ramp"])
    length.__name__ = "length"  # our built-in's metric name (rewards/length/mean)
    loader = importlib.util.spec_from_file_location("grpo_trl_reward", spec["reward_file"])
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return [length, getattr(module, spec["reward_function"])]


def give_completions(trainer, prompt_ids: list, completions: list) -> None:
    """trainer._generate_single_turn returns the given completions: rollout r (the r-th call), the prompt's row by
    its token ids, the k-th occurrence of that prompt its k-th completion."""
    rows: dict[tuple, int] = {}
    calls = [0]

    def given(self, prompt_ids_batch, images, multimodal_fields, num_generations, has_tool_images=False):
        if not rows:  # the chat template's tokens of each prompt, as TRL renders them
            for row, ids in enumerate(prompt_ids):
                rows[tuple(ids)] = row
        rollout, calls[0] = calls[0], calls[0] + 1
        seen: collections.Counter = collections.Counter()
        out = []
        for ids in prompt_ids_batch:
            row = rows[tuple(ids)]
            out.append(list(completions[rollout][row][seen[row]]))
            seen[row] += 1
        return out, None

    trainer._generate_single_turn = types.MethodType(given, trainer)


def record_rollouts(trainer, rollouts: list) -> None:
    """Each rollout's (prompt ids, completion ids) as TRL trains on them: its padded tensors without the padding."""
    original = trainer._generate_and_score_completions

    def wrapped(inputs):
        output = original(inputs)
        rows = []
        for i in range(len(output["prompt_ids"])):
            prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
            completion = output["completion_ids"][i][output["completion_mask"][i].bool()].tolist()
            rows.append({"prompt": prompt, "completion": completion})
        rollouts.append(rows)
        return output

    trainer._generate_and_score_completions = wrapped


def our_adapter_init(model, seed: int) -> None:
    """Every lora_A as our run initialises it (its name in our model: peft's without base_model.model. and the
    adapter name); lora_B stays peft's zeros, as ours."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                ours = name.removeprefix("base_model.model.").replace(".lora_A.default.", ".lora_A.")
                param.copy_(initial_value(ours, list(param.shape), seed))


def run(spec: dict, settings: dict, tokenizer) -> dict:
    from peft import LoraConfig

    torch.manual_seed(spec["seed"])
    model = load_model(spec["model"])
    peft_config = None
    if settings["lora"]:
        lora = spec["lora"]
        peft_config = LoraConfig(
            r=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=0.0,
            target_modules=lora["targets"],
            task_type="CAUSAL_LM",
        )
    capture, rollouts = LogCapture(), []
    batch = len(spec["prompts"]) * spec["num_generations"]  # every prompt once per rollout
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            loss_type=settings["loss_type"],
            beta=settings["beta"],
            num_iterations=settings["num_iterations"],
            epsilon=spec["epsilon"],
            epsilon_high=spec["epsilon_high"],
            temperature=spec["temperature"],
            num_generations=spec["num_generations"],
            max_completion_length=spec["max_completion_length"],
            reward_weights=spec["reward_weights"],
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            max_steps=spec["steps"],
            logging_steps=1,
            learning_rate=spec["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            disable_dropout=True,
            disable_tqdm=True,
            seed=spec["seed"],
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_functions(spec),
            args=config,
            train_dataset=Dataset.from_list([{"prompt": p} for p in spec["prompts"]]),
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[capture],
        )
        if settings["lora"]:
            our_adapter_init(trainer.model, spec["seed"])
        prompt_ids = trainer._tokenize_prompts(spec["prompts"])[0]
        give_completions(trainer, prompt_ids, spec["completions"])
        record_rollouts(trainer, rollouts)
        trainer.train()
    steps = [log for log in capture.logs if "loss" in log and "train_runtime" not in log]
    figures = [{k: float(v) for k, v in log.items() if isinstance(v, (int, float)) and v is not None} for log in steps]
    return {"name": settings["name"], "steps": figures, "rollouts": rollouts, "prompt_ids": prompt_ids}


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    import trl

    results = [run(spec, settings, tokenizer) for settings in spec["runs"]]
    Path(out_path).write_text(json.dumps({"trl_version": trl.__version__, "runs": results}))


if __name__ == "__main__":
    main()
