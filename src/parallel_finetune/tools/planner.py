"""Layout planner: memory per GPU and time per SST-2 epoch for every tensor x pipeline x data-parallel layout.

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
  A language model's last stage adds its logits: with loss_chunk_tokens (the run's default) one chunk's, 10 bytes
  (16-bit matmul output, fp32 logits, fp32 exponentials; 8 in fp32) x chunk x vocabulary/t, and the head's fp32
  gradient while it is made (4 B x head parameters/t, when the head trains); with loss_chunk_tokens=0 every
  position's, 14*s*b*vocab (the fp32 log-softmax and its gradient beside the logits; 12 in fp32). Instruction
  tuning (sft) with `packing`: a micro-batch's b rows of `tokens_per_row` tokens laid end to end in sequences of s
  (first-fit decreasing fills PACKING_EFFICIENCY of their slots), so the activations are those of
  ceil(b x tokens_per_row / (efficiency x s)) sequences of s; padded, b rows of s.
- Time: 6*N FLOPs per token (+2*N recomputed with checkpointing), N = weights of Linear layers (exact for
  grouped-query attention and gated MLPs), plus attention 12*L*s*d (+4*L*s*d), d = heads x head dimension
  (Qwen 3 4B: 4096 at width 2560), at MFU 0.35 of the dense 16-bit peak, / pipeline efficiency m/(m + pp - 1).
  Here s = tokens per sample, 13.4 by default: SST-2 with dynamic padding and length-grouped batches (measured
  13.3 real, 13.9 padded WordPiece tokens per sentence incl. [CLS]/[SEP]; GPT-2 BPE has no special tokens);
  max_length with `padded`. An epoch is 67,349 // batch steps, as the trainer draws them.
- Communication, not overlapped (the trainer all-reduces after the backward), ring algorithms at 70% of the nominal
  link: tensor parallel 4 (+2 recomputed) all-reduces of s*b*h*2 bytes per layer and micro-batch; data parallel
  an all-reduce of the fp32 gradients (ZeRO-1 the same volume); FSDP two 16-bit all-gathers and an fp32
  reduce-scatter; between nodes, the node's network / GPUs per node. Pipeline sends and latency are ignored.
- The trainer runs every layout except pp > 1 together with sharding full or hybrid, which estimates a planned feature.
"""

from __future__ import annotations

