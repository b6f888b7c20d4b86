"""A run's assembly, before any training: the layout, the settings resolved and checked, the run folders claimed,
the data prepared, the model built and loaded, its updates, runner and lr schedule, a checkpoint resumed. All of
them, or one line on a bad input before any work; the Trainer (trainer.py) receives them (`RunParts`) and only
trains.

    RunBuilder(config).build():  layout -> checks -> run folders (+ the model fetched) -> data -> model, updates,
                                 runner, schedule -> resume -> the run folder written
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import transformers
from torch import nn

from . import checkpoint
from . import data as data_module
from .checkpoint import TrainingState
from .config import Config, compile_decision
from .errors import UserError
from .families import get_family
from .families.base import Family
from .hub import fetch_model
from .interfaces import Runner, Updates
from .layout import Engine, Layout, check_batch_split, init_distributed, rank0_decides
from .model import ReadyModel, load_model, log_loaded
from .parallel import Placement
from .parallel.pipeline import Pipeline, PipelineSettings, check_microbatches
from .precision import autocast
from .preflight import check_heads, check_model_config
from .reporting import PhaseTimer
from .resolve import Resolved, pretrained_name, resolve
from .runfolder import RunLock, claim_run_folders, open_run_folder
from .runner import WholeModel
from .throughput import Peak, device_peak
from .updates import TorchUpdates

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    """What the builder assembles and the Trainer drives: every part made, its inputs accepted."""

    config: Config
    family: Family
    layout: Layout
    resolved: Resolved  # decided once; components receive these
    peak: Peak  # the device's peak FLOP/s (for MFU)
    timer: PhaseTimer  # seconds per phase: setup, data, model, resume here; the Trainer adds its own
    output_dir: Path
    checkpoint_root: Path
    data: data_module.PreparedData
    train_ids: list
    train_lengths: list[int]
    train_labels: list | None
    train_types: list | None  # token type ids (sentence pairs of a family with them), else None
    train_target_masks: list | None  # which tokens are trained (task=sft), else None: every next token
    train_targets: list[int] | None  # each row's count of trained tokens (task=sft), else None
    batches: data_module.GlobalBatches
    total_steps: int
    ready: ReadyModel
    model: nn.Module  # ready.model, or DeepSpeed's engine (forwards go through it: ZeRO-3 gathers there)
    updates: Updates
    runner: Runner
    scheduler: object  # the lr schedule
    resumed_from: Path | None = None
    resumed_step: int = 0

    def base_description(self) -> str:
        config = self.config
        if config.size == "tiny":
            return f"tiny {self.family.name} from config, initialised from seed {config.seed}"
        name = self.resolved.model_name
        return f"{name}@{config.revision}" if config.revision else name

    def training_state(self, step: int) -> TrainingState:
        return TrainingState(
            step,
            self.model,
            self.updates,
            self.scheduler,
            self.config.to_dict(),
            self.data.tokenizer,
            self.layout,
            self.family.name,
            self.ready.parameter_shapes,
            self.ready.parallel.trainable,
            self.base_description(),
            self.data.source.fingerprint,
            self.data.task,
            self.token_identity,
        )

    @functools.cached_property
    def token_identity(self) -> str:
        """What decides the data's token ids (the tokenizer and its chat template): a continuation must match it."""
        return data_module.tokenizer_identity(self.data.tokenizer)


@dataclass
class _TrainRows:
    """The training split's columns that the loop reads, and the global batches over them."""

    ids: list
    lengths: list[int]
    labels: list | None
    types: list | None
    target_masks: list | None
    targets: list[int] | None
    batches: data_module.GlobalBatches
    total_steps: int


def prepare_data(config: Config, model_path: str | None = None, resolved: Resolved | None = None):
    """data.prepare on a recipe's sections, as a run calls it (scripts/prepare_data.py, the notebooks, a SageMaker
    job's staging, a run's rank 0); `model_path`: the pretrained model's local folder when it was fetched."""
    return data_module.prepare(
        data=config.data,
        model=config.model,
        family=resolved.family if resolved else get_family(config.family),
        model_name=model_path or (resolved.model_name if resolved else pretrained_name(config)),
        seed=config.training.seed,
        predict=config.output.predict,
    )


