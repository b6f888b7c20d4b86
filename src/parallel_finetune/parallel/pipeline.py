"""Pipeline parallelism with `torch.distributed.pipelining`: the blocks cut into consecutive stages.

Every rank builds the whole model (same seed, so the same weights as one process), then deletes what its
stages do not hold: parameter names stay those of the unsplit model, so checkpoints, export and the optimizer
never depend on the layout. A stage runs a family's `pipeline_embed` (first stage), its blocks, and
`pipeline_head` (last stage); between stages travel the hidden states plus the padding mask and positions,
from which each stage rebuilds the attention mask its blocks need.

Stages are numbered 0..S-1 and placed "looped": stage s on pipeline rank s % pp, so with interleaving
(`virtual_stages` = v > 1) rank r holds stages r, r + pp, r + 2pp, ... and S = pp x v.

`torch.distributed.pipelining` fixes the shapes of its receive buffers on its first step, while our batches
are padded per batch (dynamic padding). So sequences are padded to a multiple of `PAD_MULTIPLE` and one
schedule (with its own stage objects over the same modules) is kept per shape: a handful per run. Padding
changes no result: padded positions are masked out of attention, pooling and the loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..data.batch import Batch
from ..errors import UserError
from ..families.base import Family, has_module
from ..interfaces import Objective, Stats, joined
from ..tasks.task import HeadKind

log = logging.getLogger(__name__)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
PAD_MULTIPLE = 8


@dataclass(frozen=True)
class Stage:
    index: int
    blocks: tuple[int, ...]  # block numbers in the unsplit model
    first: bool
    last: bool


def stage_costs(model: nn.Module, family: Family) -> tuple[list[int], int]:
    """Per-block compute cost and the head's, in multiply-accumulates per token (= parameters of matrices a token
    goes through). An embedding lookup costs no matmul; a vocabulary-sized LM head costs about one block or more."""
    blocks = [sum(p.numel() for p in block.parameters() if p.ndim >= 2) for block in family.blocks(model)]
    head = sum(
        model.get_submodule(path).weight.numel()
        for path in family.last_stage_modules
        if has_module(model, path)
        and getattr(model.get_submodule(path), "weight", None) is not None
        and model.get_submodule(path).weight.ndim >= 2
    )
    return blocks, head


def balanced_partition(block_costs: list[int], head_cost: int, stages: int) -> list[int]:
    """Blocks per stage (each at least one, in order) minimising the largest stage cost, the head counting
    on the last stage: exact dynamic programme over the cut points."""
    n = len(block_costs)
    prefix = [0]
    for cost in block_costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: smallest possible max cost putting the first i blocks on s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = prefix[i] - prefix[j] + (head_cost if s == stages else 0)
                value = max(best[s - 1][j], cost)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


def check_stages(n_blocks: int, pp: int, virtual: int, partition) -> None:
    """One-line errors for a split that cannot exist; runs at --check (no model built) and again at setup."""
    stages = pp * virtual
    if stages > n_blocks:
        raise UserError(
            f"pipeline_parallel_degree={pp}"
            + (f" x virtual_stages={virtual}" if virtual > 1 else "")
            + f" = {stages} stages for a model of {n_blocks} blocks: at most one stage per block; "
            f"use fewer stages or more layers"
        )
    if partition != "auto" and (len(partition) != stages or sum(partition) != n_blocks):
        raise UserError(
            f"partition={list(partition)}: needs {stages} entries (one per stage) adding up to the "
            f"model's {n_blocks} blocks, e.g. {balanced_partition([1] * n_blocks, 0, stages)}"
        )


def plan_stages(model: nn.Module, family: Family, pp: int, virtual: int, partition) -> list[Stage]:
    """All S = pp x virtual stages, from `partition` ('auto' or blocks per stage); errors name the key."""
    n_blocks, stages = len(family.blocks(model)), pp * virtual
    check_stages(n_blocks, pp, virtual, partition)
    if partition == "auto":
        block_costs, head_cost = stage_costs(model, family)
        counts = balanced_partition(block_costs, head_cost, stages)
    else:
        counts = list(partition)
    result, start = [], 0
    for index, count in enumerate(counts):
        result.append(Stage(index, tuple(range(start, start + count)), index == 0, index == stages - 1))
        start += count
    return result


def describe_stages(stages: list[Stage], pp: int) -> str:
    parts = []
    for stage in stages:
        blocks = f"blocks {stage.blocks[0]}-{stage.blocks[-1]}" if len(stage.blocks) > 1 else f"block {stage.blocks[0]}"
        what = ("embeddings + " if stage.first else "") + blocks + (" + head" if stage.last else "")
        parts.append(f"stage {stage.index} (rank {stage.index % pp}): {what}")
    return "; ".join(parts)


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names that share one Parameter (GPT-2 and GPT-Neo tie the LM head to the token embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def cut_model(model: nn.Module, family: Family, mine: list[Stage]) -> None:
    """Delete, in place, every block and end module that none of this rank's stages holds."""
    keep = {number for stage in mine for number in stage.blocks}
    container = model.get_submodule(family.block_path)
    parent_path, _, attr = family.block_path.rpartition(".")
    kept = nn.ModuleDict({str(i): block for i, block in enumerate(container) if i in keep})
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, kept)
    for holds, paths in (
        (any(s.first for s in mine), family.first_stage_modules),
        (any(s.last for s in mine), family.last_stage_modules),
    ):
        if holds:
            continue
        for path in paths:
            if has_module(model, path):
                parent, _, name = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, name, None)


