"""Parallelism applied to an unmodified transformers model: pipeline stages, tensor parallel, activation
checkpointing, compilation and sharding, in that order, all while the parameters are still on the `meta`
device (nothing is allocated until `weights.materialize`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import MemorySection, ParallelSection, TrainingSection
from ..families.base import Family
from ..model import lora, quantize
from .fsdp import apply_fsdp
from .layout import Layout
from .memory import apply_activation_checkpointing
from .pipeline import Stage, cut_model, describe_stages, plan_stages, tied_parameters
from .tensor import apply_tp

if TYPE_CHECKING:
    from ..tasks.task import HeadKind

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    """What the training loop needs to know of how the model was split."""

    stages: list[Stage] = field(default_factory=list)  # every pipeline stage (this rank holds those % pp == pp_rank)
    tied: list[tuple[str, ...]] = field(default_factory=list)  # weights shared by the first and last stage
    tied_shapes: dict[str, torch.Size] = field(default_factory=dict)  # their global shapes, by first name
    lora: list[str] = field(default_factory=list)  # peft=lora: the adapters' parameters this rank holds
    trainable: set[str] | None = None  # peft=lora: the parameters that train (adapters, head); None = all
    quantized: list[quantize.Pending] = field(default_factory=list)  # QLoRA: weights quantized as loaded
    compiled: bool = False  # the blocks go through torch.compile (`compiled_graphs` counts what it compiled)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A run's model: this rank's place in the layout, the recipe's sections that say how it is split and trained,
    the values resolved for the run (resolve.Resolved's precision, autocast dtype and micro-batches; the compile
    decision), DeepSpeed's config (ZeRO-3 partitions the model as it is built)."""

    layout: Layout
    parallel: ParallelSection  # the pipeline's schedule, stages and partition; the engine
    memory: MemorySection  # activation checkpointing
    training: TrainingSection  # AdamW's settings: ZeRO-1's optimizer is made with the model (it holds the parameters)
    precision: str = "fp32"  # fp16 | bf16 | fp32, resolved
    autocast_dtype: torch.dtype | None = None  # FSDP's all-gather dtype and LoRA's frozen weights'; None in fp32
    microbatches: int = 1  # a pipeline's, per accumulation slice
    compile: bool = False  # torch.compile each block (config.compile_decision resolved `auto`)
    deepspeed_config: dict | None = None


def parallelize(
    model: nn.Module, family: Family, placement: Placement, *, head: HeadKind, adapters: lora.LoraSettings | None
) -> Parallelized:
    """Pipeline cut -> TP -> LoRA's `adapters` -> activation checkpointing -> compile -> FSDP, in place, as
    `placement` says; parameter names stay those of the unsplit model. `head`: the model's last layer (a pipeline's last
    stage holds its head)."""
    layout, parallel = placement.layout, placement.parallel
    result = Parallelized()
    n_blocks = len(family.blocks(model))
    if layout.pp > 1:
        family.check_pipeline(model.config, head)
        virtual = parallel.virtual_stages if parallel.pipeline_schedule == "interleaved" else 1
        result.stages = plan_stages(model, family, layout.pp, virtual, parallel.partition)
        result.tied = tied_parameters(model)
        result.tied_shapes = {names[0]: model.get_parameter(names[0]).shape for names in result.tied}
        cut_model(model, family, [s for s in result.stages if s.index % layout.pp == layout.pp_rank])
        log.info(
            "pipeline: %s schedule, %d micro-batches | %s",
            parallel.pipeline_schedule,
            placement.microbatches,
            describe_stages(result.stages, layout.pp),
        )
    apply_tp(model, family, layout.tp_mesh)
    if adapters is not None:  # after TP (adapters placed like their layer), before checkpointing/compile/FSDP
        result.lora = lora.apply_lora(model, family, adapters, layout.tp_mesh)
        result.trainable = lora.trainable_names(model, result.lora, adapters)
        lora.freeze_base(model, result.trainable, placement.autocast_dtype)
        if adapters.quantization is not None:  # still on meta: each weight is quantized as its block is read
            fsdp_mesh = layout.fsdp_mesh if layout.dims.fsdp else None  # FSDP2 shards the NF4 weights too
            result.quantized = quantize.prepare(model, family, adapters.quantization, fsdp_mesh)
        # a frozen weight shared by the first and last stage has no gradient to sum
        result.tied = [names for names in result.tied if set(names) & result.trainable]
    checkpointed = apply_activation_checkpointing(
        family.blocks(model), placement.memory.activation_checkpointing, family.block_numbers(model)
    )
    if checkpointed:
        log.info(
            "activation checkpointing: blocks %s of %d%s",
            checkpointed,
            n_blocks,
            " (this stage's)" if layout.pp > 1 else "",
        )
    if placement.compile:
        compile_blocks(family.blocks(model))
        result.compiled = True
        log.info(
            "compile: each of the %d transformer blocks%s compiled on first use (torch.compile)",
            len(family.blocks(model)),
            " of this stage" if layout.pp > 1 else "",
        )
    if layout.dims.fsdp:
        apply_fsdp(model, family.blocks(model), layout, placement.autocast_dtype)
    return result


def compiled_graphs() -> int:
    """How many graphs torch.compile compiled for the blocks in this process so far (dynamo's count of unique
    graphs, less QLoRA's compiled dequantization's, which load_model compiles on CUDA)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"] - quantize.compiled_graphs()


def compile_blocks(blocks: list[nn.Module]) -> None:
    """Regional compilation: `Module.compile` swaps each block's call for a compiled one, keeping the module and
    its parameter names. The blocks run the same code, so dynamo traces it once for all of them, for any sequence
    length (dynamic padding changes it every step), plus once for evaluation (no gradients). Activation
    checkpointing, applied before, is traced into the graph."""
    for block in blocks:
        block.compile(dynamic=True)
