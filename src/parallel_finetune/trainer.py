"""The one training loop: any family, any layout, any precision.

The promise: for a given global batch, the loss, gradients and update are those of single-process training.
Every rank draws the same global batches; each micro-batch loss is a *sum* divided by the global count of
samples (classification) or target tokens (causal_lm); gradients are *summed* over data-parallel ranks.
With engine=deepspeed, DeepSpeed's ZeRO does the backward's reduction, clipping, loss scaling and update instead
of our optimizer (`parallel/deepspeed_engine.py`); everything else is this same loop.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.fsdp import FSDPModule

from . import checkpoint
from . import data as data_module
from .config import Config
from .checkpoint import continuing_run
from .divergence import NonFiniteGuard
from .errors import RankError, UserError
from .export import DTYPES as EXPORT_DTYPES
from .export import gather_full_state_dict, save_hf
from .families import get_family
from .families.base import download_model
from .layout import Layout, init_distributed, shutdown, timed_out
from .metrics import load_metric
from .parallel import parallelize
from .parallel.gradients import reduce_norm_and_loss, scale_gradients
from .parallel.memory import measure_state_bytes, offload_context
from .parallel.pipeline import PAD_MULTIPLE, Pipeline, check_microbatches, stage_costs, sync_tied_gradients
from .parallel.sharding import DataParallelAdamW, ZeroAdamW
from .parallel.tensor import keep_gradients_sharded
from .preflight import check_heads, check_model_config
from .precision import DTYPES, DynamicLossScaler, autocast, resolve_precision
from .throughput import achieved, device_peak_tflops, model_flops
from .reporting import (PhaseTimer, Reporter, choose_output_dir, package_versions, peak_memory_mib,
                        write_json, write_yaml)
from .runfolder import RunLock, replace_previous_run, restarted, run_folders
from .weights import (NewWeights, load_weights, local_tensor, materialize, plan_load, shard_box, tied_aliases,
                      weights_source)

log = logging.getLogger("parallel_finetune")
IGNORE = -100
DOWNLOAD_WAIT_S = 6 * 3600  # a checkpoint of tens of GB over a slow link


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank0_decides(layout: Layout, decide: Callable[[], object]) -> object:
    """Run `decide` on rank 0 only and hand its result, or its UserError, to every rank."""
    box: list = [None]
    if layout.is_main:
        try:
            box[0] = ("ok", decide())
        except UserError as exc:
            box[0] = ("error", str(exc))
    if layout.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise UserError(value)
    return value


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Positions count real tokens only, so a left-padded row sees the positions of its unpadded self
    (transformers would number the padding too); with right padding this equals 0, 1, 2, ..."""
    mask = batch["attention_mask"]
    return {"input_ids": batch["input_ids"], "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "use_cache": False}


def check_batch_split(batch_size: int, dp: int, accumulation: int) -> None:
    if batch_size % (dp * accumulation):
        raise UserError(f"batch_size={batch_size} must be divisible by data-parallel degree {dp} x "
                        f"gradient_accumulation_steps={accumulation}")


class Trainer:
    def __init__(self, config: Config, after_backward: Callable[["Trainer", int], None] | None = None):
        self.config = config
        self.family = get_family(config.family)
        self.after_backward = after_backward  # test hook: runs after each step's backward, before the sync
        self.nonfinite = NonFiniteGuard(config.max_nonfinite_steps, config.lr)
        self.timer = PhaseTimer()
        self.step = 0
        self.history: list[dict] = []
        self.state_bytes: dict[str, int] | None = None  # measured at the first optimizer step
        self.deepspeed = None  # engine=deepspeed: a DeepSpeedEngine; self.model is then DeepSpeed's own engine
        self.adam_step = 0  # optimizer updates done (fp16 skips steps), for AdamW's bias correction on resume
        self.stop_requested = False  # set by SIGTERM: finish the step, checkpoint, exit 0
        self.stop_agreed = False  # any rank was asked to stop (agreed in the step's one all-reduce)
        self.resumed_from: Path | None = None
        self.pipeline: Pipeline | None = None  # pipeline_parallel_degree > 1: this rank's stages and schedules
        self.tied: list[tuple[str, ...]] = []  # weights shared by the first and last stage (tied embeddings)
        self.padding: dict[int, list[int]] = {}  # epoch -> [real tokens, token slots after padding] trained
        self.run_lock: RunLock | None = None  # rank 0's hold on the run folders, taken in setup
        self.reporter: Reporter | None = None  # set when training starts

    @property
    def microbatches(self) -> int:
        return self.config.microbatches or 2 * self.config.pipeline_parallel_degree

    # ------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        config = self.config
        with self.timer("setup"):
            self.layout = layout = init_distributed(config.device, config.tensor_parallel_degree, config.sharding,
                                                    config.shard_group_size, config.pipeline_parallel_degree,
                                                    config.collective_timeout_s)
            logging.basicConfig(level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s",
                                force=True)
            transformers.logging.set_verbosity_error()
            self.precision = resolve_precision(config.precision, layout.device, config.engine)
            if config.lr_note:
                log.info("%s", config.lr_note)
            compute_dtype = DTYPES[self.precision] if self.precision != "fp32" else torch.float32
            self.peak_tflops, source = device_peak_tflops(layout.device, compute_dtype, config.peak_tflops)
            log.info("MFU is measured against %.3g TFLOP/s per device (%s)", self.peak_tflops, source)
            check_batch_split(config.batch_size, layout.dp, config.gradient_accumulation_steps)
            if config.size == "tiny":  # (full size: once the model is fetched, in _build_model)
                check_heads(check_model_config(config))  # a bad model_config: one line, not a traceback per rank
            if layout.pp > 1:
                check_microbatches(config.batch_size // (layout.dp * config.gradient_accumulation_steps),
                                   self.microbatches)
            if config.engine == "deepspeed":  # one line (fp16 on a CPU, a conflicting JSON) before any work
                from .parallel import deepspeed_engine

                self.deepspeed_config = deepspeed_engine.preflight(config, layout.dp, layout.device.type,
                                                                   self.precision)
            self.output_dir = Path(rank0_decides(layout, lambda: str(choose_output_dir(
                config.output_dir, config.recipe, config.overwrite, continuing_run(config)))))
            self.checkpoint_root = checkpoint.checkpoint_root(config.checkpoint_dir, self.output_dir)
            self.run_lock = RunLock(run_folders(self.output_dir, self.checkpoint_root))
            rank0_decides(layout, self.run_lock.acquire)  # a second run into these folders stops here
            self.model_path = self._fetch_model() if config.size == "full" else None
        with self.timer("data"):
            self.data = self._prepare_data()
        with self.timer("model"):
            self.model = self._build_model()
            self._build_optimizer()
        if config.engine == "torch":
            # The newest checkpoint that all ranks together verify (skipped ones said once, by rank 0).
            resume_from = checkpoint.choose_resume(config, self.checkpoint_root, layout)
            if resume_from:
                with self.timer("resume"):
                    checkpoint.load(self, resume_from)
                self.resumed_from = resume_from
        # Only now, with every input accepted, is the run folder written (a failed start leaves nothing).
        if layout.is_main:
            if config.overwrite and not restarted():
                replace_previous_run(self.output_dir, self.checkpoint_root)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_yaml(self.output_dir / "config.yaml", config.to_dict())
            if self.deepspeed is not None:
                write_json(self.output_dir / "deepspeed_config.json", self.deepspeed.config)
        log.info("run folder %s | %s", self.output_dir, layout.describe())

    def _fetch_model(self) -> str:
        """The pretrained model's local folder. A Hub name is downloaded once per node, by its first process,
        while the others wait; then all read the same cache. A local folder or SageMaker channel is used as is."""
        config, layout = self.config, self.layout
        name = config.model or self.family.default_model
        # Waiting for a download is no hung collective: this wait has its own limit, not collective_timeout_s.
        waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(
            config.collective_timeout_s, DOWNLOAD_WAIT_S)))
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
        self.batches = data_module.GlobalBatches(self.train_lengths, config.batch_size, config.seed,
                                                 config.group_by_length)
        log.info("data: %s | %s", prepared.source.description,
                 ", ".join(f"{k} {len(v):,} rows" for k, v in prepared.splits.items()))
        return prepared

    def _build_model(self) -> nn.Module:
        """Built on `meta`, split by `parallelize`, then each rank allocates and loads only its own shards."""
        config, layout, family = self.config, self.layout, self.family
        tokenizer = self.data.tokenizer
        if config.size == "full":
            check_heads(check_model_config(config, self.model_path))
        hf_config = family.config_for(config, len(tokenizer), tokenizer.pad_token_id, self.model_path)
        family.check_tp(hf_config, layout.tp)
        seed_everything(config.seed)  # identical initialisation on every rank and in every layout
        started = time.perf_counter()
        self.memory_before_load_mib = peak_memory_mib(layout.device)
        weights = weights_source(family, config.task, hf_config, self.model_path)
        model = family.build(config.task, hf_config)
        aliases = tied_aliases(model)
        whole_plan = plan_load(model, family, weights, aliases)  # of the unsplit model
        new = NewWeights(model, list(whole_plan.new), config.seed)
        total = sum(p.numel() for p in model.parameters())
        if config.size == "tiny":
            log.info("model: tiny %s from config (%s), %.2fM parameters", family.name,
                     ", ".join(f"{k}={v}" for k, v in family.tp_dimensions(hf_config).items()), total / 1e6)
        self.parameter_shapes = checkpoint.parameter_shapes(model)  # of the unsplit model: layout-neutral
        self.flops = model_flops(*stage_costs(model, family), hf_config.hidden_size)
        box_of, write = shard_box, None
        if config.engine == "deepspeed" and self.deepspeed_config["zero_optimization"]["stage"] == 3:
            from .parallel.deepspeed_engine import zero3_box, zero3_init, zero3_write

            # Built again, partitioned as it is built: the meta model above gave the names, shapes and new weights.
            model = family.build(config.task, hf_config, zero3_init(self.deepspeed_config, layout.device.type))
            box_of, write = zero3_box, zero3_write
        compute_dtype = DTYPES[self.precision] if self.precision != "fp32" else None
        self.parallel = parallelize(model, family, layout, config, compute_dtype)
        self.tied = self.parallel.tied
        if config.engine == "torch" and config.sharding == "optimizer":
            # ZeRO-1 keeps parameters in flat buffers: allocating them there is the model's only allocation.
            self.optimizer = ZeroAdamW(model, layout, config.weight_decay, config.lr, config.adam_betas,
                                       config.adam_eps, self._held_names(self.tied, model))
        materialize(model, layout.device)
        load_weights(model, plan_load(model, family, weights, aliases, box_of), weights, new, write)
        weights.close()
        keep_gradients_sharded(model)
        if layout.pp > 1:
            self.pipeline = Pipeline(model, family, self.parallel.stages, layout, config.pipeline_schedule,
                                     self.microbatches, self._autocast)
        if config.offload_activations and layout.device.type == "cpu":
            log.warning("offload_activations=true has no effect on a CPU run: activations already live in CPU "
                        "memory (the offload still runs, so the code path is the one GPUs use)")
        self.load_seconds = time.perf_counter() - started
        self.load_peak_mib = peak_memory_mib(layout.device)  # the model is ready: no gradients, no optimizer state
        if config.size == "full":
            mine = sum(getattr(p, "ds_tensor", local_tensor(p)).numel() for p in model.parameters())
            log.info("model: %s, %.3gB parameters (this rank holds %.3gB) from %s (%s) in %.1f s; peak %.0f MiB",
                     config.model or family.default_model, total / 1e9, mine / 1e9, weights.description,
                     "/".join(sorted(str(d).removeprefix("torch.") for d in weights.dtypes())),
                     self.load_seconds, self.load_peak_mib)
            if new.templates:
                log.info("new (not in the checkpoint), initialised from seed %d: %s", config.seed,
                         ", ".join(sorted(new.templates)))
            if whole_plan.unused:
                log.info("not used (this task's model has no such weight): %s", ", ".join(whole_plan.unused))
        return model

    @staticmethod
    def _held_names(tied: list[tuple[str, ...]], model: nn.Module) -> dict[str, str]:
        """For each weight shared across pipeline stages: the name this stage holds it by -> its first name."""
        held = dict(model.named_parameters())
        return {name: names[0] for names in tied for name in names if name in held}

    def _build_optimizer(self) -> None:
        config = self.config
        if config.engine == "deepspeed":
            from .parallel.deepspeed_engine import DeepSpeedEngine

            self.deepspeed = DeepSpeedEngine(self.model, config, self.layout, self.precision)
            self.model = self.deepspeed.engine  # forwards go through DeepSpeed (ZeRO-3 gathers parameters there)
            optimizer = self.deepspeed.optimizer
        else:
            if config.sharding != "optimizer":  # ZeRO-1's was made with the model (it holds the parameters)
                self.optimizer = DataParallelAdamW(self.model, self.layout, config.weight_decay, config.lr,
                                                   config.adam_betas, config.adam_eps,
                                                   self._held_names(self.tied, self.model))
            optimizer = self.optimizer.optimizer
        self.steps_per_epoch = len(self.batches)
        self.total_steps = config.max_steps or max(1, math.ceil(config.epochs * self.steps_per_epoch))
        warmup = config.warmup_steps or math.ceil(config.warmup_ratio * self.total_steps)
        try:
            self.scheduler = transformers.get_scheduler(config.lr_scheduler, optimizer,
                                                        num_warmup_steps=warmup,
                                                        num_training_steps=self.total_steps)
        except ValueError as exc:
            raise UserError(f"lr_scheduler={config.lr_scheduler!r}: {str(exc).splitlines()[0]}") from None
        self.scaler = DynamicLossScaler(self.precision == "fp16" and self.deepspeed is None, config.initial_loss_scale,
                                        config.loss_scale_growth_interval)

    # ------------------------------------------------------------------------------------------- training
    def loss_sum(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed (not averaged) loss of a micro-batch, in fp32."""
        if self.config.task == "classification":
            return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
        targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                               reduction="sum")

    def loss_count(self, indices: list[int]) -> int:
        """What the loss of a global batch is averaged over: samples, or predicted tokens."""
        if self.config.task == "classification":
            return len(indices)
        return sum(self.train_lengths[i] - 1 for i in indices)

    def micro_batch(self, indices: list[int], ids: list | None = None, labels: list | None = None) -> dict:
        tokenizer = self.data.tokenizer
        ids, labels = (self.train_ids, self.train_labels) if ids is None else (ids, labels)
        batch = data_module.collate([ids[i] for i in indices], tokenizer.pad_token_id, tokenizer.padding_side,
                                    [labels[i] for i in indices] if labels is not None else None,
                                    # a pipeline keeps one schedule per shape: fewer lengths, fewer schedules
                                    pad_to_multiple_of=PAD_MULTIPLE if self.pipeline is not None else 1)
        return {k: v.to(self.layout.device, non_blocking=True) for k, v in batch.items()}

    def targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the loss compares the logits with: labels, or the next tokens with padding ignored."""
        if self.config.task == "classification":
            return batch["labels"]
        return batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)

    def _autocast(self):
        return autocast(self.precision, self.layout.device)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Logits (under pipeline parallelism: on the last stage; None on the others)."""
        if self.pipeline is not None:
            return self.pipeline.forward(batch)
        with self._autocast():
            return self.model(**model_inputs(batch)).logits

    def _set_gradient_sync(self, enabled: bool) -> None:
        """FSDP reduce-scatters in every backward unless told not to: only the last micro-batch's should."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(enabled)

    def train_step(self, global_batch: list[int]) -> dict:
        config, layout = self.config, self.layout
        started = time.perf_counter()
        count = self.loss_count(global_batch)
        engine = self.deepspeed
        scale = self.scaler.scale if engine is None else engine.loss_scale
        backward = (lambda loss: (loss * scale).backward()) if engine is None else engine.backward
        local_loss = torch.zeros((), device=layout.device)
        micro_batches = data_module.local_micro_batches(global_batch, layout.dp_rank, layout.dp,
                                                        config.gradient_accumulation_steps)
        for number, indices in enumerate(micro_batches, start=1):
            self._set_gradient_sync(number == len(micro_batches))
            batch = self.micro_batch(indices)
            if self.pipeline is not None:  # forward and backward of every micro-batch, stage by stage
                local_loss += self.pipeline.train(batch, self.targets(batch), scale / count) / scale
                continue
            with offload_context(config.offload_activations, layout.device):
                loss = self.loss_sum(self.forward(batch), batch) / count
            backward(loss)
            local_loss += loss.detach()
        if self.after_backward is not None:
            self.after_backward(self, self.step + 1)
        lr = self.scheduler.get_last_lr()[0]
        if engine is not None:  # DeepSpeed reduces, unscales, clips, updates (or skips) and zeroes the gradients
            grad_norm, skipped = engine.step()
            _, loss, stop = reduce_norm_and_loss([], local_loss, layout.tp, layout.world_size, self.stop_requested)
            # DeepSpeed has applied the step already: the guard can only stop a diverged run here
            self.nonfinite.skip(self.step + 1, loss, math.nan if grad_norm is None else grad_norm,
                                scale if skipped else None)
            if self.state_bytes is None:
                self.state_bytes = engine.state_bytes()
        else:
            self.optimizer.sync_gradients()
            sync_tied_gradients(self.model, self.tied, self.parallel.tied_shapes, layout)
            pieces = self.optimizer.gradient_pieces()
            # One collective: global norm (inf/NaN if any rank overflowed, so all skip together) and global loss.
            grad_norm, loss, stop = reduce_norm_and_loss(pieces, local_loss, layout.tp, layout.world_size,
                                                         self.stop_requested)
            grad_norm /= scale
            skipped = self.scaler.update(not math.isfinite(grad_norm))
            # Never apply a NaN/inf step, in any precision; max_nonfinite_steps of them in a row stop the run.
            skipped = self.nonfinite.skip(self.step + 1, loss, grad_norm,
                                          scale if self.scaler.enabled else None) or skipped
            if not skipped:
                clip = config.max_grad_norm
                coefficient = min(1.0, clip / (grad_norm + 1e-6)) if clip else 1.0
                scale_gradients([grad for grad, _ in pieces], coefficient / scale)
                self.optimizer.step()
                self.adam_step += 1
                if self.state_bytes is None:  # gradients and optimizer state all exist now: the peak of both
                    self.state_bytes = measure_state_bytes(self.model, self.optimizer.optimizer)
            self.optimizer.zero_grad()
        self.scheduler.step()
        self.step += 1
        self.stop_agreed = stop
        elapsed = time.perf_counter() - started
        lengths = [self.train_lengths[i] for i in global_batch]
        tokens = sum(lengths)
        epoch_padding = self.padding.setdefault(int((self.step - 1) // self.steps_per_epoch), [0, 0])
        epoch_padding[0] += tokens
        epoch_padding[1] += data_module.token_slots(global_batch, self.train_lengths, layout.dp,
                                                    config.gradient_accumulation_steps,
                                                    PAD_MULTIPLE if self.pipeline is not None else 1)
        tflops, mfu = achieved(self.flops.batch(lengths), elapsed, layout.world_size, self.peak_tflops)
        # A skipped step's norm is not a number worth logging (and differs between ranks when one overflowed).
        return {"step": self.step, "epoch": self.step / self.steps_per_epoch, "loss": float(loss), "lr": lr,
                "grad_norm": None if skipped else grad_norm, "loss_scale": scale, "skipped": skipped,
                "samples_per_s": len(global_batch) / elapsed, "tokens_per_s": tokens / elapsed,
                "tflops_per_device": tflops, "mfu": mfu, "step_time_s": elapsed}

    def fit(self) -> list[dict]:
        config = self.config
        reporter = Reporter(self.output_dir, self.total_steps, config.log_every, self.layout.is_main,
                            resumed_at=self.step)
        self.reporter = reporter
        log.info("training %d steps (%d per epoch), global batch %d = %d dp x %d accumulation x %d, precision %s",
                 self.total_steps, self.steps_per_epoch, config.batch_size, self.layout.dp,
                 config.gradient_accumulation_steps,
                 config.batch_size // (self.layout.dp * config.gradient_accumulation_steps), self.precision)
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
                        log.info("stopping after step %d as asked (SIGTERM); resume=auto continues from the "
                                    "checkpoint", self.step)
                        return self.history
                    if self.step >= self.total_steps:
                        break
        return self.history

    def checkpoint_due(self) -> bool:
        if self.config.engine != "torch":
            return False
        every = self.config.checkpoint_every
        return self.stop_agreed or self.step >= self.total_steps or bool(every and self.step % every == 0)

    def save_checkpoint(self) -> Path | None:
        if self.nonfinite.bad_steps:  # weights that just gave a NaN/inf loss or gradient are not worth resuming
            log.warning("checkpoint at step %d not written: the loss or gradient norm of step %d was not finite",
                        self.step, self.nonfinite.bad_steps[-1])
            return None
        with self.timer("checkpoint"):
            return checkpoint.save(self, self.checkpoint_root)

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
        chunks = [order[i:i + config.eval_batch_size] for i in range(0, len(order), config.eval_batch_size)]
        predictions: list[tuple[int, int]] = []
        totals = torch.zeros(2, dtype=torch.float64, device=layout.device)  # loss sum, count
        mine = chunks[layout.dp_rank::layout.dp]
        # Under FSDP and ZeRO-3 a forward all-gathers parameters over the data-parallel ranks, so all of them
        # run the same number: a rank short of a chunk runs the first one again and scores it nowhere.
        rounds = -(-len(chunks) // layout.dp)
        for number, chunk in enumerate(mine + [chunks[0]] * (rounds - len(mine))):
            batch = self.micro_batch(chunk, ids, labels)
            logits = self.forward(batch)
            if number >= len(mine) or logits is None:  # a repeat, or a pipeline stage that is not the last
                continue
            totals[0] += self.loss_sum(logits, batch).double()
            if labels is not None:
                totals[1] += len(chunk)
                predictions.extend(zip(chunk, logits.argmax(-1).tolist()))
            else:
                totals[1] += batch["attention_mask"][:, 1:].sum()
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
        accuracy = load_metric("accuracy").compute(predictions=[by_row[i] for i in ordered],
                                                   references=[labels[i] for i in ordered])["accuracy"]
        return {"eval_loss": mean_loss, "accuracy": accuracy}

    # ------------------------------------------------------------------------------------------- outputs
    def export(self, out: Path | None = None) -> Path | None:
        """The model as a Hugging Face folder: `out`, else (export=true) hf/ in the run folder (on SageMaker, the
        job's model folder, which it uploads to S3 as the model artifact). Every rank calls it."""
        if out is None and not self.config.export:
            return None
        if out is None:
            out = Path(os.environ["SM_MODEL_DIR"]) if "SM_MODEL_DIR" in os.environ else self.output_dir / "hf"
        with self.timer("export"):
            dtype, keep = EXPORT_DTYPES[self.config.export_dtype], self.layout.is_main
            if self.deepspeed is not None:  # from DeepSpeed's fp32 master partitions
                model, state = self.deepspeed.module, self.deepspeed.full_state_dict(dtype, keep)
            elif self.pipeline is not None:  # each stage's first rank gathers its shards, then rank 0 all stages
                keep_stage = self.layout.dp_rank == 0 and self.layout.tp_rank == 0
                part = gather_full_state_dict(self.model, dtype, keep_stage)
                parts: list | None = [None] * self.layout.pp if self.layout.pp_rank == 0 else None
                dist.gather_object(part, parts, group=self.layout.pp_group, group_dst=0)
                model, state = self.model, {k: v for piece in parts or [] for k, v in piece.items()}
            else:
                model, state = self.model, gather_full_state_dict(self.model, dtype, keep)
            # rank 0 writes; its failure (NaN weights, a full disk) is every rank's one-line error
            rank0_decides(self.layout, lambda: save_hf(model, self.family.to_hf_state_dict(state, model.config),
                                                       self.data.tokenizer, out))
            log.info("exported a Hugging Face model to %s", out)
        return out

    def summary(self, results: dict) -> dict:
        layout = self.layout
        memory = [None] * layout.world_size
        dist.all_gather_object(memory, round(peak_memory_mib(layout.device), 1))
        load_peaks = [None] * layout.world_size
        dist.all_gather_object(load_peaks, round(self.load_peak_mib, 1))
        state_bytes = [None] * layout.world_size
        dist.all_gather_object(state_bytes, self.state_bytes)
        trained = self.history
        train_seconds = sum(r["step_time_s"] for r in trained) or float("nan")
        samples = len(trained) * self.config.batch_size
        return {
            **results,
            "task": self.config.task,
            "family": self.family.name,
            "model": (f"tiny {self.family.name} (from config)" if self.config.size == "tiny"
                      else self.config.model or self.family.default_model),
            "data": self.data.source.description,
            "steps": self.step,
            "skipped_steps": sum(r["skipped"] for r in trained),
            "final_loss": trained[-1]["loss"] if trained else None,
            "train_samples_per_s": samples / train_seconds,
            "train_tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in trained) / train_seconds,
            # model FLOPs of all trained steps over their time: the run's mean, not the mean of per-step MFUs
            "train_tflops_per_device": (tflops := sum(r["tflops_per_device"] * r["step_time_s"] for r in trained)
                                        / train_seconds),
            "mfu": tflops / self.peak_tflops,
            "peak_tflops_per_device": self.peak_tflops,
            "padding_fraction": padding_fraction(self.padding.values()),
            "padding_fraction_per_epoch": {epoch: padding_fraction([counts])
                                           for epoch, counts in sorted(self.padding.items())},
            "layout": layout.describe(),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "precision": self.precision,
            "engine": self.config.engine,
            **({"zero_stage": self.deepspeed.zero_stage} if self.deepspeed is not None else {}),
            "seconds": {k: round(v, 3) for k, v in self.timer.seconds.items()},
            "peak_memory_mib_per_rank": memory,
            # when the model was ready, before the first step: process peak RSS (CPU) or allocated bytes (CUDA)
            "load_peak_mib_per_rank": load_peaks,
            "load_seconds": round(self.load_seconds, 3),
            "state_bytes_per_rank": state_bytes,
            "versions": package_versions(),
        }


def padding_fraction(counts) -> float | None:
    """Share of the token slots that were padding, from [real tokens, slots] pairs."""
    real, slots = (sum(c[i] for c in counts) for i in (0, 1))
    return 1 - real / slots if slots else None


def run(config: Config, after_backward: Callable | None = None) -> dict:
    """Train, evaluate, export and report: what `scripts/train.py` does. Returns summary.json's content."""
    trainer = Trainer(config, after_backward)
    signal.signal(signal.SIGTERM, trainer.request_stop)
    try:
        trainer.setup()
        trainer.fit()
        if trainer.stop_agreed:
            shutdown()
            return {"stopped_at_step": trainer.step}
        with trainer.timer("eval"):
            results = trainer.evaluate()
        trainer.reporter.evaluation(trainer.step, results)
        trainer.reporter.close()
        trainer.export()
        summary = trainer.summary(results)
        if trainer.layout.is_main:
            write_json(trainer.output_dir / "summary.json", summary)
            log.info("done: %s | %s", ", ".join(f"{k} {v:.4f}" for k, v in results.items()),
                     ", ".join(f"{k} {v:.1f}s" for k, v in summary["seconds"].items()))
            log.info("outputs in %s", trainer.output_dir)
        shutdown()
        return summary
    except BaseException as exc:
        if trainer.reporter is not None:
            trainer.reporter.bar.close()  # ends the progress bar's line: the error gets a line of its own
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = timed_out(exc, config.collective_timeout_s)
        if timeout:  # one line naming the key, not a traceback from the collective
            raise RankError(f"after step {trainer.step}: {timeout}") from None
        raise
    finally:
        if trainer.run_lock is not None:
            trainer.run_lock.release()
