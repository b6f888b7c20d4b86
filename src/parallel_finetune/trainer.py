"""The one training loop: any family, any layout, any precision, either engine.

The promise: for a given global batch, the loss, gradients and update are those of single-process training.
Every rank draws the same global batches; each slice's loss is a *sum* divided by the global count of samples
(classification) or target tokens (causal_lm); gradients are *summed* over data-parallel ranks.

The loop knows two interfaces (`interfaces.py`) and no engine or layout: a runner does a slice's forward and
backward (`runner.WholeModel`, or the `parallel.pipeline.Pipeline`), the updates turn the gradients into an update
(`updates.TorchUpdates`, or DeepSpeed's ZeRO: `parallel.deepspeed_engine.DeepSpeedUpdates`). The Trainer receives
them, assembled, from builder.py.

`run` is a whole run: RunBuilder.build (builder.py) -> Trainer.fit -> evaluate (evaluation.py) -> export_model
(export.py) -> summary.json (summary.py); the last three are functions of plain inputs, not parts of the trainer.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import data as data_module
from . import packing
from .builder import RunBuilder, RunParts
from .checkpoint import TrainingState
from .checkpointer import CheckpointManager
from .config import Config
from .divergence import NonFiniteGuard
from .errors import Interrupted, RankError
from .evaluation import evaluate, evaluate_all, predict_test
from .export import ExportPlace, export_model
from .generation import Generator, held_out_prompts
from .launch import end_with_launcher
from .layout import Engine, rank0_decides, shutdown, timed_out
from .loggers import destinations
from .loss import loss_count
from .parallel import compiled_graphs
from .reporting import Reporter
from .runfolder import record_written
from .summary import RunRecord, run_summary, write_summary
from .throughput import achieved

log = logging.getLogger(__name__)


class StopRequest:
    """SIGTERM (a spot interruption, `docker stop`): the current step finishes, then every rank checkpoints.
    Installed as the handler before the run is assembled, so a signal during assembly is not lost."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum=None, frame=None) -> None:
        self.requested = True