class StageForward(nn.Module):
    """What one stage computes. First stage in: (input_ids, attention_mask, position_ids[, token_type_ids]); every
    stage out: (hidden, attention_mask, position_ids), the last one a classifier's logits or a language model's
    final hidden states (its head runs with the loss: loop/loss.py's HiddenTokenLoss). Token type ids (BERT's
    sentence pairs)
    are needed by the embeddings only, so only the first stage takes them. `packed` (set by the Pipeline for each
    batch): the positions restart at every row of a packed batch, which the attention mask follows, and a
    classifier's logits are those of every position."""

    def __init__(self, model: nn.Module, family: Family, stage: Stage, classifier: bool):
        super().__init__()
        self.model, self.family, self.stage, self.classifier = model, family, stage, classifier
        holder = model.get_submodule(family.block_path)
        self.blocks = [holder[str(number)] for number in stage.blocks]
        self.packed = False

    def forward(self, first, attention_mask, position_ids, token_type_ids=None):
        model, family = self.model, self.family
        if self.stage.first:  # token types only when there are some: a family without them keeps a 3-argument embed
            types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            hidden = family.pipeline_embed(model, first, position_ids, **types)
        else:
            hidden = first
        mask = family.pipeline_mask(model, hidden, attention_mask, position_ids, packed=self.packed)
        for block in self.blocks:
            hidden = family.pipeline_block(block, hidden, mask, position_ids)
        if self.stage.last and not self.classifier:
            return family.pipeline_hidden(model, hidden)
        if self.stage.last and self.packed:
            return family.pipeline_position_head(model, hidden)
        if self.stage.last:
            return family.pipeline_head(model, hidden, attention_mask)
        return hidden, attention_mask, position_ids


@dataclass(frozen=True)
class PipelineSettings:
    """What a run's pipeline runs: the schedule (`pipeline_schedule`), micro-batches per accumulation slice, the
    task, whether the first stage also takes token type ids (sentence pairs, BERT), and whether training batches
    are packed (`packing`: the stages then build masks from the restarting positions)."""

    schedule: str
    microbatches: int
    head: HeadKind  # the head (resolve.Resolved.head)
    objective: Objective  # the head's (loss.objective_for) or a pair objective; a language model's takes hidden states
    token_types: bool = False
    packing: bool = False
    pad_multiple: int = 1  # data.pad_to_multiple_of: the pipeline pads to a multiple of it and of PAD_MULTIPLE


