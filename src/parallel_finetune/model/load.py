"""The one way a model is made: built on `meta`, split by `parallelize`, then only this rank's shards allocated
and loaded (weights.py). A run, resume (its checkpoint read on top by checkpoint.py), the offline export of a
checkpoint, the tests and the benchmarks all call `load_model`."""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..families.base import Family, has_module
from ..parallel import Parallelized, Placement, parallelize
from ..parallel.hardware import peak_memory_mib
from ..parallel.layout import Engine
from ..parallel.memory import nf4_bytes
from ..parallel.pipeline import stage_costs
from ..parallel.tensor import keep_gradients_sharded
from ..parallel.zero import ZeroAdamW, zero_adamw
from . import lora, quantize
from .throughput import ModelFlops, attention_width, model_flops
from .weights import LoadPlan, NewWeights, load_weights, local_tensor, materialize, plan_load, plan_whole, shard_box

if TYPE_CHECKING:
    from ..tasks.task import HeadKind

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parameter_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Global (unsplit) shapes by name: what identifies a model whatever the layout."""
    return {name: list(param.shape) for name, param in model.named_parameters()}


@dataclass
class ReadyModel:
    model: nn.Module
    parallel: Parallelized
    parameter_shapes: dict[str, list[int]]  # of the unsplit model: layout-neutral (checkpoints check them)
    flops: ModelFlops
    zero_adamw: ZeroAdamW | None  # sharding=optimizer: made first, its flat buffers hold the parameters
    load_seconds: float
    memory_before_load_mib: float
    load_peak_mib: float  # when the model is ready: no gradients, no optimizer state yet
    loaded: Loaded  # what was loaded from where (`log_loaded` says it)


@dataclass
class Loaded:
    """What `load_model` read and made, for the lines a run logs about it (`log_loaded`)."""

    parameters: int  # of the unsplit model, adapters not counted
    source: str | None  # the weights' description (None: none read)
    dtypes: list[str]  # of the weights read, e.g. ["float32"]
    new: list[str]  # initialised from the seed: not in the checkpoint
    unused: list[str]  # in the checkpoint, but this task's model has no such weight
    adapters: dict[str, list[int]]  # peft=lora: the planned adapters' shapes


def load_model(
    family: Family,
    head: HeadKind,
    hf_config,
    pretrained: str | None,
    *,
    seed: int,
    adapters: lora.LoraSettings | None = None,
    placement: Placement | None = None,
    from_checkpoint: bool = False,
) -> ReadyModel:
    """The model `hf_config` describes, its values loaded:

        weights -> build on `meta` -> plan (the unsplit model's) -> new weights from the seed -> parallelize
        -> allocate this rank's shards (materialize) -> load (plan this rank's blocks, read them)

    `pretrained`: a Hugging Face model folder, or None: a tiny model, whose "checkpoint" is the unmodified
    transformers model initialised in memory from `seed`. `placement`: a run's (what `parallelize` reads); None: a
    world of one, whole, on the CPU, not parallelized (export, tests, benchmarks). `adapters`: peft=lora's
    (resolve.Resolved.lora: planned, initialised from the seed; None: no adapters). `from_checkpoint`: a run's
    checkpoint supplies the values, read on top by checkpoint.py (as resume does, with everything else it holds):
    the base is read here only for what it lacks (LoRA's: the frozen base), else the parameters are allocated
    only. QLoRA on CUDA: each layout of its NF4 weights' dequantization compiled before it returns (not in a
    timed step). Quiet but for a run's tiny model's size and that compile: a run logs what was loaded with
    `log_loaded`."""
    seed_everything(seed)  # identical initialisation on every rank and in every layout
    device = placement.layout.device if placement is not None else torch.device("cpu")
    started, before = time.perf_counter(), peak_memory_mib(device)
    settings = adapters
    weights = None
    if from_checkpoint and settings is None:
        model, aliases, whole_plan = family.build(head, hf_config), {}, LoadPlan()
    else:
        weights, model, aliases, whole_plan = plan_whole(family, head, hf_config, pretrained)
    new = NewWeights(model, list(whole_plan.new), seed)
    total = sum(p.numel() for p in model.parameters())
    if placement is not None and pretrained is None:  # here, before parallelize says how it split the model
        dimensions = ", ".join(f"{k}={v}" for k, v in family.tp_dimensions(hf_config).items())
        log.info("model: tiny %s from config (%s), %.2fM parameters", family.name, dimensions, total / 1e6)
    shapes, adapters = parameter_shapes(model), {}
    if settings is not None:
        adapters = _plan_adapters(model, family, settings, new, missing=list(whole_plan.new), source=weights, seed=seed)
        shapes.update(adapters)
    flops = model_flops(*stage_costs(model, family), attention_width(hf_config))
    if settings is not None:  # LoRA: the frozen base at 4 FLOPs a parameter and token, the adapters at 6
        flops = lora_flops(flops, model, family, settings, adapters)
    box_of, write = shard_box, None
    deepspeed_config = placement.deepspeed_config if placement is not None else None
    if deepspeed_config is not None and deepspeed_config["zero_optimization"]["stage"] == 3:
        model, box_of, write = _zero3_model(family, head, hf_config, deepspeed_config, device)
    adamw = None
    if placement is not None:
        parallel = parallelize(model, family, placement, head=head, adapters=settings)
        if (
            Engine(placement.parallel.engine) is Engine.TORCH and placement.layout.dims.zero1
        ):  # the model's only allocation
            adamw = zero_adamw(model, placement.layout, training=placement.training, tied=parallel.tied)
    else:  # a world of one: the adapters only, so that the names are those of a run's checkpoint
        parallel = _adapters_only(model, family, settings)
    materialize(model, device, leave={id(entry.module.weight) for entry in parallel.quantized})
    # QLoRA: each frozen Linear's block quantized as it is read, its full-precision copy dropped
    write, box_of, global_shape = quantize.loading(parallel.quantized, settings, device, box_of, write)
    source, dtypes = None, []
    if weights is not None:
        load_weights(model, plan_load(model, family, weights, aliases, box_of, global_shape), weights, new, write)
        source, dtypes = weights.description, sorted(str(d).removeprefix("torch.") for d in weights.dtypes())
        weights.close()  # (an in-memory or .bin source forgets its tensors, dtypes included)
    keep_gradients_sharded(model)
    if parallel.quantized and not parallel.compiled:  # compiled blocks compile it into their own graphs instead
        _compile_dequantization(model)
    loaded = Loaded(total, source, dtypes, sorted(new.templates), list(whole_plan.unused), adapters)
    seconds = time.perf_counter() - started
    return ReadyModel(model, parallel, shapes, flops, adamw, seconds, before, peak_memory_mib(device), loaded)


def _compile_dequantization(model: nn.Module) -> None:
    """QLoRA on CUDA: each layout of its NF4 weights' dequantization compiled now, not inside the first timed step;
    said once."""
    started = time.perf_counter()
    if layouts := quantize.warm_up(model):
        log.info(
            "qlora: dequantization compiled for %d NF4 weight layouts in %.1f s (before the first step)",
            layouts,
            time.perf_counter() - started,
        )


def _plan_adapters(
    model: nn.Module, family: Family, settings: lora.LoraSettings, new: NewWeights, *, missing: list[str], source, seed
) -> dict[str, list[int]]:
    """LoRA's checks on the unsplit meta model, and its adapters' shapes, their initial values made from `seed`."""
    lora.check_targets(model, family, settings)
    lora.check_new_trained(missing, settings, source.description)
    adapters = lora.planned_shapes(model, family, settings)
    for name, shape in adapters.items():
        new.computed[name] = functools.partial(lora.initial_value, name, shape, seed)
    return adapters


def _zero3_model(family: Family, head: HeadKind, hf_config, deepspeed_config: dict, device: torch.device):
    """DeepSpeed ZeRO-3's model, built again, partitioned as it is built (the meta model gave the names, shapes and
    new weights), with its loader's box and write."""
    from ..parallel.deepspeed_engine import zero3_box, zero3_init, zero3_write

    return family.build(head, hf_config, zero3_init(deepspeed_config, device.type)), zero3_box, zero3_write


