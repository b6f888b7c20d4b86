"""Entry point: `torchrun --nproc_per_node N -m parallel_finetune.train RECIPE.yaml [key=value ...]`.

Runs from any folder (the recipe is a path; `parallel-finetune RECIPE.yaml ...` is the same for one process).
A SageMaker job calls it as `train.py --recipe RECIPE.yaml --key value ...` (see sagemaker_job.py).

`--check --nproc N [--nnodes M]` validates a recipe, its data, model and layout (N processes over M nodes) without
starting processes (the Makefile and scripts/train.sbatch run it before torchrun, so bad input ends in one line
instead of a traceback from every rank).
"""

from __future__ import annotations

import gc
import os
import sys

from .config import USER_KEYS, parse_config
from .errors import OneLineArgumentParser, RankError, UserError


def sagemaker_arguments(argv: list[str]) -> list[str]:
    """SageMaker's drivers pass hyperparameters as `--key value` pairs: `--recipe R --lr 2e-5` -> R lr=2e-5."""
    if not argv or not argv[0].startswith("--") or argv[0] in ("--check", "--nproc", "--nnodes", "-h", "--help"):
        return argv
    recipe, overrides, pairs = None, [], list(argv)
    while pairs:
        flag = pairs.pop(0)
        if not flag.startswith("--") or not pairs:
            raise UserError(f"argument {flag!r}: expected --key value pairs (SageMaker hyperparameters)")
        value = pairs.pop(0)
        if flag == "--recipe":
            recipe = value
        else:
            overrides.append(f"{flag[2:]}={value}")
    if recipe is None:
        raise UserError("SageMaker hyperparameters lack `recipe` (the recipe YAML's path in the code channel)")
    return [recipe, *overrides]


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sagemaker_arguments(sys.argv[1:] if argv is None else argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser = OneLineArgumentParser(
        prog="parallel_finetune.train",
        description="Fine-tune a recipe on SST-2. Overrides: key=value with keys " + ", ".join(USER_KEYS),
    )
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/gptj/tp.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value (flat or section.key)")
    parser.add_argument("--check", action="store_true", help="validate only; start no processes")
    parser.add_argument("--nproc", type=int, default=1, help="with --check: processes the run will have")
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="with --check: nodes they are spread over (tensor_parallel_degree: auto = per node)",
    )
    args = parser.parse_args(argv)
    try:
        # The recipe and every key=value read and checked by the config package first: a typo or a bad value is one
        # line in a second, before torch and transformers are imported (resolve.py and what follows need them).
        parse_config(args.recipe, args.overrides)
        from .resolve import load_config

        config = load_config(args.recipe, args.overrides)
        if args.check:
            from .preflight import preflight

            print(preflight(config, args.nproc, args.nnodes))
            return 0
        from .loop.run import run

        # The imports' ~1M objects live as long as the process: frozen, no collection rescans them (a full one
        # cost ~0.3 s per process here, and one that lands mid-step on one rank stalls every rank's collectives).
        gc.freeze()
        with kernel_standins(os.environ.get(STANDINS_VARIABLE, "")):
            run(config)
        # Interpreter teardown would otherwise spend ~2 s garbage-collecting torch's and transformers' objects
        # (measured here, per process); frozen objects are skipped and the process exits at once.
        gc.freeze()
        return 0
    except UserError as exc:
        return report(exc)
    except KeyboardInterrupt as exc:
        return interrupted(exc)


# A dry run of the CUDA-only branches on a CPU (tests, `bench/gpu.py --dry-run`): the kernels replaced by their strict
# stand-ins (model/standins.py), said once. Its value names the torch release whose signature the stand-ins take
# ("1" or "installed": this torch's).
STANDINS_VARIABLE = "PARALLEL_FINETUNE_KERNEL_STANDINS"


def kernel_standins(value: str):
    """The stand-ins installed for the run when `value` asks for them; nothing otherwise."""
    import contextlib

    if not value or value == "0":
        return contextlib.nullcontext()
    from .model import standins

    release = None if value in ("1", "installed") else value
    if release is not None and release not in standins.SIGNATURES:
        raise UserError(f"{STANDINS_VARIABLE}={value}: one of 1, installed, {', '.join(standins.SIGNATURES)}")
    if os.environ.get("RANK", "0") == "0":
        print(f"{STANDINS_VARIABLE}: CUDA-only kernels run as strict CPU stand-ins (a dry run, not a GPU run)")
    return standins.install(release)


def interrupted(exc: KeyboardInterrupt) -> int:
    """Ctrl-C: one line, by rank 0, and exit code 130 (128 + SIGINT, as a shell reports it), not a traceback per
    rank."""
    if os.environ.get("RANK", "0") == "0":
        print(str(exc) or "interrupted (SIGINT)", file=sys.stderr)
    return 130


def report(exc: UserError) -> int:
    """Print the one `error:` line and return the exit code. Agreed errors are said once, by rank 0; a rank's own
    discovery (RankError) by the rank that made it."""
    if os.environ.get("RANK", "0") == "0" or isinstance(exc, RankError):
        print(f"error: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
