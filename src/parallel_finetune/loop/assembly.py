"""The loop's assembly, once the data and the model stages are built: the reference pass (a kind whose objective
reads one), the checkpoint manager, the training batcher the task's kind names (data/batchers.py), the evaluator,
the generator, the reporter (trackers started) and the Trainer they make. It reads the sections it is given, and
the run's settings as written (`settings`: what checkpoints and trackers record), never the whole Config."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from ..config import CheckpointSection, DataSection, GRPOSection, LoggingSection, TrainingSection
from ..data.batch import PairReference
from ..data.batchers import Padding, make_batcher
from ..data.packing import PackedShape
from ..data.prepare import PreparedData, tokenizer_identity
from ..families.base import Family
from ..model.throughput import Peak
from ..outputs.checkpoint import TrainingState
from ..outputs.loggers import destinations
from ..outputs.reporting import PhaseTimer, Reporter
from ..outputs.runfolder import written_settings
from ..parallel.layout import Layout, rank0_decides
from ..resolve import Resolved, Schedule
from ..rl.steps import make_step_source
from .checkpointer import CheckpointManager
from .data_stage import DataStage
from .divergence import NonFiniteGuard
from .evaluation import Evaluator
from .generation import Generator, held_out_prompts
from .model_stage import BuiltModel
from .reference import Scorer, measure_reference, step_batches
from .trainer import Steps, StopRequest, Trainer


@dataclass
class LoopAssembly:
    """The loop's parts of one run, from its data and model stages."""

    data: DataSection
    training: TrainingSection
    checkpoint: CheckpointSection
    logs: LoggingSection
    settings: dict  # every key as the run has it (Config.to_dict): checkpoints and trackers record them
    layout: Layout
    resolved: Resolved
    family: Family
    timer: PhaseTimer
    grpo: GRPOSection = field(default_factory=GRPOSection)  # task=grpo's rollouts

    def padding(self, prepared: PreparedData, built: BuiltModel) -> Padding:
        tokenizer = prepared.tokenizer
        return Padding(tokenizer.pad_token_id, tokenizer.padding_side, built.runner.pad_multiple, self.layout.device)

    def references(self, stage: DataStage, built: BuiltModel, schedule: Schedule) -> dict:
        """The reference log-probabilities of the units the run trains on and of the held-out ones
        (loop/reference.py: task=dpo's pairs, task=kto's rows and KL rows), each split's reference by name ({}: an
        objective that reads none); then the objective is handed them and the scorer (`measured`)."""
        if not built.objective.needs_reference:  # SimPO, ORPO, a task without pairs: no pass, no time
            return {}
        kind, padding, max_length = stage.prepared.task.kind, self.padding(stage.prepared, built), self.data.max_length
        scorer = Scorer(
            built.runner,
            self.layout,
            self.data.eval_batch_size,
            lambda split: make_batcher(kind.batcher, split, padding, max_length=max_length),
        )
        validation, references = stage.split("validation"), {}
        with self.timer("reference"):
            for name, split, batches in (
                ("train", stage.train, step_batches(stage.sampler, schedule.total_steps)),
                ("validation", validation, [list(range(len(validation)))]),
            ):
                batcher = scorer.batcher(split)
                lora = self.resolved.lora is not None
                references[name] = measure_reference(batcher, batches, scorer=scorer, model=built.model, lora=lora)
        built.objective.measured(references, scorer)
        return references

    def checkpoints(
        self, root: Path, prepared: PreparedData, built: BuiltModel, base: str, rollouts=None
    ) -> CheckpointManager:
        """The checkpoint manager, with what a checkpoint of a step holds (checkpoint.TrainingState); `base`: what
        the trained model started from (a Hub name and revision, or a tiny model's seed); `rollouts`: the step
        source (`rollouts`), whose kept rollout a checkpoint holds too."""
        state = functools.partial(
            TrainingState,
            model=built.model,
            updates=built.updates,
            scheduler=built.scheduler,
            settings=self.settings,
            tokenizer=prepared.tokenizer,
            layout=self.layout,
            family=self.family.name,
            parameter_shapes=built.ready.parameter_shapes,
            trainable=built.ready.parallel.trainable,
            base=base,
            data=prepared.source.fingerprint,
            task=prepared.task,
            tokens=tokenizer_identity(prepared.tokenizer),
            step_source=rollouts,
        )
        return CheckpointManager(
            root, checkpoint=self.checkpoint, enabled=built.updates.checkpointable, timer=self.timer, state=state
        )

    def batcher(self, stage: DataStage, built: BuiltModel, reference: PairReference | None):
        """The training rows' batcher, the one the task's kind names: padded, or packed (`packing: true`) as this
        runner wants its batches (a pipeline's are of static shapes); a pair batcher keeps each pair's two rows
        together, with their `reference`."""
        prepared, layout, kind = stage.prepared, self.layout, stage.prepared.task.kind
        shape = None
        if self.data.packing:  # a pair's sequence holds twice max_length, so any pair's two rows fit in one
            pipeline = layout.pp > 1
            shape = PackedShape(
                capacity=kind.rows_per_sample * self.data.max_length,
                pad_multiple=built.runner.pad_multiple,
                fixed_length=pipeline,
                rows_multiple=self.resolved.microbatches if pipeline else 1,
                pooled=self.family.pooled_token,
            )
        score_prompts = getattr(built.objective, "scores_prompts", False)  # ORPO's NLL over the chosen prompts too
        padding = self.padding(prepared, built)
        return make_batcher(kind.batcher, stage.train, padding, shape, reference, score_prompts=score_prompts)

    def generator(self, stage: DataStage, built: BuiltModel) -> Generator | None:
        """generate_every's decoder over the run's runner, with the held-out prompts it answers (None: off)."""
        training = self.training
        if not training.generate_every:
            return None
        return Generator(
            runner=built.runner,
            model=built.model,
            tokenizer=stage.prepared.tokenizer,
            prompts=held_out_prompts(stage.split("validation"), training.generate_prompts),
            max_new_tokens=training.generate_max_new_tokens,
            max_length=self.data.max_length,
            layout=self.layout,
            every=training.generate_every,
        )

    def rollouts(self, stage: DataStage, built: BuiltModel):
        """The step source the task's kind names (rl/steps.py: grpo's rollouts), or None: steps train on the
        sampled split's rows."""
        name = stage.prepared.task.kind.step_source
        if not name:
            return None
        return make_step_source(
            name,
            built=built,
            prepared=stage.prepared,
            grpo=self.grpo,
            training=self.training,
            layout=self.layout,
            padding=self.padding(stage.prepared, built),
            lora=self.resolved.lora is not None,
            compute_dtype=self.resolved.compute_dtype,
        )

    def reporter(self, output_dir: Path, total_steps: int, step: int) -> Reporter:
        """The progress bar, metrics files and the trackers `report_to` names, started by rank 0 (a failure is
        every rank's one line)."""
        logs, layout = self.logs, self.layout
        reporter = Reporter(output_dir, total_steps, self.training.log_every, layout.is_main, resumed_at=step)
        trackers = destinations(logs.report_to)
        params = written_settings(self.settings) | self.resolved.as_params()  # as written, and what `auto` became
        reporter.started = rank0_decides(
            layout, lambda: reporter.add_trackers(trackers, logs.run_name, params, logs.tracker_timeout_s)
        )
        return reporter

    def trainer(
        self,
        stage: DataStage,
        built: BuiltModel,
        schedule: Schedule,
        references: dict[str, PairReference],
        checkpoints: CheckpointManager,
        run: tuple[Path, int, Peak, StopRequest],
        rollouts=None,
    ) -> Trainer:
        """The Trainer of these parts; `run`: (the run folder, the step it resumes at, the device's peak, the
        SIGTERM handler the Trainer obeys); `rollouts`: the step source (`rollouts`), the checkpoints' too."""
        output_dir, step, peak, stop = run
        training, layout = self.training, self.layout
        return Trainer(
            steps=Steps(schedule.total_steps, len(stage.sampler), training.gradient_accumulation_steps),
            sampler=stage.sampler,
            batcher=self.batcher(stage, built, references.get("train")),
            runner=built.runner,
            updates=built.updates,
            scheduler=built.scheduler,
            model=built.model,
            evaluator=Evaluator(
                model=built.model,
                runner=built.runner,
                data=stage.prepared,
                batch_size=self.data.eval_batch_size,
                layout=layout,
                every=training.eval_every,
                objective=built.objective,
                references=references,
            ).scoring_by(rollouts),
            generator=self.generator(stage, built),
            checkpoints=checkpoints,
            reporter=self.reporter(output_dir, schedule.total_steps, step),
            guard=NonFiniteGuard(training.max_nonfinite_steps, training.lr),
            layout=layout,
            timer=self.timer,
            flops=built.ready.flops,
            peak=peak,
            step=step,
            stop=stop,
            objective=built.objective,
            rollouts=rollouts,
        )
