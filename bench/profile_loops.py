"""torch.profiler on both loops, real MiniLM and SST-2, fp32, 2 threads, batch 32: `ours` profiles steps 40-44 of
our trainer (after 12 warm-up steps), `hf` steps 10-14 of the Trainer with length-grouped batches (a callback
starts and stops the profiler inside its own `train()`). Prints the operator table (self CPU time) and the
seconds the profiled steps took. `python bench/profile_loops.py ours|hf [recipe overrides]`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_vs_hf  # noqa: E402
import transformers  # noqa: E402

from parallel_finetune.loop.builder import RunBuilder  # noqa: E402
from parallel_finetune.resolve import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    which, overrides = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(2)
    out = REPO / "runs" / "bench" / "profile"
    config = load_config(
        REPO / "recipes" / "bert" / "minilm.yaml",
        [
            f"data_dir={REPO.parent / 'shared' / 'data' / 'sst2'}",
            "max_steps=300" if which == "ours" else "max_steps=16",
            "batch_size=32",
            "tensor_parallel_degree=1",
            "export=false",
            f"output_dir={out / which}",
            "overwrite=true",
            "resume=none",
            "log_every=1000000",
            "precision=fp32",
            *overrides,
        ],
    )
    prof = profile(activities=[ProfilerActivity.CPU])
    if which == "ours":
        trainer = RunBuilder(config).build().trainer
        trainer.model.train()
        batches = trainer.sampler.epoch(0)
        for batch in batches[:12]:
            trainer.train_step(batch)
        started = time.perf_counter()
        with prof:
            for batch in batches[40:45]:
                with record_function("STEP"):
                    trainer.train_step(batch)
        seconds = time.perf_counter() - started
    else:

        class Window(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == 10:
                    prof.start()
                    self.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 15:
                    prof.stop()
                    window.seconds = time.perf_counter() - self.started

        window = Window()
        original = trainer_vs_hf.Trainer.__init__

        def with_window(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.add_callback(window)

        trainer_vs_hf.Trainer.__init__ = with_window
        trainer_vs_hf.hf_run(config, trainer_vs_hf.prepared_data(config), out / which, grouped=True)
        seconds = window.seconds
    print(f"{which}: 5 profiled steps in {seconds:.2f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
