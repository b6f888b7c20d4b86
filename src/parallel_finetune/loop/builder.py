"""A run's assembly, before any training, in typed stages: the layout, the settings resolved and checked, the run
folders claimed (here), then the data stage (data_stage.py), the model stage (model_stage.py) and the loop's
assembly (assembly.py), each given the config sections it reads and returning a typed record. All of them, or one
line on a bad input before any work; the Trainer (trainer.py) receives the components and only trains.

    RunBuilder(config).build():  layout -> checks -> run folders (+ the model fetched) -> DataStage (+ the schedule
                                 resolved) -> BuiltModel: model, updates, objective, runner, lr schedule -> the
                                 reference pass -> resume -> the run folder written -> batcher, evaluator,
                                 generator, reporter (trackers started) -> Trainer
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import transformers

from ..config import Config
from ..data.prepare import PreparedData, prepare
from ..families import get_family
from ..families.base import Family
from ..model.hub import fetch_model
from ..model.load import ReadyModel
from ..model.throughput import Peak, device_peak
from ..outputs.reporting import PhaseTimer
from ..outputs.runfolder import RunLock, claim_run_folders, open_run_folder
from ..parallel.layout import Engine, Layout, check_batch_split, init_distributed
from ..parallel.pipeline import check_microbatches
from ..preflight import check_heads, check_model_config
from ..resolve import Resolved, choose_model, resolve, resolve_schedule
from ..tasks.sources import carved_fingerprint
from .assembly import LoopAssembly
from .data_stage import DataStage, data_stage
from .model_stage import BuiltModel, ModelStage
from .trainer import StopRequest, Trainer

log = logging.getLogger(__name__)


@dataclass
class BuiltRun:
    """What the entry point (train.run) drives: the Trainer, and what the run's end reads."""

    trainer: Trainer
    resolved: Resolved
    family: Family
    ready: ReadyModel  # the model as loaded (its load figures, its parallel placement)
    data: PreparedData
    output_dir: Path
    resumed_from: Path | None
    saved_initial: dict = field(default_factory=dict)  # export's `saved_initial` (_saved_initial)


def prepare_data(config: Config, model_path: str | None = None, resolved: Resolved | None = None):
    """data.prepare on a recipe's sections, as a run calls it (scripts/prepare_data.py, the notebooks, a SageMaker
    job's staging, a run's rank 0); `model_path`: the pretrained model's local folder when it was fetched."""
    return prepare(
        data=config.data,
        model=config.model,
        family=resolved.family if resolved else get_family(config.model.family),
        model_name=model_path or (resolved or choose_model(config)).model_name,
        seed=config.training.seed,
        predict=config.output.predict,
    )


# Below these a run's figures say little: a metric over n held-out rows moves in steps of 1/n (2 pairs: an accuracy
# of 0, 0.5 or 1), and a handful of steps shows no trend. Said once, at the start, with the count and what to change.
FEW_HELD_OUT = 32
FEW_STEPS = 10


def small_run_warnings(config: Config, prepared: PreparedData, total_steps: int, steps_per_epoch: int) -> list[str]:
    """One line for a held-out split of fewer than FEW_HELD_OUT rows (pairs, for dpo), one for a run of fewer than
    FEW_STEPS steps: the count and the key to change."""
    lines = []
    held = len(prepared.splits["validation"])
    if held < FEW_HELD_OUT:
        unit = prepared.task.kind.sample_unit
        percentage, seed = config.data.validation_split_percentage, config.training.seed
        if prepared.source.fingerprint.endswith(
            carved_fingerprint("", validation_split_percentage=percentage, seed=seed)
        ):
            change = f"raise validation_split_percentage (now {percentage:g}% of the training rows)"
        else:
            change = "give a validation split of more rows (validation_file=)"
        lines.append(
            f"the held-out split has {held} {unit}: a metric over so few moves in steps of 1/{held} and says little; "
            f"{change} for at least {FEW_HELD_OUT}"
        )
    if total_steps < FEW_STEPS:
        if config.training.max_steps is not None:
            why, change = f"max_steps={config.training.max_steps}", f"raise max_steps to {FEW_STEPS} or more"
        else:
            training = config.training
            why = f"epochs={training.epochs:g} of {steps_per_epoch} step(s) of batch_size {training.batch_size}"
            change = f"raise epochs (or give more training rows) for {FEW_STEPS} steps or more"
        lines.append(
            f"the run trains {total_steps} step(s) ({why}): too few for its loss or metrics to show a trend; {change}"
        )
    return lines


