"""GRPO's rollout speed: rl/rollout.py's `sample` against transformers' own `model.generate` (do_sample, its own
KV cache) on the same model, prompts and settings: completion tokens per second.

The model: a Llama of `--hidden/--layers/--heads` and a `--vocab` vocabulary, initialised from `--seed` (fp32, eval
mode); `--prompts` prompts of 8 to `--prompt-length` random tokens, `--generations` completions each, exactly
`--new-tokens` new tokens per completion (no stop token, so that both make the same number of tokens), temperature
1.0 and top_p `--top-p`. generate gets the same rows (each prompt repeated `--generations` times, left-padded).
Each side runs `--repeats` times after one warm-up, alternating; the fastest wall time counts (on a shared machine
the others wait for foreign work), and the process's CPU time is reported beside it. Tokens/s = rows x new
tokens / seconds. Prints a markdown table and one JSON line; `--out FILE` writes the JSON too.

  .venv/bin/python bench/rollout_speed.py                 (CPU; --device cuda on a GPU)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from parallel_finetune.rl.rollout import SamplingSettings, sample  # noqa: E402

PAD = 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def build(args) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.prompt_length + args.new_tokens,
        pad_token_id=PAD,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(args.device).eval()
    model.generation_config.eos_token_id = None  # no stop: every completion is --new-tokens long
    model.generation_config.pad_token_id = PAD
    return model


def prompts_of(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    lengths = [rng.randint(8, args.prompt_length) for _ in range(args.prompts)]
    return [[rng.randrange(1, args.vocab) for _ in range(length)] for length in lengths]


def ours(model, prompts, args) -> float:
    settings = SamplingSettings(
        num_generations=args.generations,
        max_completion_length=args.new_tokens,
        stop_ids=frozenset(),
        pad_id=PAD,
        temperature=1.0,
        top_p=args.top_p,
        seed=args.seed,
    )
    start = clock()
    rollout = sample(model, prompts, list(range(len(prompts))), settings, step=0, group=None)
    sync(args)
    assert int(rollout.completion_mask.sum()) == len(prompts) * args.generations * args.new_tokens
    return elapsed(start)


def theirs(model, prompts, args) -> float:
    rows = [prompt for prompt in prompts for _ in range(args.generations)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    start = clock()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(args.device),
            attention_mask=mask.to(args.device),
            do_sample=True,
            temperature=1.0,
            top_p=args.top_p,
            top_k=0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
        )
    sync(args)
    assert out.shape[1] - width == args.new_tokens
    return elapsed(start)


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def elapsed(start: tuple[float, float]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) since `start`."""
    wall, cpu = clock()
    return wall - start[0], cpu - start[1]


def sync(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    args = parse_args(argv)
    model, prompts = build(args), prompts_of(args)
    tokens = args.prompts * args.generations * args.new_tokens
    ours(model, prompts, args), theirs(model, prompts, args)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {"rl/rollout.py sample": [], "transformers generate": []}
    for _ in range(args.repeats):
        times["rl/rollout.py sample"].append(ours(model, prompts, args))
        times["transformers generate"].append(theirs(model, prompts, args))
    result = {
        "model": f"llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocabulary {args.vocab}",
        "device": args.device,
        "threads": torch.get_num_threads(),
        "rows": args.prompts * args.generations,
        "new_tokens": args.new_tokens,
        "tokens_per_s": {name: tokens / min(wall for wall, _ in ts) for name, ts in times.items()},
        "tokens_per_cpu_s": {name: tokens / min(cpu for _, cpu in ts) for name, ts in times.items()},
        "seconds": times,
    }
    rates, cpu = result["tokens_per_s"], result["tokens_per_cpu_s"]
    result["ratio"] = rates["rl/rollout.py sample"] / rates["transformers generate"]
    result["cpu_ratio"] = cpu["rl/rollout.py sample"] / cpu["transformers generate"]
    print(f"| {result['model']}, {result['rows']} rows x {args.new_tokens} new tokens, {args.device} "
          "| tokens/s (fastest) | tokens per CPU second |")  # fmt: skip
    print("| --- | --- | --- |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {cpu[name]:.0f} |")
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