class RunBuilder:
    """Assembles a run (`build`); holds rank 0's lock on the run folders from claiming them until `release`."""

    def __init__(self, config: Config):
        self.config = config
        self.family = get_family(config.family)
        self.timer = PhaseTimer()
        self.run_lock: RunLock | None = None  # rank 0's hold on the run folders
        self.model_path: str | None = None  # a full-size model's local folder (tiny: built from its config)
        self.deepspeed_config: dict | None = None  # engine=deepspeed: the config made for it
        self.resumed_step = 0  # the step a resumed checkpoint had reached (errors name it)

    def release(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()

    def build(self) -> RunParts:
        """Every part of the run, or an error before any work; the run folder is written last (rank 0)."""
        config = self.config
        with self.timer("setup"):
            layout = init_distributed(
                config.device,
                config.tensor_parallel_degree,
                config.sharding,
                config.shard_group_size,
                config.pipeline_parallel_degree,
                config.collective_timeout_s,
            )
            logging.basicConfig(
                level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s", force=True
            )
            transformers.logging.set_verbosity_error()
            resolved, peak = self._check_settings(layout)
            output_dir, checkpoint_root, self.run_lock = claim_run_folders(
                layout, recipe=config.recipe, checkpoint=config.checkpoint, output=config.output
            )
            if config.size == "full":
                name = resolved.model_name
                self.model_path = fetch_model(name, config.revision, layout, config.collective_timeout_s)
        with self.timer("data"):
            prepared, rows = self._prepare_data(layout, resolved)
        with self.timer("model"):
            ready, model, updates, runner, scheduler = self._build(layout, resolved, prepared, rows)
        parts = RunParts(
            config,
            self.family,
            layout,
            resolved,
            peak,
            self.timer,
            output_dir,
            checkpoint_root,
            prepared,
            rows.ids,
            rows.lengths,
            rows.labels,
            rows.types,
            rows.target_masks,
            rows.targets,
            rows.batches,
            rows.total_steps,
            ready,
            model,
            updates,
            runner,
            scheduler,
        )
        if parts.updates.checkpointable:
            self._resume(parts)
        if layout.is_main:  # only now, with every input accepted, is the run folder written
            deepspeed_config = parts.updates.config if self.deepspeed_config is not None else None
            open_run_folder(
                output_dir,
                checkpoint_root,
                settings=config.to_dict(),
                overwrite=config.output.overwrite,
                deepspeed_config=deepspeed_config,
                task=prepared.task,
            )
        log.info("run folder %s | %s", output_dir, layout.describe())
        return parts

    def _check_settings(self, layout: Layout) -> tuple[Resolved, Peak]:
        """Precision, the device's peak, the batch split, micro-batches, DeepSpeed's config: resolved, or one
        line on a bad input, before any work."""
        config = self.config
        resolved = resolve(config, layout.device, layout.dims)  # decided once; components receive these
        if config.lr_note:
            log.info("%s", config.lr_note)
        peak = device_peak(layout.device, resolved.compute_dtype, config.peak_tflops)
        log.info("%s", peak.describe())
        check_batch_split(config.batch_size, layout.dp, config.gradient_accumulation_steps)
        if config.size == "tiny":  # (full size: once the model is fetched, in _build)
            check_heads(check_model_config(config))  # a bad model_config: one line, not a traceback per rank
        if layout.pp > 1:
            check_microbatches(
                config.batch_size // (layout.dp * config.gradient_accumulation_steps), resolved.microbatches
            )
        if resolved.engine is Engine.DEEPSPEED:  # one line (fp16 on a CPU, a conflicting JSON) before any work
            from .parallel import deepspeed_engine

            self.deepspeed_config = deepspeed_engine.preflight(
                training=config.training,
                parallel=config.parallel,
                dp=layout.dp,
                device_type=layout.device.type,
                precision=resolved.precision,
            )
        return resolved, peak

    def _resume(self, parts: RunParts) -> None:
        """From the newest checkpoint that all ranks together verify and load (skipped ones said once, by rank 0),
        if there is one."""
        started, state = time.perf_counter(), parts.training_state(0)
        config = parts.config
        parts.resumed_from = checkpoint.resume(
            state, parts.checkpoint_root, checkpoint=config.checkpoint, output=config.output
        )
        if parts.resumed_from:
            parts.resumed_step = self.resumed_step = state.step
            self.timer.seconds["resume"] = time.perf_counter() - started

    def _prepare_data(self, layout: Layout, resolved: Resolved) -> tuple[data_module.PreparedData, _TrainRows]:
        config = self.config
        mine: list[data_module.PreparedData] = []

        def prepare_on_rank0():
            mine.append(prepare_data(config, self.model_path, resolved))
            return str(mine[0].cache_path), mine[0].source

        # Rank 0 builds the cache (and may fall back to the sample, loudly, once); the others then read it.
        cache_path, source = rank0_decides(layout, prepare_on_rank0)
        prepared = mine[0] if mine else data_module.load_prepared(Path(cache_path), source)
        train = prepared.splits["train"]
        lengths = data_module.column(train, "length")
        batches = data_module.GlobalBatches(lengths, config.batch_size, config.seed, config.group_by_length)
        rows = _TrainRows(
            data_module.column(train, "input_ids"),
            lengths,
            data_module.column(train, "label") if "label" in train.column_names else None,
            data_module.column(train, "token_type_ids") if "token_type_ids" in train.column_names else None,
            *(
                data_module.column(train, name) if name in train.column_names else None
                for name in ("target_mask", "targets")
            ),
            batches,
            config.max_steps or max(1, math.ceil(config.epochs * len(batches))),
        )
        log.info(
            "data: %s | %s",
            prepared.source.description,
            ", ".join(f"{k} {len(v):,} rows" for k, v in prepared.splits.items()),
        )
        return prepared, rows

    def _build(
        self, layout: Layout, resolved: Resolved, prepared: data_module.PreparedData, rows: _TrainRows
    ) -> tuple[ReadyModel, nn.Module, Updates, Runner, object]:
        """The model (each rank its own shards; the module forwards go through), the updates, the runner, the lr
        schedule."""
        config, family = self.config, self.family
        ready = self._load_model(layout, resolved, prepared, rows)
        model, precision = ready.model, resolved.precision
        if resolved.engine is Engine.DEEPSPEED:
            from .parallel.deepspeed_engine import DeepSpeedUpdates

            updates = DeepSpeedUpdates(
                ready.model, layout, training=config.training, parallel=config.parallel, precision=precision
            )
            model = updates.engine  # forwards go through DeepSpeed (ZeRO-3 gathers parameters there)
        else:
            updates = TorchUpdates(
                ready.model,
                layout,
                ready.parallel,
                training=config.training,
                parallel=config.parallel,
                precision=precision,
                adamw=ready.zero_adamw,
            )
        autocast_context = functools.partial(autocast, precision, layout.device)
        if layout.pp > 1:
            settings = PipelineSettings(
                config.pipeline_schedule,
                resolved.microbatches,
                resolved.head,
                token_types=rows.types is not None,
                packing=config.packing,
            )
            runner = Pipeline(
                ready.model,
                family,
                ready.parallel.stages,
                layout,
                settings,
                autocast_context,
                lambda: updates.loss_scale,
            )
        else:
            runner = WholeModel(
                model,
                resolved.head,
                autocast_context,
                updates.backward,
                config.offload_activations,
                layout.device,
                packing=family if config.packing else None,
            )
        warmup = config.warmup_steps or math.ceil(config.warmup_ratio * rows.total_steps)
        try:
            scheduler = transformers.get_scheduler(
                config.lr_scheduler, updates.optimizer, num_warmup_steps=warmup, num_training_steps=rows.total_steps
            )
        except ValueError as exc:
            raise UserError(f"lr_scheduler={config.lr_scheduler!r}: {str(exc).splitlines()[0]}") from None
        return ready, model, updates, runner, scheduler

    def _load_model(
        self, layout: Layout, resolved: Resolved, prepared: data_module.PreparedData, rows: _TrainRows
    ) -> ReadyModel:
        """The model's config from the checkpoint or the family, then this rank's shards loaded, and said."""
        config, family, tokenizer = self.config, self.family, prepared.tokenizer
        if config.size == "full":
            check_heads(check_model_config(config, self.model_path))
        hf_config = family.config_for(
            model=config.model,
            max_length=config.max_length,
            tokenizer_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            model_path=self.model_path,
            labels=prepared.task,
        )
        family.check_tp(hf_config, layout.tp)
        if config.packing:
            family.check_packing(hf_config, config.max_length)
        compiled, why = compile_decision(config, rows.total_steps, layout.device.type, layout.tp)
        if config.compile == "auto":
            log.info("%s", why)
        placement = Placement(
            layout=layout,
            parallel=config.parallel,
            memory=config.memory,
            training=config.training,
            precision=resolved.precision,
            autocast_dtype=resolved.autocast_dtype,
            microbatches=resolved.microbatches,
            compile=compiled,
            deepspeed_config=self.deepspeed_config,
        )
        ready = load_model(
            family, resolved.head, hf_config, self.model_path, seed=config.seed, peft=config.peft, placement=placement
        )
        log_loaded(
            ready,
            family,
            placement,
            peft=config.peft,
            task=resolved.head,
            model_name=resolved.model_name,
            seed=config.seed,
        )
        return ready
