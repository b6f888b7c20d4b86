"""What the walkthrough notebooks share: launch a recipe (local torchrun or SageMaker), then read its results.

A notebook stays prose plus a few calls, so the walkthroughs cannot drift apart in how they launch or plot. The
instruction-tuning one (notebooks/sft.ipynb) also shows which tokens train, what packing saves, the answers
generate_every wrote, and a chat with the exported model; the preference-tuning one (notebooks/dpo.ipynb) plots
TRL's rewards/* per step beside the loss; the online RL one (notebooks/grpo.ipynb) warm-starts a tiny policy
(`warm_start`) and plots the reward per step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..tasks.files import FORMATS


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_size() -> str:
    """`full` where GPUs are, else `tiny` (a small model of the same family, trained from scratch)."""
    return "full" if gpu_count() else "tiny"


def default_nproc() -> int:
    """Every GPU, or 2 processes on a CPU."""
    return gpu_count() or 2


def stream(command: list[str], cwd: str | Path | None = None) -> None:
    """Run a command, printing its output as it comes; one-line error if it fails."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    for line in process.stdout:
        # tqdm redraws with carriage returns; keep the newest state of each line
        print(line.rstrip("\n").rsplit("\r", 1)[-1][-300:], flush=True)
    if process.wait() != 0:
        raise RuntimeError(f"{' '.join(map(str, command[:4]))} ... exited with {process.returncode} (see above)")


def run_folder(recipe: str | Path, root: str | Path = "runs") -> Path:
    """A new folder for a notebook's run: runs/notebook-<recipe folder>-<recipe>-<time>."""
    recipe = Path(recipe)
    return Path(root).resolve() / f"notebook-{recipe.parent.name}-{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def launch_local(recipe: str | Path, overrides: list[str], nproc: int, check: bool = True) -> None:
    """Validate in one process (bad input = one line, no traceback from every rank), then torchrun."""
    if check:
        stream(
            [sys.executable, "-m", "parallel_finetune.train", "--check", "--nproc", str(nproc), str(recipe), *overrides]
        )
    stream(
        [
            sys.executable,
            "-m",
            "parallel_finetune.launch",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "parallel_finetune.train",
            str(recipe),
            *overrides,
        ]
    )


def data_overrides(data: str | Path) -> list[str]:
    """DATA as the Makefile reads it: a file of rows -> train_file, a save_to_disk folder -> dataset, another folder
    (GLUE's files) -> data_dir; made absolute, since the notebook moves to the repository root."""
    if not data:
        return []
    path = Path(data).expanduser().resolve()
    if path.is_dir():
        saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        return [f"{'dataset' if saved else 'data_dir'}={path}"]
    return [f"{'train_file' if path.is_file() or path.suffix.lower() in FORMATS else 'data_dir'}={path}"]


def write_labelled_csv(path: str | Path, glue_folder: str | Path | None = None, rows: int = 2000) -> Path:
    """A CSV of SST-2 sentences labelled with words (columns review, sentiment: awful or great), the shape your own
    data may have: from `glue_folder`'s train.tsv, else the small sample shipped in the package."""
    import csv

    from ..data.prepare import read_glue_dir
    from ..tasks import SAMPLE_DIR

    train = read_glue_dir(Path(glue_folder).expanduser() if glue_folder else SAMPLE_DIR)["train"]
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["review", "sentiment"])
        for row in train.select(range(min(rows, len(train)))):
            writer.writerow([row["text"], ("awful", "great")[row["label"]]])
    print(f"{path}: {min(rows, len(train)):,} rows, labels awful / great")
    return path


@dataclass
class SageMakerJob:
    """A notebook's SageMaker parameters (used with LAUNCH="sagemaker"): the instances, and None = from the
    environment ($SAGEMAKER_ROLE, $AWS_REGION, $SAGEMAKER_BUCKET); `wait`: for the job, then download its model
    and metrics."""

    instance_type: str = "ml.p4d.24xlarge"
    instance_count: int = 1
    role: str | None = None
    region: str | None = None
    bucket: str | None = None
    wait: bool = True


