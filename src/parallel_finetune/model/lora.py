"""LoRA (Hu et al. 2021): the pretrained weights frozen, a low-rank update B·A (scaled by alpha/rank) trained on
chosen Linear layers, plus the classification head.

Our own layer, not `peft`'s: peft replaces each target by a wrapper (`...q_proj.base_layer.weight`), which the
families' tensor-parallel plans (`parallelize_module` wants an `nn.Linear` at each planned path), the sharded
loader (checkpoint names) and the meta-device build would all have to learn. Here a target stays the same
`nn.Linear` object with the same parameter names; it gains two children, `lora_A` and `lora_B` (so their names
are exactly peft's, `...q_proj.lora_A.weight`), and its class becomes `LoraLinear`, whose forward adds the
update. The adapter is exported in peft's format (adapter_config.json + adapter_model.safetensors) for
`PeftModel.from_pretrained`, see `export_adapter`.

Tensor parallelism (LoRA is applied after the family's plan, still on `meta`): the adapter of a column-wise layer
holds A whole and shards B on its output dimension (B·A·x is then sharded exactly like W·x); the adapter of a
row-wise layer shards A on its input dimension and holds B whole (A·x is a partial sum, like W·x, and both are
summed by the layer's one all-reduce). No activation is gathered that the base layer did not gather already.
GPT-2's fused c_attn is three Linears q/k/v in this repository (families/gpt2.py): each gets its adapter, so every
rank keeps whole heads; export folds the three into one adapter of c_attn (rank 3r, exactly the same update).

Frozen means `requires_grad=False`: no gradient, no AdamW state, not in checkpoints. In 16-bit training the frozen
weights are held in the compute dtype (bf16/fp16), not as fp32 master copies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import UserError
from ..tasks.task import HeadKind
from .quantize import NF4Settings, block_linears, check_quantizable, check_shards

log = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...] | str  # module names (a name or a dotted tail of a path inside a block), or all-linear
    modules_to_save: tuple[str, ...]  # trained in full (the classification head)
    quantization: NF4Settings | None = None  # QLoRA: the base's block Linears held in NF4 (quantize.py)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _matches(relative: str, target: str) -> bool:
    """`target`'s dotted parts appear, in a row, among the path's parts: q_proj ~ attn.q_proj, c_attn ~
    attn.c_attn.q (GPT-2's fused q|k|v: all three), attention.output.dense, ..."""
    parts, wanted = relative.split("."), target.split(".")
    return any(parts[i : i + len(wanted)] == wanted for i in range(len(parts) - len(wanted) + 1))


def target_modules(model: nn.Module, family, settings: LoraSettings) -> list[tuple[str, nn.Linear, str]]:
    """(path, module, tensor-parallel style: column|row|none) of every adapted Linear in the blocks this
    process holds (a pipeline stage: its blocks), in order."""
    found = []
    for path, relative, module in block_linears(model, family):
        if settings.targets != ALL_LINEAR and not any(_matches(relative, t) for t in settings.targets):
            continue
        style = "column" if relative in family.column_wise else "row" if relative in family.row_wise else "none"
        found.append((path, module, style))
    return found


def planned_shapes(model: nn.Module, family, settings: LoraSettings) -> dict[str, list[int]]:
    """The adapters' global parameter shapes by name, for the unsplit model (what identifies a checkpoint)."""
    shapes = {}
    for path, module, _ in target_modules(model, family, settings):
        shapes[f"{path}.lora_A.weight"] = [settings.rank, module.in_features]
        shapes[f"{path}.lora_B.weight"] = [module.out_features, settings.rank]
    return shapes


def check_targets(model: nn.Module, family, settings: LoraSettings) -> None:
    """Every entry of lora_target_modules and lora_modules_to_save names something in `model` (the whole model,
    on `meta`), and no adapter is wider than its layer; else one line. A name matching nothing would leave what
    it meant untouched: a misspelt head stays frozen at its random initialisation. QLoRA: the blocks have Linear
    layers to quantize."""
    linears = sorted({relative for _, relative, _ in block_linears(model, family)})
    for target in settings.targets if settings.targets != ALL_LINEAR else ():
        if not any(_matches(relative, target) for relative in linears):
            raise UserError(
                f"lora_target_modules: {target!r} matches no Linear layer of a {family.name} block; its layers: "
                f"{', '.join(linears)} (or all-linear)"
            )
    names = [name for name, _ in model.named_parameters()]  # the names trainable_names selects from
    first_name = {id(param): name for name, param in reversed(list(model.named_parameters()))}
    for module in settings.modules_to_save:
        if not any(name.startswith(f"{module}.") for name in names):
            tied = [
                first_name[id(param)]
                for name, param in model.named_parameters(remove_duplicate=False)
                if name.startswith(f"{module}.")
            ]
            if tied:
                raise UserError(
                    f"lora_modules_to_save: {module!r} holds only weights tied to {', '.join(tied)}; "
                    f"name {tied[0].rsplit('.', 1)[0]} instead"
                )
            outside = sorted({n.rsplit(".", 1)[0] for n in names if not n.startswith(f"{family.block_path}.")})
            raise UserError(
                f"lora_modules_to_save: {module!r} names no module with parameters in this {family.name} model; "
                f"modules outside the blocks: {', '.join(outside)} (or a block's path, {family.block_path}.0)"
            )
    if settings.quantization is not None:
        check_quantizable(model, family)
        check_saved_unquantized(model, family, settings)
    for path, module, _ in target_modules(model, family, settings):
        if settings.rank > min(module.in_features, module.out_features):
            raise UserError(
                f"lora_rank={settings.rank} is larger than the layer it adapts: {path} has {module.in_features} "
                f"inputs and {module.out_features} outputs; use lora_rank <= "
                f"{min(module.in_features, module.out_features)} or leave that layer out of lora_target_modules"
            )


def check_saved_unquantized(model: nn.Module, family, settings: LoraSettings) -> None:
    """QLoRA holds every Linear of the blocks in NF4, frozen: a module to save that is one of them, or holds one,
    would be logged as trained and never change, so it is refused in one line."""
    for module in settings.modules_to_save:
        inside = [
            path for path, _, _ in block_linears(model, family) if path == module or path.startswith(f"{module}.")
        ]
        if inside:
            raise UserError(
                f"lora_modules_to_save: {module!r} holds {inside[0]}"
                + (f" and {len(inside) - 1} more Linear layer(s)" if len(inside) > 1 else "")
                + ", which lora_base_quantization=nf4 keeps frozen in 4 bits, so it would never train; adapt it "
                "with lora_target_modules, or set lora_base_quantization=none to train it in full"
            )


def check_new_trained(new: list[str], settings: LoraSettings, source: str) -> None:
    """Weights the checkpoint lacks (a classification head) start random: frozen, they would stay random."""
    heads = tuple(f"{m}." for m in settings.modules_to_save)
    frozen = sorted(name for name in new if ".lora_" not in name and not name.startswith(heads))
    if frozen:
        modules = sorted({name.rsplit(".", 1)[0] for name in frozen})
        raise UserError(
            f"peft=lora: {', '.join(frozen)} not in the checkpoint ({source}), so initialised at random, and "
            f"lora_modules_to_save={list(settings.modules_to_save)} would keep them frozen at random values; add "
            f"{', '.join(modules)} to lora_modules_to_save"
        )


def preflight(
    settings: LoraSettings | None,
    *,
    family,
    head: HeadKind,
    hf_config,
    pretrained_folder: str | None,
    tp: int = 1,
    fsdp: int = 1,
) -> None:
    """`--check`'s LoRA checks, on the model built on `meta`: what check_targets refuses, QLoRA's shards that do
    not block under `tp`-way tensor parallelism and `fsdp`-way FSDP, and (pretrained weights in a local folder,
    `pretrained_folder`) a new weight left frozen."""
    if settings is None:
        return
    model = family.build(head, hf_config)
    check_targets(model, family, settings)
    if settings.quantization is not None:
        check_shards(model, family, settings.quantization, tp=tp, fsdp=fsdp)
    if pretrained_folder is None or not Path(pretrained_folder).is_dir():
        return  # trained from scratch, or a Hub name: the run checks the same once it has the files
    from .weights import plan_whole

    weights, _, _, plan = plan_whole(family, head, hf_config, pretrained_folder)
    try:
        check_new_trained(list(plan.new), settings, weights.description)
    finally:
        weights.close()


class LoraLinear(nn.Linear):
    """An nn.Linear with a LoRA update: y = W x + scaling * B(A(dropout(x))) + b. The bias is added last, so under
    row-wise tensor parallelism both partial sums meet the layer's one all-reduce together."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    lora_scaling: float
    lora_disabled = False  # adapters_disabled: the base layer alone (task=dpo's reference model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.lora_disabled:
            return out + self.bias if self.bias is not None else out
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))
        out = out + update * self.lora_scaling
        return out + self.bias if self.bias is not None else out


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The model without its LoRA updates while inside: the frozen base, which is task=dpo's reference model (no
    second model held)."""
    layers = [module for module in model.modules() if isinstance(module, LoraLinear)]
    for layer in layers:
        layer.lora_disabled = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_disabled = False


def _meta_parameter(shape: tuple[int, int], mesh: DeviceMesh | None, placement) -> nn.Parameter:
    if mesh is None or mesh.size() == 1:
        return nn.Parameter(torch.empty(shape, device="meta"))
    local_shape = list(shape)
    if isinstance(placement, Shard):
        local_shape[placement.dim] //= mesh.size()
    local = torch.empty(local_shape, device="meta")
    stride = (shape[1], 1)
    return nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride))


