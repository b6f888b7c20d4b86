#!/usr/bin/env python
"""Memory per GPU and time per SST-2 epoch for every parallel layout of a model, best first. Nothing is downloaded.

python scripts/plan.py EleutherAI/gpt-j-6b --instance ml.p4d.24xlarge
python scripts/plan.py gpt2-xl --gpus 8 --gpu-mem-gb 24 --nodes 2 --all
python scripts/plan.py meta-llama/Llama-3.1-70B --instance ml.p4d.24xlarge --qlora 16
"""

import argparse
import sys

from parallel_finetune.errors import UserError
from parallel_finetune.families import published_models
from parallel_finetune.parallel.hardware import GPUS, INSTANCES
from parallel_finetune.tasks.task import head_of
from parallel_finetune.tools.planner import SFT_TOKENS_PER_ROW, Workload, plan


class OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage too; every bad input here is one line
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrors(prog="plan.py", description=__doc__.splitlines()[0])
    try:
        known = ", ".join(published_models())  # a bad PARALLEL_FINETUNE_FAMILIES file: one line
    except UserError as exc:
        parser.error(str(exc))
    parser.add_argument(
        "model",
        nargs="?",
        default="EleutherAI/gpt-j-6b",
        help=f"one of {known}; a local folder; package:MODULE; tiny:FAMILY",
    )
    parser.add_argument("--gpus", help="GPUs per node (default with --instance: all of its GPUs)")
    parser.add_argument("--gpu-mem-gb", help="memory per GPU in GB (1e9 bytes); required without --instance")
    parser.add_argument("--instance", help=f"SageMaker instance: {', '.join(INSTANCES)}")
    parser.add_argument("--gpu", help=f"GPU type, for its speed: {', '.join(GPUS)}")
    parser.add_argument("--nodes", default="1", help="nodes (default 1)")
    parser.add_argument("--task", default="classification", choices=["classification", "causal_lm", "sft", "dpo"])
    parser.add_argument("--max-length", type=int, default=128, help="tokens per sequence for memory (default 128)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (default 32, the recipes')")
    parser.add_argument(
        "--tokens-per-sample",
        type=float,
        default=13.4,
        help="tokens per SST-2 sentence after dynamic padding, for time (default 13.4)",
    )
    parser.add_argument("--padded", action="store_true", help="time with every sentence padded to --max-length")
    parser.add_argument("--packing", action="store_true", help="sft: rows packed into --max-length sequences")
    parser.add_argument(
        "--tokens-per-row", type=float, default=None, help="with --packing: the rows' mean tokens (default 512)"
    )
    parser.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=1024,
        help="a language model's head and loss this many tokens at a time (the run's default 1024; 0: whole logits)",
    )
    parser.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation (default 0.35)")
    parser.add_argument(
        "--runs-today",
        action="store_true",
        help="only layouts the trainer runs now (all but pipeline stages with FSDP)",
    )
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument("--lora", type=int, default=0, metavar="RANK", help="plan LoRA of this rank (peft=lora)")
    adapters.add_argument(
        "--qlora",
        type=int,
        default=0,
        metavar="RANK",
        help="plan QLoRA: LoRA of this rank on a base whose block Linear weights are NF4 (lora_base_quantization=nf4)",
    )
    parser.add_argument("--all", action="store_true", help="print every layout, not the best 15")
    args = parser.parse_args(argv)
    try:
        result = plan(
            args.model,
            args.gpus,
            args.gpu_mem_gb,
            args.instance,
            nodes=args.nodes,
            gpu=args.gpu,
            workload=Workload(
                head_of(args.task),
                args.max_length,
                args.batch_size,
                args.tokens_per_sample,
                args.padded,
                args.mfu,
                args.lora or args.qlora,
                "nf4" if args.qlora else "none",
                packing=args.packing,
                tokens_per_row=args.tokens_per_row or (SFT_TOKENS_PER_ROW if args.packing else None),
                loss_chunk_tokens=args.loss_chunk_tokens,
                pairs=args.task == "dpo",
            ),
            runs_today=args.runs_today,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.table(limit=None if args.all else 15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