import dataclasses
import math
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
from ..model.pretrained import load_hf_config
from ..model.throughput import attention_width
from ..parallel.hardware import Hardware, hardware_for, positive_int, positive_number
from ..parallel.layout import ParallelDims, Sharding
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

    @property
    def lora_elements(self) -> int:
        """Trainable parameters under LoRA: rank-r adapters on every Linear of the blocks, plus a classification
        head (trained in full: modules_to_save); a language model's head stays frozen."""
        trained_head = self.head_total if HeadKind(self.task) is HeadKind.CLASSIFICATION else 0
        return self.lora_rank * self.block_linear_in_out + trained_head

    def lora_elements_per_rank(self, tp: int) -> float:
        """`lora_elements` on one of `tp` tensor-parallel ranks: an adapter's factor on the split dimension is
        sharded like its layer (B of a column-wise layer, A of a row-wise one), the other factor whole."""
        return self.lora_elements - self.lora_rank * self.block_linear_split * (1 - 1 / tp)

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
    h, a, t = shape.hidden, shape.heads, layout.tp
    micro = dataclasses.replace(workload, seq_len=seq_len).micro_batch(batch_size // (layout.dp * layout.microbatches))
    s, b = micro.length, micro.rows
    layer = s * b * h * (10 + shape.split_activations / t + 5 * a * s / (h * t)) * compute_bytes / 2
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
        logits = logit_bytes(shape, workload, s * b, t, compute_bytes) if i == layout.pp - 1 else 0
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
        memory["total"] = (1 + OVERHEAD_FRACTION) * sum(memory.values()) + OVERHEAD_BYTES
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


def logit_bytes(shape: ModelShape, workload: Workload, tokens: float, tp: int, compute_bytes: int) -> float:
    """A language model's loss on the last stage: one chunk's logits of this rank's vocabulary shard (and the
    head's fp32 gradient while the backward makes it), or, with loss_chunk_tokens=0, every token's whole logits."""
    if HeadKind(shape.task) is not HeadKind.CAUSAL_LM:
        return 0
    vocab = shape.hf_config.vocab_size
    # per logit: the matmul's output in the compute dtype, its fp32 copy (16-bit compute only), and one fp32
    # temporary (the exponentials); whole logits keep the fp32 log-softmax and its gradient instead (two)
    made = compute_bytes + (4 if compute_bytes < 4 else 0)
    if not workload.loss_chunk_tokens:
        return (made + 8) * tokens * vocab
    head_gradient = 0 if shape.lora_rank else 4 * vocab * shape.hidden / tp
    return (made + 4) * min(workload.loss_chunk_tokens, tokens) * vocab / tp + head_gradient


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
    epoch_min: float
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
    rows: list[Row]  # best first: fitting layouts by epoch time, then the others by epoch time
    recommended: Row | None
    batch_size: int
    seq_len: int
    tokens_per_sample: float
    mfu: float
    pairs: bool = False  # task=dpo: a sample is a preference pair

    def table(self, limit: int | None = 15) -> str:
        """The best `limit` rows (all with None), plus the recommended one if it is further down."""
        shown = self.rows if limit is None else self.rows[:limit]
        if self.recommended is not None and self.recommended not in shown:
            shown = shown + [self.recommended]
        cells = [COLUMNS] + [self._cells(row) for row in shown]
        widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
        align = [str.ljust if name == "sharding" else str.rjust for name in COLUMNS]
        lines = self._header() + ["  ".join(a(c, w) for a, c, w in zip(align, line, widths)) for line in cells]
        if len(shown) < len(self.rows):
            lines.append(f"... {len(self.rows) - len(shown)} more layouts (--all / table(limit=None) prints all)")
        lines.append(self._verdict())
        return "\n".join(lines + [""] + self._footer())

    __str__ = table

    def _cells(self, row: Row) -> tuple[str, ...]:
        lay, mem = row.layout, row.memory
        micro = f"{lay.microbatches}x{self.batch_size // (lay.dp * lay.microbatches)}"
        sizes = [f"{(mem['params'] + mem['gathered'] + mem['dequantized']) / GB:.2f}"]
        sizes += [f"{mem[k] / GB:.2f}" for k in ("grads", "optimizer")]
        sizes.append(f"{(mem['activations'] + mem['logits']) / GB:.2f}")  # a language model's logits with them
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
            f"{row.epoch_min:.1f}",
        )

    def _header(self) -> list[str]:
        shape, hw = self.shape, self.hardware
        where = f" ({hw.instance})" if hw.instance else ""
        return [
            f"{shape.name} ({shape.family.name}, {shape.task}): {shape.total:,} parameters, {shape.layers} blocks, "
            f"hidden {shape.hidden}, {shape.heads} heads; valid tp "
            f"{', '.join(map(str, shape.family.valid_tp_degrees(shape.hf_config)))}",
            f"{hw.nodes} node(s) x {hw.gpus_per_node} {hw.gpu}{where}: {hw.memory_gb:g} GB each, "
            f"{hw.spec.tflops:g} TFLOP/s 16-bit peak, {hw.spec.link_gb_s:g} GB/s GPU link"
            + (f", {hw.internode_gbits:g} Gbit/s between nodes" if hw.nodes > 1 else "")
            + hw.note,
            *(
                [
                    f"LoRA rank {shape.lora_rank} on every linear layer + head: {shape.lora_elements:,} trainable "
                    f"parameters ({shape.lora_elements / shape.total:.2%}); the base frozen in 16-bit"
                ]
                if shape.lora_rank and not shape.nf4
                else []
            ),
            *(
                [
                    f"QLoRA rank {shape.lora_rank} on every linear layer + head: {shape.lora_elements:,} trainable "
                    f"parameters ({shape.lora_elements / shape.total:.2%}); the blocks' Linear weights "
                    f"({sum(map(sum, shape.quantizable)):,}) frozen in NF4 ({NF4_BYTES:.4f} B each), the rest "
                    "of the base in 16-bit; layouts the trainer refuses with NF4 (hybrid, FSDP with tp) left out"
                ]
                if shape.nf4
                else []
            ),
            *(
                [
                    "dpo: each sample is a pair of rows (chosen, rejected), both in memory and time; the reference "
                    "model costs no memory (its log-probabilities are measured once before training, in this "
                    "layout: one forward per trained pair, about a third of a step's compute per pair)"
                ]
                if self.pairs
                else []
            ),
            f"SST-2 epoch: {SST2_TRAIN_SENTENCES:,} sentences = {SST2_TRAIN_SENTENCES // self.batch_size:,} steps "
            f"of {self.batch_size}; memory at {self.seq_len} tokens per sequence, time at "
            f"{self.tokens_per_sample:g} tokens per sample, MFU {self.mfu:g}",
            "",
        ]

    def _verdict(self) -> str:
        best = self.recommended
        if best is None:
            fitting = [row for row in self.rows if row.fits]
            return f"recommended: nothing fits with {HEADROOM:.0%} headroom; " + (
                f"fastest that fits at all: {fitting[0].layout.describe(self.batch_size)}"
                if fitting
                else "nothing fits at all: use more GPUs per node, larger GPUs or more nodes"
            )
        today = (
            "the trainer runs this today"
            if best.layout.runs_today
            else "needs pipeline parallelism with FSDP, not in the trainer yet"
        )
        return (
            f"recommended: {best.layout.describe(self.batch_size)}: {best.memory['total'] / GB:.1f} of "
            f"{self.hardware.memory_gb:g} GB per GPU, {best.epoch_min:.1f} min per epoch ({today})"
        )

    def _footer(self) -> list[str]:
        return [
            "Assumptions (details: the parallel_finetune/tools/planner.py docstring):",
            "- GB = 1e9 bytes, GPU memory as sold; per GPU on the worst pipeline stage. total = 1.1 x (params + grads",
            "  + optim + activ) + 1.5 GB for CUDA context and fragmentation while training; load = 1.1 x (params +",
            "  the largest tensor's local piece) + 1.5 GB before the first step; fits: total and load <= GPU memory.",
            "- State as the trainer keeps it: fp32 params 4 B, fp32 grads 4 B, AdamW 8 B per parameter, 16-bit",
            "  autocast. tp-sharded parameters and their gradients / tp; the rest whole. optimizer =",
            "  ZeRO-1, full = FSDP (+ one gathered 16-bit block), hybrid = FSDP inside a node, replicas across nodes.",
            "- LoRA (--lora R): frozen parameters 2 B (16-bit), adapters + head 4 + 4 + 8 B; 4N FLOPs per token",
            "  instead of 6N (no weight gradients of the frozen matmuls); data parallel moves trainable gradients.",
            f"- QLoRA (--qlora R): LoRA with the blocks' Linear weights in NF4, {NF4_BYTES:.4f} B (4-bit codes, an",
            "  int8 scaler per 64, an fp32 factor per 256 scalers), the rest of the base 16-bit; params adds one",
            "  block's Linear weights dequantized (16-bit working memory); FLOPs as LoRA (dequantizing each weight",
            "  in the forward and backward is a few operations per weight and step: negligible).",
            "- Activations: Korthikanti et al. 2022, s*b*h*(10 + S/t + 5*a*s/(h*t)) bytes per layer at",
            f"  s = max_length, S = {self.shape.split_activations:.4g} (24 for a 4h GeLU MLP; grouped-query attention",
            "  and gated MLPs change it); ac keeps 2*s*b*h per layer + one layer; 1F1B stage i holds pp-i",
            "  micro-batches; micro = count x size. activ includes a language model's logits on the last stage:",
            "  one chunk's of this rank's vocabulary shard (loss_chunk_tokens, 10 B per logit) + the head's fp32",
            "  gradient, or with --loss-chunk-tokens 0 every token's; sft with --packing: rows of",
            f"  --tokens-per-row packed into max_length sequences at {PACKING_EFFICIENCY:.0%} of their slots.",
            "- Time: (6N + 12*L*s*d) FLOPs per token (+ 2N + 4*L*s*d with ac), d = heads x head dimension, at the",
            "  MFU of peak, / pipeline efficiency m/(m+pp-1), + tp/dp/FSDP ring collectives at 70% of the link",
            "  rate, not overlapped.",
            "- The trainer runs every layout today except pp > 1 with sharding full or hybrid (a planned feature).",
        ]