@dataclass
class Walkthrough:
    """A notebook's run, from its parameters cell: `start` once, then `prepare_data`, `check`, `launch`."""

    recipe: str
    where: str  # "local" (torchrun here) or "sagemaker" (a training job)
    overrides: list[str]
    nproc: int
    job_settings: object = None  # sagemaker_job.JobSettings, for where="sagemaker"
    wait: bool = True
    job: object = field(default=None, repr=False)

    @classmethod
    def start(
        cls, launch, recipe, size, data, max_steps, nproc, args, sagemaker: SageMakerJob | None = None
    ) -> Walkthrough:
        """Resolve the parameters (DATA relative to where the notebook started: a GLUE folder, a datasets folder or
        a file of rows, as in `make`) and move to the repository root, where recipes, the data cache and runs/
        live."""
        if launch not in ("local", "sagemaker"):
            raise UserError(f"LAUNCH={launch!r}: use 'local' or 'sagemaker'")
        data_keys = data_overrides(data)
        repo = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
        os.chdir(repo)
        size = size or ("full" if launch == "sagemaker" else default_size())
        overrides = [f"size={size}", *data_keys]
        overrides += [*([f"max_steps={max_steps}"] if max_steps else []), *args]
        sagemaker = sagemaker or SageMakerJob()
        settings = None
        if launch == "sagemaker":
            from ..sagemaker_job import JobSettings

            where = (sagemaker.instance_type, sagemaker.instance_count, sagemaker.role, sagemaker.region)
            settings = JobSettings(*where, sagemaker.bucket)
        walk = cls(recipe, launch, overrides, nproc or default_nproc(), settings, sagemaker.wait)
        print("recipe:", recipe, "| overrides:", " ".join(overrides), "| launch:", launch)
        return walk

    def prepare_data(self):
        """Tokenize and cache the data as the run will (a tiny model's tokenizer is learned here); print the splits."""
        from ..loop.builder import prepare_data
        from ..resolve import load_config

        config = load_config(self.recipe, self.overrides)
        prepared = prepare_data(config)
        print(prepared.cache_path)
        for split, rows in prepared.splits.items():
            print(f"{split:>10}: {len(rows):,} rows")
        return prepared

    @property
    def tiny(self) -> bool:
        return "size=tiny" in self.overrides

    def check(self) -> None:
        """Locally, `--check` in one process; for SageMaker, the processes per node the job will start."""
        if self.where == "local":
            stream(
                [sys.executable, "-m", "parallel_finetune.train", "--check", "--nproc", str(self.nproc), self.recipe]
                + self.overrides
            )
        else:
            from ..parallel.hardware import INSTANCES

            gpu, gpus, _ = INSTANCES[self.job_settings.instance_type]
            count, kind = self.job_settings.instance_count, self.job_settings.instance_type
            print(f"{count} x {kind}: {gpus} x {gpu} per node, torchrun --nproc_per_node {gpus}")

    def launch(self) -> Path | None:
        """Train; returns the folder with metrics.jsonl, summary.json and hf/ (None: a job not waited for)."""
        folder = run_folder(self.recipe)
        if self.where == "local":
            launch_local(self.recipe, [*self.overrides, f"output_dir={folder}"], self.nproc, check=False)
            return folder
        from ..sagemaker_job import launch

        self.job = launch(self.recipe, self.overrides, self.job_settings)
        job = self.job
        print(f"job {job.name}\n  console {job.console_url}\n  hyperparameters {job.hyperparameters}")
        if not self.wait:
            print("Not waiting: once the job completed, run `RUN = walk.job.download(notebook.run_folder(RECIPE))` "
                  "and the cells below.")  # fmt: skip
            return None
        print("status:", job.wait())
        return job.download(folder)


