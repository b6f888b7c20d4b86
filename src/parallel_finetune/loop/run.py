"""A whole run, what `python -m parallel_finetune.train` does: RunBuilder.build (builder.py) -> Trainer.fit
(trainer.py) -> every validation split evaluated -> predictions written (predict=true) -> the model exported
(export.py) -> summary.json (summary.py). SIGTERM, or the torchrun launcher's end: checkpoint and stop; Ctrl-C:
stop at once (Interrupted)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import torch.distributed as dist

from ..config import Config
from ..errors import Interrupted, RankError
from ..launch import end_with_launcher
from ..outputs.export import ExportPlace, export_model
from ..outputs.runfolder import record_written
from ..outputs.summary import RunRecord, run_summary, write_summary
from ..parallel import compiled_graphs
from ..parallel.layout import Engine, shutdown, timed_out
from .builder import BuiltRun, RunBuilder
from .evaluation import prediction_files, write_predictions
from .trainer import StopRequest

log = logging.getLogger(__name__)


def run(config: Config, after_backward: Callable | None = None) -> dict:
    """Train, evaluate, export and report. Returns summary.json's content (or {"stopped_at_step": N}).
    `after_backward(built, step)`: called after each step's backward, before the update (tests, the selftest)."""
    builder, stop, built = RunBuilder(config), StopRequest(), None
    signal.signal(signal.SIGTERM, stop)
    end_with_launcher()
    try:
        built = builder.build(stop)
        trainer = built.trainer
        if after_backward is not None:  # a test's or the selftest's hook: (the built run, step)
            trainer.after_backward = lambda _, step: after_backward(built, step)
        trainer.fit()
        if trainer.stop_agreed:
            trainer.reporter.close("stopped")
            shutdown()
            return {"stopped_at_step": trainer.step}
        summary = finish(config, built)
        shutdown()
        return summary
    except BaseException as exc:
        if built is not None:
            built.trainer.reporter.close("failed")  # the bar first: the error gets a line of its own
        if dist.is_initialized():
            dist.destroy_process_group()
        step = built.trainer.step if built is not None else builder.resumed_step
        timeout = timed_out(exc, config.parallel.collective_timeout_s)
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


def finish(config: Config, built: BuiltRun) -> dict:
    """After training: every validation split's metrics, predictions, the export, summary.json."""
    trainer, layout = built.trainer, built.trainer.layout
    with trainer.timer("eval"):
        results = trainer.evaluator.evaluate_all()
    trainer.reporter.evaluation(trainer.step, results)
    if built.ready.parallel.compiled:
        report_compiled(compiled_graphs())
    if config.output.predict:
        with trainer.timer("predict"):
            predictions = trainer.evaluator.predict_tests()
        if layout.is_main:
            write_all_predictions(built, predictions)
    if config.output.export:
        with trainer.timer("export"):
            place = ExportPlace.of_run(config.output.output_dir, built.output_dir)
            export_model(
                trainer.updates,
                built.data.tokenizer,
                layout,
                place,
                model=config.model,
                peft=config.peft,
                resolved=built.resolved,
                saved_initial=built.saved_initial,
            )
    summary = run_summary(summary_record(config, built, results), layout)
    trainer.reporter.close()
    if layout.is_main:
        record_written(built.output_dir, "summary.json")
        write_summary(built.output_dir, summary, results)
    return summary


def write_all_predictions(built: BuiltRun, predictions: dict[str, list]) -> None:
    """Rank 0: predictions.tsv (and predictions_mismatched.tsv, MNLI) in GLUE's submission format."""
    task = built.data.task
    for split, name in prediction_files(task).items():
        record_written(built.output_dir, name)
        index = built.data.splits[split]["index"][:]
        write_predictions(built.output_dir / name, index, predictions[split], task)


def report_compiled(graphs: int) -> None:
    """What compile=true did: a run whose blocks ran eager says so (dynamo skips frames it cannot trace quietly)."""
    if graphs:
        log.info("compile: torch.compile compiled %d graph(s) of the blocks", graphs)
    else:
        log.warning("compile: torch.compile compiled no graph; the blocks ran eager")


def summary_record(config: Config, built: BuiltRun, results: dict) -> RunRecord:
    """The plain values summary.json reports, from a trained run."""
    trainer, family, updates = built.trainer, built.family, built.trainer.updates
    return RunRecord(
        results=results,
        task=config.model.task,
        family=family.name,
        model=f"tiny {family.name} (from config)" if config.model.size == "tiny" else built.resolved.model_name,
        engine=config.parallel.engine,
        batch_size=config.training.batch_size,
        data=built.data.source.description,
        steps=trainer.step,
        history=trainer.history,
        padding=trainer.padding,
        packing=config.data.packing,
        peak=trainer.peak,
        precision=built.resolved.precision,
        resumed_from=built.resumed_from,
        seconds=trainer.timer.seconds,
        load_peak_mib=built.ready.load_peak_mib,
        load_seconds=built.ready.load_seconds,
        state_bytes=updates.state_bytes(),
        zero_stage=updates.zero_stage if built.resolved.engine is Engine.DEEPSPEED else None,
    )
