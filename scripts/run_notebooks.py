#!/usr/bin/env python
"""Execute the walkthrough notebooks top to bottom with papermill (`make notebooks`).

python scripts/run_notebooks.py [NAME ...] [-p KEY VALUE ...]
  NAME      a walkthrough, notebooks/NAME.ipynb: a family's, sft or dpo (default: all of them)
  -p        a parameter for every notebook, e.g. -p MAX_STEPS 40 -p DATA ../shared/data/sst2 -p LAUNCH local

Executed copies go to runs/notebooks/NAME.ipynb. Fails unless each notebook's plot cell drew a figure and its
accuracy cell printed the dev accuracy (or perplexity, or rewards/accuracies); prints how long each notebook took.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from parallel_finetune.errors import OneLineArgumentParser

REPO = Path(__file__).resolve().parents[1]
# One walkthrough per family that has one, then the topic walkthroughs (sft: instruction tuning on the shipped chat
# sample, dpo: preference tuning on the shipped preference sample, grpo: online RL on the shipped arithmetic
# sample; each reads DATA only when it holds conversations, pairs or prompts).
TOPICS = ("sft", "dpo", "grpo")
NOTEBOOKS = tuple(sorted(path.stem for path in (REPO / "notebooks").glob("*.ipynb")))


def run_order(names: tuple[str, ...]) -> list[str]:
    """The families' walkthroughs in the registry's order, then the topics. The registry imports transformers, so
    it is asked only once the arguments are good (--help and a wrong name are answered at once)."""
    from parallel_finetune.families import family_names

    order = [*family_names(), *TOPICS]
    return sorted(names, key=lambda name: order.index(name) if name in order else len(order))


def value(text: str):
    """-p values as papermill's CLI reads them: JSON where it parses (40, null, true, [..]), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def check(executed: Path) -> list[str]:
    """What the executed notebook failed to show."""
    cells = json.loads(executed.read_text())["cells"]
    problems = []
    for tag, wanted, what in (("plot", "image/png", "a figure"), ("accuracy", "dev ", "the dev accuracy")):
        tagged = [c for c in cells if tag in c.get("metadata", {}).get("tags", [])]
        shown = json.dumps([c.get("outputs", []) for c in tagged])
        if not tagged or wanted not in shown:
            problems.append(f"its {tag} cell produced no {what}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=", ".join(NOTEBOOKS) + " (default: all)")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="do not require the plot and accuracy outputs (e.g. LAUNCH sagemaker with WAIT false)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in NOTEBOOKS]
    if unknown:
        parser.error(f"unknown notebook(s) {', '.join(unknown)}; valid: {', '.join(NOTEBOOKS)}")
    import papermill

    names = args.names or run_order(NOTEBOOKS)  # named ones in the order given

    parameters = {key: value(text) for key, text in args.p}
    out = REPO / "runs" / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in names:
        started = time.perf_counter()
        executed = out / f"{name}.ipynb"
        print(f">>> notebooks/{name}.ipynb {parameters}", flush=True)
        try:
            papermill.execute_notebook(
                str(REPO / "notebooks" / f"{name}.ipynb"),
                str(executed),
                parameters=parameters,
                cwd=str(REPO / "notebooks"),
                kernel_name="python3",
                log_output=True,
                progress_bar=False,
            )
            problems = [] if args.no_check else check(executed)
        except papermill.PapermillExecutionError as exc:
            problems = [f"cell {exc.exec_count} raised {exc.ename}: {exc.evalue}"]
        seconds = time.perf_counter() - started
        print(
            f"<<< notebooks/{name}.ipynb: {'ok' if not problems else '; '.join(problems)} in {seconds:.0f} s "
            f"(executed copy: {executed.relative_to(REPO)})",
            flush=True,
        )
        if problems:
            failed.append(name)
    if failed:
        print(f"error: notebook(s) {', '.join(failed)} failed (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
