"""Two gloo ranks sample a tiny Llama's completions (rl/rollout.py) under TP=2 and under FSDP over both ranks, and
compare them with what one process samples (each rank's own copy of the model, no group). Rank 0 prints one JSON
line. Run by tests/rl/test_rollout.py."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "rl")]
from test_rollout import PROMPTS, settings, tiny_llama  # noqa: E402

from parallel_finetune.families import get_family  # noqa: E402
from parallel_finetune.parallel.fsdp import apply_fsdp  # noqa: E402
from parallel_finetune.parallel.layout import init_distributed  # noqa: E402
from parallel_finetune.parallel.tensor import apply_tp  # noqa: E402
from parallel_finetune.rl.rollout import sample  # noqa: E402

INDICES = [0, 1, 2, 3]
STEP = 4


def main() -> None:
    layout = init_distributed("cpu", 1, sharding="full")  # FSDP over both ranks
    family, rank = get_family("llama"), layout.rank
    model = tiny_llama(seed=0)
    # the stop tokens: those prompt 0's completions draw second, so rank 0 (prompt 0 alone) is done first
    free = settings(temperature=1.0, top_p=0.95, max_completion_length=10, stop_ids=frozenset())
    drawn = sample(copy.deepcopy(model), PROMPTS, INDICES, free, STEP, group=None).completions()
    chosen = type(free)(**{**free.__dict__, "stop_ids": frozenset(c[1] for c in drawn[:2])})
    one = sample(copy.deepcopy(model), PROMPTS, INDICES, chosen, STEP, group=None)
    expected = one.completions(), one.truncated.tolist()

    tp_model = apply_tp(copy.deepcopy(model), family, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    tp = sample(tp_model, PROMPTS, INDICES, chosen, STEP)
    tp_equal = (tp.completions(), tp.truncated.tolist()) == expected

    fsdp_model = copy.deepcopy(model)
    apply_fsdp(fsdp_model, family.blocks(fsdp_model), layout, None)
    forwards = []
    fsdp_model.register_forward_hook(lambda *_: forwards.append(1))
    share = [0] if rank == 0 else [1, 2, 3]
    fsdp = sample(fsdp_model, [PROMPTS[i] for i in share], share, chosen, STEP)
    own_steps = int(fsdp.completion_mask.sum(-1).max())
    gathered = [None, None]
    dist.all_gather_object(gathered, (fsdp.completions(), fsdp.truncated.tolist(), len(forwards), own_steps, tp_equal))
    if rank == 0:
        completions = [c for part in gathered for c in part[0]]
        truncated = [t for part in gathered for t in part[1]]
        result = {
            "tp_equal": [part[4] for part in gathered],
            "fsdp_equal": (completions, truncated) == expected,
            "fsdp_forwards": [part[2] for part in gathered],
            "fsdp_own_steps": [part[3] for part in gathered],
            "distinct": len({tuple(c) for c in expected[0]}),
            "expected": expected[0],
            "fsdp": completions,
        }
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
