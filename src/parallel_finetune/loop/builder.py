"""A run's assembly, before any training: the layout, the settings resolved and checked, the run folders claimed,
the data prepared, the model built and loaded, its updates, runner and lr schedule, a checkpoint resumed, the
loop's components made. All of them, or one line on a bad input before any work; the Trainer (trainer.py)
receives the components and only trains.

    RunBuilder(config).build():  layout -> checks -> run folders (+ the model fetched) -> data (+ the schedule
                                 resolved) -> model, updates, runner, lr schedule -> resume -> the run folder
                                 written -> batcher, evaluator, generator, reporter (trackers started) -> Trainer
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from torch import nn

from ..config import Config
from ..data.batch import PackedBatcher, PaddedBatcher, PairReference, PreferenceBatcher, TokenizedSplit
from ..data.packing import PackedShape
from ..data.prepare import PreparedData, load_prepared, prepare, tokenizer_identity
from ..data.reward import RewardBatcher
from ..data.sampling import GlobalBatches
from ..errors import UserError
from ..families import get_family
from ..families.base import Family
from ..interfaces import Runner, Updates
from ..model import attention
from ..model.hub import fetch_model
from ..model.load import ReadyModel, load_model, log_loaded
from ..model.precision import autocast
from ..model.throughput import Peak, device_peak
from ..outputs.checkpoint import TrainingState
from ..outputs.loggers import destinations
from ..outputs.reporting import PhaseTimer, Reporter
from ..outputs.runfolder import RunLock, claim_run_folders, open_run_folder, written_settings
from ..parallel import Placement
from ..parallel.layout import Engine, Layout, check_batch_split, init_distributed, rank0_decides
from ..parallel.pipeline import Pipeline, PipelineSettings, check_microbatches
from ..preflight import check_heads, check_model_config
from ..resolve import Resolved, choose_model, resolve, resolve_schedule
from ..tasks.sources import carved_fingerprint
from ..tasks.task import HeadKind
from .checkpointer import CheckpointManager
from .divergence import NonFiniteGuard
from .evaluation import Evaluator
from .generation import Generator, held_out_prompts
from .loss import HiddenTokenLoss, PreferenceLoss, summed_loss_for
from .reference import measure_reference, trained_pairs
from .reward_loss import RewardLoss
from .runner import WholeModel
from .trainer import Steps, StopRequest, Trainer
from .updates import TorchUpdates

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


@dataclass
class _Model:
    """The model built and what drives it."""

    ready: ReadyModel
    model: nn.Module  # ready.model, or DeepSpeed's engine (forwards go through it: ZeRO-3 gathers there)
    updates: Updates
    runner: Runner
    scheduler: object  # the lr schedule
    preference: PreferenceLoss | RewardLoss | None  # task=dpo's or task=reward's loss (per-pair figures: metrics)


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
    """Assembles a run (`build`); holds rank 0's lock on the run folders from claiming them until `release`."""

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
            prepared = self._prepare_data(layout, resolved)
            train = TokenizedSplit.of(prepared.splits["train"], prepared.task)
            sampler = GlobalBatches(
                train.lengths, config.training.batch_size, config.training.seed, config.data.group_by_length
            )
            schedule = resolve_schedule(config, len(sampler), layout.device.type, layout.tp)
            if layout.is_main:  # rank 0 alone: the other ranks show WARNING lines too, and would repeat it
                for line in small_run_warnings(config, prepared, schedule.total_steps, len(sampler)):
                    log.warning("%s", line)
        with self.timer("model"):
            built = self._build(layout, resolved, prepared, train, schedule)
        # before a resumed checkpoint replaces the weights
        saved_initial = self._saved_initial(resolved, built)
        references = self._measure_reference(layout, resolved, prepared, built, train, sampler, schedule)
        checkpoints = CheckpointManager(
            checkpoint_root,
            checkpoint=config.checkpoint,
            enabled=built.updates.checkpointable,
            timer=self.timer,
            state=self._state_of(layout, resolved, prepared, built),
        )
        step = self.resumed_step = checkpoints.resume(output=config.output)
        if layout.is_main:  # only now, with every input accepted, is the run folder written
            self._open_run_folder(output_dir, checkpoint_root, built.updates, prepared)
        log.info("run folder %s | %s", output_dir, layout.describe())
        trainer = Trainer(
            steps=Steps(schedule.total_steps, len(sampler), config.training.gradient_accumulation_steps),
            sampler=sampler,
            batcher=self._batcher(train, prepared, layout, resolved, built, references.get("train")),
            runner=built.runner,
            updates=built.updates,
            scheduler=built.scheduler,
            model=built.model,
            evaluator=Evaluator(
                model=built.model,
                runner=built.runner,
                data=prepared,
                batch_size=config.data.eval_batch_size,
                layout=layout,
                every=config.training.eval_every,
                preference=built.preference,
                references=references,
            ),
            generator=self._generator(prepared, layout, built) if config.training.generate_every else None,
            checkpoints=checkpoints,
            reporter=self._reporter(output_dir, layout, resolved, schedule.total_steps, step),
            guard=NonFiniteGuard(config.training.max_nonfinite_steps, config.training.lr),
            layout=layout,
            timer=self.timer,
            flops=built.ready.flops,
            peak=peak,
            step=step,
            stop=stop or StopRequest(),
            preference=built.preference,
        )
        accumulation = config.training.gradient_accumulation_steps
        log.info(
            "training %d steps (%d per epoch), global batch %d = %d dp x %d accumulation x %d, precision %s",
            *(schedule.total_steps, len(sampler), config.training.batch_size, layout.dp, accumulation),
            *(config.training.batch_size // (layout.dp * accumulation), resolved.precision),
        )
        return BuiltRun(
            trainer, resolved, self.family, built.ready, prepared, output_dir, checkpoints.resumed_from, saved_initial
        )

    def _setup(self) -> tuple[Layout, Resolved, Peak, tuple]:
        """The process group and mesh, this rank's logging, the settings resolved, the run folders claimed and a
        full-size model's files fetched: (layout, resolved, peak, (output folder, checkpoint folder))."""
        config = self.config
        layout = init_distributed(
            config.parallel.device,
            config.parallel.tensor_parallel_degree,
            config.parallel.sharding,
            config.parallel.shard_group_size,
            config.parallel.pipeline_parallel_degree,
            config.parallel.collective_timeout_s,
        )
        logging.basicConfig(level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s", force=True)
        transformers.logging.set_verbosity_error()
        resolved, peak = self._check_settings(layout)
        output_dir, checkpoint_root, self.run_lock = claim_run_folders(
            layout, recipe=config.recipe, checkpoint=config.checkpoint, output=config.output
        )
        if config.model.size == "full":
            self.model_path = fetch_model(
                resolved.model_name, config.model.revision, layout, config.parallel.collective_timeout_s
            )
        return layout, resolved, peak, (output_dir, checkpoint_root)

    def _check_settings(self, layout: Layout) -> tuple[Resolved, Peak]:
        """Precision, the device's peak, the batch split, micro-batches, DeepSpeed's config: resolved, or one
        line on a bad input, before any work."""
        config = self.config
        resolved = resolve(config, layout.device, layout.dims)  # decided once; components receive these
        if config.lr_note:
            log.info("%s", config.lr_note)
        peak = device_peak(layout.device, resolved.compute_dtype, config.training.peak_tflops)
        log.info("%s", peak.describe())
        check_batch_split(config.training.batch_size, layout.dp, config.training.gradient_accumulation_steps)
        if config.model.size == "tiny":  # (full size: once the model is fetched, in _build)
            check_heads(check_model_config(config))  # a bad model_config: one line, not a traceback per rank
        if layout.pp > 1:
            check_microbatches(
                config.training.batch_size // (layout.dp * config.training.gradient_accumulation_steps),
                resolved.microbatches,
            )
        if resolved.engine is Engine.DEEPSPEED:  # one line (fp16 on a CPU, a conflicting JSON) before any work
            from ..parallel import deepspeed_engine

            self.deepspeed_config = deepspeed_engine.preflight(
                training=config.training,
                parallel=config.parallel,
                dp=layout.dp,
                device_type=layout.device.type,
                precision=resolved.precision,
            )
        return resolved, peak

    def _open_run_folder(self, output_dir: Path, checkpoint_root: Path, updates: Updates, prepared) -> None:
        """Rank 0: config.yaml, labels.json (and DeepSpeed's config) into the run folder, claimed before."""
        config = self.config
        open_run_folder(
            output_dir,
            checkpoint_root,
            settings=config.to_dict(),
            overwrite=config.output.overwrite,
            deepspeed_config=updates.deepspeed_config if self.deepspeed_config is not None else None,
            task=prepared.task,
        )

    def _state_of(self, layout: Layout, resolved: Resolved, prepared, built: _Model):
        """step -> what a checkpoint of that step holds (checkpoint.TrainingState)."""
        config, ready = self.config, built.ready
        if config.model.size == "tiny":
            base = f"tiny {self.family.name} from config, initialised from seed {config.training.seed}"
        else:
            base = f"{resolved.model_name}@{config.model.revision}" if config.model.revision else resolved.model_name
        return functools.partial(
            TrainingState,
            model=built.model,
            updates=built.updates,
            scheduler=built.scheduler,
            settings=config.to_dict(),
            tokenizer=prepared.tokenizer,
            layout=layout,
            family=self.family.name,
            parameter_shapes=ready.parameter_shapes,
            trainable=ready.parallel.trainable,
            base=base,
            data=prepared.source.fingerprint,
            task=prepared.task,
            tokens=tokenizer_identity(prepared.tokenizer),
        )

    def _saved_initial(self, resolved: Resolved, built: _Model) -> dict:
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

    def _measure_reference(self, layout, resolved, prepared, built: _Model, train, sampler, schedule) -> dict:
        """task=dpo: the reference log-probabilities of the pairs the run trains on and of the held-out pairs
        (loop/reference.py), each split's PairReference by name ({}: another task, or a reference-free pair
        loss)."""
        if built.preference is None or not built.preference.needs_reference:  # SimPO, ORPO: no pass, no time
            return {}
        config, tokenizer = self.config, prepared.tokenizer
        validation = TokenizedSplit.of(prepared.splits["validation"], prepared.task)
        trained, references = trained_pairs(sampler, schedule.total_steps), {}
        with self.timer("reference"):
            for name, split, pairs in (("train", train, trained), ("validation", validation, range(len(validation)))):
                batcher = PreferenceBatcher(
                    split,
                    pad_id=tokenizer.pad_token_id,
                    padding_side=tokenizer.padding_side,
                    pad_multiple=built.runner.pad_multiple,
                    device=layout.device,
                )
                references[name] = measure_reference(
                    batcher,
                    list(pairs),
                    runner=built.runner,
                    model=built.model,
                    loss=built.preference,
                    batch_size=config.data.eval_batch_size,
                    layout=layout,
                    lora=resolved.lora is not None,
                )
        return references

    def _batcher(
        self,
        train: TokenizedSplit,
        prepared,
        layout: Layout,
        resolved: Resolved,
        built: _Model,
        reference: PairReference | None,
    ):
        """The training rows' batcher: padded, or packed (`packing: true`) as this runner wants its batches (a
        pipeline's are of static shapes); task=dpo's keeps each pair's two rows together, with their `reference`."""
        config, tokenizer, runner = self.config, prepared.tokenizer, built.runner
        pairs, pipeline = prepared.task.kind.pairs, layout.pp > 1
        shape = None
        if config.data.packing:  # task=dpo: a sequence holds twice max_length, so any pair's two rows fit in one
            shape = PackedShape(
                capacity=prepared.task.kind.rows_per_sample * config.data.max_length,
                pad_multiple=runner.pad_multiple,
                fixed_length=pipeline,
                rows_multiple=resolved.microbatches if pipeline else 1,
                pooled=self.family.pooled_token,
            )
        if shape is not None and not pairs:
            return PackedBatcher(train, pad_id=tokenizer.pad_token_id, shape=shape, device=layout.device)
        padding = {"pad_id": tokenizer.pad_token_id, "padding_side": tokenizer.padding_side}
        padding |= {"pad_multiple": runner.pad_multiple, "device": layout.device}
        if not pairs:
            return PaddedBatcher(train, **padding)
        if prepared.task.kind.reward_model:
            return RewardBatcher(train, **padding)
        score_prompts = built.preference.scores_prompts
        return PreferenceBatcher(train, **padding, shape=shape, score_prompts=score_prompts, reference=reference)

    def _generator(self, prepared, layout: Layout, built: _Model) -> Generator:
        """generate_every's decoder over the run's runner, with the held-out prompts it answers."""
        config = self.config
        validation = TokenizedSplit.of(prepared.splits["validation"], prepared.task)
        return Generator(
            runner=built.runner,
            model=built.model,
            tokenizer=prepared.tokenizer,
            prompts=held_out_prompts(validation, config.training.generate_prompts),
            max_new_tokens=config.training.generate_max_new_tokens,
            max_length=config.data.max_length,
            layout=layout,
            every=config.training.generate_every,
        )

    def _reporter(self, output_dir: Path, layout: Layout, resolved: Resolved, total_steps: int, step: int):
        """The progress bar, metrics files and the trackers `report_to` names, started by rank 0 (a failure is
        every rank's one line)."""
        config = self.config
        reporter = Reporter(output_dir, total_steps, config.training.log_every, layout.is_main, resumed_at=step)
        trackers = destinations(config.logging.report_to)
        params = written_settings(config.to_dict()) | resolved.as_params()  # as written, and what `auto` became
        reporter.started = rank0_decides(
            layout,
            lambda: reporter.add_trackers(trackers, config.logging.run_name, params, config.logging.tracker_timeout_s),
        )
        return reporter

    def _prepare_data(self, layout: Layout, resolved: Resolved) -> PreparedData:
        config = self.config
        mine: list[PreparedData] = []

        def prepare_on_rank0():
            mine.append(prepare_data(config, self.model_path, resolved))
            return str(mine[0].cache_path), mine[0].source

        # Rank 0 builds the cache (and may fall back to the sample, loudly, once); the others then read it.
        cache_path, source = rank0_decides(layout, prepare_on_rank0)
        prepared = mine[0] if mine else load_prepared(Path(cache_path), source)
        log.info(
            "data: %s | %s",
            prepared.source.description,
            ", ".join(f"{k} {len(v):,} rows" for k, v in prepared.splits.items()),
        )
        return prepared

    def _build(
        self, layout: Layout, resolved: Resolved, prepared: PreparedData, train: TokenizedSplit, schedule
    ) -> _Model:
        """The model (each rank its own shards; the module forwards go through), the updates, the runner, the lr
        schedule."""
        config, family = self.config, self.family
        ready = self._load_model(layout, resolved, prepared, schedule)
        model, precision = ready.model, resolved.precision
        if resolved.engine is Engine.DEEPSPEED:
            from ..parallel.deepspeed_engine import DeepSpeedUpdates

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
        preference = None
        if prepared.task.kind.reward_model:  # its pairs' scores from the classifier's logits
            loss = preference = RewardLoss(config.preference.center_rewards_coefficient)
        elif prepared.task.kind.pairs:
            loss = preference = self._preference_loss(ready, resolved)
        else:
            loss = summed_loss_for(prepared.task, self._hidden_loss(ready, resolved, layout))
        if layout.pp > 1:
            settings = PipelineSettings(
                config.parallel.pipeline_schedule,
                resolved.microbatches,
                resolved.head,
                loss,
                token_types=train.token_types is not None,
                packing=config.data.packing,
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
                loss,
                autocast_context,
                updates.backward,
                config.memory.offload_activations,
                layout.device,
                packing=family if config.data.packing else None,
            )
        try:
            scheduler = transformers.get_scheduler(
                config.training.lr_scheduler,
                updates.optimizer,
                num_warmup_steps=schedule.warmup_steps,
                num_training_steps=schedule.total_steps,
            )
        except ValueError as exc:
            raise UserError(f"lr_scheduler={config.training.lr_scheduler!r}: {str(exc).splitlines()[0]}") from None
        return _Model(ready, model, updates, runner, scheduler, preference)

    def _packed_attention(self, hf_config, layout: Layout, resolved: Resolved) -> None:
        """Packed batches' attention: varlen flash attention where its kernel's preconditions hold
        (model/attention.py), else the dense 4-D mask; said once, with why."""
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

    def _hidden_loss(self, ready: ReadyModel, resolved: Resolved, layout: Layout) -> HiddenTokenLoss | None:
        """A language model's loss from its final hidden states and head: chunked (loss_chunk_tokens), or whole
        logits of the labelled positions; None: from the logits the model's forward makes (engine=deepspeed, or
        loss_chunk_tokens=0 without a pipeline, whose last stage always hands over hidden states)."""
        if resolved.head is not HeadKind.CAUSAL_LM:
            return None
        if resolved.engine is Engine.DEEPSPEED:
            log.info("engine=deepspeed: the language model's loss from its whole logits (loss_chunk_tokens: torch)")
            return None
        if not resolved.loss_chunk_tokens and layout.pp == 1:
            return None
        model = ready.model
        head = model.get_output_embeddings() if getattr(model, "lm_head", None) is not None else None
        softcap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2 and 3
        return HiddenTokenLoss(head, resolved.loss_chunk_tokens, softcap)

    def _preference_loss(self, ready: ReadyModel, resolved: Resolved) -> PreferenceLoss:
        """task=dpo's loss: from the final hidden states and the head (chunked, vocabulary-parallel), or under
        engine=deepspeed from the whole logits (ZeRO-3 gathers the head in its own forward)."""
        model = ready.model
        head = None if resolved.engine is Engine.DEEPSPEED else model.get_output_embeddings()
        softcap = getattr(model.config, "final_logit_softcapping", None)
        return PreferenceLoss(head, resolved.loss_chunk_tokens, softcap, preference=self.config.preference)

    def _load_model(self, layout: Layout, resolved: Resolved, prepared: PreparedData, schedule) -> ReadyModel:
        """The model's config from the checkpoint or the family, then this rank's shards loaded, and said."""
        config, family, tokenizer = self.config, self.family, prepared.tokenizer
        if config.model.size == "full":
            check_heads(check_model_config(config, self.model_path))
        hf_config = family.config_for(
            model=config.model,
            head=resolved.head,
            max_length=config.data.max_length,
            tokenizer_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            model_path=self.model_path,
            labels=prepared.task,
        )
        family.check_tp(hf_config, layout.tp)
        if config.data.packing:
            family.check_packing(hf_config, config.data.max_length)
            self._packed_attention(hf_config, layout, resolved)
        if config.training.compile == "auto":
            log.info("%s", schedule.compile_why)
        placement = Placement(
            layout=layout,
            parallel=config.parallel,
            memory=config.memory,
            training=config.training,
            precision=resolved.precision,
            autocast_dtype=resolved.autocast_dtype,
            microbatches=resolved.microbatches,
            compile=schedule.compile,
            deepspeed_config=self.deepspeed_config,
        )
        ready = load_model(
            family,
            resolved.head,
            hf_config,
            self.model_path,
            seed=config.training.seed,
            adapters=resolved.lora,
            placement=placement,
        )
        log_loaded(
            ready,
            family,
            placement,
            adapters=resolved.lora,
            model_name=resolved.model_name,
            seed=config.training.seed,
        )
        return ready