class RunBuilder:
    """Assembles a run (`build`) from its stages; holds rank 0's lock on the run folders from claiming them until
    `release`."""

    def __init__(self, config: Config):
        self.config = config
        self.family = get_family(config.model.family)
        self.timer = PhaseTimer()
        self.run_lock: RunLock | None = None  # rank 0's hold on the run folders
        self.model_path: str | None = None  # a full-size model's local folder (tiny: built from its config)
        self.deepspeed_config: dict | None = None  # engine=deepspeed: the config made for it
        self.resumed_step = 0  # the step a resumed checkpoint had reached (errors name it)

    def release(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()

    def build(self, stop: StopRequest | None = None) -> BuiltRun:
        """Every part of the run, or an error before any work; the run folder is written last (rank 0), then the
        trackers start. `stop`: the SIGTERM handler the Trainer obeys."""
        config = self.config
        with self.timer("setup"):
            layout, resolved, peak, (output_dir, checkpoint_root) = self._setup()
        with self.timer("data"):
            stage = data_stage(
                layout,
                lambda: prepare_data(config, self.model_path, resolved),
                config.data,
                config.training,
                config.grpo,
            )
            schedule = resolve_schedule(config, len(stage.sampler), layout.device.type, layout.tp)
            if layout.is_main:  # rank 0 alone: the other ranks show WARNING lines too, and would repeat it
                for line in small_run_warnings(config, stage.prepared, schedule.total_steps, len(stage.sampler)):
                    log.warning("%s", line)
        with self.timer("model"):
            if config.model.size == "full":  # (tiny: checked before any work, in _check_settings)
                check_heads(check_model_config(config, self.model_path))
            built = self._model_stage(layout, resolved).build(stage.prepared, stage.train, schedule)
        # before a resumed checkpoint replaces the weights
        saved_initial = self._saved_initial(resolved, built)
        loop = LoopAssembly(
            *(config.data, config.training, config.checkpoint, config.logging, config.to_dict()),
            *(layout, resolved, self.family, self.timer, config.grpo),
        )
        references = loop.references(stage, built, schedule)
        rollouts = loop.rollouts(stage, built)  # before resuming: a checkpoint may hold its kept rollout
        checkpoints = loop.checkpoints(checkpoint_root, stage.prepared, built, self._base(resolved), rollouts)
        step = self.resumed_step = checkpoints.resume(output=config.output)
        if layout.is_main:  # only now, with every input accepted, is the run folder written
            self._open_run_folder(output_dir, checkpoint_root, built, stage.prepared)
        log.info("run folder %s | %s", output_dir, layout.describe())
        trainer = loop.trainer(
            stage, built, schedule, references, checkpoints, (output_dir, step, peak, stop or StopRequest()), rollouts
        )
        self._say_training(stage, layout, resolved, schedule.total_steps)
        return BuiltRun(
            trainer,
            resolved,
            self.family,
            built.ready,
            stage.prepared,
            output_dir,
            checkpoints.resumed_from,
            saved_initial,
        )

    def _model_stage(self, layout: Layout, resolved: Resolved) -> ModelStage:
        config = self.config
        return ModelStage(
            *(config.model, config.data, config.training, config.parallel, config.memory, config.preference),
            *(layout, resolved, self.family, self.model_path, self.deepspeed_config, config.grpo),
        )

    def _say_training(self, stage: DataStage, layout: Layout, resolved: Resolved, total_steps: int) -> None:
        training = self.config.training
        batch_size, accumulation = training.batch_size, training.gradient_accumulation_steps
        log.info(
            "training %d steps (%d per epoch), global batch %d = %d dp x %d accumulation x %d, precision %s",
            *(total_steps, len(stage.sampler), batch_size, layout.dp, accumulation),
            *(batch_size // (layout.dp * accumulation), resolved.precision),
        )

    def _setup(self) -> tuple[Layout, Resolved, Peak, tuple]:
        """The process group and mesh, this rank's logging, the settings resolved, the run folders claimed and a
        full-size model's files fetched: (layout, resolved, peak, (output folder, checkpoint folder))."""
        config = self.config
        parallel = config.parallel
        layout = init_distributed(
            parallel.device,
            parallel.tensor_parallel_degree,
            parallel.sharding,
            parallel.shard_group_size,
            parallel.pipeline_parallel_degree,
            parallel.collective_timeout_s,
        )
        logging.basicConfig(level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s", force=True)
        transformers.logging.set_verbosity_error()
        resolved, peak = self._check_settings(layout)
        output_dir, checkpoint_root, self.run_lock = claim_run_folders(
            layout, recipe=config.recipe, checkpoint=config.checkpoint, output=config.output
        )
        if config.model.size == "full":
            self.model_path = fetch_model(
                resolved.model_name, config.model.revision, layout, parallel.collective_timeout_s
            )
        return layout, resolved, peak, (output_dir, checkpoint_root)

    def _check_settings(self, layout: Layout) -> tuple[Resolved, Peak]:
        """Precision, the device's peak, the batch split, micro-batches, DeepSpeed's config: resolved, or one
        line on a bad input, before any work."""
        config, training = self.config, self.config.training
        resolved = resolve(config, layout.device, layout.dims)  # decided once; components receive these
        if config.lr_note:
            log.info("%s", config.lr_note)
        peak = device_peak(layout.device, resolved.compute_dtype, training.peak_tflops)
        log.info("%s", peak.describe())
        check_batch_split(training.batch_size, layout.dp, training.gradient_accumulation_steps)
        if config.model.size == "tiny":  # (full size: once the model is fetched, in build)
            check_heads(check_model_config(config))  # a bad model_config: one line, not a traceback per rank
        if layout.pp > 1:
            check_microbatches(
                training.batch_size // (layout.dp * training.gradient_accumulation_steps), resolved.microbatches
            )
        if resolved.engine is Engine.DEEPSPEED:  # one line (fp16 on a CPU, a conflicting JSON) before any work
            from ..parallel import deepspeed_engine

            self.deepspeed_config = deepspeed_engine.preflight(
                training=training,
                parallel=config.parallel,
                dp=layout.dp,
                device_type=layout.device.type,
                precision=resolved.precision,
            )
        return resolved, peak

    def _open_run_folder(self, output_dir: Path, checkpoint_root: Path, built: BuiltModel, prepared) -> None:
        """Rank 0: config.yaml, labels.json (and DeepSpeed's config) into the run folder, claimed before."""
        config = self.config
        open_run_folder(
            output_dir,
            checkpoint_root,
            settings=config.to_dict(),
            overwrite=config.output.overwrite,
            deepspeed_config=built.updates.deepspeed_config if self.deepspeed_config is not None else None,
            task=prepared.task,
        )

    def _base(self, resolved: Resolved) -> str:
        """What the trained model started from, as a checkpoint records it."""
        model = self.config.model
        if model.size == "tiny":
            return f"tiny {self.family.name} from config, initialised from seed {self.config.training.seed}"
        return f"{resolved.model_name}@{model.revision}" if model.revision else resolved.model_name

    def _saved_initial(self, resolved: Resolved, built: BuiltModel) -> dict:
        """A tiny LoRA run's lora_modules_to_save as loaded, gathered on rank 0 in the export dtype: its base/ is
        the frozen base, so it holds these, not the trained ones (which the adapter carries); a tiny base exists
        nowhere else to be read again. {}: not a tiny LoRA run with modules to save. A collective."""
        settings = resolved.lora
        if self.config.model.size != "tiny" or settings is None or not settings.modules_to_save:
            return {}
        heads = tuple(f"{m}." for m in settings.modules_to_save)
        names = {n for n, p in built.updates.module.named_parameters() if p.requires_grad and n.startswith(heads)}
        gathered = built.updates.full_state_dict(resolved.export_dtype, names)
        return {name: tensor.clone() for name, tensor in gathered.items()}  # on a CPU: the live parameter itself