def apply_lora(model: nn.Module, family, settings: LoraSettings, tp_mesh: DeviceMesh | None) -> list[str]:
    """Adapters on this process's targets (after tensor parallelism, on `meta`); returns their parameter names."""
    names = []
    for path, module, style in target_modules(model, family, settings):
        a_place, b_place = {
            "column": (Replicate(), Shard(0)),
            "row": (Shard(1), Replicate()),
            "none": (Replicate(), Replicate()),
        }[style]
        mesh = tp_mesh if isinstance(module.weight, DTensor) else None
        lora_a = nn.Linear(module.in_features, settings.rank, bias=False, device="meta")
        lora_b = nn.Linear(settings.rank, module.out_features, bias=False, device="meta")
        lora_a.weight = _meta_parameter((settings.rank, module.in_features), mesh, a_place)
        lora_b.weight = _meta_parameter((module.out_features, settings.rank), mesh, b_place)
        module.lora_A, module.lora_B = lora_a, lora_b
        module.lora_dropout = nn.Dropout(settings.dropout) if settings.dropout else nn.Identity()
        module.lora_scaling = settings.scaling
        module.__class__ = LoraLinear
        names += [f"{path}.lora_A.weight", f"{path}.lora_B.weight"]
    return names


def freeze_base(model: nn.Module, trainable: set[str], frozen_dtype: torch.dtype | None) -> None:
    """Everything but `trainable` stops requiring gradients; with `frozen_dtype` (16-bit training) frozen weights
    are held in it. Still on `meta`: nothing is converted, the dtype decides what is allocated."""
    names: dict[int, set[str]] = {}
    for full, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(full)
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or names[id(param)] & trainable:
                continue
            if id(param) not in replaced:
                data = param.detach()
                if frozen_dtype is not None and param.is_floating_point():
                    data = data.to(frozen_dtype)
                replaced[id(param)] = nn.Parameter(data, requires_grad=False)
            module._parameters[name] = replaced[id(param)]