def _log_quantized(model: nn.Module, quantization: quantize.NF4Settings) -> None:
    nf4 = quantize.nf4_weights(model)
    full = sum(weight.numel() * weight.element_size() for weight in nf4)
    log.info(
        "qlora: %d Linear weights of this rank's blocks held in NF4 (blocks of %d, scalers double-quantized in "
        "groups of %d): %.2f MiB instead of %.2f MiB in %s; embeddings, norms, biases and heads unquantized",
        len(nf4),
        quantization.block_size,
        quantization.scaler_block_size,
        nf4_bytes(nf4) / 2**20,
        full / 2**20,
        str(nf4[0].dtype).removeprefix("torch.") if nf4 else "-",
    )


def lora_flops(
    flops: ModelFlops, model: nn.Module, family: Family, settings: lora.LoraSettings, adapters: dict[str, list[int]]
) -> ModelFlops:
    """`flops` of the whole model under LoRA: the matrices stage_costs counts that lora_modules_to_save does not
    name are frozen; the planned adapters (every A and B) are trained (throughput.py's convention)."""
    heads = tuple(f"{m}." for m in settings.modules_to_save)
    counted = [
        (f"{path}.weight", model.get_submodule(path).weight)
        for path in family.last_stage_modules
        if has_module(model, path) and getattr(model.get_submodule(path), "weight", None) is not None
    ]
    for block in family.blocks(model):
        prefix = next(name for name, module in model.named_modules() if module is block)
        counted += [(f"{prefix}.{name}", p) for name, p in block.named_parameters()]
    trained = sum(p.numel() for name, p in counted if p.ndim >= 2 and name.startswith(heads))
    adapter = sum(math.prod(shape) for shape in adapters.values())
    return flops.with_adapters(flops.matmul_params - trained, adapter)


