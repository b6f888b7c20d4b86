"""Trains like scripts/train.py, task=grpo on completions GIVEN rather than sampled (rl/steps.py's fixed-rollouts
mode): `given_completions=FILE` among the arguments names bench/grpo_vs_trl.py's spec, {"prompts": [the prompt
values, in any order of the data], "completions": [rollout][prompt][generation] token ids, ...}. A step's rollout is
(step - 1) // num_iterations (a rollout is trained on num_iterations steps); each prompt is found by its value, and
gets its completions in order. The rows trained on (the run's prompt token ids and the completion's) are written to
<output_dir>/given_rows.jsonl, one line per completion: {"rollout", "prompt", "completion"}.

  python bench/grpo_given.py RECIPE key=value ... given_completions=SPEC.json
"""

import functools
import json
import sys
from pathlib import Path

from parallel_finetune.rl import steps
from parallel_finetune.train import main


def given_completions(spec: dict, out: Path, stage, step: int, global_batch: list[int], positions: list[int]):
    rows = {json.dumps(prompt, sort_keys=True): n for n, prompt in enumerate(spec["prompts"])}
    rollout = (step - 1) // stage.grpo.num_iterations
    completions, lines = [], []
    for position in positions:
        row = global_batch[position]
        group = spec["completions"][rollout][rows[json.dumps(stage.rows.prompts[row], sort_keys=True)]]
        assert len(group) == stage.grpo.num_generations, (len(group), stage.grpo.num_generations)
        for completion in group:
            completions.append(list(completion))
            lines.append({"rollout": rollout, "prompt": list(stage.rows.ids[row]), "completion": list(completion)})
    with open(out, "a", encoding="utf-8") as file:
        file.writelines(json.dumps(line) + "\n" for line in lines)
    return completions


def install(spec_path: str, output_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(output_dir) / "given_rows.jsonl"
    out.unlink(missing_ok=True)  # a run into the same folder again
    post_init = steps.RolloutStage.__post_init__

    def given_post_init(self):
        post_init(self)
        self.fixed = functools.partial(given_completions, spec, out, self)

    steps.RolloutStage.__post_init__ = given_post_init


if __name__ == "__main__":
    spec_arg = next(a for a in sys.argv[1:] if a.startswith("given_completions="))
    output_arg = next(a for a in sys.argv[1:] if a.startswith("output_dir="))
    sys.argv.remove(spec_arg)
    install(spec_arg.partition("=")[2], output_arg.partition("=")[2])
    sys.exit(main())