def trainable_names(model: nn.Module, lora_names: list[str], settings: LoraSettings) -> set[str]:
    heads = tuple(f"{m}." for m in settings.modules_to_save)
    return set(lora_names) | {name for name, _ in model.named_parameters() if name.startswith(heads)}


def trainable_count(shapes: dict[str, list[int]], settings: LoraSettings) -> int:
    """Trainable parameters of the whole (unsplit) model, from its shapes by name."""
    heads = tuple(f"{m}." for m in settings.modules_to_save)
    return sum(math.prod(shape) for name, shape in shapes.items() if ".lora_" in name or name.startswith(heads))


def initial_value(name: str, shape: list[int] | tuple[int, ...], seed: int) -> torch.Tensor:
    """peft's initialisation, from the run's seed and the name (the same numbers in every layout): A
    Kaiming-uniform (a=sqrt(5), as nn.Linear), B zeros, so training starts from the pretrained model."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2/6), bound gain*sqrt(3/fan_in)
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


# ----------------------------------------------------------------------------------------------- export
def adapter_modules(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted({name[: -len(".lora_A.weight")] for name in state if name.endswith(".lora_A.weight")})


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Whole tensors by the built model's names -> the same model with W + scaling * B @ A and no adapters."""
    out = {name: tensor for name, tensor in state.items() if ".lora_" not in name}
    for path in adapter_modules(state):
        weight = out[f"{path}.weight"]
        delta = state[f"{path}.lora_B.weight"].float() @ state[f"{path}.lora_A.weight"].float()
        out[f"{path}.weight"] = (weight.float() + scaling * delta).to(weight.dtype)
    return out