def read_metrics(folder: str | Path) -> list[dict]:
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: no metrics yet (did the run start?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# A task's own per-step metrics, drawn in a second row where metrics.jsonl holds them: (title, keys) per panel.
TASK_PANELS = (
    ("rewards/chosen (blue), rewards/rejected (orange)", ("rewards/chosen", "rewards/rejected")),  # task=dpo
    ("rewards/margins", ("rewards/margins",)),
    ("rewards/accuracies", ("rewards/accuracies",)),
    ("reward: the step's completions' mean", ("reward",)),  # task=grpo
    ("reward_std: within the prompts' groups", ("reward_std",)),
    ("completions/mean_length (tokens)", ("completions/mean_length",)),
)


def plot_training(folder: str | Path):
    """Loss, learning rate and throughput per step from metrics.jsonl, and below them the task's own per-step
    metrics where it logs some (TASK_PANELS: task=dpo's rewards); returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    records = read_metrics(folder)
    steps = [r["step"] for r in records]
    panels = [(title, keys) for title, keys in TASK_PANELS if all(key in records[0] for key in keys)]
    figure, grid = plt.subplots(2 if panels else 1, 3, figsize=(15, 7 if panels else 3.5), squeeze=False)
    axes = grid[0]
    for ax, (title, keys) in zip(grid[1] if panels else (), panels):
        for key in keys:
            ax.plot(steps, [r[key] for r in records], label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].plot(steps, [r["loss"] for r in records])
    axes[0].set_title("training loss")
    axes[1].plot(steps, [r["lr"] for r in records])
    axes[1].set_title("learning rate")
    axes[2].plot(steps, [r["samples_per_s"] for r in records], label="samples/s")
    tokens = axes[2].twinx()
    tokens.plot(steps, [r["tokens_per_s"] for r in records], color="tab:orange", label="tokens/s (no padding)")
    axes[2].set_title("throughput: samples/s (blue), real tokens/s (orange)")
    for ax in axes:
        ax.set_xlabel("step")
    figure.tight_layout()
    return figure


DEV_METRICS = (
    "accuracy",
    "f1",
    "macro_f1",
    "matthews_correlation",
    "pearson",
    "spearmanr",
    "mse",
    "mismatched_accuracy",
    "perplexity",
    "rewards/accuracies",  # task=dpo: the held-out pairs whose chosen answer's reward beats the rejected one's
    "rewards/margins",
    "eval_reward",  # task=grpo: the held-out prompts' completions' mean reward
)


def read_summary(folder: str | Path) -> dict:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise UserError(f"{path}: no summary (the run has not finished)")
    return json.loads(path.read_text())


def report(folder: str | Path) -> dict:
    """Print the numbers a user looks at after a run; returns summary.json."""
    summary = read_summary(folder)
    for key in DEV_METRICS:  # whichever the task reports (metrics.metric_keys), the main one first
        if summary.get(key) is not None:
            print(f"dev {key.replace('_', ' ')} {summary[key]:.4f} after {summary['steps']} steps")
    for key in (
        "layout",
        "precision",
        "train_samples_per_s",
        "train_tokens_per_s",
        "mfu",
        "mfu_unknown",
        "achievable_matmul_tflops",
        "padding_fraction",
        "packing_efficiency",
        "seconds",
        "peak_memory_mib_per_rank",
    ):
        if summary.get(key) is not None:
            print(f"{key}: {summary[key]}")
    return summary


def classify(model_folder: str | Path, sentences: list[str]) -> list[tuple[str, float, str]]:
    """(label, score, sentence) for each sentence, with the exported Hugging Face model (no repository code)."""
    from transformers import pipeline

    from ..model.pretrained import refuse_custom_code

    refuse_custom_code(model_folder)
    classifier = pipeline("text-classification", model=str(model_folder), device=-1, trust_remote_code=False)
    return [(result["label"], result["score"], sentence) for result, sentence in zip(classifier(sentences), sentences)]


# --- instruction tuning (notebooks/sft.ipynb)

ANSWER_MARKS = ("\u27e6", "\u27e7")  # ⟦ ⟧ around the trained tokens of a rendered row


def instruction_data(data: str | Path, kind: str = "instruction data", sample: str = "chat sample") -> str | Path:
    """DATA for the instruction- (and preference-) tuning walkthroughs: a file of conversations (pairs) or a
    save_to_disk folder as given; a GLUE folder (what `make notebooks DATA=` hands every walkthrough) holds none,
    so the shipped sample is used instead, and said."""
    if data and Path(data).expanduser().is_dir() and not data_overrides(data)[0].startswith("dataset="):
        print(f"DATA={data}: a GLUE folder is no {kind}; this walkthrough trains on the shipped {sample}")
        return ""
    return data


def marked_row(prepared, split: str = "train", row: int = 0) -> str:
    """A tokenized row's text with its trained tokens (target_mask) inside ⟦ ⟧: the assistant's answers and the
    template's end of turn; everything else is context only."""
    tokens = prepared.splits[split][row]
    ids, mask = tokens["input_ids"], tokens["target_mask"]
    pieces, start = [], 0
    for position in range(1, len(ids) + 1):
        if position == len(ids) or mask[position] != mask[start]:
            text = prepared.tokenizer.decode(ids[start:position], clean_up_tokenization_spaces=False)
            pieces.append(ANSWER_MARKS[0] + text + ANSWER_MARKS[1] if mask[start] else text)
            start = position
    return "".join(pieces)


def packing_efficiency(prepared, batch_size: int, max_length: int, seed: int = 42) -> dict[str, float]:
    """One epoch of the train split in global batches of `batch_size` (one process): the share of token slots
    holding real tokens, for random batches padded to their longest row ("padded") or packed into sequences of
    `max_length` ("packed"), and for batches of similar lengths (group_by_length) padded ("grouped")."""
    from ..data.packing import PackedShape, packed_token_slots
    from ..data.prepare import column
    from ..data.sampling import GlobalBatches, token_slots

    lengths = column(prepared.splits["train"], "length")
    shape = PackedShape(capacity=max_length)

    def share(group_by_length: bool, slots) -> float:
        batches = GlobalBatches(lengths, batch_size, seed, group_by_length).epoch(0)
        return sum(lengths[i] for batch in batches for i in batch) / sum(slots(batch) for batch in batches)

    return {
        "padded": share(False, lambda batch: token_slots(batch, lengths, 1, 1)),
        "packed": share(False, lambda batch: packed_token_slots(batch, lengths, 1, 1, shape)),
        "grouped": share(True, lambda batch: token_slots(batch, lengths, 1, 1)),
    }


def read_generations(folder: str | Path) -> list[dict]:
    """generations.jsonl: generate_every's greedy answers (step, prompt, answer), in the order written."""
    path = Path(folder) / "generations.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: no generations (generate_every=0, or the run has not trained that far)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def chat(model_folder: str | Path, conversations: list[list[dict]], max_new_tokens: int = 32) -> list[str]:
    """The exported model's greedy answer to each conversation (a list of {role, content}) through transformers'
    text-generation pipeline, which renders it with the chat template saved in hf/ (no repository code)."""
    from transformers import pipeline

    from ..model.pretrained import refuse_custom_code

    refuse_custom_code(model_folder)
    # the export's generation_config.json stops at EOS and the template's end of turn, as generate_every does
    generator = pipeline("text-generation", model=str(model_folder), device=-1, trust_remote_code=False)
    answers = []
    for messages in conversations:
        out = generator(messages, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(out[0]["generated_text"][-1]["content"])
    return answers


def warm_start_rows(folder: Path) -> Path:
    """The grpo sample's prompts with the completion `Answer: <answer>` (task=sft's prompt + completion format),
    train.jsonl and validation.jsonl in `folder`: what a tiny policy's warm start learns (bench/grpo_learning.py's
    too)."""
    from ..tasks.sources import SAMPLE_DIR

    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        lines = (SAMPLE_DIR / "grpo" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        answers = [[{"role": "assistant", "content": f"Answer: {row['answer']}"}] for row in rows]
        text = "".join(json.dumps({"prompt": r["prompt"], "completion": a}) + "\n" for r, a in zip(rows, answers))
        (folder / f"{split}.jsonl").write_text(text, encoding="utf-8")
    return folder


def warm_start(walk: Walkthrough, steps: int, lr: float = 2e-3, grpo_lr: float = 5e-4) -> list[str]:
    """A tiny grpo walkthrough's starting policy. GRPO climbs only rewards its samples sometimes earn: a tiny model
    from scratch never writes `Answer: <number>`, every completion of a group scores alike, every advantage is 0
    and nothing is learned. GRPO runs start from an instruct model; the tiny one starts from `steps` steps of
    task=sft (the family's tp.yaml, size=tiny, at `lr`) on the grpo sample's own training prompts with the
    completion `Answer: <answer>`, exported. Returns the walkthrough's overrides that train its recipe from that
    model (size=full: a model folder) at the recipe's tiny settings, lr `grpo_lr` (the tiny section's 2e-3 makes
    the warm-started policy collapse within 40 steps: docs/benchmarks.md), the walkthrough's own overrides last."""
    from ..resolve import load_config

    folder = Path("runs") / "grpo-warm-start"
    data = warm_start_rows(folder / "data")
    tiny = load_config(walk.recipe, [o for o in walk.overrides if not o.startswith("max_steps=")])
    sft = ["size=tiny", "task=sft", f"train_file={(data / 'train.jsonl').resolve()}"]
    sft += [f"validation_file={(data / 'validation.jsonl').resolve()}", f"max_steps={steps}", f"lr={lr}"]
    sft += ["warmup_ratio=0", "lr_scheduler=constant", "export=true", f"output_dir={folder / 'sft'}"]
    sft += [f"tensor_parallel_degree={tiny.parallel.tensor_parallel_degree}", "overwrite=true", "resume=none"]
    launch_local(Path(walk.recipe).parent / "tp.yaml", sft, walk.nproc, check=False)
    grpo, training = tiny.grpo, tiny.training
    return [
        "size=full",
        f"model={(folder / 'sft' / 'hf').resolve()}",
        f"family={tiny.model.family}",
        f"precision={training.precision}",
        f"tensor_parallel_degree={tiny.parallel.tensor_parallel_degree}",
        f"activation_checkpointing={str(tiny.memory.activation_checkpointing).lower()}",
        f"max_length={tiny.data.max_length}",
        f"batch_size={training.batch_size}",
        f"gradient_accumulation_steps={training.gradient_accumulation_steps}",
        f"num_generations={grpo.num_generations}",
        f"max_completion_length={grpo.max_completion_length}",
        f"lr={grpo_lr}",
        "eval_every=null",
        *[o for o in walk.overrides if not o.startswith("size=")],
    ]
