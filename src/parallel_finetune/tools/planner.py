"""Layout planner: memory per GPU and time for every tensor x pipeline x data-parallel layout of a run.

Nothing is downloaded: published models are built from the config values their family lists (`published`) on
the meta device, so parameter counts are exact. Assumptions, also printed under the table:
- 1 GB = 1e9 bytes; GPU memory as sold (a 40 GB A100 counts 40e9; its real 40 GiB = 42.9e9 is left as margin).
  Total = 1.1 x (state + activations) + 1.5 GB for the CUDA context and allocator fragmentation.
- Loading (before the first step): each rank allocates only its shards and reads one block at a time, so
  load = 1.1 x (this rank's fp32 parameters + the largest tensor's local piece in fp32) + 1.5 GB; `fits` needs
  both the load and the training total within the GPU's memory.
- State as the trainer keeps it: fp32 master parameters 4 B, fp32 gradients 4 B, AdamW exp_avg + exp_avg_sq 8 B
  per parameter; 16-bit autocast. The 16-bit weight copies autocast saves for the backward are not counted: the
  fp32 gradients do not exist during the forward and grow as those copies are freed, so 16 B/parameter +
  activations bounds the peak. Per rank: parameters in the family's tp_plan / tp (row-wise biases replicated),
  others whole; gradients are placed like their parameters. `optimizer` (ZeRO-1) divides the optimizer state
  over the dp ranks, `full` (FSDP) also parameters and gradients and adds one block's all-gathered 16-bit copy
  (`gathered`); `hybrid` = `full` within a node.
- Pipeline: contiguous stages, later ones take the extra blocks; the first holds the embeddings, the last the final
  norm and head (and a copy of tied embeddings); the worst stage is reported. 1F1B: stage i holds min(m, pp - i)
  micro-batches in flight; m = the largest divisor of batch/dp that is <= 4 x pp (m = 1 without pipeline).
- Activations (Korthikanti et al. 2022, 16-bit, no sequence parallelism): s*b*h*(10 + S/t + 5*a*s/(h*t)) bytes
  per layer and micro-batch, s = max_length (the worst batch), b = micro-batch size; with checkpointing 2*s*b*h
  per layer (its input) plus one layer's full activations. S, what tensor parallelism splits, is the paper's 24 for
  attention as wide as the block and a 4h GeLU MLP; in general 4*q/h + 4*kv/h (q, k, v and the attention output
  kept, q = heads x head dimension, kv the key/value width: grouped-query attention) + 4*m/h, m the width of what
  the MLP's input layers write (inner, or twice it for a gated MLP: Llama's gate and up), so 33 for Llama 3.1 8B.
  A language model's last stage adds its loss (`logit_bytes`): with loss_chunk_tokens (the run's default) one
  chunk's logits of this rank's vocabulary shard, with loss_chunk_tokens=0 every labelled position's whole logits
  with their fp32 log-softmax and gradients (12 B per logit at their fullest), both then the hidden states'
  gradient and the head's weight gradient while made (when the head trains). Instruction
  tuning (sft) with `packing`: a micro-batch's b rows of `tokens_per_row` tokens laid end to end in sequences of s
  (first-fit decreasing fills PACKING_EFFICIENCY of their slots), so the activations are those of
  ceil(b x tokens_per_row / (efficiency x s)) sequences of s; padded, b rows of s.
- task=grpo (`Rollouts`, `rollout_bytes`): the larger of three phases, each beside the same state (params, grads and
  optimizer as training keeps them: the gradients, freed between steps by plain AdamW, stand for the 16-bit weight
  copies autocast makes in a sampling forward, as in training's forward). The rollout: a data-parallel rank samples its
  share of the step's prompts x num_generations at once, batch_size / dp rows (an evaluation samples its share of the
  held-out prompts in pieces of a step's prompts per rank: never more), each holding a KV cache of max_length +
  max_completion_length - 1 positions: 2 x layers x kv_heads / tp x head_dim x compute bytes per position (Llama 3.1 8B
  in bf16: 131,072 B), plus one layer's K and V made again per appended token, plus the larger of the prompts' forward
  (one layer's activations at max_length: nothing kept for a backward) and a decode step's whole-vocabulary logits (2c +
  SAMPLING_BYTES_PER_LOGIT per logit). The kept log-probabilities (num_iterations > 1 or beta > 0): one no-gradient
  forward of the step's whole global batch on every rank (one layer's activations, the last hidden states, the head's
  forward, KEPT_BYTES_PER_TOKEN). The update: training on rows of max_length + max_completion_length tokens, with the
  batch's per-token columns. A step consumes batch_size / num_generations prompts; the decode is not timed.
- Time: 6*N FLOPs per token (+2*N recomputed with checkpointing), N = weights of Linear layers (exact for
  grouped-query attention and gated MLPs), plus attention 12*L*s*d (+4*L*s*d), d = heads x head dimension
  (Qwen 3 4B: 4096 at width 2560), at MFU 0.35 of the dense 16-bit peak, / pipeline efficiency m/(m + pp - 1).
  Here s = tokens per sample, 13.4 by default: SST-2 with dynamic padding and length-grouped batches (measured
  13.3 real, 13.9 padded WordPiece tokens per sentence incl. [CLS]/[SEP]; GPT-2 BPE has no special tokens);
  max_length with `padded`; sft and dpo rows at tokens_per_row (a pair: two rows). A model is timed over an
  SST-2 epoch, 67,349 // batch steps as the trainer draws them; a recipe (resolve.planner_workload) over its
  run's steps: max_steps, or epochs x its samples // batch, plus dpo's reference pass (a third of a step per
  batch of pairs, once). Gradient accumulation: b is a slice's, the step's compute the whole batch's.
- Communication, not overlapped (the trainer all-reduces after the backward), ring algorithms at 70% of the nominal
  link: tensor parallel 4 (+2 recomputed) all-reduces of s*b*h*2 bytes per layer and micro-batch; data parallel
  an all-reduce of the fp32 gradients (ZeRO-1 the same volume); FSDP two 16-bit all-gathers and an fp32
  reduce-scatter; between nodes, the node's network / GPUs per node. Pipeline sends and latency are ignored.
- The trainer runs every layout except pp > 1 together with sharding full or hybrid, which estimates a planned feature.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import PretrainedConfig

from ..errors import UserError
from ..families import Family, all_families, family_names, get_family, published_model, published_models
from ..families.base import tiny_vocab_size
from ..families.styles import ReplicatedWithGradAllReduce
from ..model import quantize
from ..model.hub import resolve_model_path
from ..model.lora import ALL_LINEAR, LoraSettings, target_modules
from ..model.pretrained import load_hf_config
from ..model.throughput import attention_width
from ..parallel.hardware import Hardware, hardware_for, positive_int, positive_number
from ..parallel.layout import ParallelDims, Sharding
from ..tasks.kinds import find_kind
from ..tasks.task import HeadKind

GB = 1e9
SST2_TRAIN_SENTENCES = 67_349
OVERHEAD_FRACTION, OVERHEAD_BYTES = 0.10, 1.5 * GB
HEADROOM = 0.10  # the recommendation leaves this much of the GPU free
# QLoRA's NF4 with double quantization (QLoRA's and the recipes' blocks): 4-bit codes, one int8 scaler per block of
# 64 elements, one fp32 factor per group of 256 scalers
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_BYTES = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)
# Quantizing a shard at load holds it in fp32, its block-scaled copy and one byte per code (9 B per element), and
# torchao's nearest-code search runs over chunks of 2**20 elements: the differences to the 16 codes in fp32 and
# their absolute values (`(value - nf4).abs()`: two such tensors at once), the nearest's fp32 value and int64 index
NF4_QUANTIZE_BYTES, NF4_SEARCH_BYTES = 9, 2**20 * (2 * 16 * 4 + 4 + 8)
LINK_EFFICIENCY = 0.7
# a chat row's mean tokens, as planned for an sft recipe: conversations of 1-3 turns measured 466 on average (p90 901)
SFT_TOKENS_PER_ROW = 512
PACKING_EFFICIENCY = 0.9  # real tokens per packed token slot: first-fit decreasing on chat rows (the sample: 0.91)
# task=grpo's sampling of one token per row (rl/rollout.py's next_tokens) at its fullest, per logit of the whole
# vocabulary, besides the head's output: the fp32 logits after the temperature (4 B), top-k/top-p's sorted order
# (int64, 8 B), the fp32 probabilities and top-p's cumulative mass (4 + 4 B), the float64 copy and its CDF (8 + 8 B)
SAMPLING_BYTES_PER_LOGIT = 4 + 8 + 4 + 4 + 8 + 8
# task=grpo's batches carry, at each position, (completion, advantage, old, reference) in float64 (data/grpo.py)
KEPT_BYTES_PER_TOKEN = 4 * 8


@dataclass
class ModelShape:
    """Parameter counts as (tensor-parallel-sharded, replicated) pairs, by where a pipeline puts them."""

    name: str
    family: Family
    hf_config: PretrainedConfig
    task: str
    blocks: list[tuple[int, int]]
    embedding: tuple[int, int]  # before the first block: the first stage
    head: tuple[int, int]  # after the last block: the last stage
    tied: tuple[int, int]  # embedding parameters the head reuses: a second copy on a last stage that is not first
    total: int
    matmul: int  # weights of Linear layers: 2 FLOPs per token each in the forward
    largest: tuple[int, int]  # elements of the largest tensor-parallel-sharded and of the largest replicated tensor
    block_linear_in_out: int = 0  # sum of in + out features over the blocks' Linear layers (LoRA all-linear: x rank)
    block_linear_split: int = 0  # of those, the features tensor parallelism splits (out column-wise, in row-wise)
    head_total: int = 0  # parameters after the last block (the classification head LoRA trains in full)
    lora_rank: int = 0  # > 0: plan LoRA (see `with_lora`)
    nf4: bool = False  # QLoRA: the blocks' Linear weights in NF4 (needs lora_rank)
    quantizable: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # per block: its Linear weights
    largest_linear: int = 0  # elements of the blocks' largest Linear weight
    meta_model: nn.Module | None = None  # the model on meta, for the trainer's NF4 shard checks
    split_activations: float = 24  # S: activation bytes per token and unit of hidden width that TP splits
    # LoRA as a run sets it (`with_lora`): (trainable elements, of those the adapter elements tensor parallelism
    # splits, whether the output head trains); None: rank-r adapters on every Linear of the blocks + a
    # classification head, as `--lora R` plans
    lora_counts: tuple[int, int, bool] | None = None

    @property
    def lora_elements(self) -> int:
        """Trainable parameters under LoRA: the adapters, plus the modules trained in full (a classification
        head by default; a language model's head stays frozen unless lora_modules_to_save names it)."""
        if self.lora_counts is not None:
            return self.lora_counts[0]
        trained_head = self.head_total if HeadKind(self.task) is HeadKind.CLASSIFICATION else 0
        return self.lora_rank * self.block_linear_in_out + trained_head

    def lora_elements_per_rank(self, tp: int) -> float:
        """`lora_elements` on one of `tp` tensor-parallel ranks: an adapter's factor on the split dimension is
        sharded like its layer (B of a column-wise layer, A of a row-wise one), the other factor whole."""
        split = self.lora_counts[1] if self.lora_counts is not None else self.lora_rank * self.block_linear_split
        return self.lora_elements - split * (1 - 1 / tp)

    @property
    def head_trains(self) -> bool:
        """Whether the output head (a language model's: the logits' weight) gets a gradient."""
        if not self.lora_rank:
            return True
        if self.lora_counts is not None:
            return self.lora_counts[2]
        return HeadKind(self.task) is HeadKind.CLASSIFICATION

    @property
    def head_weight(self) -> int:
        """Elements of a language model's output weight (vocabulary x hidden; tied: the embedding)."""
        return self.hf_config.vocab_size * self.hidden

    hidden = property(lambda self: self.hf_config.hidden_size)
    heads = property(lambda self: self.hf_config.num_attention_heads)
    layers = property(lambda self: len(self.blocks))
    attention_width = property(lambda self: attention_width(self.hf_config))  # heads x head dimension


def model_config(model: str) -> tuple[Family, PretrainedConfig]:
    """A published checkpoint's config from its family's `published` values, a tiny model's, or a folder's."""
    known = published_model(model)
    if known is not None:
        return known
    if model.startswith("tiny:"):
        if model[len("tiny:") :] not in family_names():
            raise UserError(f"model={model!r}: no such family; valid: {', '.join('tiny:' + f for f in family_names())}")
        family = get_family(model[len("tiny:") :])
        return family, family.hf_config(None, "tiny", tiny_vocab_size(8192), 128, {})
    folder = resolve_model_path(model)
    if not (Path(folder) / "config.json").is_file():
        raise UserError(
            f"model={model!r} is not known offline; known: {', '.join(published_models())}, "
            f"a local folder with config.json, package:MODULE or tiny:FAMILY"
        )
    config = load_hf_config(folder)
    for family in all_families():
        if isinstance(config, family.config_class):
            return family, config
    raise UserError(
        f"model={model!r} is a {type(config).__name__}; the planner knows the families {', '.join(family_names())}"
    )


def model_shape(model: str, head: HeadKind = HeadKind.CLASSIFICATION) -> ModelShape:
    family, hf_config = model_config(model)
    if head not in family.tasks:
        raise UserError(
            f"task={str(head)!r} is not supported by family {family.name}; valid: {', '.join(family.tasks)}"
        )
    family.set_task(hf_config, head, pad_token_id=0)
    built = family.build(head, hf_config)  # on the meta device: shapes only
    plan = family.tp_plan(built)
    prefix = family.block_path + "."
    blocks = [[0, 0] for _ in family.blocks(built)]
    embedding, head_params, tied = [0, 0], [0, 0], [0, 0]
    quantizable = [[0, 0] for _ in family.blocks(built)]
    linear_weights = {
        id(m.weight) for block in family.blocks(built) for m in block.modules() if isinstance(m, nn.Linear)
    }
    where: dict[int, str] = {}  # id(parameter) -> "embedding" | "block" | "head": ties appear under two names
    largest = [0, 0]
    after_blocks = False  # parameters come in module order: embeddings, blocks, final norm and head
    for name, param in built.named_parameters(remove_duplicate=False):
        module, _, leaf = name.rpartition(".")
        style = plan.get(module)
        replicated = (
            style is None
            or isinstance(style, ReplicatedWithGradAllReduce)  # Qwen 3's per-head norms: whole on every rank
            or (isinstance(style, RowwiseParallel) and leaf == "bias")
        )
        if name.startswith(prefix):
            place, counts = "block", blocks[int(name[len(prefix) :].split(".")[0])]
            after_blocks = True
        elif after_blocks:
            place, counts = "head", head_params
        else:
            place, counts = "embedding", embedding
        if id(param) in where:
            if place == "head" and where[id(param)] == "embedding":
                tied[replicated] += param.numel()
            continue
        where[id(param)] = place
        counts[replicated] += param.numel()
        if place == "block" and id(param) in linear_weights:
            quantizable[int(name[len(prefix) :].split(".")[0])][replicated] += param.numel()
        largest[replicated] = max(largest[replicated], param.numel())
    matmul = sum(m.weight.numel() for m in built.modules() if isinstance(m, nn.Linear))
    split = 0
    for name, module in built.named_modules():
        if name.startswith(prefix) and isinstance(module, nn.Linear):
            style = plan.get(name)
            split += module.in_features if isinstance(style, RowwiseParallel) else 0
            split += module.out_features if isinstance(style, ColwiseParallel) else 0
    in_out = sum(
        m.in_features + m.out_features
        for block in family.blocks(built)
        for m in block.modules()
        if isinstance(m, nn.Linear)
    )
    return ModelShape(
        model,
        family,
        hf_config,
        head,
        [tuple(b) for b in blocks],
        tuple(embedding),
        tuple(head_params),
        tuple(tied),
        sum(p.numel() for p in built.parameters()),
        matmul,
        tuple(largest),
        in_out,
        split,
        sum(head_params) - sum(tied),
        split_activations=split_activations(hf_config, family.blocks(built)[0]),
        quantizable=[tuple(q) for q in quantizable],
        largest_linear=max(
            (m.weight.numel() for b in family.blocks(built) for m in b.modules() if isinstance(m, nn.Linear)), default=0
        ),
        meta_model=built,
    )


def with_lora(shape: ModelShape, lora: LoraSettings) -> ModelShape:
    """`shape` under LoRA as a run applies it (model/lora.py): adapters on the blocks' Linear layers that
    `lora.targets` names, and `lora.modules_to_save` trained in full; NF4 when `lora.quantization` is set."""
    adapted = target_modules(shape.meta_model, shape.family, lora)
    adapters = sum(lora.rank * (m.in_features + m.out_features) for _, m, _ in adapted)
    # the factor on the split dimension is sharded like its layer: B of a column-wise layer, A of a row-wise one
    split = sum(lora.rank * {"row": m.in_features, "column": m.out_features}.get(style, 0) for _, m, style in adapted)
    saved = tuple(f"{name}." for name in lora.modules_to_save)
    full = sum(p.numel() for name, p in shape.meta_model.named_parameters() if name.startswith(saved))
    output = shape.meta_model.get_output_embeddings()
    head_trains = any(
        module is output for name, module in shape.meta_model.named_modules() if name in lora.modules_to_save
    )
    if HeadKind(shape.task) is not HeadKind.CAUSAL_LM:
        head_trains = bool(full)
    return dataclasses.replace(
        shape,
        lora_rank=lora.rank,
        nf4=lora.quantization is not None,
        lora_counts=(adapters + full, split, head_trains),
    )


def split_activations(hf_config: PretrainedConfig, block: nn.Module) -> float:
    """S of the module docstring: 4*q/h + 4*kv/h + 4*m/h, the MLP's input layers found as the block's Linear
    layers that read the hidden state into the inner width (one: GeLU MLP; two, or one twice as wide: gated)."""
    h, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = attention_width(hf_config) // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    inner = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None) or 4 * h
    into_inner = sum(
        m.out_features
        for m in block.modules()
        if isinstance(m, nn.Linear) and m.in_features == h and m.out_features in (inner, 2 * inner)
    )
    return (4 * attention_width(hf_config) + 4 * kv + 4 * (into_inner or inner)) / h


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    sharding: Sharding | str  # a Sharding once made
    ac: bool  # activation checkpointing
    microbatches: int  # per data-parallel rank and step (pipeline micro-batches)
    shard_degree: int = 1  # ranks that share one copy of the sharded state

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", Sharding(self.sharding))

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.split(self.dp, self.tp, self.pp, self.sharding, self.shard_degree)

    def describe(self, batch_size: int) -> str:
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp} sharding={self.sharding} ac={'on' if self.ac else 'off'} "
            f"micro-batches={self.microbatches}x{batch_size // (self.dp * self.microbatches)}"
        )

    def overrides(self, gpus_per_node: int) -> list[str]:
        """The recipe keys (key=value, as a run takes them) that start this layout on nodes of `gpus_per_node`."""
        keys = [
            f"tensor_parallel_degree={self.tp}",
            f"pipeline_parallel_degree={self.pp}",
            f"sharding={self.sharding}",
            f"activation_checkpointing={'true' if self.ac else 'false'}",
        ]
        if self.pp > 1:
            keys.append(f"microbatches={self.microbatches}")
        if self.dims.hybrid and self.shard_degree != max(1, gpus_per_node // self.tp):
            keys.append(f"shard_group_size={self.shard_degree}")
        return keys

    # pipeline stages do not combine with FSDP in the trainer yet (resolve.validate says so)
    runs_today = property(lambda self: not (self.dims.pp_enabled and self.dims.fsdp))


def stage_blocks(layers: int, pp: int) -> list[range]:
    """The block numbers of each pipeline stage: contiguous, later stages take the blocks that do not divide evenly."""
    sizes = [layers // pp + (i >= pp - layers % pp) for i in range(pp)]
    return [range(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(pp)]


def stages(shape: ModelShape, pp: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """(blocks, parameter parts) of each pipeline stage; later stages take the blocks that do not divide evenly."""
    result, start = [], 0
    for i, size in enumerate(len(blocks) for blocks in stage_blocks(shape.layers, pp)):
        first, last = i == 0, i == pp - 1
        parts = (
            shape.blocks[start : start + size]
            + [shape.embedding] * first
            + [shape.head] * last
            + [shape.tied] * (last and not first)
        )
        result.append((size, parts))
        start += size
    return result


def rank_elements(parts: list[tuple[int, int]], tp: int) -> list[float]:
    return [sharded / tp + replicated for sharded, replicated in parts]


def memory_per_gpu(
    shape: ModelShape,
    layout: Candidate,
    seq_len: int,
    batch_size: int,
    *,
    compute_bytes: int = 2,
    workload: Workload | None = None,
) -> dict[str, float]:
    """Bytes on the fullest GPU (the worst pipeline stage): params, gathered, dequantized, grads, optimizer,
    activations, logits, total (training); load (this rank's shards + the largest block being read, before the
    first step), load_total, and peak. `compute_bytes`: the compute dtype's bytes (2: 16-bit autocast, as on GPUs;
    4: fp32), which frozen LoRA weights, dequantized NF4 weights and activations take. `workload`: packing and the
    language model's loss (None: rows padded to `seq_len`, whole logits)."""
    workload = workload or Workload(
        head=HeadKind(shape.task), seq_len=seq_len, batch_size=batch_size, loss_chunk_tokens=0
    )
    h, t, rollouts = shape.hidden, layout.tp, workload.rollouts
    slice_rows = batch_size // (layout.dp * workload.accumulation * layout.microbatches)
    # grpo: the update trains on the prompts followed by their completions
    seq_len += rollouts.completion_tokens if rollouts else 0
    micro = dataclasses.replace(workload, seq_len=seq_len).micro_batch(slice_rows)
    s, b = micro.length, micro.rows
    layer = layer_bytes(shape, s, b, t, compute_bytes)
    fsdp = layout.dims.fsdp
    state_divisor = layout.shard_degree if fsdp else 1
    optimizer_divisor = layout.shard_degree if layout.dims.sharded else 1
    worst: dict[str, float] = {}
    for i, ((blocks, parts), numbers) in enumerate(
        zip(stages(shape, layout.pp), stage_blocks(shape.layers, layout.pp))
    ):
        per_part = rank_elements(parts, t)
        elements = sum(per_part)
        # NF4 (QLoRA): this rank's share of its blocks' Linear weights; one block's, dequantized, is working memory
        nf4 = rank_elements([shape.quantizable[n] for n in numbers], t) if shape.nf4 else [0]
        # LoRA: the frozen base in the compute dtype (no gradient, no AdamW state); adapters + head in fp32 with both
        # (the adapters sharded like their layers; spread evenly over the stages)
        trainable = shape.lora_elements_per_rank(t) / layout.pp if shape.lora_rank else elements
        in_flight = min(layout.microbatches, layout.pp - i)
        kept = in_flight * blocks * (2 * s * b * h * compute_bytes / 2 if layout.ac else layer)
        kept += layer if layout.ac else 0
        last = i == layout.pp - 1
        logits = logit_bytes(shape, workload, s * b, t, compute_bytes) if last else 0
        kept += KEPT_BYTES_PER_TOKEN * s * b if rollouts else 0  # the batch's per-token columns
        frozen = NF4_BYTES * sum(nf4) + compute_bytes * (elements - sum(nf4))
        memory = {
            "params": (frozen + 4 * trainable if shape.lora_rank else 4 * elements) / state_divisor,
            "gathered": gathered_block(per_part, nf4, compute_bytes) if fsdp else 0,
            "dequantized": compute_bytes * max(nf4),
            "grads": 4 * trainable / state_divisor,
            "optimizer": 8 * trainable / optimizer_divisor,
            "activations": kept,
            "logits": logits,
        }
        working = memory["activations"] + logits  # the update's, beside the state
        if rollouts:  # grpo: the phases before the update, each beside the same state
            memory |= rollout_bytes(shape, workload, layout, blocks, last, compute_bytes)
            working = max(working, memory["rollout"], memory["scoring"])
        state = sum(memory[k] for k in ("params", "gathered", "dequantized", "grads", "optimizer"))
        memory["total"] = (1 + OVERHEAD_FRACTION) * (state + working) + OVERHEAD_BYTES
        # Loading: this rank's fp32 shards plus one block being read (the largest tensor's local piece).
        largest_block = max(shape.largest[0] / t, shape.largest[1]) / state_divisor
        working = 4 * largest_block
        if shape.nf4:  # or the largest NF4 shard being quantized
            working = max(working, NF4_QUANTIZE_BYTES * shape.largest_linear / t / state_divisor + NF4_SEARCH_BYTES)
        memory["load"] = memory["params"] + working
        memory["load_total"] = (1 + OVERHEAD_FRACTION) * memory["load"] + OVERHEAD_BYTES
        memory["peak"] = max(memory["total"], memory["load_total"])
        if memory["peak"] > worst.get("peak", -1):
            worst = memory
    return worst


def layer_bytes(shape: ModelShape, s: float, b: float, tp: int, compute_bytes: int) -> float:
    """One block's activations for b sequences of s tokens (Korthikanti et al. 2022, no sequence parallelism)."""
    h, a = shape.hidden, shape.heads
    return s * b * h * (10 + shape.split_activations / tp + 5 * a * s / (h * tp)) * compute_bytes / 2


def kv_cache_bytes(shape: ModelShape, layers: int, tokens: float, tp: int, compute_bytes: int) -> float:
    """The KV cache of `tokens` positions (rows x positions) over `layers` blocks on one of `tp` ranks: a key and a
    value per key/value head (tensor parallelism keeps each rank's heads) of the head dimension, in the compute
    dtype. Llama 3.1 8B in bf16: 2 x 32 x 8 x 128 x 2 = 131,072 B per position, / tp."""
    config = shape.hf_config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = shape.attention_width // config.num_attention_heads
    return 2 * layers * kv_heads / tp * head_dim * compute_bytes * tokens


def rollout_bytes(
    shape: ModelShape, workload: Workload, layout: Candidate, blocks: int, last: bool, compute_bytes: int
) -> dict[str, float]:
    """task=grpo's phases before the update, on a stage of `blocks` blocks (`last`: it holds the head), each beside
    the state (see `Rollouts`):
    - kv_cache: the rank's rows x (max_length + max_completion_length - 1) positions (the last token is sampled,
      never fed back), `kv_cache_bytes`;
    - rollout: the cache, one block's keys and values made again as a token is appended (torch.cat), and the larger
      of the prompts' forward (one block's activations for the rows at max_length: nothing is kept for a backward)
      and a decode step's logits (the head's output over the whole vocabulary, its shard under tensor parallelism,
      and SAMPLING_BYTES_PER_LOGIT);
    - scoring (num_iterations > 1 or beta > 0; else 0): the no-gradient forward of the step's whole global batch of
      max_length + max_completion_length tokens per row: one block's activations, the last hidden states, the
      head's forward (one chunk of this rank's vocabulary shard, or the whole logits) and the per-token columns."""
    rollouts, c, t = workload.rollouts, compute_bytes, layout.tp
    rows = rollouts.rows_per_rank(workload.batch_size, layout.dp)
    prompt, row_tokens = workload.seq_len, workload.seq_len + rollouts.completion_tokens
    kv = kv_cache_bytes(shape, blocks, rows * (row_tokens - 1), t, c)
    vocab = shape.hf_config.vocab_size
    decode = rows * vocab * (c + c / t + SAMPLING_BYTES_PER_LOGIT) if last else 0
    rollout = kv + kv / blocks + max(layer_bytes(shape, prompt, rows, t, c), decode)
    scoring = 0.0
    if rollouts.kept_logps:
        tokens = workload.batch_size * row_tokens
        made = c + (4 if c < 4 else 0)
        chunk = min(workload.loss_chunk_tokens, tokens) * vocab / t if workload.loss_chunk_tokens else tokens * vocab
        head = tokens * shape.hidden * c + chunk * (made + 4) if last else 0
        scoring = layer_bytes(shape, row_tokens, workload.batch_size, t, c) + head + KEPT_BYTES_PER_TOKEN * tokens
    return {"kv_cache": kv, "rollout": rollout, "scoring": scoring}


def logit_bytes(shape: ModelShape, workload: Workload, tokens: float, tp: int, compute_bytes: int) -> float:
    """A language model's loss on the last stage, at its fullest moment, for `tokens` labelled positions (the
    worst batch: every position labelled). V: the vocabulary, c: the compute dtype's bytes, made = c + 4 in
    16-bit (a matmul's output and its fp32 copy; fp32: 4, one tensor). Both paths end the same way: the gradient
    of the hidden states (4 x tokens x hidden, fp32 at most) and, when the head trains, its weight's gradient
    while it is made (H = this rank's head weight elements, x made: the product in the compute dtype and its fp32
    copy; the fp32 gradient it becomes or is added to is the `grads` state).

    Chunked (loss_chunk_tokens, parallel/vocab.py), C = min(chunk, tokens) rows of this rank's V / tp columns:
    forward C x V/tp x (made + 4) (+ the fp32 exponentials); backward C x V/tp x (4 + c) (the fp32 softmax made in
    place, its compute-dtype copy for the two matmuls) + the common end. Whole logits (loss_chunk_tokens=0,
    loop/loss.py's token_loss: the head's output replicated over the whole vocabulary on every rank, then
    cross_entropy in fp32): forward tokens x V x (made + 4) (the logits, their fp32 copy, the fp32 log-softmax
    autograd keeps); backward tokens x V x 12 (the log-softmax, its gradient, the logits' gradient, all fp32),
    then tokens x V x (4 + c) (the fp32 gradient and its compute-dtype copy) + the common end. So whole logits
    never plan less than the chunked loss."""
    if HeadKind(shape.task) is not HeadKind.CAUSAL_LM:
        return 0
    vocab, c = shape.hf_config.vocab_size, compute_bytes
    made = c + (4 if c < 4 else 0)
    end = 4 * tokens * shape.hidden + (shape.head_weight / tp * made if shape.head_trains else 0)
    if not workload.loss_chunk_tokens:
        whole = tokens * vocab
        return max(whole * (made + 4), whole * 12, whole * (4 + c) + end)
    rows = min(workload.loss_chunk_tokens, tokens) * vocab / tp
    return max(rows * (made + 4), rows * (4 + c) + end)


def gathered_block(per_part: list[float], nf4: list[float], compute_bytes: int) -> float:
    """FSDP's all-gathered copy of the largest part in the compute dtype; with NF4 a block's Linear weights travel
    as their codes and scalers (`nf4`: the quantized elements of the stage's blocks, the first parts)."""
    return max(
        compute_bytes * part - (compute_bytes - NF4_BYTES) * q for part, q in zip_longest(per_part, nf4, fillvalue=0)
    )


def step_seconds(
    shape: ModelShape, hardware: Hardware, layout: Candidate, batch_size: int, tokens_per_sample: float, mfu: float
) -> float:
    s, h, d, L, recompute = tokens_per_sample, shape.hidden, shape.attention_width, shape.layers, int(layout.ac)
    m, pp, dp, t = layout.microbatches, layout.pp, layout.dp, layout.tp
    weight_grads = 0 if shape.lora_rank else 2  # LoRA: no weight gradients of the frozen matmuls
    flops = batch_size * s * ((4 + weight_grads + 2 * recompute) * shape.matmul + (12 + 4 * recompute) * L * s * d)
    compute = flops / (hardware.world * hardware.spec.tflops * 1e12 * mfu) * (m + pp - 1) / m
    intra = hardware.spec.link_gb_s * GB * LINK_EFFICIENCY
    inter = hardware.internode_gbits / 8 / hardware.gpus_per_node * GB * LINK_EFFICIENCY
    dp_link = intra if hardware.nodes == 1 else inter
    tensor = (4 + 2 * recompute) * math.ceil(L / pp) * (batch_size / dp) * s * h * 2 * 2 * (t - 1) / t / intra
    elements = max(sum(rank_elements(parts, t)) for _, parts in stages(shape, pp))
    if shape.lora_rank:  # only the trainable parameters' gradients travel between data-parallel ranks
        elements = shape.lora_elements / pp
    if not layout.dims.fsdp:  # none and ZeRO-1: an all-reduce's volume
        data = 2 * (dp - 1) / dp * 4 * elements / dp_link
    elif not layout.dims.hybrid:
        data = (dp - 1) / dp * 8 * elements / dp_link
    else:  # hybrid: FSDP inside the node, then an all-reduce of each shard across the nodes
        shard, replicas = layout.shard_degree, dp // layout.shard_degree
        data = (shard - 1) / shard * 8 * elements / intra + 2 * (replicas - 1) / replicas * 4 * elements / shard / inter
    return compute + tensor + data


def candidate_layouts(shape: ModelShape, hardware: Hardware, batch_size: int) -> list[Candidate]:
    layouts = []
    for tp in shape.family.valid_tp_degrees(shape.hf_config):
        for pp in (1, 2, 4, 8):
            if hardware.gpus_per_node % tp or hardware.world % (tp * pp) or pp > shape.layers:
                continue
            dp = hardware.world // (tp * pp)
            if batch_size % dp:
                continue
            per_rank = batch_size // dp
            m = max(d for d in range(1, min(per_rank, 4 * pp) + 1) if per_rank % d == 0) if pp > 1 else 1
            for sharding in Sharding:
                group = dp // hardware.nodes  # hybrid: FSDP inside a node
                if sharding.sharded and dp == 1:
                    continue  # nothing to shard over
                if sharding.hybrid and (hardware.nodes == 1 or dp % hardware.nodes or not 1 < group < dp):
                    continue
                shard = ParallelDims.split(dp, tp, pp, sharding, group).optimizer_shards
                layouts += [Candidate(tp, pp, dp, sharding, ac, m, shard) for ac in (False, True)]
    return layouts


def nf4_refusal(shape: ModelShape, layout: Candidate) -> str | None:
    """Why the trainer refuses QLoRA in `layout` (None: it runs it, or the plan is not QLoRA): hybrid sharding,
    FSDP with tensor parallelism, or a shard that is not whole NF4 scaler groups (the trainer's own check)."""
    if not shape.nf4:
        return None
    if layout.dims.hybrid:
        return "lora_base_quantization=nf4 with sharding=hybrid is not supported"
    try:
        quantize.check_shards(
            shape.meta_model,
            shape.family,
            quantize.NF4Settings(NF4_BLOCK, NF4_SCALER_BLOCK),
            tp=layout.tp,
            fsdp=layout.shard_degree if layout.dims.fsdp else 1,
        )
    except UserError as refused:
        return str(refused)
    return None


@dataclass(frozen=True)
class Row:
    layout: Candidate
    memory: dict[str, float]  # bytes per GPU
    step_s: float
    run_min: float  # minutes for the run's steps (an SST-2 epoch when planning a model, not a recipe)
    fits: bool


COLUMNS = (
    "tp",
    "pp",
    "dp",
    "sharding",
    "ac",
    "micro",
    "params",
    "grads",
    "optim",
    "activ",
    "total GB",
    "load GB",
    "fits",
    "step s",
    "epoch min",
)


@dataclass
class Plan:
    shape: ModelShape
    hardware: Hardware
    rows: list[Row]  # best first: fitting layouts by run time, then the others by run time
    recommended: Row | None
    batch_size: int
    seq_len: int
    tokens_per_sample: float
    mfu: float
    workload: Workload = dataclasses.field(default_factory=lambda: Workload())
    steps: int = SST2_TRAIN_SENTENCES // 32  # the run's optimizer steps
    current: Row | None = None  # the layout the recipe starts, when a recipe is planned
    recipe: str | None = None  # the recipe planned (None: a model), for the printed command
    overrides: tuple[str, ...] = ()  # the recipe's overrides as given

    @property
    def pairs(self) -> bool:
        return self.workload.pairs

    @property
    def timed_as_run(self) -> bool:
        """Time for the run's own steps (a recipe, or instruction and preference tuning), not an SST-2 epoch."""
        kind = find_kind(self.workload.task)
        return self.recipe is not None or (kind is not None and kind.chat)

    @property
    def slice_size(self) -> int:
        """Samples per accumulation slice, over all data-parallel ranks."""
        return self.batch_size // self.workload.accumulation

    def table(self, limit: int | None = 15) -> str:
        """The best `limit` rows (all with None), plus the recommended one (and the recipe's) if further down."""
        shown = self.rows if limit is None else self.rows[:limit]
        for extra in (self.recommended, self.current):
            if extra is not None and extra not in shown and extra.layout not in [r.layout for r in shown]:
                shown = shown + [extra]
        columns = (*COLUMNS[:-1], "run min") if self.timed_as_run else COLUMNS
        if self.workload.rollouts:  # grpo: the rollout's KV cache and phase beside the update's activations
            at = columns.index("total GB")
            columns = (*columns[:at], "kv", "rollout", *columns[at:])
        cells = [columns] + [self._cells(row) for row in shown]
        widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
        align = [str.ljust if name == "sharding" else str.rjust for name in columns]
        lines = self._header() + ["  ".join(a(c, w) for a, c, w in zip(align, line, widths)) for line in cells]
        if len(shown) < len(self.rows):
            lines.append(f"... {len(self.rows) - len(shown)} more layouts (--all / table(limit=None) prints all)")
        lines += self._verdict()
        return "\n".join(lines + [""] + self._footer())

    __str__ = table

    def _cells(self, row: Row) -> tuple[str, ...]:
        lay, mem = row.layout, row.memory
        micro = f"{lay.microbatches}x{self.slice_size // (lay.dp * lay.microbatches)}"
        if self.workload.accumulation > 1:
            micro = f"{self.workload.accumulation}x{micro}"
        sizes = [f"{(mem['params'] + mem['gathered'] + mem['dequantized']) / GB:.2f}"]
        sizes += [f"{mem[k] / GB:.2f}" for k in ("grads", "optimizer")]
        sizes.append(f"{(mem['activations'] + mem['logits']) / GB:.2f}")  # a language model's logits with them
        if self.workload.rollouts:
            sizes += [f"{mem['kv_cache'] / GB:.2f}", f"{max(mem['rollout'], mem['scoring']) / GB:.2f}"]
        return (
            str(lay.tp),
            str(lay.pp),
            str(lay.dp),
            lay.sharding,
            "on" if lay.ac else "off",
            micro,
            *sizes,
            f"{mem['total'] / GB:.1f}",
            f"{mem['load_total'] / GB:.1f}",
            "yes" if row.fits else "no",
            f"{row.step_s:.3f}",
            f"{row.run_min:.1f}",
        )

    def _header(self) -> list[str]:
        shape, hw, work = self.shape, self.hardware, self.workload
        where = f" ({hw.instance})" if hw.instance else ""
        task = work.task or str(shape.task)
        trained = "the classification head" if HeadKind(shape.task) is HeadKind.CLASSIFICATION else "the head"
        trained_part = (
            f" + {trained} trained in full" if shape.lora_rank and shape.lora_elements and shape.head_trains else ""
        )
        targets = "every linear layer"
        if work.lora is not None and work.lora.targets != ALL_LINEAR:
            targets = ", ".join(work.lora.targets)
        timed = self._timed()
        return [
            f"{shape.name} ({shape.family.name}, {task}): {shape.total:,} parameters, {shape.layers} blocks, "
            f"hidden {shape.hidden}, {shape.heads} heads; valid tp "
            f"{', '.join(map(str, shape.family.valid_tp_degrees(shape.hf_config)))}",
            f"{hw.nodes} node(s) x {hw.gpus_per_node} {hw.gpu}{where}: {hw.memory_gb:g} GB each, "
            f"{hw.spec.tflops:g} TFLOP/s 16-bit peak, {hw.spec.link_gb_s:g} GB/s GPU link"
            + (f", {hw.internode_gbits:g} Gbit/s between nodes" if hw.nodes > 1 else "")
            + hw.note,
            *(
                [
                    f"LoRA rank {shape.lora_rank} on {targets}{trained_part}: {shape.lora_elements:,} trainable "
                    f"parameters ({shape.lora_elements / shape.total:.2%}); the base frozen in 16-bit"
                ]
                if shape.lora_rank and not shape.nf4
                else []
            ),
            *(
                [
                    f"QLoRA rank {shape.lora_rank} on {targets}{trained_part}: {shape.lora_elements:,} trainable "
                    f"parameters ({shape.lora_elements / shape.total:.2%}); the blocks' Linear weights "
                    f"({sum(map(sum, shape.quantizable)):,}) frozen in NF4 ({NF4_BYTES:.4f} B each), the rest "
                    "of the base in 16-bit; layouts the trainer refuses with NF4 (hybrid, FSDP with tp) left out"
                ]
                if shape.nf4
                else []
            ),
            *(
                [
                    "dpo: each sample is a pair of rows (chosen, rejected), both in memory and time; "
                    + (
                        "the reference model costs no memory (its log-probabilities are measured once before "
                        "training, in this layout: one forward per trained pair, about a third of a step's compute "
                        "per pair, in the time)"
                        if self.workload.reference_pass
                        else "no reference pass (a reference-free loss: simpo, orpo)"
                    )
                ]
                if self.pairs
                else []
            ),
            timed,
            "",
        ]

    def _timed(self) -> str:
        """The header's line of what is timed: an SST-2 epoch (a model planned), or the run's own steps."""
        work, rollouts = self.workload, self.workload.rollouts
        unit = "pairs" if self.pairs else "completions" if rollouts else "samples"
        if not self.timed_as_run:
            return (
                f"SST-2 epoch: {SST2_TRAIN_SENTENCES:,} sentences = {self.steps:,} steps of {self.batch_size}; "
                f"memory at {self.seq_len} tokens per sequence, time at {self.tokens_per_sample:g} tokens per sample, "
                f"MFU {self.mfu:g}"
            )
        if work.max_steps:
            counted = f"max_steps={work.max_steps}"
        elif work.samples is not None:
            counted = f"{work.epochs:g} epoch(s) of {work.samples:,} {'prompts' if rollouts else unit} ({work.data})"
        else:
            counted = f"{work.epochs:g} epoch(s) of {SST2_TRAIN_SENTENCES:,} {unit} assumed ({work.data})"
        slices = f" ({work.accumulation} accumulation slices of {self.slice_size})" if work.accumulation > 1 else ""
        row = f"{self.seq_len} tokens per row ({'packed into' if work.packing else 'padded to'} max_length)"
        if rollouts:  # grpo: a step's prompts, and rows of a prompt and its completion; the decode is not timed
            unit += f" = {self.batch_size // rollouts.generations} prompts x {rollouts.generations}"
            row = (
                f"{self.seq_len} + {rollouts.completion_tokens} tokens per row (max_length, the prompt budget, + "
                "max_completion_length), the rollout's decode not timed"
            )
        return (
            f"the run: {self.steps:,} steps of {self.batch_size} {unit}{slices}: {counted}; memory at "
            f"{row}, time at {self.tokens_per_sample:g} "
            f"tokens per sample, MFU {self.mfu:g}; {'fp32' if work.compute_bytes == 4 else '16-bit'} compute, "
            + (
                f"the loss in chunks of {work.loss_chunk_tokens:,} tokens"
                if work.loss_chunk_tokens
                else "whole logits (loss_chunk_tokens=0)"
            )
            * (HeadKind(self.shape.task) is HeadKind.CAUSAL_LM)
        ).rstrip(", ")

    def _describe(self, row: Row) -> str:
        return (
            f"{row.layout.describe(self.slice_size)}: {row.memory['total'] / GB:.1f} of "
            f"{self.hardware.memory_gb:g} GB per GPU (loading {row.memory['load_total'] / GB:.1f})"
        )

    def _verdict(self) -> list[str]:
        best, lines = self.recommended, []
        minutes = "min for the run" if self.timed_as_run else "min per epoch"
        if self.current is not None:
            verdict = "fits" if self.current.fits else "does NOT fit"
            lines.append(
                f"the recipe's layout: {self._describe(self.current)}, {self.current.run_min:.1f} {minutes}: {verdict}"
            )
        if best is None:
            fitting = [row for row in self.rows if row.fits]
            return lines + [
                f"recommended: nothing fits with {HEADROOM:.0%} headroom; "
                + (
                    f"fastest that fits at all: {fitting[0].layout.describe(self.slice_size)}"
                    if fitting
                    else "nothing fits at all: use more GPUs per node, larger GPUs or more nodes"
                    + (", or a smaller batch per slice (gradient_accumulation_steps)" if self.recipe else "")
                )
            ]
        today = (
            "the trainer runs this today"
            if best.layout.runs_today
            else "needs pipeline parallelism with FSDP, not in the trainer yet"
        )
        lines.append(
            f"recommended: {best.layout.describe(self.slice_size)}: {best.memory['total'] / GB:.1f} of "
            f"{self.hardware.memory_gb:g} GB per GPU, {best.run_min:.1f} {minutes} ({today})"
        )
        if self.recipe is not None:
            keys = " ".join(best.layout.overrides(self.hardware.gpus_per_node))
            lines.append(f"  as overrides (after {' '.join([self.recipe, *self.overrides])}): {keys}")
        return lines + self._rollout_lines()

    def _rollout_lines(self) -> list[str]:
        """grpo: what the rollout holds in the recipe's layout (or the recommended one), KV cache first."""
        rollouts, row = self.workload.rollouts, self.current or self.recommended
        if not rollouts or row is None:
            return []
        mem, dp = row.memory, row.layout.dp
        rows = rollouts.rows_per_rank(self.batch_size, dp)
        scoring = f", kept log-probabilities {mem['scoring'] / GB:.1f} GB" if rollouts.kept_logps else ""
        return [
            f"rollout KV cache {mem['kv_cache'] / GB:.2f} GB ({mem['kv_cache'] / 2**30:.2f} GiB) per GPU in "
            f"{'the recipe' if self.current else 'the recommended'}'s layout: {rows:,} completions at once "
            f"({self.batch_size // rollouts.generations // dp:,} prompts x {rollouts.generations}, a step's or an "
            f"evaluation's piece) x {self.seq_len} + {rollouts.completion_tokens} - 1 positions; "
            f"the rollout phase {mem['rollout'] / GB:.1f} GB beside the state{scoring}"
        ]

    def _footer(self) -> list[str]:
        return [
            "Assumptions (details: the parallel_finetune/tools/planner.py docstring):",
            "- GB = 1e9 bytes, GPU memory as sold; per GPU on the worst pipeline stage. total = 1.1 x (params + grads",
            "  + optim + activ) + 1.5 GB for CUDA context and fragmentation while training; load = 1.1 x (params +",
            "  the largest tensor's local piece) + 1.5 GB before the first step; fits: total and load <= GPU memory.",
            "- State as the trainer keeps it: fp32 params 4 B, fp32 grads 4 B, AdamW 8 B per parameter, 16-bit",
            "  autocast. tp-sharded parameters and their gradients / tp; the rest whole. optimizer =",
            "  ZeRO-1, full = FSDP (+ one gathered 16-bit block), hybrid = FSDP inside a node, replicas across nodes.",
            "- LoRA (peft=lora, --lora R): frozen parameters 2 B (16-bit), adapters + modules trained in full",
            "  4 + 4 + 8 B; 4N FLOPs per token instead of 6N (no weight gradients of the frozen matmuls); data",
            "  parallel moves trainable gradients. --lora R: every linear layer + a classification head.",
            f"- QLoRA (--qlora R): LoRA with the blocks' Linear weights in NF4, {NF4_BYTES:.4f} B (4-bit codes, an",
            "  int8 scaler per 64, an fp32 factor per 256 scalers), the rest of the base 16-bit; params adds one",
            "  block's Linear weights dequantized (16-bit working memory); FLOPs as LoRA (dequantizing each weight",
            "  in the forward and backward is a few operations per weight and step: negligible).",
            "- Activations: Korthikanti et al. 2022, s*b*h*(10 + S/t + 5*a*s/(h*t)) bytes per layer at",
            f"  s = max_length, S = {self.shape.split_activations:.4g} (24 for a 4h GeLU MLP; grouped-query attention",
            "  and gated MLPs change it); ac keeps 2*s*b*h per layer + one layer; 1F1B stage i holds pp-i",
            "  micro-batches; micro = [accumulation slices x] count x size. activ includes a language model's",
            "  logits on the last stage: one chunk's of this rank's vocabulary shard (loss_chunk_tokens) + the",
            "  head's gradient while made, or with loss_chunk_tokens=0 every labelled position's whole logits,",
            "  fp32 log-softmax and gradients; sft/dpo with packing: rows of --tokens-per-row packed into",
            f"  max_length sequences (dpo: 2 x max_length) at {PACKING_EFFICIENCY:.0%} of their slots.",
            *(
                [
                    "- grpo: total = 1.1 x (state + the largest of the update's activ, the",
                    "  rollout and the kept log-probabilities' forward) + 1.5 GB. rollout = KV",
                    "  cache (a rank's batch_size/dp rows; an evaluation samples as many at once)",
                    "  x (max_length + max_completion_length - 1)",
                    "  positions x 2 x layers x kv heads/tp x head dim x 2 B) + one layer's K, V",
                    "  appended + the larger of the prompts' forward (one layer at max_length)",
                    "  and a decode step's whole-vocabulary logits; kept log-probabilities",
                    "  (num_iterations > 1, beta > 0): one no-grad forward of the global batch.",
                ]
                if self.workload.rollouts
                else []
            ),
            "- Time: (6N + 12*L*s*d) FLOPs per token (+ 2N + 4*L*s*d with ac), d = heads x head dimension, at the",
            "  MFU of peak, / pipeline efficiency m/(m+pp-1), + tp/dp/FSDP ring collectives at 70% of the link",
            "  rate, not overlapped.",
            "- The trainer runs every layout today except pp > 1 with sharding full or hybrid (a planned feature).",
        ]


@dataclass(frozen=True)
class Workload:
    """What a plan trains: the task, tokens per sequence for memory (`seq_len`), the global batch, real tokens per
    sample for time (SST-2's mean after dynamic padding; `padded`: every row padded to `seq_len`), the model FLOPs
    utilisation assumed, LoRA's rank (0: full fine-tuning) and the frozen base's quantization (nf4: QLoRA).
    resolve.planner_workload makes one from a recipe: everything a run of it would do."""

    head: HeadKind = HeadKind.CLASSIFICATION  # the model's last layer (instruction tuning trains the causal LM)
    seq_len: int = 128
    batch_size: int = 32  # global: summed over data-parallel ranks and accumulation slices
    tokens_per_sample: float = 13.4
    padded: bool = False
    mfu: float = 0.35
    lora_rank: int = 0
    base_quantization: str = "none"
    packing: bool = False  # sft: rows laid end to end in sequences of seq_len (data.packing)
    tokens_per_row: float | None = None  # packing: the rows' mean length (None: tokens_per_sample)
    loss_chunk_tokens: int = 1024  # a language model's head and loss this many tokens at a time; 0: whole logits
    # task=dpo: each sample is a preference pair, two rows (chosen, rejected) of seq_len at most, packed together in
    # sequences of twice seq_len; the reference model costs no memory (its log-probabilities are measured before
    # training: one forward of each trained pair, about a third of a step's compute, once)
    pairs: bool = False
    reference_pass: bool = False  # dpo's reference log-probabilities measured before training (not simpo, orpo)
    accumulation: int = 1  # gradient_accumulation_steps: slices of batch_size / (dp x accumulation) rows per rank
    compute_bytes: int = 2  # the compute dtype's bytes: 2 (bf16/fp16 autocast, precision auto on GPUs), 4 (fp32)
    lora: LoraSettings | None = None  # the run's adapters and modules trained in full (None with lora_rank: all
    # linear layers + a classification head, as --lora R plans)
    task: str | None = None  # the recipe's `task:` (classification, causal_lm, sft, dpo); None: the head's name
    samples: int | None = None  # training samples per epoch (None: SST-2's 67,349 sentences)
    epochs: float = 1.0  # passes over them (time: epochs x samples / batch_size steps)
    max_steps: int | None = None  # when set, the run's steps (wins over epochs)
    data: str = ""  # where the samples come from, for the header
    rollouts: Rollouts | None = None  # task=grpo: what each step samples before it trains (None: no rollouts)

    def micro_batch(self, rows: float) -> MicroBatch:
        """What `rows` training rows (samples: pairs for dpo, two rows each) of one micro-batch become: packed
        sequences, or rows padded to seq_len."""
        rows, length = (2 * rows, 2 * self.seq_len) if self.pairs else (rows, self.seq_len)
        if not self.packing:
            return MicroBatch(rows, self.seq_len)
        per_row = min(self.tokens_per_row or self.tokens_per_sample, self.seq_len)
        return MicroBatch(max(1, math.ceil(rows * per_row / (PACKING_EFFICIENCY * length))), length)

    @property
    def steps(self) -> int:
        """The run's optimizer steps: max_steps, or epochs x the global batches of an epoch (as the trainer)."""
        samples = SST2_TRAIN_SENTENCES if self.samples is None else self.samples
        per_step = self.batch_size // self.rollouts.generations if self.rollouts else self.batch_size  # grpo: prompts
        return self.max_steps or max(1, math.ceil(self.epochs * (samples // per_step or 1)))


@dataclass(frozen=True)
class Rollouts:
    """task=grpo's sampling (rl/steps.py, rl/rollout.py), as the planner counts it. A step's batch_size completions
    are num_generations of each of batch_size / num_generations prompts; a data-parallel rank samples its share of
    them all at once (batch_size / dp rows: accumulation slices cut only the update), each row's prompt padded to
    the longest (at most max_length, the prompt budget) and up to max_completion_length tokens. An evaluation samples
    a rank's share of the held-out prompts in pieces of as many prompts (rl/steps.py). With num_iterations > 1 or
    beta > 0 every rank measures the kept per-token log-probabilities of the step's whole global batch in one
    no-gradient forward."""

    generations: int  # grpo.num_generations
    completion_tokens: int  # grpo.max_completion_length
    kept_logps: bool = False  # num_iterations > 1 or beta > 0

    def rows_per_rank(self, batch_size: int, dp: int) -> int:
        """Completions one rank samples at once: its share of a step's (an evaluation's pieces are no larger)."""
        return batch_size // dp


@dataclass(frozen=True)
class MicroBatch:
    """The sequences one micro-batch holds on a rank: `rows` of `length` tokens."""

    rows: float
    length: int


@dataclass(frozen=True)
class Considered:
    """Which layouts a plan lists: with `runs_today` only those the trainer runs now; with a recipe, none its run's
    own checks refuse (`refuse`: a reason against a layout, or None), and the one it starts (`current`) planned and
    reported beside the recommendation."""

    runs_today: bool = False
    current: Candidate | None = None
    refuse: Callable[[Candidate], str | None] | None = None


def _checked(workload: Workload) -> None:
    """The workload's numbers, each checked as the run checks its key (one line)."""
    positive_int("seq_len", workload.seq_len), positive_int("batch_size", workload.batch_size)
    positive_int("accumulation", workload.accumulation)
    positive_number("tokens_per_sample", workload.tokens_per_sample, "13.4")
    if workload.tokens_per_row is not None:
        positive_number("tokens_per_row", workload.tokens_per_row, "512")
    if workload.rollouts is not None:
        positive_int("num_generations", workload.rollouts.generations)
        positive_int("max_completion_length", workload.rollouts.completion_tokens)
    if workload.loss_chunk_tokens < 0 or isinstance(workload.loss_chunk_tokens, bool):
        raise UserError(f"loss_chunk_tokens={workload.loss_chunk_tokens!r} must be >= 0 (0: the whole logits at once)")
    if workload.compute_bytes not in (2, 4):
        raise UserError(f"compute_bytes={workload.compute_bytes!r} is not valid; valid: 2 (bf16, fp16), 4 (fp32)")
    if not 0 < workload.mfu <= 1:
        raise UserError(f"mfu={workload.mfu!r} is not valid; expected a fraction in (0, 1], e.g. 0.35")
    if workload.base_quantization not in ("none", "nf4"):
        raise UserError(f"base_quantization={workload.base_quantization!r} is not valid; valid: none, nf4")
    if workload.base_quantization == "nf4" and not workload.lora_rank:
        raise UserError("base_quantization=nf4 is QLoRA: it quantizes LoRA's frozen base; give a lora_rank > 0")


def _adapted(shape: ModelShape, workload: Workload) -> ModelShape:
    """The shape with the workload's LoRA adapters (and NF4 base) counted; as it is without them."""
    if not workload.lora_rank:
        return shape
    nf4 = workload.base_quantization == "nf4"
    rank = positive_int("lora_rank", workload.lora_rank)
    head = tuple(shape.family.lora_head) if HeadKind(shape.task) is HeadKind.CLASSIFICATION else ()
    lora = workload.lora or LoraSettings(rank, 2.0 * rank, 0.0, ALL_LINEAR, head)
    if nf4 and lora.quantization is None:
        lora = dataclasses.replace(lora, quantization=quantize.NF4Settings(NF4_BLOCK, NF4_SCALER_BLOCK))
    return with_lora(shape, lora if nf4 else dataclasses.replace(lora, quantization=None))


def plan(
    model: str,
    gpus: int | None = None,
    gpu_mem_gb: float | None = None,
    instance: str | None = None,
    *,
    nodes: int = 1,
    gpu: str | None = None,
    workload: Workload = Workload(),
    considered: Considered = Considered(),
) -> Plan:
    """Every layout of `model` training `workload` on `nodes` x `gpus` GPUs (or an `instance`'s) that is
    `considered`, best first. See the module docstring for the assumptions."""
    hardware = hardware_for(gpus, gpu_mem_gb, instance, gpu, nodes)
    _checked(workload)
    seq_len, batch_size, accumulation = workload.seq_len, workload.batch_size, workload.accumulation
    mfu, refuse, runs_today = workload.mfu, considered.refuse, considered.runs_today
    shape = _adapted(model_shape(model, workload.head), workload)
    # time: real tokens per sample (a chat row's planned mean for sft and dpo), or padded to seq_len
    real = workload.tokens_per_row if workload.tokens_per_row is not None else workload.tokens_per_sample
    tokens = seq_len if workload.padded else min(real, seq_len)
    tokens *= 2 if workload.pairs else 1  # a preference pair is two rows: twice the compute of one
    steps = workload.steps
    # dpo: the reference pass, once before training: one forward per pair, about a third of a step's compute
    reference_steps = (workload.samples or SST2_TRAIN_SENTENCES) / batch_size / 3 if workload.reference_pass else 0

    def row_of(layout: Candidate) -> Row:
        memory = memory_per_gpu(shape, layout, seq_len, batch_size, workload=workload)
        step = step_seconds(shape, hardware, layout, batch_size, tokens, mfu)
        run_min = (steps + reference_steps) * step / 60
        return Row(layout, memory, step, run_min, memory["peak"] <= hardware.memory_gb * GB)

    rows = [
        row_of(layout)
        for layout in candidate_layouts(shape, hardware, batch_size // accumulation)
        if not ((runs_today and not layout.runs_today) or nf4_refusal(shape, layout) or (refuse and refuse(layout)))
    ]
    if not rows:
        degrees = ", ".join(map(str, shape.family.valid_tp_degrees(shape.hf_config)))
        raise UserError(
            f"batch_size={batch_size}: no layout of {model} on {hardware.world} GPUs splits it evenly "
            f"over its data-parallel ranks x gradient_accumulation_steps={accumulation} (valid tp: {degrees})"
        )
    rows.sort(key=lambda row: (not row.fits, row.run_min, row.memory["peak"]))
    roomy = [row for row in rows if row.memory["peak"] <= (1 - HEADROOM) * hardware.memory_gb * GB]
    return Plan(
        shape,
        hardware,
        rows,
        roomy[0] if roomy else None,
        batch_size,
        seq_len,
        tokens,
        mfu,
        workload,
        steps,
        current=row_of(considered.current) if considered.current is not None else None,
    )
