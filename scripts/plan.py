#!/usr/bin/env python
"""Memory per GPU and time for every parallel layout of a recipe's run (or a model's), best first; no download.

python scripts/plan.py recipes/llama/dpo.yaml --instance ml.p4d.24xlarge                 # the run that recipe starts
python scripts/plan.py recipes/llama/dpo_lora.yaml max_length=2048 --instance ml.g5.2xlarge   # + overrides, as a run
python scripts/plan.py EleutherAI/gpt-j-6b --instance ml.p4d.24xlarge                    # a model: an SST-2 epoch
python scripts/plan.py gpt2-xl --gpus 8 --gpu-mem-gb 24 --nodes 2 --all
python scripts/plan.py meta-llama/Llama-3.1-70B --instance ml.p4d.24xlarge --qlora 16

A recipe is read as a run reads it (its `extends`, size=full unless an override says size=tiny, key=value
overrides checked as the run checks them); the plan is that run's: its task, max_length, batch and accumulation
slices, packing, LoRA, precision and loss chunk, timed over its steps and data, with the layout the recipe starts
on the hardware marked, and the recommendation printed as the key=value overrides that start it.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

# The flags a model is planned with, and the recipe key each one sets (with a recipe: give the key=value instead).
KEY_FLAGS = {
    "task": "task",
    "max_length": "max_length",
    "batch_size": "batch_size",
    "packing": "packing",
    "loss_chunk_tokens": "loss_chunk_tokens",
    "lora": "lora_rank",
    "qlora": "lora_rank",
}


class OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage too; every bad input here is one line
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def is_recipe(target: str) -> bool:
    return target.endswith((".yaml", ".yml")) or Path(target).is_file()


def model_overrides(args, family: str) -> list[str]:
    """A model planned with the flags: the recipe keys of a run of it (checked as the run checks them)."""
    keys = [
        f"family={family}",
        f"model={args.target}",
        "size=full",
        f"task={args.task or 'classification'}",
        f"max_length={128 if args.max_length is None else args.max_length}",
        f"batch_size={32 if args.batch_size is None else args.batch_size}",
        f"packing={'true' if args.packing else 'false'}",
        f"loss_chunk_tokens={1024 if args.loss_chunk_tokens is None else args.loss_chunk_tokens}",
    ]
    rank = args.lora or args.qlora
    if rank is not None:  # every linear layer of the blocks, as --lora has always planned
        keys += ["peft=lora", f"lora_rank={rank}", "lora_target_modules=all-linear"]
    if args.qlora is not None:
        keys.append("lora_base_quantization=nf4")
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrors(prog="plan.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "target",
        nargs="?",
        default="EleutherAI/gpt-j-6b",
        help="a recipe (recipes/FAMILY/NAME.yaml), or a model: a published name, a local folder, package:MODULE, "
        "tiny:FAMILY",
    )
    parser.add_argument("overrides", nargs="*", help="key=value, as a run takes them (e.g. max_length=2048)")
    parser.add_argument("--gpus", help="GPUs per node (default with --instance: all of its GPUs)")
    parser.add_argument("--gpu-mem-gb", help="memory per GPU in GB (1e9 bytes); required without --instance")
    parser.add_argument("--instance", help="SageMaker instance, e.g. ml.p4d.24xlarge, ml.g5.2xlarge")
    parser.add_argument("--gpu", help="GPU type, for its speed (e.g. A100-40GB)")
    parser.add_argument("--nodes", default="1", help="nodes (default 1)")
    model_only = parser.add_argument_group("a model's run (with a recipe: give the key=value instead)")
    model_only.add_argument("--task", help="task= (default classification): classification, causal_lm, sft, dpo")
    model_only.add_argument("--max-length", help="max_length= (default 128): tokens per sequence")
    model_only.add_argument("--batch-size", help="batch_size= (default 32): the global batch")
    model_only.add_argument("--packing", action="store_true", help="packing=true: rows packed into max_length")
    model_only.add_argument(
        "--loss-chunk-tokens",
        help="loss_chunk_tokens= (default 1024, the run's): a language model's head and loss this many tokens at a "
        "time; 0: whole logits",
    )
    adapters = model_only.add_mutually_exclusive_group()
    adapters.add_argument("--lora", metavar="RANK", help="peft=lora lora_rank=RANK on every linear layer")
    adapters.add_argument(
        "--qlora",
        metavar="RANK",
        help="QLoRA: --lora RANK with the blocks' Linear weights in NF4 (lora_base_quantization=nf4)",
    )
    parser.add_argument(
        "--tokens-per-sample",
        type=float,
        default=13.4,
        help="tokens per classification sample after dynamic padding, for time (default 13.4: SST-2's)",
    )
    parser.add_argument(
        "--tokens-per-row", type=float, default=None, help="sft/dpo: a row's mean tokens, for time (default 512)"
    )
    parser.add_argument("--padded", action="store_true", help="time with every sample padded to max_length")
    parser.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation (default 0.35)")
    parser.add_argument(
        "--runs-today",
        action="store_true",
        help="only layouts the trainer runs now (all but pipeline stages with FSDP; always so with a recipe)",
    )
    parser.add_argument("--all", action="store_true", help="print every layout, not the best 15")
    args = parser.parse_intermixed_args(argv)
    if args.lora is not None and args.qlora is not None:  # intermixed parsing does not keep the group's check
        parser.error("argument --qlora: not allowed with argument --lora")

    # torch and the package only now: --help and bad flags answer at once
    from parallel_finetune.errors import UserError
    from parallel_finetune.parallel.hardware import hardware_for
    from parallel_finetune.preflight import layout_refusal, planned_layout
    from parallel_finetune.resolve import choose_model, load_config, planner_workload
    from parallel_finetune.tools.planner import Considered, model_config, plan

    try:
        hardware = hardware_for(args.gpus, args.gpu_mem_gb, args.instance, args.gpu, args.nodes)
        recipe = args.target if is_recipe(args.target) else None
        if recipe is not None:
            given = [f"--{flag.replace('_', '-')}" for flag in KEY_FLAGS if getattr(args, flag) not in (None, False)]
            if given:
                raise UserError(
                    f"{given[0]} plans a model; with a recipe give its key as an override: "
                    f"{KEY_FLAGS[given[0][2:].replace('-', '_')]}=VALUE"
                )
            overrides = ["size=full", *args.overrides]  # a recipe's full size, unless an override says tiny
            config = load_config(recipe, overrides)
        else:
            family, _ = model_config(args.target)  # an unknown model: one line naming the known ones
            config = load_config(None, model_overrides(args, family.name) + args.overrides)
        chosen = choose_model(config)
        model = chosen.model_name or f"tiny:{chosen.family.name}"
        workload = planner_workload(config)
        workload = dataclasses.replace(
            workload,
            mfu=args.mfu,
            tokens_per_sample=args.tokens_per_sample,
            padded=args.padded,
            tokens_per_row=args.tokens_per_row or workload.tokens_per_row,
        )
        current = refuse = None
        if recipe is not None:
            hf_config = model_config(model)[1]
            world, per_node = hardware.world, hardware.gpus_per_node
            current = planned_layout(config, hf_config, world, per_node)

            def refuse(candidate):
                return layout_refusal(config, hf_config, world, per_node, candidate)

        result = plan(
            model,
            args.gpus,
            args.gpu_mem_gb,
            args.instance,
            nodes=args.nodes,
            gpu=args.gpu,
            workload=workload,
            considered=Considered(args.runs_today or recipe is not None, current, refuse),
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if recipe is not None:
        result = dataclasses.replace(result, recipe=recipe, overrides=tuple(args.overrides))
    print(result.table(limit=None if args.all else 15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
