"""The names a run writes: its output folder's entries, the run-folder lock and record, checkpoint folders and
their files, export staging. A leaf: it imports nothing of the package, so every module that writes or reads a
run's files names them from here (runfolder, checkpoint, export, loggers)."""

from __future__ import annotations

import re

LOCK = ".run.lock"
RECORD = ".parallel-finetune-outputs"
RECORD_HEADER = "# parallel-finetune: what runs wrote in this folder; overwrite=true deletes these names only"
# Every name a run may write into its output folder, each recorded just before it is written, and only when it is
# (report_to=none writes no tensorboard/, predict=false no predictions.tsv): overwrite=true deletes recorded names
# only, and refuses a folder holding one of these that no run recorded.
RUN_OUTPUTS = (
    "config.yaml",  # every run (runfolder.open_run_folder), as labels.json (but sft and dpo, which have no labels)
    "labels.json",  # the task: its label names and ids, columns, problem type (tasks.LABEL_FILE)
    "metrics.jsonl",  # every run, once training starts (loggers.JsonlLogger), as eval.jsonl
    "eval.jsonl",
    "generations.jsonl",  # generate_every: held-out prompts' greedy answers (loggers.JsonlLogger)
    "summary.json",  # a run that finished
    "deepspeed_config.json",  # engine=deepspeed
    "tensorboard",  # report_to=tensorboard
    "tracking.json",  # report_to=mlflow / wandb: their run ids (loggers.TRACKING_IDS)
    "wandb",  # report_to=wandb without WANDB_DIR: the offline run
    "predictions.tsv",  # predict=true: the test split's predictions
    "predictions_mismatched.tsv",  # predict=true on MNLI: the mismatched test split's
    "hf",  # export=true (export.py), as the LoRA run's adapter/ and, from a tiny model, base/
    "adapter",
    "base",
)
# A checkpoint is a folder step-<8 digits> of the checkpoint root (.tmp-step-… while it is written).
CHECKPOINT_NAME = re.compile(r"^step-(\d{8})$")
STATE_FILE = "trainer_state.json"  # in each checkpoint: step, layout, settings, data fingerprint
CONFIG_FILE = "config.yaml"  # in each checkpoint and the run folder: the run's settings
ROLLOUT_FILE = "rollout.json"  # in a task=grpo checkpoint taken between a rollout's iterations: that rollout
EXPORT_STAGING = ".export-in-progress-"  # + pid: a staging folder of ours, holding EXPORT_STAGING_MARKER
EXPORT_STAGING_MARKER = ".parallel-finetune-export"
