"""The one training loop: any family, any layout, any precision, either engine.

The promise: for a given global batch, the loss, gradients and update are those of single-process training.
Every rank draws the same global batches; each slice's loss is a *sum* divided by the global count of samples
(classification) or target tokens (causal_lm); gradients are *summed* over data-parallel ranks.

The loop knows two interfaces (`interfaces.py`) and no engine or layout: a runner does a slice's forward and
backward (`runner.WholeModel`, or the `parallel.pipeline.Pipeline`), the updates turn the gradients into an update
(`updates.TorchUpdates`, or DeepSpeed's ZeRO: `parallel.deepspeed_engine.DeepSpeedUpdates`).
"""

from __future__ import annotations

import dataclasses
import datetime
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
from .checkpoint import TrainingState, continuing_run
from .config import Config, compile_decision
from .divergence import NonFiniteGuard
from .errors import Interrupted, RankError, UserError
from .export import save_hf, write_folder
from .families import get_family
from .families.base import download_model
from .interfaces import Runner, Updates
from .launch import end_with_launcher
from .layout import check_batch_split, init_distributed, rank0_decides, shutdown, timed_out
from .loggers import destinations
from .loss import loss_count, scored_count, summed_loss, targets
from .metrics import load_metric
from .model import load_model
from .parallel.pipeline import Pipeline, check_microbatches
from .precision import DTYPES, autocast, resolve_precision
from .preflight import check_heads, check_model_config
from .reporting import (
    PhaseTimer,
    Reporter,
    choose_output_dir,
    format_throughput,
    package_versions,
    peak_memory_mib,
    write_json,
    write_yaml,
)
from .runfolder import (
    RUN_FILES,
    RunLock,
    check_run_folders,
    record_written,
    replace_previous_run,
    restarted,
    run_folders,
    sagemaker_folder,
)
from .runner import WholeModel
from .throughput import achieved, device_peak
from .updates import TorchUpdates