def peft_tensors(
    state: dict[str, torch.Tensor], family, hf_config, settings: LoraSettings
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The adapter (and head) in peft's naming, by the unmodified transformers class's module names; adapters of
    several of our Linears that are one module there (GPT-2's q/k/v of c_attn) become one adapter of rank
    sum(r): A stacked, B block-placed at each part's output rows. Returns (tensors, module -> rank if not r)."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for path in adapter_modules(state):
        source = family.hf_source(f"{path}.weight", hf_config)
        groups.setdefault(source.key.removesuffix(".weight"), []).append((source.start, path))
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for module, parts in groups.items():
        parts.sort()
        a = torch.cat([state[f"{p}.lora_A.weight"] for _, p in parts])
        rows = max(start + state[f"{p}.lora_B.weight"].shape[0] for start, p in parts)
        if len(parts) > 1 or parts[0][0]:
            out_features = family.hf_out_features(parts[0][1], rows, hf_config)
            b = torch.zeros(out_features, a.shape[0], dtype=a.dtype)
            column = 0
            for start, p in parts:
                piece = state[f"{p}.lora_B.weight"]
                b[start : start + piece.shape[0], column : column + piece.shape[1]] = piece
                column += piece.shape[1]
            ranks[module] = a.shape[0]
        else:
            b = state[f"{parts[0][1]}.lora_B.weight"]
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    heads = tuple(f"{m}." for m in settings.modules_to_save)
    for name, tensor in state.items():
        if ".lora_" not in name and name.startswith(heads):
            tensors[f"base_model.model.{family.hf_source(name, hf_config).key}"] = tensor.contiguous()
    return tensors, ranks


def export_adapter(
    state: dict[str, torch.Tensor], family, hf_config, settings: LoraSettings, head: HeadKind, base: str, out: Path
) -> None:
    """Write `out` as a peft adapter folder: adapter_config.json + adapter_model.safetensors."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors, ranks = peft_tensors(state, family, hf_config, settings)
    short = {name.rsplit(".", 1)[-1] for name in ranks}  # peft's patterns match module names' ends
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=sorted(
            {
                key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0].rsplit(".", 1)[-1]
                for key in tensors
                if ".lora_" in key
            }
        ),
        rank_pattern={name: ranks[next(k for k in ranks if k.endswith(name))] for name in short},
        alpha_pattern={
            name: settings.alpha * ranks[next(k for k in ranks if k.endswith(name))] / settings.rank for name in short
        },
        modules_to_save=list(settings.modules_to_save) or None,
        fan_in_fan_out=family.hf_conv1d,
        task_type="SEQ_CLS" if HeadKind(head) is HeadKind.CLASSIFICATION else "CAUSAL_LM",
        base_model_name_or_path=base,
    )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        f"LoRA adapter (rank {settings.rank}, alpha {settings.alpha:g}) of {base}, written by parallel_finetune.\n\n"
        "```python\nfrom peft import PeftModel\nmodel = PeftModel.from_pretrained(base_model, this_folder)\n```\n"
    )
    log.debug("adapter tensors: %s", json.dumps({k: list(v.shape) for k, v in tensors.items()}))