class Pipeline:
    """This rank's stages and the schedules that run them, one per (rows, sequence length, training): the pipeline
    `interfaces.Runner` (`runner.WholeModel` is the other)."""

    def __init__(
        self,
        model: nn.Module,
        family: Family,
        stages: list[Stage],
        layout,
        settings: PipelineSettings,
        autocast: Callable,
        loss_scale: Callable[[], float],
    ):
        self.layout, self.schedule_name, self.microbatches = layout, settings.schedule, settings.microbatches
        # a schedule per shape: fewer distinct lengths, fewer schedules
        self.pad_multiple = math.lcm(PAD_MULTIPLE, settings.pad_multiple)
        self.autocast = autocast  # () -> the precision's autocast context
        self.objective = settings.objective
        self.loss_scale = loss_scale  # () -> the fp16 scale of this step
        self.token_types = settings.token_types  # the first stage also takes token type ids (sentence pairs, BERT)
        self.n_stages = len(stages)
        self.mine = [s for s in stages if s.index % layout.pp == layout.pp_rank]
        classifier = settings.head is HeadKind.CLASSIFICATION
        self.modules = [StageForward(model, family, stage, classifier) for stage in self.mine]
        if settings.packing:
            family.prepare_packing(model)
        self.is_first = any(s.first for s in self.mine)
        self.is_last = any(s.last for s in self.mine)
        self.loss_factor = 1.0  # loss scale / global count, set before every step
        # the statistics of the objective's calls in the schedule's step under way (last stage): the schedule's
        # loss_fn must return a tensor, so the runner keeps them itself and train() hands them back
        self._step_stats: list[Stats] = []
        self._schedules: dict[tuple, object] = {}

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss, stats = self.objective(logits, target)
        self._step_stats.append(stats)
        return loss * self.loss_factor

    def _schedule(self, rows: int, length: int, training: bool, packed: bool = False):
        for module in self.modules:
            module.packed = packed
        key = (rows, length, training, packed)
        if key not in self._schedules:
            microbatches = self.microbatches if training else 1
            stages = []
            for module in self.modules:
                inputs, outputs = self._examples(module, rows // microbatches, length, training)
                stages.append(
                    PipelineStage(
                        module,
                        module.stage.index,
                        self.n_stages,
                        self.layout.device,
                        input_args=inputs,
                        output_args=outputs,
                        group=self.layout.pp_group,
                    )
                )
            kind = SCHEDULES[self.schedule_name]
            if not training and kind is Schedule1F1B:  # forward only: 1F1B is GPipe (and needs m >= stages)
                kind = ScheduleGPipe
            loss_fn = self._loss if training else None
            try:
                if kind is ScheduleInterleaved1F1B:
                    schedule = kind(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
                else:
                    schedule = kind(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
            except ValueError as exc:
                raise UserError(
                    f"pipeline_schedule={self.schedule_name} with microbatches={microbatches}: "
                    f"{str(exc).splitlines()[0]}"
                ) from None
            self._schedules[key] = schedule
        return self._schedules[key]

    def _examples(self, module: StageForward, rows: int, length: int, training: bool) -> tuple[tuple, tuple]:
        """Example inputs and outputs of a stage for one micro-batch shape. Given up front, they spare the
        library's own shape inference, which runs each stage on uninitialised buffers: garbage positions
        index out of range."""
        device, config = self.layout.device, module.model.config
        dtype = next(module.model.parameters()).dtype  # what a block's residual stream is kept in
        mask = torch.ones(rows, length, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device).expand(rows, length).contiguous()
        hidden = torch.zeros(rows, length, config.hidden_size, dtype=dtype, device=device)
        first = torch.zeros_like(mask) if module.stage.first else hidden.clone().requires_grad_(training)
        inputs = (first, mask, positions)
        if module.stage.first and self.token_types:
            inputs += (torch.zeros_like(mask),)
        if module.stage.last:
            devices = [device] if device.type == "cuda" else []
            # a real forward on dummy inputs gives the logits' shape and dtype; its dropout must not move the RNG
            with torch.random.fork_rng(devices=devices), torch.no_grad(), self.autocast():
                logits = module(*inputs)
            outputs = (logits.detach().requires_grad_(training),)
        else:
            outputs = (hidden.clone().requires_grad_(training), mask, positions)
        return inputs, outputs

    def inputs(self, batch: Batch) -> tuple:
        """What the first stage takes; the other stages receive theirs. A packed batch's positions restart at
        every row."""
        inputs = batch.input_ids, batch.attention_mask, batch.positions
        return (*inputs, batch.token_type_ids) if self.token_types else inputs

    def train(self, batch: Batch, count: int, last: bool) -> tuple[torch.Tensor, Stats]:
        """Forward and backward of one batch over all stages; returns this rank's share of the loss (summed over
        the batch, divided by the global `count`), nonzero on the last stage only, and the objective's statistics
        of the batch's micro-batches (empty on the other stages). Gradients accumulate in the parameters' .grad
        (every micro-batch of the pipeline; `last` changes nothing here)."""
        schedule = self._schedule(batch.rows, batch.length, training=True, packed=batch.packed)
        scale = self.loss_scale()
        self.loss_factor = scale / count
        target = batch.loss_target()
        losses: list[torch.Tensor] = []
        self._step_stats = []
        with self.autocast():
            if self.is_first:
                schedule.step(*self.inputs(batch), target=target if self.is_last else None, losses=losses)
            elif self.is_last:
                schedule.step(target=target, losses=losses)
            else:
                schedule.step()
        stats, self._step_stats = joined(self._step_stats), []
        total = float(sum(loss.detach().double() for loss in losses)) if losses else 0.0
        return torch.tensor(total / scale, device=self.layout.device), stats

    @torch.no_grad()
    def output(self, batch: Batch) -> torch.Tensor | None:
        """The last stage's output (None elsewhere): a classifier's logits, a language model's final hidden
        states."""
        schedule = self._schedule(batch.rows, batch.length, training=False, packed=batch.packed)
        with self.autocast():
            out = schedule.step(*self.inputs(batch)) if self.is_first else schedule.step()
        return out if self.is_last else None

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits on the last stage (None elsewhere): a language model's at every position (its head applied to
        the final hidden states: what an export is compared with, not what training or evaluation need)."""
        out = self.output(batch)
        if out is None or not self.objective.takes_hidden:
            return out
        with self.autocast():
            return self.objective.logits(out)

    @torch.no_grad()
    def loss(self, batch: Batch) -> tuple[torch.Tensor | None, Stats]:
        """The summed loss and its statistics on the last stage ((None, {}) elsewhere), without gradients
        (evaluation)."""
        out = self.output(batch)
        if out is None:
            return None, {}
        with self.autocast():
            return self.objective(out, batch.loss_target())

    @torch.no_grad()
    def last_logits(self, batch: Batch) -> torch.Tensor | None:
        """A language model's logits at each row's last position, on the last stage (None elsewhere): its head
        applied to that position only (generation)."""
        hidden = self.output(batch)
        if hidden is None:
            return None
        last = batch.last_positions()
        with self.autocast():
            return self.objective.logits(hidden[torch.arange(batch.rows, device=hidden.device), last])


def sync_tied_gradients(model: nn.Module, tied: list[tuple[str, ...]], shapes: dict[str, torch.Size], layout) -> None:
    """A weight shared by the first and the last stage (tied embedding and LM head) lives on both: summing its
    two gradients over the pipeline group gives each the single-process gradient, so both copies stay equal."""
    if layout.pp == 1:
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in tied:
        held = next((params[name] for name in names if name in params), None)
        grad = held.grad if held is not None and held.grad is not None else None
        buffer = grad if grad is not None else torch.zeros(shapes[names[0]], device=layout.device)
        dist.all_reduce(buffer, group=layout.pp_group)


def check_microbatches(batch_rows: int, microbatches: int) -> None:
    if batch_rows % microbatches:
        raise UserError(
            f"microbatches={microbatches} does not divide the {batch_rows} sequences each pipeline "
            f"step gets (batch_size / (data-parallel degree x gradient_accumulation_steps)); use a "
            f"divisor of {batch_rows}"
        )