class Trainer:
    """The loop over a run's parts, assembled by builder.py (`RunParts`): `fit` trains, `train_step` is one
    update, and a checkpoint is written when due."""

    def __init__(
        self,
        parts: RunParts,
        after_backward: Callable[[Trainer, int], None] | None = None,
        stop: StopRequest | None = None,
    ):
        self.parts = parts
        self.config, self.family, self.layout, self.timer = parts.config, parts.family, parts.layout, parts.timer
        self.resolved, self.precision, self.peak = parts.resolved, parts.resolved.precision, parts.peak
        self.output_dir, self.checkpoint_root, self.data = parts.output_dir, parts.checkpoint_root, parts.data
        self.train_ids, self.train_lengths = parts.train_ids, parts.train_lengths
        self.train_labels, self.train_types = parts.train_labels, parts.train_types
        self.train_target_masks, self.train_targets = parts.train_target_masks, parts.train_targets
        # packing=true: how this runner wants its packed batches (a pipeline's are of static shapes)
        pipeline = self.layout.pp > 1
        self.packed_shape = (
            packing.PackedShape(
                capacity=self.config.max_length,
                pad_multiple=parts.runner.pad_multiple,
                fixed_length=pipeline,
                rows_multiple=self.resolved.microbatches if pipeline else 1,
                pooled=self.family.pooled_token,
            )
            if self.config.packing
            else None
        )
        self.batches, self.steps_per_epoch, self.total_steps = parts.batches, len(parts.batches), parts.total_steps
        self.ready, self.model, self.updates = parts.ready, parts.model, parts.updates
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self.step, self.resumed_from = parts.resumed_step, parts.resumed_from
        self.after_backward = after_backward  # test hook: runs after each step's backward, before the update
        self.stop = stop or StopRequest()  # set by SIGTERM: finish the step, checkpoint, exit 0
        self.nonfinite = NonFiniteGuard(self.config.max_nonfinite_steps, self.config.lr)
        self.history: list[dict] = []
        self.stop_agreed = False  # any rank was asked to stop (agreed in the step's one all-reduce)
        self.padding: dict[int, list[int]] = {}  # epoch -> [real tokens, token slots after padding] trained
        self.reporter: Reporter | None = None  # made when training starts
        self.generator = self._generator() if self.config.generate_every else None
        self.generated_at: int | None = None  # the step of the last generations

    def _generator(self) -> Generator:
        """generate_every's decoder over the run's runner, with the held-out prompts it answers."""
        config = self.config
        return Generator(
            runner=self.runner,
            model=self.model,
            tokenizer=self.data.tokenizer,
            prompts=held_out_prompts(self.data.splits["validation"], config.generate_prompts),
            max_new_tokens=config.generate_max_new_tokens,
            max_length=config.max_length,
            layout=self.layout,
        )

    def generate(self) -> None:
        """Every rank decodes the held-out prompts; rank 0's reporter writes the answers."""
        with self.timer("generate"):
            answers = self.generator.answers()
        self.reporter.generations(self.step, answers)
        self.generated_at = self.step

    def training_state(self) -> TrainingState:
        return self.parts.training_state(self.step)

    # ------------------------------------------------------------------------------------------- training
    def batch_of(self, indices: list[int]) -> dict:
        """Training rows `indices` padded (or packed) into tensors on this rank's device."""
        if self.packed_shape is not None:
            return packing.packed_batch(
                indices,
                ids=self.train_ids,
                labels=self.train_labels,
                token_types=self.train_types,
                target_masks=self.train_target_masks,
                pad_id=self.data.tokenizer.pad_token_id,
                shape=self.packed_shape,
                device=self.layout.device,
            )
        return data_module.device_batch(
            indices,
            self.train_ids,
            self.train_labels,
            self.data.tokenizer,
            self.runner.pad_multiple,
            self.layout.device,
            self.train_types,
            self.train_target_masks,
        )

    def _token_slots(self, global_batch: list[int]) -> int:
        """Token positions the global batch occupied on all replicas, padded (or packed)."""
        accumulation = self.config.gradient_accumulation_steps
        if self.packed_shape is not None:
            return packing.packed_token_slots(
                global_batch, self.train_lengths, self.layout.dp, accumulation, self.packed_shape
            )
        return data_module.token_slots(
            global_batch, self.train_lengths, self.layout.dp, accumulation, self.runner.pad_multiple
        )

    def _skip_rule(self, loss: float, grad_norm: float, loss_scale: float | None) -> bool:
        return self.nonfinite.skip(self.step + 1, loss, grad_norm, loss_scale)

    def train_step(self, global_batch: list[int]) -> dict:
        config, layout = self.config, self.layout
        started = time.perf_counter()
        lengths = [self.train_lengths[i] for i in global_batch]
        targets = [self.train_targets[i] for i in global_batch] if self.train_targets is not None else None
        count = loss_count(lengths, self.resolved.head, targets)
        local_loss = torch.zeros((), device=layout.device)
        slices = data_module.accumulation_slices(
            global_batch, layout.dp_rank, layout.dp, config.gradient_accumulation_steps
        )
        for number, indices in enumerate(slices, start=1):
            local_loss += self.runner.train(self.batch_of(indices), count, last=number == len(slices))
        if self.after_backward is not None:
            self.after_backward(self, self.step + 1)
        lr = self.scheduler.get_last_lr()[0]
        outcome = self.updates.step(local_loss, self.stop.requested, self._skip_rule)
        self.scheduler.step()
        self.step += 1
        self.stop_agreed = outcome.stop
        elapsed = time.perf_counter() - started
        tokens = sum(lengths)
        epoch_padding = self.padding.setdefault(int((self.step - 1) // self.steps_per_epoch), [0, 0])
        epoch_padding[0] += tokens
        epoch_padding[1] += self._token_slots(global_batch)
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
        checkpoints = CheckpointManager.for_run(
            self.checkpoint_root, checkpoint=config.checkpoint, enabled=self.updates.checkpointable, timer=self.timer
        )
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
                    every = config.generate_every
                    if every and self.step % every == 0 and self.step < self.total_steps:
                        self.generate()
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
        if self.generator is not None and self.generated_at != self.step:  # and at the end
            self.generate()
        if self.packed_shape is not None:
            real, slots = (sum(counts) for counts in zip(*self.padding.values()))
            log.info("packing: %.1f%% of the packed token slots held real tokens", 100 * real / slots)
        return self.history


def report_compiled(graphs: int) -> None:
    """What compile=true did: a run whose blocks ran eager says so (dynamo skips frames it cannot trace quietly)."""
    if graphs:
        log.info("compile: torch.compile compiled %d graph(s) of the blocks", graphs)
    else:
        log.warning("compile: torch.compile compiled no graph; the blocks ran eager")


def run(config: Config, after_backward: Callable | None = None) -> dict:
    """Train, evaluate, export and report: what `scripts/train.py` does. Returns summary.json's content.
    SIGTERM, or the torchrun launcher's end: checkpoint and stop; Ctrl-C: stop at once (Interrupted)."""
    builder, stop, trainer = RunBuilder(config), StopRequest(), None
    signal.signal(signal.SIGTERM, stop)
    end_with_launcher()
    try:
        trainer = Trainer(builder.build(), after_backward, stop)
        trainer.fit()
        if trainer.stop_agreed:
            trainer.reporter.close("stopped")
            shutdown()
            return {"stopped_at_step": trainer.step}
        layout, tokenizer, updates = trainer.layout, trainer.data.tokenizer, trainer.updates
        model, runner, data, batch_size = trainer.model, trainer.runner, trainer.data, config.eval_batch_size
        with trainer.timer("eval"):
            results = evaluate_all(model, runner, data, batch_size, layout)
        trainer.reporter.evaluation(trainer.step, results)
        if trainer.ready.parallel.compiled:
            report_compiled(compiled_graphs())
        if config.predict:
            with trainer.timer("predict"):
                predict_test(model, runner, data, batch_size, layout, trainer.output_dir)
        if config.export:
            with trainer.timer("export"):
                place = ExportPlace.of_run(config.output_dir, trainer.output_dir)
                export_model(
                    updates, tokenizer, layout, place, model=config.model, peft=config.peft, resolved=trainer.resolved
                )
        summary = run_summary(summary_record(trainer, results), layout)
        trainer.reporter.close()
        if layout.is_main:
            record_written(trainer.output_dir, "summary.json")
            write_summary(trainer.output_dir, summary, results)
        shutdown()
        return summary
    except BaseException as exc:
        if trainer is not None and trainer.reporter is not None:
            trainer.reporter.close("failed")  # the bar first: the error gets a line of its own
        if dist.is_initialized():
            dist.destroy_process_group()
        step = trainer.step if trainer is not None else builder.resumed_step
        timeout = timed_out(exc, config.collective_timeout_s)
        if timeout:  # one line naming the key, not a traceback from the collective
            raise RankError(f"after step {step}: {timeout}") from None
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(
                f"interrupted (SIGINT) after step {step}: the run stopped; its checkpoints are kept, and "
                "resume=auto continues from the newest"
            ) from None
        raise
    finally:
        builder.release()


def summary_record(trainer: Trainer, results: dict) -> RunRecord:
    """The plain values summary.json reports, from a trained run."""
    config, family, updates = trainer.config, trainer.family, trainer.updates
    return RunRecord(
        results=results,
        task=config.task,
        family=family.name,
        model=f"tiny {family.name} (from config)" if config.size == "tiny" else trainer.resolved.model_name,
        engine=config.engine,
        batch_size=config.batch_size,
        data=trainer.data.source.description,
        steps=trainer.step,
        history=trainer.history,
        padding=trainer.padding,
        packing=config.packing,
        peak=trainer.peak,
        precision=trainer.precision,
        resumed_from=trainer.resumed_from,
        seconds=trainer.timer.seconds,
        load_peak_mib=trainer.ready.load_peak_mib,
        load_seconds=trainer.ready.load_seconds,
        state_bytes=updates.state_bytes(),
        zero_stage=updates.zero_stage if trainer.resolved.engine is Engine.DEEPSPEED else None,
    )
