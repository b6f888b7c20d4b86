"""The run's model stage: the model's config, this rank's shards loaded and said, the updates (torch's or
DeepSpeed's), the objective the task's kind names (loop/objectives.py), the runner (the whole model, or a pipeline
stage) and the lr schedule, as one record (`BuiltModel`). It reads the sections it is given, never the whole
Config."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import transformers
from torch import nn

from ..config import (
    DataSection,
    GRPOSection,
    MemorySection,
    ModelSection,
    ParallelSection,
    PreferenceSection,
    TrainingSection,
)
from ..data.batch import TokenizedSplit
from ..data.prepare import PreparedData
from ..errors import UserError
from ..families.base import Family
from ..interfaces import Objective, Runner, Updates
from ..model import attention
from ..model.load import ReadyModel, load_model, log_loaded
from ..model.precision import autocast
from ..parallel import Placement
from ..parallel.layout import Engine, Layout
from ..parallel.pipeline import Pipeline, PipelineSettings
from ..resolve import Resolved, Schedule
from .objectives import ObjectiveInputs, make_objective
from .runner import WholeModel
from .updates import TorchUpdates

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """The model built and what drives it."""

    ready: ReadyModel  # the model as loaded (its load figures, its parallel placement)
    model: nn.Module  # ready.model, or DeepSpeed's engine (forwards go through it: ZeRO-3 gathers there)
    updates: Updates
    runner: Runner
    scheduler: object  # the lr schedule
    objective: Objective  # the loss the task's kind names (loop/objectives.py): its statistics are metrics too


@dataclass
class ModelStage:
    """The model stage of one run: its sections, the layout, the resolved settings, the family, and where a
    full-size model's files are (None: a tiny model, built from its config)."""

    model_section: ModelSection
    data: DataSection
    training: TrainingSection
    parallel: ParallelSection
    memory: MemorySection
    preference: PreferenceSection
    layout: Layout
    resolved: Resolved
    family: Family
    model_path: str | None = None
    deepspeed_config: dict | None = None  # engine=deepspeed: the config made for it (deepspeed_engine.preflight)
    grpo: GRPOSection = field(default_factory=GRPOSection)  # task=grpo's objective reads it

    def build(self, prepared: PreparedData, train: TokenizedSplit, schedule: Schedule) -> BuiltModel:
        """The model (each rank its own shards; the module forwards go through), the updates, the objective, the
        runner, the lr schedule."""
        resolved, layout = self.resolved, self.layout
        ready = self._load(prepared, schedule)
        model, updates = self._updates(ready)
        inputs = ObjectiveInputs(
            task=prepared.task,
            model=ready.model,
            head=resolved.head,
            engine=resolved.engine,
            loss_chunk_tokens=resolved.loss_chunk_tokens,
            pipeline=layout.pp > 1,
            preference=self.preference,
            grpo=self.grpo,
        )
        objective = make_objective(prepared.task.kind.objective, inputs)
        runner = self._runner(ready, model, updates, objective, token_types=train.token_types is not None)
        try:
            scheduler = transformers.get_scheduler(
                self.training.lr_scheduler,
                updates.optimizer,
                num_warmup_steps=schedule.warmup_steps,
                num_training_steps=schedule.total_steps,
            )
        except ValueError as exc:
            raise UserError(f"lr_scheduler={self.training.lr_scheduler!r}: {str(exc).splitlines()[0]}") from None
        return BuiltModel(ready, model, updates, runner, scheduler, objective)

    def _updates(self, ready: ReadyModel) -> tuple[nn.Module, Updates]:
        """(what forwards go through, the updates): DeepSpeed's engine and its updates, or the model and torch's."""
        layout, precision = self.layout, self.resolved.precision
        if self.resolved.engine is Engine.DEEPSPEED:
            from ..parallel.deepspeed_engine import DeepSpeedUpdates

            updates = DeepSpeedUpdates(
                ready.model, layout, training=self.training, parallel=self.parallel, precision=precision
            )
            return updates.engine, updates  # forwards go through DeepSpeed (ZeRO-3 gathers parameters there)
        updates = TorchUpdates(
            ready.model,
            layout,
            ready.parallel,
            training=self.training,
            parallel=self.parallel,
            precision=precision,
            adamw=ready.zero_adamw,
        )
        return ready.model, updates

    def _runner(self, ready: ReadyModel, model: nn.Module, updates: Updates, objective, token_types: bool) -> Runner:
        """A pipeline stage's runner (pipeline_parallel_degree > 1), else the whole model's."""
        layout, resolved, family, packing = self.layout, self.resolved, self.family, self.data.packing
        autocast_context = functools.partial(autocast, resolved.precision, layout.device)
        if layout.pp > 1:
            settings = PipelineSettings(
                self.parallel.pipeline_schedule,
                resolved.microbatches,
                resolved.head,
                objective,
                token_types=token_types,
                packing=packing,
                pad_multiple=self.data.pad_to_multiple_of,
            )
            return Pipeline(
                ready.model,
                family,
                ready.parallel.stages,
                layout,
                settings,
                autocast_context,
                lambda: updates.loss_scale,
            )
        runner = WholeModel(
            model,
            resolved.head,
            objective,
            autocast_context,
            updates.backward,
            self.memory.offload_activations,
            layout.device,
            packing=family if packing else None,
        )
        runner.pad_multiple = self.data.pad_to_multiple_of  # a pipeline's comes with its settings
        return runner

    def _packed_attention(self, hf_config) -> None:
        """Packed batches' attention: varlen flash attention where its kernel's preconditions hold
        (model/attention.py), else the dense 4-D mask; said once, with why."""
        layout, resolved = self.layout, self.resolved
        model_class = self.family.model_classes[resolved.head]
        why = attention.varlen_unavailable(
            hf_config, model_class, layout.device, pipeline=layout.pp > 1, compute_dtype=resolved.compute_dtype
        )
        if why is None:
            attention.register()
            hf_config._attn_implementation = attention.NAME
            log.info("packing: varlen attention over each packed row (no dense mask)")
        else:
            log.info("packing: a dense 4-D attention mask per packed sequence (%s)", why)

    def _load(self, prepared: PreparedData, schedule: Schedule) -> ReadyModel:
        """The model's config from the checkpoint or the family, then this rank's shards loaded, and said."""
        family, tokenizer, resolved, layout = self.family, prepared.tokenizer, self.resolved, self.layout
        hf_config = family.config_for(
            model=self.model_section,
            head=resolved.head,
            max_length=self.data.max_length,
            tokenizer_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            model_path=self.model_path,
            labels=prepared.task,
        )
        family.check_tp(hf_config, layout.tp)
        if self.data.packing:
            family.check_packing(hf_config, self.data.max_length)
            self._packed_attention(hf_config)
        if self.training.compile == "auto":
            log.info("%s", schedule.compile_why)
        placement = Placement(
            layout=layout,
            parallel=self.parallel,
            memory=self.memory,
            training=self.training,
            precision=resolved.precision,
            autocast_dtype=resolved.autocast_dtype,
            microbatches=resolved.microbatches,
            compile=schedule.compile,
            deepspeed_config=self.deepspeed_config,
        )
        seed = self.training.seed
        ready = load_model(
            family, resolved.head, hf_config, self.model_path, seed=seed, adapters=resolved.lora, placement=placement
        )
        log_loaded(ready, family, placement, adapters=resolved.lora, model_name=resolved.model_name, seed=seed)
        return ready