log = logging.getLogger(__name__)
DOWNLOAD_WAIT_S = 6 * 3600  # a checkpoint of tens of GB over a slow link


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
            self.precision = resolve_precision(config.precision, layout.device, config.engine)
            if config.lr_note:
                log.info("%s", config.lr_note)
            self.peak = device_peak(layout.device, DTYPES[self.precision], config.peak_tflops)
            self.peak_tflops = self.peak.tflops  # None: unknown
            log.info("%s", self.peak.describe())
            check_batch_split(config.batch_size, layout.dp, config.gradient_accumulation_steps)
            if config.size == "tiny":  # (full size: once the model is fetched, in _build)
                check_heads(check_model_config(config))  # a bad model_config: one line, not a traceback per rank
            self.microbatches = config.microbatches or 2 * layout.pp  # a pipeline's, per accumulation slice
            if layout.pp > 1:
                check_microbatches(
                    config.batch_size // (layout.dp * config.gradient_accumulation_steps), self.microbatches
                )
            self.deepspeed_config = None
            if config.engine == "deepspeed":  # one line (fp16 on a CPU, a conflicting JSON) before any work
                from .parallel import deepspeed_engine

                self.deepspeed_config = deepspeed_engine.preflight(
                    config, layout.dp, layout.device.type, self.precision
                )
            self.output_dir = Path(
                rank0_decides(
                    layout,
                    lambda: str(
                        choose_output_dir(config.output_dir, config.recipe, config.overwrite, continuing_run(config))
                    ),
                )
            )
            self.checkpoint_root = checkpoint.checkpoint_root(config.checkpoint_dir, self.output_dir)
            self.run_lock = RunLock(run_folders(self.output_dir, self.checkpoint_root))
            rank0_decides(layout, self.run_lock.acquire)  # a second run into these folders stops here
            replacing = config.overwrite and not restarted()
            rank0_decides(layout, lambda: check_run_folders(self.output_dir, self.checkpoint_root, replacing))
            self.model_path = self._fetch_model() if config.size == "full" else None
        with self.timer("data"):
            self.data = self._prepare_data()
        with self.timer("model"):
            self._build()
        if self.updates.checkpointable:
            # The newest checkpoint that all ranks together verify and load (skipped ones said once, by rank 0).
            started, state = time.perf_counter(), self.training_state()
            self.resumed_from = checkpoint.resume(state, self.checkpoint_root)
            if self.resumed_from:
                self.step = state.step
                self.timer.seconds["resume"] = time.perf_counter() - started
        # Only now, with every input accepted, is the run folder written (a failed start leaves nothing).
        if layout.is_main:
            if config.overwrite and not restarted():
                replace_previous_run(self.output_dir, self.checkpoint_root)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            deepspeed = ["deepspeed_config.json"] if self.deepspeed_config is not None else []
            record_written(self.output_dir, *RUN_FILES, *deepspeed)  # before writing: a killed run's are on record
            write_yaml(self.output_dir / "config.yaml", config.to_dict())
            if self.deepspeed_config is not None:
                write_json(self.output_dir / "deepspeed_config.json", self.updates.config)
        log.info("run folder %s | %s", self.output_dir, layout.describe())

    def _fetch_model(self) -> str:
        """The pretrained model's local folder. A Hub name is downloaded once per node, by its first process,
        while the others wait; then all read the same cache. A local folder or SageMaker channel is used as is."""
        config, layout = self.config, self.layout
        name = config.model or self.family.default_model
        # Waiting for a download is no hung collective: this wait has its own limit, not collective_timeout_s.
        waiting = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=max(config.collective_timeout_s, DOWNLOAD_WAIT_S))
        )
        problem = ""
        if layout.local_rank == 0:
            try:
                download_model(name, config.revision)
            except UserError as exc:
                problem = str(exc)
        problems: list = [None] * layout.world_size
        dist.all_gather_object(problems, problem, group=waiting)  # no rank reads a half-downloaded cache
        dist.destroy_process_group(waiting)
        if any(problems):
            raise UserError(next(p for p in problems if p))
        return download_model(name, config.revision, local_only=True)

    def _prepare_data(self) -> data_module.PreparedData:
        config = self.config
        mine: list[data_module.PreparedData] = []

        def prepare_on_rank0():
            mine.append(data_module.prepare_for_config(config, self.model_path))
            return str(mine[0].cache_path), mine[0].source

        # Rank 0 builds the cache (and may fall back to the sample, loudly, once); the others then read it.
        cache_path, source = rank0_decides(self.layout, prepare_on_rank0)
        prepared = mine[0] if mine else data_module.load_prepared(Path(cache_path), source)
        train = prepared.splits["train"]
        self.train_ids = data_module.column(train, "input_ids")
        self.train_lengths = data_module.column(train, "length")
        self.train_labels = data_module.column(train, "label") if config.task == "classification" else None
        self.batches = data_module.GlobalBatches(
            self.train_lengths, config.batch_size, config.seed, config.group_by_length
        )
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
        hf_config = family.config_for(config, len(tokenizer), tokenizer.pad_token_id, self.model_path)
        family.check_tp(hf_config, layout.tp)
        total_steps = config.max_steps or max(1, math.ceil(config.epochs * len(self.batches)))
        compiled, why = compile_decision(config, total_steps, layout.device.type)
        if config.compile == "auto":
            log.info("%s", why)
        built = dataclasses.replace(config, compile=compiled)
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
        self.steps_per_epoch = len(self.batches)
        self.total_steps = config.max_steps or max(1, math.ceil(config.epochs * self.steps_per_epoch))
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
        )

    def base_description(self) -> str:
        config = self.config
        if config.size == "tiny":
            return f"tiny {self.family.name} from config, initialised from seed {config.seed}"
        name = config.model or self.family.default_model
        return f"{name}@{config.revision}" if config.revision else name

    # ------------------------------------------------------------------------------------------- training
    def batch_of(self, indices: list[int], ids: list | None = None, labels: list | None = None) -> dict:
        """Rows `indices` (of the training split, or of `ids`/`labels`) padded into tensors on this rank's device."""
        tokenizer = self.data.tokenizer
        ids, labels = (self.train_ids, self.train_labels) if ids is None else (ids, labels)
        batch = data_module.collate(
            [ids[i] for i in indices],
            tokenizer.pad_token_id,
            tokenizer.padding_side,
            [labels[i] for i in indices] if labels is not None else None,
            pad_to_multiple_of=self.runner.pad_multiple,
        )
        return {k: v.to(self.layout.device, non_blocking=True) for k, v in batch.items()}

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
        config = self.config
        reporter = Reporter(
            self.output_dir, self.total_steps, config.log_every, self.layout.is_main, resumed_at=self.step
        )
        self.reporter = reporter
        trackers = destinations(config.report_to)
        rank0_decides(self.layout, lambda: reporter.add_trackers(trackers, config.run_name, config.to_dict()))
        log.info(
            "training %d steps (%d per epoch), global batch %d = %d dp x %d accumulation x %d, precision %s",
            self.total_steps,
            self.steps_per_epoch,
            config.batch_size,
            self.layout.dp,
            config.gradient_accumulation_steps,
            config.batch_size // (self.layout.dp * config.gradient_accumulation_steps),
            self.precision,
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
                            reporter.evaluation(self.step, self.evaluate())
                        self.model.train()
                    if self.checkpoint_due():
                        self.save_checkpoint()
                    if self.stop_agreed:
                        log.info(
                            "stopping after step %d as asked (SIGTERM); resume=auto continues from the checkpoint",
                            self.step,
                        )
                        return self.history
                    if self.step >= self.total_steps:
                        break
        return self.history

    def checkpoint_due(self) -> bool:
        if not self.updates.checkpointable:
            return False
        every = self.config.checkpoint_every
        return self.stop_agreed or self.step >= self.total_steps or bool(every and self.step % every == 0)

    def save_checkpoint(self) -> Path | None:
        if self.nonfinite.bad_steps:  # weights that just gave a NaN/inf loss or gradient are not worth resuming
            log.warning(
                "checkpoint at step %d not written: the loss or gradient norm of step %d was not finite",
                self.step,
                self.nonfinite.bad_steps[-1],
            )
            return None
        with self.timer("checkpoint"):
            return checkpoint.save(self.training_state(), self.checkpoint_root)

    def request_stop(self, signum=None, frame=None) -> None:
        """SIGTERM (a spot interruption, `docker stop`): the current step finishes, then every rank checkpoints."""
        self.stop_requested = True

    # ------------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, split: str = "validation") -> dict:
        """Dev metrics over all data-parallel ranks: each row is scored exactly once."""
        layout, config = self.layout, self.config
        self.model.eval()
        rows = self.data.splits[split]
        ids, lengths = data_module.column(rows, "input_ids"), data_module.column(rows, "length")
        labels = data_module.column(rows, "label") if config.task == "classification" else None
        order = sorted(range(len(ids)), key=lambda i: lengths[i])
        chunks = [order[i : i + config.eval_batch_size] for i in range(0, len(order), config.eval_batch_size)]
        predictions: list[tuple[int, int]] = []
        totals = torch.zeros(2, dtype=torch.float64, device=layout.device)  # loss sum, count
        mine = chunks[layout.dp_rank :: layout.dp]
        # Under FSDP and ZeRO-3 a forward all-gathers parameters over the data-parallel ranks, so all of them
        # run the same number: a rank short of a chunk runs the first one again and scores it nowhere.
        rounds = -(-len(chunks) // layout.dp)
        for number, chunk in enumerate(mine + [chunks[0]] * (rounds - len(mine))):
            batch = self.batch_of(chunk, ids, labels)
            logits = self.runner.forward(batch)
            if number >= len(mine) or logits is None:  # a repeat, or a pipeline stage that is not the last
                continue
            totals[0] += summed_loss(logits, targets(batch, config.task)).double()
            totals[1] += scored_count(batch, config.task)
            if labels is not None:
                predictions.extend(zip(chunk, logits.argmax(-1).tolist()))
        if layout.dp > 1:
            dist.all_reduce(totals, group=layout.dp_group)
        gathered: list = [None] * layout.dp
        if labels is not None and layout.dp > 1:
            dist.all_gather_object(gathered, predictions, group=layout.dp_group)
        else:
            gathered = [predictions]
        if layout.pp > 1:  # the last stage scored everything: hand its sums and predictions to the other stages
            box = [(totals.tolist(), gathered)]
            dist.broadcast_object_list(box, group=layout.pp_group, group_src=layout.pp - 1)
            totals, gathered = torch.tensor(box[0][0], dtype=torch.float64), box[0][1]
        mean_loss = (totals[0] / totals[1]).item()
        if labels is None:
            return {"eval_loss": mean_loss, "perplexity": math.exp(min(mean_loss, 700.0))}
        by_row = dict(pair for part in gathered for pair in part)
        assert len(by_row) == len(ids), "every dev row is predicted exactly once"
        ordered = sorted(by_row)
        accuracy = load_metric("accuracy").compute(
            predictions=[by_row[i] for i in ordered], references=[labels[i] for i in ordered]
        )["accuracy"]
        return {"eval_loss": mean_loss, "accuracy": accuracy}

    # ------------------------------------------------------------------------------------------- outputs
    def export(self, out: Path | None = None) -> Path | None:
        """The model as a Hugging Face folder: `out`, else (export=true) hf/ in the run folder, or in a SageMaker
        job given no output_dir, the job's model folder, which it uploads to S3 as the model artifact. Every rank
        calls it."""
        if out is None and not self.config.export:
            return None
        model_dir = None if out is not None or self.config.output_dir else sagemaker_folder("SM_MODEL_DIR")
        out = out or model_dir or self.output_dir / "hf"
        with self.timer("export"):
            if self.ready.parallel.trainable is not None:
                return self._export_lora(out, inside=model_dir is not None)
            state, model = self.updates.full_state_dict(DTYPES[self.config.export_dtype]), self.updates.module

            def write():  # rank 0; its failure (NaN weights, a full disk) is every rank's one-line error
                self._record_exports(out)
                save_hf(model, self.family.to_hf_state_dict(state, model.config), self.data.tokenizer, out)

            rank0_decides(self.layout, write)
            log.info("exported a Hugging Face model to %s", out)
        return out

    def _record_exports(self, *folders: Path) -> None:
        """Put the export folders that lie in the run folder on its record, before writing them (rank 0)."""
        ours = [folder.name for folder in folders if folder.parent.resolve() == self.output_dir.resolve()]
        if ours:
            record_written(self.output_dir, *ours)

    def _export_lora(self, out: Path, inside: bool = False) -> Path:
        """peft=lora: the adapter (and head) in peft's format in adapter/ beside `out` (`inside` it: SageMaker's
        model folder, so the job's model artifact holds it); with lora_export_merged also `out` (hf/): the base
        with the update merged in. A tiny base exists nowhere else, so it is written too (base/), and the adapter
        names it."""
        from . import lora

        config, family = self.config, self.family
        dtype, model = DTYPES[config.export_dtype], self.updates.module
        settings = lora.settings_from_config(config, family)
        whole = config.lora_export_merged or config.size == "tiny"
        # every rank takes part in the gather; what to gather is the same on all of them
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        state = self.updates.full_state_dict(dtype, None if whole else trainable)
        adapter, base_dir = (
            (out / "adapter", out / "base") if inside else (out.with_name("adapter"), out.with_name("base"))
        )
        base = str(base_dir.resolve()) if config.size == "tiny" else (config.model or family.default_model)
        tokenizer = self.data.tokenizer

        def write():
            tiny_base, merged = [base_dir] if config.size == "tiny" else [], [out] if config.lora_export_merged else []
            self._record_exports(adapter, *tiny_base, *merged)
            if config.lora_export_merged:  # first: written into an existing `out`, it replaces what `out` held
                merged = lora.merged_state(state, settings.scaling)
                save_hf(model, family.to_hf_state_dict(merged, model.config), tokenizer, out)
            if config.size == "tiny":
                frozen = {name: tensor for name, tensor in state.items() if ".lora_" not in name}
                save_hf(model, family.to_hf_state_dict(frozen, model.config), tokenizer, base_dir)
            write_folder(
                adapter,
                lambda folder: (
                    lora.export_adapter(state, family, model.config, settings, config.task, base, folder),
                    tokenizer.save_pretrained(folder),
                ),
            )

        rank0_decides(self.layout, write)
        log.info(
            "exported the LoRA adapter (peft format) to %s%s",
            adapter,
            f" and the merged model to {out}" if config.lora_export_merged else "",
        )
        return adapter

    def summary(self, results: dict) -> dict:
        layout = self.layout
        memory = [None] * layout.world_size
        dist.all_gather_object(memory, round(peak_memory_mib(layout.device), 1))
        load_peaks = [None] * layout.world_size
        dist.all_gather_object(load_peaks, round(self.ready.load_peak_mib, 1))
        state_bytes = [None] * layout.world_size
        dist.all_gather_object(state_bytes, self.updates.state_bytes())
        trained = self.history
        train_seconds = sum(r["step_time_s"] for r in trained) or float("nan")
        samples = len(trained) * self.config.batch_size
        return {
            **results,
            "task": self.config.task,
            "family": self.family.name,
            "model": (
                f"tiny {self.family.name} (from config)"
                if self.config.size == "tiny"
                else self.config.model or self.family.default_model
            ),
            "data": self.data.source.description,
            "steps": self.step,
            "skipped_steps": sum(r["skipped"] for r in trained),
            "final_loss": trained[-1]["loss"] if trained else None,
            "train_samples_per_s": samples / train_seconds,
            "train_tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in trained) / train_seconds,
            # model FLOPs of all trained steps over their time: the run's mean, not the mean of per-step MFUs
            "train_tflops_per_device": (
                tflops := sum(r["tflops_per_device"] * r["step_time_s"] for r in trained) / train_seconds
            ),
            "mfu": self.peak.mfu(tflops),  # None: unknown, and why
            "mfu_unknown": self.peak.unknown_reason(tflops),
            "peak_tflops_per_device": self.peak.tflops,
            "peak_source": self.peak.source,
            "achievable_matmul_tflops": self.peak.achievable_tflops,  # a CPU's matmul probe (what it reached)
            "padding_fraction": padding_fraction(self.padding.values()),
            "padding_fraction_per_epoch": {
                epoch: padding_fraction([counts]) for epoch, counts in sorted(self.padding.items())
            },
            "layout": layout.describe(),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "precision": self.precision,
            "engine": self.config.engine,
            **({"zero_stage": self.updates.zero_stage} if self.deepspeed_config is not None else {}),
            "seconds": {k: round(v, 3) for k, v in self.timer.seconds.items()},
            "peak_memory_mib_per_rank": memory,
            # when the model was ready, before the first step: process peak RSS (CPU) or allocated bytes (CUDA)
            "load_peak_mib_per_rank": load_peaks,
            "load_seconds": round(self.ready.load_seconds, 3),
            "state_bytes_per_rank": state_bytes,
            "versions": package_versions(),
        }


def padding_fraction(counts) -> float | None:
    """Share of the token slots that were padding, from [real tokens, slots] pairs."""
    real, slots = (sum(c[i] for c in counts) for i in (0, 1))
    return 1 - real / slots if slots else None


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
        with trainer.timer("eval"):
            results = trainer.evaluate()
        trainer.reporter.evaluation(trainer.step, results)
        trainer.export()
        summary = trainer.summary(results)
        trainer.reporter.close()
        if trainer.layout.is_main:
            write_json(trainer.output_dir / "summary.json", summary)
            log.info(
                "done: %s | %s",
                ", ".join(f"{k} {v:.4f}" for k, v in results.items()),
                ", ".join(f"{k} {v:.1f}s" for k, v in summary["seconds"].items()),
            )
            log.info("%s", format_throughput(summary))
            log.info("outputs in %s", trainer.output_dir)
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
