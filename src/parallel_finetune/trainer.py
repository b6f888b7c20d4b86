"""The one training loop: any family, any layout, any precision, either engine.

The promise: for a given global batch, the loss, gradients and update are those of single-process training.
Every rank draws the same global batches; each slice's loss is a *sum* divided by the global count of samples
(classification) or target tokens (causal_lm); gradients are *summed* over data-parallel ranks.

The loop knows two interfaces (`interfaces.py`) and no engine or layout: a runner does a slice's forward and
backward (`runner.WholeModel`, or the `parallel.pipeline.Pipeline`), the updates turn the gradients into an update
(`updates.TorchUpdates`, or DeepSpeed's ZeRO: `parallel.deepspeed_engine.DeepSpeedUpdates`).

`run` is a whole run: Trainer.setup -> Trainer.fit -> evaluate (evaluation.py) -> export_model (export.py) ->
summary.json (summary.py); the last three are functions of plain inputs, not parts of the trainer.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from . import checkpoint
from . import data as data_module
from .checkpoint import TrainingState
from .checkpointer import CheckpointManager
from .config import Config, compile_decision
from .divergence import NonFiniteGuard
from .errors import Interrupted, RankError, UserError
from .evaluation import evaluate, predict, write_predictions
from .export import export_model
from .families import get_family
from .hub import fetch_model
from .interfaces import Runner, Updates
from .launch import end_with_launcher
from .layout import check_batch_split, init_distributed, rank0_decides, shutdown, timed_out
from .loggers import destinations
from .loss import loss_count
from .model import load_model
from .parallel.pipeline import Pipeline, check_microbatches
from .precision import autocast
from .preflight import check_heads, check_model_config
from .reporting import PhaseTimer, Reporter
from .resolve import resolve
from .runfolder import RunLock, claim_run_folders, open_run_folder, record_written
from .runner import WholeModel
from .summary import run_summary, write_summary
from .throughput import achieved, device_peak
from .updates import TorchUpdates

log = logging.getLogger(__name__)


class Trainer:
    """A run's parts, made in `setup` (all of them, or an error), driven by `fit`; every attribute exists after
    `setup`."""

    runner: Runner  # made in _build, like the updates
    updates: Updates

    def __init__(self, config: Config, after_backward: Callable[[Trainer, int], None] | None = None):
        self.config = config
        self.family = get_family(config.family)
        self.after_backward = after_backward  # test hook: runs after each step's backward, before the update
        self.nonfinite = NonFiniteGuard(config.max_nonfinite_steps, config.lr)
        self.timer = PhaseTimer()
        self.step = 0
        self.history: list[dict] = []
        self.stop_requested = False  # set by SIGTERM: finish the step, checkpoint, exit 0
        self.stop_agreed = False  # any rank was asked to stop (agreed in the step's one all-reduce)
        self.resumed_from: Path | None = None
        self.padding: dict[int, list[int]] = {}  # epoch -> [real tokens, token slots after padding] trained
        self.run_lock: RunLock | None = None  # rank 0's hold on the run folders, taken in setup
        self.model_path: str | None = None  # a full-size model's local folder (tiny: built from its config)
        self.deepspeed_config: dict | None = None  # engine=deepspeed: the config made for it
        self.reporter: Reporter | None = None  # made when training starts

    # ------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        config = self.config
        with self.timer("setup"):
            self.layout = layout = init_distributed(
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
            self._check_settings()
            self.output_dir, self.checkpoint_root, self.run_lock = claim_run_folders(config, layout)
            if config.size == "full":
                name = self.resolved.model_name
                self.model_path = fetch_model(name, config.revision, layout, config.collective_timeout_s)
        with self.timer("data"):
            self.data = self._prepare_data()
        with self.timer("model"):
            self._build()
        if self.updates.checkpointable:
            self._resume()
        if layout.is_main:  # only now, with every input accepted, is the run folder written
            deepspeed_config = self.updates.config if self.deepspeed_config is not None else None
            open_run_folder(self.output_dir, self.checkpoint_root, config, deepspeed_config, self.data.task)
        log.info("run folder %s | %s", self.output_dir, layout.describe())

    def _check_settings(self) -> None:
        """Precision, the device's peak, the batch split, micro-batches, DeepSpeed's config: resolved, or one
        line on a bad input, before any work."""
        config, layout = self.config, self.layout
        self.resolved = resolve(config, layout.device, layout.dims)  # decided once; components receive these
        self.precision = self.resolved.precision
        if config.lr_note:
            log.info("%s", config.lr_note)
        self.peak = device_peak(layout.device, self.resolved.compute_dtype, config.peak_tflops)
        self.peak_tflops = self.peak.tflops  # None: unknown
        log.info("%s", self.peak.describe())
        check_batch_split(config.batch_size, layout.dp, config.gradient_accumulation_steps)
        if config.size == "tiny":  # (full size: once the model is fetched, in _build)
            check_heads(check_model_config(config))  # a bad model_config: one line, not a traceback per rank
        self.microbatches = self.resolved.microbatches
        if layout.pp > 1:
            check_microbatches(config.batch_size // (layout.dp * config.gradient_accumulation_steps), self.microbatches)
        if config.engine == "deepspeed":  # one line (fp16 on a CPU, a conflicting JSON) before any work
            from .parallel import deepspeed_engine

            self.deepspeed_config = deepspeed_engine.preflight(config, layout.dp, layout.device.type, self.precision)

    def _resume(self) -> None:
        """From the newest checkpoint that all ranks together verify and load (skipped ones said once, by rank 0),
        if there is one."""
        started, state = time.perf_counter(), self.training_state()
        self.resumed_from = checkpoint.resume(state, self.checkpoint_root)
        if self.resumed_from:
            self.step = state.step
            self.timer.seconds["resume"] = time.perf_counter() - started

    def _prepare_data(self) -> data_module.PreparedData:
        config = self.config
        mine: list[data_module.PreparedData] = []

        def prepare_on_rank0():
            mine.append(
                data_module.prepare(
                    data=config.data,
                    model=config.model,
                    family=self.resolved.family,
                    model_name=self.model_path or self.resolved.model_name,
                    seed=config.training.seed,
                    predict=config.output.predict,
                )
            )
            return str(mine[0].cache_path), mine[0].source

        # Rank 0 builds the cache (and may fall back to the sample, loudly, once); the others then read it.
        cache_path, source = rank0_decides(self.layout, prepare_on_rank0)
        prepared = mine[0] if mine else data_module.load_prepared(Path(cache_path), source)
        train = prepared.splits["train"]
        self.train_ids = data_module.column(train, "input_ids")
        self.train_lengths = data_module.column(train, "length")
        self.train_labels = data_module.column(train, "label") if "label" in train.column_names else None
        self.train_types = (
            data_module.column(train, "token_type_ids") if "token_type_ids" in train.column_names else None
        )
        self.batches = data_module.GlobalBatches(
            self.train_lengths, config.batch_size, config.seed, config.group_by_length
        )
        self.steps_per_epoch = len(self.batches)
        self.total_steps = config.max_steps or max(1, math.ceil(config.epochs * self.steps_per_epoch))
        log.info(
            "data: %s | %s",
            prepared.source.description,
            ", ".join(f"{k} {len(v):,} rows" for k, v in prepared.splits.items()),
        )
        return prepared

    def _build(self) -> None:
        """The model (each rank its own shards), the updates, the runner, the lr schedule."""
        config, layout, family = self.config, self.layout, self.family
        tokenizer = self.data.tokenizer
        if config.size == "full":
            check_heads(check_model_config(config, self.model_path))
        hf_config = family.config_for(
            config, len(tokenizer), tokenizer.pad_token_id, self.model_path, labels=self.data.task
        )
        family.check_tp(hf_config, layout.tp)
        compiled, why = compile_decision(config, self.total_steps, layout.device.type)
        if config.compile == "auto":
            log.info("%s", why)
        built = config.replace(compile=compiled)
        ready = load_model(
            family,
            config.task,
            hf_config,
            self.model_path,
            seed=config.seed,
            layout=layout,
            config=built,
            precision=self.precision,
            deepspeed_config=self.deepspeed_config,
        )
        self.ready, self.model = ready, ready.model
        if config.engine == "deepspeed":
            from .parallel.deepspeed_engine import DeepSpeedUpdates

            self.updates = DeepSpeedUpdates(ready.model, config, layout, self.precision)
            self.model = self.updates.engine  # forwards go through DeepSpeed (ZeRO-3 gathers parameters there)
        else:
            self.updates = TorchUpdates(ready.model, layout, config, self.precision, ready.parallel, ready.zero_adamw)
        if layout.pp > 1:
            self.runner = Pipeline(
                ready.model,
                family,
                ready.parallel.stages,
                layout,
                config.pipeline_schedule,
                self.microbatches,
                self._autocast,
                config.task,
                lambda: self.updates.loss_scale,
                token_types=self.train_types is not None,
            )
        else:
            self.runner = WholeModel(
                self.model,
                config.task,
                self._autocast,
                self.updates.backward,
                config.offload_activations,
                layout.device,
            )
        warmup = config.warmup_steps or math.ceil(config.warmup_ratio * self.total_steps)
        try:
            self.scheduler = transformers.get_scheduler(
                config.lr_scheduler,
                self.updates.optimizer,
                num_warmup_steps=warmup,
                num_training_steps=self.total_steps,
            )
        except ValueError as exc:
            raise UserError(f"lr_scheduler={config.lr_scheduler!r}: {str(exc).splitlines()[0]}") from None

    def training_state(self) -> TrainingState:
        return TrainingState(
            self.step,
            self.model,
            self.updates,
            self.scheduler,
            self.config,
            self.data.tokenizer,
            self.layout,
            self.family.name,
            self.ready.parameter_shapes,
            self.ready.parallel.trainable,
            self.base_description(),
            self.data.source.fingerprint,
            self.data.task,
        )

    def base_description(self) -> str:
        config = self.config
        if config.size == "tiny":
            return f"tiny {self.family.name} from config, initialised from seed {config.seed}"
        name = self.resolved.model_name
        return f"{name}@{config.revision}" if config.revision else name

    # ------------------------------------------------------------------------------------------- training
    def batch_of(self, indices: list[int]) -> dict:
        """Training rows `indices` padded into tensors on this rank's device."""
        return data_module.device_batch(
            indices,
            self.train_ids,
            self.train_labels,
            self.data.tokenizer,
            self.runner.pad_multiple,
            self.layout.device,
            self.train_types,
        )

    def _autocast(self):
        return autocast(self.precision, self.layout.device)

    def _skip_rule(self, loss: float, grad_norm: float, loss_scale: float | None) -> bool:
        return self.nonfinite.skip(self.step + 1, loss, grad_norm, loss_scale)

    def train_step(self, global_batch: list[int]) -> dict:
        config, layout = self.config, self.layout
        started = time.perf_counter()
        lengths = [self.train_lengths[i] for i in global_batch]
        count = loss_count(lengths, config.task)
        local_loss = torch.zeros((), device=layout.device)
        slices = data_module.accumulation_slices(
            global_batch, layout.dp_rank, layout.dp, config.gradient_accumulation_steps
        )
        for number, indices in enumerate(slices, start=1):
            local_loss += self.runner.train(self.batch_of(indices), count, last=number == len(slices))
        if self.after_backward is not None:
            self.after_backward(self, self.step + 1)
        lr = self.scheduler.get_last_lr()[0]
        outcome = self.updates.step(local_loss, self.stop_requested, self._skip_rule)
        self.scheduler.step()
        self.step += 1
        self.stop_agreed = outcome.stop
        elapsed = time.perf_counter() - started
        tokens = sum(lengths)
        epoch_padding = self.padding.setdefault(int((self.step - 1) // self.steps_per_epoch), [0, 0])
        epoch_padding[0] += tokens
        epoch_padding[1] += data_module.token_slots(
            global_batch, self.train_lengths, layout.dp, config.gradient_accumulation_steps, self.runner.pad_multiple
        )
        tflops, mfu = achieved(self.ready.flops.batch(lengths), elapsed, layout.world_size, self.peak)
        # A skipped step's norm is not a number worth logging (and differs between ranks when one overflowed).
        return {
            "step": self.step,
            "epoch": self.step / self.steps_per_epoch,
            "loss": outcome.loss,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "loss_scale": outcome.loss_scale,
            "skipped": outcome.skipped,
            "samples_per_s": len(global_batch) / elapsed,
            "tokens_per_s": tokens / elapsed,
            "tflops_per_device": tflops,
            "mfu": mfu,
            "step_time_s": elapsed,
        }

    def fit(self) -> list[dict]:
        config, layout = self.config, self.layout
        tokenizer, dev = self.data.tokenizer, self.data.splits["validation"]
        reporter = Reporter(self.output_dir, self.total_steps, config.log_every, layout.is_main, resumed_at=self.step)
        self.reporter = reporter
        trackers = destinations(config.report_to)
        params = config.to_dict() | self.resolved.as_params()  # as written, and what `auto` became
        started = rank0_decides(
            layout, lambda: reporter.add_trackers(trackers, config.run_name, params, config.tracker_timeout_s)
        )
        if not started:  # SIGTERM while rank 0 started the trackers: every rank stops before training a step
            self.stop_agreed = True
            log.info("stopping before step %d as asked (SIGTERM), while the trackers started", self.step + 1)
            return self.history
        log.info(
            "training %d steps (%d per epoch), global batch %d = %d dp x %d accumulation x %d, precision %s",
            self.total_steps,
            self.steps_per_epoch,
            config.batch_size,
            layout.dp,
            config.gradient_accumulation_steps,
            config.batch_size // (layout.dp * config.gradient_accumulation_steps),
            self.precision,
        )
        checkpoints = CheckpointManager.for_run(config, self.checkpoint_root, self.updates.checkpointable, self.timer)
        with self.timer("train"):
            self.model.train()
            while self.step < self.total_steps:
                epoch, offset = divmod(self.step, self.steps_per_epoch)
                for global_batch in self.batches.epoch(epoch)[offset:]:
                    record = self.train_step(global_batch)
                    self.history.append(record)
                    reporter.step(record)
                    if config.eval_every and self.step % config.eval_every == 0 and self.step < self.total_steps:
                        with self.timer("eval"):
                            results = evaluate(
                                self.model, self.runner, dev, tokenizer, self.data.task, config.eval_batch_size, layout
                            )
                            reporter.evaluation(self.step, results)
                    if checkpoints.due(self.step, self.total_steps, self.stop_agreed):
                        checkpoints.save(self.step, self.nonfinite.bad_steps, self.training_state)
                    if self.stop_agreed:
                        log.info(
                            "stopping after step %d as asked (SIGTERM); resume=auto continues from the checkpoint",
                            self.step,
                        )
                        return self.history
                    if self.step >= self.total_steps:
                        break
        return self.history

    def evaluate_all(self) -> dict:
        """The metrics of every validation split: the first's as they are, a second's (MNLI's mismatched dev set)
        prefixed with its name ("mismatched_accuracy")."""
        results = {}
        for split in self.data.task.validation_splits:
            scores = evaluate(
                self.model,
                self.runner,
                self.data.splits[split],
                self.data.tokenizer,
                self.data.task,
                self.config.eval_batch_size,
                self.layout,
            )
            prefix = "" if split == "validation" else split.removeprefix("validation_") + "_"
            results.update({prefix + key: value for key, value in scores.items()})
        return results

    def predict_test(self) -> list[Path]:
        """predictions.tsv (and predictions_mismatched.tsv for MNLI) in GLUE's submission format: every rank
        predicts, rank 0 writes."""
        task, written = self.data.task, []
        if not task.test_splits:
            raise UserError(
                "predict=true: the data has no test split; give test_file=PATH (or a GLUE folder with test.tsv)"
            )
        for split in task.test_splits:
            rows = self.data.splits[split]
            predicted = predict(
                self.model, self.runner, rows, self.data.tokenizer, task, self.config.eval_batch_size, self.layout
            )
            if self.layout.is_main:
                name = "predictions.tsv" if split == "test" else f"predictions_{split.removeprefix('test_')}.tsv"
                record_written(self.output_dir, name)
                written.append(
                    write_predictions(self.output_dir / name, data_module.column(rows, "index"), predicted, task)
                )
        return written

    def request_stop(self, signum=None, frame=None) -> None:
        """SIGTERM (a spot interruption, `docker stop`): the current step finishes, then every rank checkpoints."""
        self.stop_requested = True


def run(config: Config, after_backward: Callable | None = None) -> dict:
    """Train, evaluate, export and report: what `scripts/train.py` does. Returns summary.json's content.
    SIGTERM, or the torchrun launcher's end: checkpoint and stop; Ctrl-C: stop at once (Interrupted)."""
    trainer = Trainer(config, after_backward)
    signal.signal(signal.SIGTERM, trainer.request_stop)
    end_with_launcher()
    try:
        trainer.setup()
        trainer.fit()
        if trainer.stop_agreed:
            trainer.reporter.close("stopped")
            shutdown()
            return {"stopped_at_step": trainer.step}
        layout, tokenizer, updates = trainer.layout, trainer.data.tokenizer, trainer.updates
        with trainer.timer("eval"):
            results = trainer.evaluate_all()
        trainer.reporter.evaluation(trainer.step, results)
        if config.predict:
            with trainer.timer("predict"):
                trainer.predict_test()
        if config.export:
            with trainer.timer("export"):
                export_model(updates, trainer.family, tokenizer, config, layout, trainer.output_dir)
        summary = run_summary(
            results,
            config,
            trainer.family,
            layout,
            data=trainer.data.source.description,
            steps=trainer.step,
            history=trainer.history,
            padding=trainer.padding,
            peak=trainer.peak,
            precision=trainer.precision,
            resumed_from=trainer.resumed_from,
            seconds=trainer.timer.seconds,
            load_peak_mib=trainer.ready.load_peak_mib,
            load_seconds=trainer.ready.load_seconds,
            state_bytes=updates.state_bytes(),
            zero_stage=updates.zero_stage if config.engine == "deepspeed" else None,
        )
        trainer.reporter.close()
        if layout.is_main:
            record_written(trainer.output_dir, "summary.json")
            write_summary(trainer.output_dir, summary, results)
        shutdown()
        return summary
    except BaseException as exc:
        if trainer.reporter is not None:
            trainer.reporter.close("failed")  # the bar first: the error gets a line of its own
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = timed_out(exc, config.collective_timeout_s)
        if timeout:  # one line naming the key, not a traceback from the collective
            raise RankError(f"after step {trainer.step}: {timeout}") from None
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(
                f"interrupted (SIGINT) after step {trainer.step}: the run stopped; its checkpoints are kept, and "
                "resume=auto continues from the newest"
            ) from None
        raise
    finally:
        if trainer.run_lock is not None:
            trainer.run_lock.release()