@dataclass(frozen=True)
class Workload:
    """What a plan trains: the task, tokens per sequence for memory (`seq_len`), the global batch, real tokens per
    sample for time (SST-2's mean after dynamic padding; `padded`: every row padded to `seq_len`), the model FLOPs
    utilisation assumed, LoRA's rank (0: full fine-tuning) and the frozen base's quantization (nf4: QLoRA)."""

    head: HeadKind = HeadKind.CLASSIFICATION  # the model's last layer (instruction tuning trains the causal LM)
    seq_len: int = 128
    batch_size: int = 32
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

    def micro_batch(self, rows: float) -> MicroBatch:
        """What `rows` training rows (samples: pairs for dpo, two rows each) of one micro-batch become: packed
        sequences, or rows padded to seq_len."""
        rows, length = (2 * rows, 2 * self.seq_len) if self.pairs else (rows, self.seq_len)
        if not self.packing:
            return MicroBatch(rows, self.seq_len)
        per_row = min(self.tokens_per_row or self.tokens_per_sample, self.seq_len)
        return MicroBatch(max(1, math.ceil(rows * per_row / (PACKING_EFFICIENCY * length))), length)


@dataclass(frozen=True)
class MicroBatch:
    """The sequences one micro-batch holds on a rank: `rows` of `length` tokens."""

    rows: float
    length: int