def _adapters_only(model: nn.Module, family: Family, settings: lora.LoraSettings | None) -> Parallelized:
    """A world of one's model (not parallelized): LoRA's adapters, QLoRA's quantized Linears (still on meta)."""
    parallel = Parallelized()
    if settings is not None:
        parallel.lora = lora.apply_lora(model, family, settings, None)
        parallel.trainable = lora.trainable_names(model, parallel.lora, settings)
        if settings.quantization is not None:
            parallel.quantized = quantize.prepare(model, family, settings.quantization)
    return parallel


def log_loaded(
    ready: ReadyModel,
    family: Family,
    placement: Placement,
    *,
    adapters: lora.LoraSettings | None,
    model_name: str | None,
    seed: int,
) -> None:
    """A run's lines about its loaded model: a full-size one's source (`model_name`, resolve.Resolved's; None at
    size=tiny), dtypes, load time and peak, and what was new (from `seed`) or not used; LoRA's adapters and
    trainable share; that offloading does nothing on a CPU."""
    loaded, shapes, precision = ready.loaded, ready.parameter_shapes, placement.precision
    if placement.memory.offload_activations and placement.layout.device.type == "cpu":
        log.warning(
            "offload_activations=true has no effect on a CPU run: activations already live in CPU "
            "memory (the offload still runs, so the code path is the one GPUs use)"
        )
    settings = adapters
    if settings is not None:
        trained = lora.trainable_count(shapes, settings)
        log.info(
            "lora: rank %d, alpha %g (scaling %g), dropout %g on %d modules (%s); trainable %s of %s parameters "
            "(%.3f%%): adapters + %s; the base is frozen%s",
            settings.rank,
            settings.alpha,
            settings.scaling,
            settings.dropout,
            len(loaded.adapters) // 2,
            settings.targets if settings.targets == lora.ALL_LINEAR else ", ".join(settings.targets),
            f"{trained:,}",
            f"{sum(math.prod(s) for s in shapes.values()):,}",
            100 * trained / sum(math.prod(s) for s in shapes.values()),
            ", ".join(settings.modules_to_save) or "no head",
            f" and held in {precision}" if precision != "fp32" else "",
        )
    if settings is not None and settings.quantization is not None:
        _log_quantized(ready.model, settings.quantization)
    if model_name is not None:
        mine = sum(getattr(p, "ds_tensor", local_tensor(p)).numel() for p in ready.model.parameters())
        log.info(
            "model: %s, %.3gB parameters (this rank holds %.3gB) from %s (%s) in %.1f s; peak %.0f MiB",
            model_name,
            loaded.parameters / 1e9,
            mine / 1e9,
            loaded.source,
            "/".join(loaded.dtypes),
            ready.load_seconds,
            ready.load_peak_mib,
        )
        if loaded.new:
            log.info("new (not in the checkpoint), initialised from seed %d: %s", seed, ", ".join(loaded.new))
        if loaded.unused:
            log.info("not used (this task's model has no such weight): %s", ", ".join(loaded.unused))