def plan(
    model: str,
    gpus: int | None = None,
    gpu_mem_gb: float | None = None,
    instance: str | None = None,
    *,
    nodes: int = 1,
    gpu: str | None = None,
    workload: Workload = Workload(),
    runs_today: bool = False,
) -> Plan:
    """Every layout of `model` training `workload` on `nodes` x `gpus` GPUs (or an `instance`'s), best first; with
    `runs_today` only those the trainer runs now. See the module docstring for the assumptions."""
    hardware = hardware_for(gpus, gpu_mem_gb, instance, gpu, nodes)
    seq_len, batch_size = positive_int("seq_len", workload.seq_len), positive_int("batch_size", workload.batch_size)
    tokens_per_sample = positive_number("tokens_per_sample", workload.tokens_per_sample, "13.4")
    mfu, lora_rank = workload.mfu, workload.lora_rank
    if not 0 < mfu <= 1:
        raise UserError(f"mfu={mfu!r} is not valid; expected a fraction in (0, 1], e.g. 0.35")
    shape = model_shape(model, workload.head)
    if workload.base_quantization not in ("none", "nf4"):
        raise UserError(f"base_quantization={workload.base_quantization!r} is not valid; valid: none, nf4")
    nf4 = workload.base_quantization == "nf4"
    if nf4 and not lora_rank:
        raise UserError("base_quantization=nf4 is QLoRA: it quantizes LoRA's frozen base; give a lora_rank > 0")
    if lora_rank:
        shape = dataclasses.replace(shape, lora_rank=positive_int("lora_rank", lora_rank), nf4=nf4)
    tokens = seq_len if workload.padded else min(tokens_per_sample, seq_len)
    tokens *= 2 if workload.pairs else 1  # a preference pair is two rows: twice the compute of one
    steps = SST2_TRAIN_SENTENCES // batch_size
    rows = []
    for layout in candidate_layouts(shape, hardware, batch_size):
        if (runs_today and not layout.runs_today) or nf4_refusal(shape, layout):
            continue
        memory = memory_per_gpu(shape, layout, seq_len, batch_size, workload=workload)
        step = step_seconds(shape, hardware, layout, batch_size, tokens, mfu)
        rows.append(Row(layout, memory, step, steps * step / 60, memory["peak"] <= hardware.memory_gb * GB))
    if not rows:
        degrees = ", ".join(map(str, shape.family.valid_tp_degrees(shape.hf_config)))
        raise UserError(
            f"batch_size={batch_size}: no layout of {model} on {hardware.world} GPUs splits it evenly "
            f"over its data-parallel ranks (valid tp: {degrees})"
        )
    rows.sort(key=lambda row: (not row.fits, row.epoch_min, row.memory["peak"]))
    roomy = [row for row in rows if row.memory["peak"] <= (1 - HEADROOM) * hardware.memory_gb * GB]
    return Plan(shape, hardware, rows, roomy[0] if roomy else None, batch_size, seq_len, tokens, mfu, workload.pairs)
