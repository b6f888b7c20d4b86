"""Pretrained weights straight into each rank's shards: no rank ever holds the whole model.

The model is built on the `meta` device (`Family.build`: shapes, no storage), cut into pipeline stages,
tensor-parallelised and sharded there. Then `materialize` allocates this rank's pieces only, and `load_weights`
fills every piece from the checkpoint files, reading just the bytes of its block:

    plan_load(model, family, tensors)   for every parameter: which checkpoint tensor, which block of it
    materialize(model, device)          allocate the local shards (plain, DTensor or FSDP)
    load_weights(model, plan, ...)      read each block (pread, one block at a time), copy it into its shard

Blocks come from the DTensor placements (`compute_local_shape_and_global_offset`: TP's Shard, FSDP's strided
shards, any mix), through the family's `hf_source` (GPT-2's Conv1D transposes and the q|k|v columns of its fused
c_attn), so a GPT-2 rank reads only the columns of its own heads.

Why our own safetensors reader instead of `safetensors.safe_open(...).get_slice` or DCP's Hugging Face storage
reader: both map the whole file into memory, and every page a slice touches stays resident in the process until
the file is closed (measured here: the per-rank peak then grows towards the file's size). `pread` into the
destination-sized buffer keeps the transient extra at one block. The safetensors format is a JSON header and raw
little-endian arrays, which is all this needs. `.bin` checkpoints (pickle archives) are read with
`torch.load(mmap=True, weights_only=True)`: no code runs, slices read only their pages, but mapped pages count.

A checkpoint's keys go through transformers' own conversion for the model (`get_model_conversion_mapping`, what
from_pretrained applies): renamings (LayerNorm gamma/beta, Mixtral's block_sparse_moe -> mlp) are aliases read
block by block; a converted tensor (a mixture-of-experts layer's experts, stored one per expert on the Hub, fused
into one 3-D parameter) is built by transformers' operations from that layer's per-expert tensors only, then cut to
the rank's block: a pipeline stage builds its own layers' experts, never the model's.

Parameters the checkpoint lacks are an error (`refuse_missing`), except the head the task adds (a new
classification head), initialised by the model's own `_init_weights` on a CPU copy of its module, from the run's
seed and the parameter's name: the same values in every layout.
A tiny run loads the same way from an unmodified transformers model initialised in memory (`Family.hf_model`),
so every layout of every test goes through this code. `model.load_model` is the one caller of the whole sequence
(a run, resume, export, tests, benchmarks); `--check` runs its first half (`plan_whole`: headers only).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import struct
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import UserError
from ..families.base import Family, HFSource

if TYPE_CHECKING:
    from ..tasks.task import HeadKind

log = logging.getLogger(__name__)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) of a block of a tensor


# ----------------------------------------------------------------------------------------------- checkpoint files
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


class SafetensorsFile:
    """One .safetensors file read with pread: the header once, then exactly the bytes of each requested block.
    Every entry of the header is checked when the file is opened (a known dtype, a shape, and data_offsets that
    span exactly shape x dtype bytes inside the file), so no read can take a neighbour's bytes."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > min(MAX_HEADER_BYTES, size - 8):
                    raise UserError(f"{path}: header length {length:,} is impossible in a file of {size:,} bytes")
                header = json.loads(handle.read(length))
        except (OSError, struct.error, ValueError) as exc:
            raise UserError(f"{path}: not a readable safetensors file ({type(exc).__name__})") from None
        if not isinstance(header, dict):
            raise UserError(f"{path}: the header is a JSON {type(header).__name__}, not an object of tensors")
        self.data_start = 8 + length
        self.entries = {
            key: _checked_entry(path, key, entry, size - self.data_start)
            for key, entry in header.items()
            if key != "__metadata__"
        }
        self.fd: int | None = None

    def keys(self):
        return self.entries.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.entries[key]["dtype"]]

    def read(self, key: str, box: Box) -> torch.Tensor:
        shape, dtype = self.shape(key), self.dtype(key)
        offsets, size = box
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY)
        begin = self.data_start + self.entries[key]["data_offsets"][0]
        out = torch.empty(size, dtype=dtype)
        if out.numel() == 0:
            return out
        # As rows of a 2-D view: leading index x the rest (rows of a matrix, or one row for a vector).
        rows_shape = (shape[0] if shape else 1, _prod(shape[1:]))
        if len(shape) > 2 and tuple(size[1:]) != tuple(shape[1:]):
            raise UserError(f"{self.path}: {key} {list(shape)}: blocks of tensors above 2-D are read whole-row")
        item = out.element_size()
        if len(shape) <= 1:
            start, count = (offsets[0], size[0]) if shape else (0, 1)
            rows = [(0, start, count)]
        else:
            row0, col0 = offsets[0], offsets[1] if len(shape) == 2 else 0
            count = size[1] if len(shape) == 2 else rows_shape[1]
            rows = [(i, (row0 + i) * rows_shape[1] + col0, count) for i in range(size[0])]
        buffer = out.view(-1).view(torch.uint8).numpy()
        contiguous = len(rows) == 1 or count == rows_shape[1]
        if contiguous:  # one read for the whole block
            _pread_into(self.fd, buffer, begin + rows[0][1] * item, self.path)
        else:
            per_row = count * item
            for index, element, _ in rows:
                _pread_into(self.fd, buffer[index * per_row : (index + 1) * per_row], begin + element * item, self.path)
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _sizes(value, length: int | None = None) -> bool:
    """A list of non-negative integers (of `length` of them)."""
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


def _checked_entry(path: Path, key: str, entry, data_bytes: int) -> dict:
    """A header entry that describes a tensor lying wholly inside the file's data, or one line saying what is wrong."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        problem = "lacks dtype, shape or data_offsets"
    elif entry["dtype"] not in SAFETENSORS_DTYPES:
        problem = f"has dtype {entry['dtype']!r}; known: {', '.join(SAFETENSORS_DTYPES)}"
    elif not _sizes(entry["shape"]):
        problem = f"has shape {entry['shape']!r}, not a list of sizes"
    elif not _sizes(entry["data_offsets"], 2) or entry["data_offsets"][0] > entry["data_offsets"][1]:
        problem = f"has data_offsets {entry['data_offsets']!r}, not [begin, end] with 0 <= begin <= end"
    else:
        (begin, end), dtype = entry["data_offsets"], SAFETENSORS_DTYPES[entry["dtype"]]
        needed = _prod(entry["shape"]) * dtype.itemsize
        if end - begin != needed:
            problem = (
                f"has data_offsets [{begin}, {end}] ({end - begin:,} bytes) but shape {entry['shape']} of "
                f"{entry['dtype']} is {needed:,} bytes"
            )
        elif end > data_bytes:
            problem = f"has data_offsets [{begin}, {end}] past the end of the file's data ({data_bytes:,} bytes)"
        else:
            return entry
    raise UserError(f"{path}: tensor {key!r} {problem}")


def _prod(values) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def _pread_into(fd: int, buffer, offset: int, path: Path) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise UserError(f"{path}: ends early (truncated file?)")
        done += count


class TorchBinFile:
    """A pytorch_model.bin (zip archive of tensors), memory-mapped; `weights_only` refuses anything but tensors."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # torch raises several types for a bad archive; all mean "cannot read it"
            raise UserError(f"{path}: not a loadable PyTorch weights file ({type(exc).__name__})") from None
        if not isinstance(self.tensors, dict) or not all(isinstance(t, torch.Tensor) for t in self.tensors.values()):
            raise UserError(f"{path}: not a state dict (a mapping of names to tensors)")

    def keys(self):
        return self.tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self.tensors[key][_slices(box)].clone()

    def close(self) -> None:
        self.tensors = {}


class TensorSource(Protocol):
    def shape(self, key: str) -> tuple[int, ...]: ...
    def dtype(self, key: str) -> torch.dtype: ...
    def read(self, key: str, box: Box) -> torch.Tensor: ...
    def close(self) -> None: ...


class StateDictSource:
    """Tensors in memory by name: a tiny run's freshly initialised transformers model."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self.tensors[key][_slices(box)]

    def close(self) -> None:
        self.tensors = {}


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(offset, offset + size) for offset, size in zip(*box))


@dataclass
class Converted:
    """A model tensor that transformers builds from several checkpoint tensors (a mixture-of-experts layer's experts,
    stored one per expert, fused into one 3-D parameter): transformers' own `WeightConverter` for it and its sources
    in the order from_pretrained collects them; `shape` and `dtype` of the result (from a run on `meta`)."""

    converter: object  # transformers.core_model_loading.WeightConverter
    sources: list[tuple[str, str]]  # (the converter's source pattern, checkpoint key)
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32


@dataclass
class Checkpoint:
    """The tensors of a Hugging Face model folder (one or several safetensors or .bin files), by key, as transformers'
    from_pretrained reads them: with or without the base model's prefix, and (`convert`) through transformers' own
    checkpoint conversion for the model (renamed keys, e.g. LayerNorm gamma/beta or Mixtral's block_sparse_moe ->
    mlp; per-expert tensors fused into one 3-D parameter per layer)."""

    files: dict[str, TensorSource]  # key -> the file holding it
    prefix: str = ""  # the model's base_model_prefix (transformer, bert)
    description: str = ""
    renamed: dict[str, str] = field(default_factory=dict)  # the model's key -> the checkpoint's
    converted: dict[str, Converted] = field(default_factory=dict)  # the model's key -> its checkpoint tensors

    def convert(self, model: nn.Module) -> None:
        """Apply transformers' checkpoint conversion for `model` (its `get_model_conversion_mapping`, as
        from_pretrained does): keys are renamed, and a converter's sources grouped by the key they build, in
        from_pretrained's order (natural key order: expert 2 before expert 10). Each converted tensor is built once
        on `meta` with transformers' operations, so its shape is known (and checked) before any byte is read."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        conversions = get_model_conversion_mapping(model)
        renamings = [entry for entry in conversions if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in conversions if isinstance(entry, WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        for key in sorted(self.files, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters)
            if pattern is not None:
                self.converted.setdefault(target, Converted(by_pattern[pattern], [])).sources.append((pattern, key))
            elif target != key:
                self.renamed[target] = key
        for target, converted in self.converted.items():
            try:
                built = self._run_converter(target, converted, self._meta)
            except Exception as exc:  # transformers' operations raise what torch raises (sizes that do not stack)
                keys = [key for _, key in converted.sources]
                raise UserError(
                    f"{self.description}: transformers cannot build {target} from the {len(keys)} tensors "
                    f"{keys[0]} ... {keys[-1]} ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]})"
                ) from None
            converted.shape, converted.dtype = tuple(built.shape), built.dtype

    def _run_converter(self, target: str, converted: Converted, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """`target` as transformers builds it: its converter (a fresh copy, as from_pretrained makes one per target)
        given each source as a callable, which its `convert` calls in turn."""
        converter = copy.deepcopy(converted.converter)
        for pattern, key in converted.sources:
            converter.add_tensor(target, key, pattern, lambda key=key: tensor(key))
        result = converter.convert(target)
        if target not in result:
            raise UserError(f"{self.description}: transformers' conversion of {target} gave {', '.join(result)}")
        value = result[target]
        return value[0] if isinstance(value, list) else value

    def find(self, key: str) -> str | None:
        candidates = [key]
        if self.prefix and key.startswith(self.prefix + "."):
            candidates.append(key[len(self.prefix) + 1 :])
        return next((c for c in candidates if c in self.converted or c in self.renamed or c in self.files), None)

    def sources_of(self, key: str) -> list[str]:
        """The checkpoint tensors that a found key reads."""
        if key in self.converted:
            return [source for _, source in self.converted[key].sources]
        return [self.renamed.get(key, key)]

    def read(self, key: str, box: Box) -> torch.Tensor:
        if key in self.converted:
            # Built whole from this layer's per-expert tensors (one layer at a time, never the model), then cut.
            converted = self._run_converter(key, self.converted[key], lambda source: self._read_whole(source))
            return converted[_slices(box)]
        key = self.renamed.get(key, key)
        return self.files[key].read(key, box)

    def _read_whole(self, key: str) -> torch.Tensor:
        shape = self.files[key].shape(key)
        return self.files[key].read(key, ((0,) * len(shape), shape))

    def _meta(self, key: str) -> torch.Tensor:
        return torch.empty(self.files[key].shape(key), dtype=self.files[key].dtype(key), device="meta")

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self.converted:
            return self.converted[key].shape
        key = self.renamed.get(key, key)
        return self.files[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        if key in self.converted:
            return self.converted[key].dtype
        key = self.renamed.get(key, key)
        return self.files[key].dtype(key)

    def dtypes(self) -> set[torch.dtype]:
        return {source.dtype(key) for key, source in self.files.items()}

    def close(self) -> None:
        for source in {id(source): source for source in self.files.values()}.values():
            source.close()


# The weight files of a Hugging Face model folder that the loader reads, preferred first: (index, single file, reader)
WEIGHT_FILES = (
    ("model.safetensors.index.json", "model.safetensors", SafetensorsFile),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", TorchBinFile),
)


def open_checkpoint(folder: str | Path, prefix: str = "") -> Checkpoint:
    """The weights of a Hugging Face model folder; safetensors preferred, sharded (index.json) or not."""
    folder = Path(folder)
    for index_name, single_name, kind in WEIGHT_FILES:
        if (folder / index_name).is_file():
            index = folder / index_name
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise UserError(f"{index}: not a valid weight index ({type(exc).__name__})") from None
            if not isinstance(weight_map, dict):
                raise UserError(f"{index}: weight_map is a JSON {type(weight_map).__name__}, not an object")
            for name in weight_map.values():
                # a plain file name beside the index, as transformers writes it: never a path out of the folder
                if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
                    raise UserError(f"{index}: weight file {name!r} is not a file name in {folder}")
            opened = {name: kind(folder / name) for name in sorted(set(weight_map.values()))}
            files = {key: opened[name] for key, name in weight_map.items()}
            for key, name in weight_map.items():
                if key not in opened[name].keys():
                    raise UserError(f"{index}: {key!r} is in {name} by the index, but that file has no such tensor")
            return Checkpoint(files, prefix, f"{len(opened)} {single_name.split('.')[-1]} files in {folder}")
        if (folder / single_name).is_file():
            source = kind(folder / single_name)
            keys = source.entries if isinstance(source, SafetensorsFile) else source.tensors
            return Checkpoint({key: source for key in keys}, prefix, f"{folder / single_name}")
    raise UserError(
        f"model={str(folder)!r}: no weights (model.safetensors, pytorch_model.bin or their .index.json) in the folder"
    )


# ----------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Read:
    name: str  # the built model's parameter
    key: str  # the checkpoint tensor
    box: Box  # its block that this rank holds
    transpose: bool  # the block is the transpose of the parameter's block (GPT-2 Conv1D)

    @property
    def numel(self) -> int:
        return _prod(self.box[1])


@dataclass
class LoadPlan:
    reads: list[Read] = field(default_factory=list)
    new: dict[str, Box] = field(default_factory=dict)  # not in the checkpoint: name -> this rank's block
    unused: list[str] = field(default_factory=list)  # checkpoint tensors no parameter reads


def shard_box(param: torch.Tensor) -> Box:
    """The block of the global tensor that this rank holds of `param` (the whole tensor if it is not sharded)."""
    if isinstance(param, DTensor):
        shape, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(offsets), tuple(shape)
    return (0,) * param.ndim, tuple(param.shape)


def plan_load(
    model: nn.Module,
    family: Family,
    checkpoint,
    aliases: dict[str, list[str]] | None = None,
    box_of: Callable[[torch.Tensor], Box] = shard_box,
    global_shape: Callable[[torch.Tensor], tuple[int, ...]] | None = None,
) -> LoadPlan:
    """For every parameter this rank holds: the checkpoint tensor and block to read, each tensor checked against
    the parameters it fills (`check_shape`, and floating point for floating point). `aliases`: other names of a
    tied weight (GPT-2's lm_head is wte), for checkpoints that store it under one of them only. `global_shape`: a
    parameter's unsharded shape in the checkpoint's terms (default: its shape, or ZeRO-3's ds_shape)."""
    plan, used = LoadPlan(), set()
    pieces: dict[str, list[tuple[str, HFSource, tuple[int, ...]]]] = {}  # key -> the parameters read from it
    for name, param in model.named_parameters():
        box = box_of(param)
        if ".lora_" in name:  # LoRA adapters (lora.py) are new by definition, never read from the base
            plan.new[name] = box
            continue
        candidates = [name, *(aliases or {}).get(name, [])]
        found = None
        for candidate in candidates:
            source = family.hf_source(candidate, model.config)
            key = checkpoint.find(source.key)
            if key is not None:
                found = source, key
                break
        if found is None:
            plan.new[name] = box
            continue
        source, key = found
        # the unsharded shape (ZeRO-3 keeps it in ds_shape; QLoRA's FSDP-held row-wise weights are stored in x out)
        whole = global_shape(param) if global_shape else tuple(getattr(param, "ds_shape", param.shape))
        pieces.setdefault(key, []).append((name, source, whole[::-1] if source.transpose else whole))
        if checkpoint.dtype(key).is_floating_point != param.dtype.is_floating_point:
            raise UserError(
                f"{checkpoint.description}: tensor {key} is {checkpoint.dtype(key)}, parameter {name} is {param.dtype}"
            )
        offsets, shape = box
        if source.transpose:
            offsets, shape = offsets[::-1], shape[::-1]
        if source.start:
            offsets = tuple(o + source.start if d == source.dim else o for d, o in enumerate(offsets))
        plan.reads.append(Read(name, key, (tuple(offsets), tuple(shape)), source.transpose))
        used.update(checkpoint.sources_of(key))
    for key, parts in pieces.items():
        check_shape(checkpoint, key, parts)
    plan.unused = sorted(set(checkpoint.files) - used) if hasattr(checkpoint, "files") else []
    return plan


def check_shape(checkpoint, key: str, parts: list[tuple[str, HFSource, tuple[int, ...]]]) -> None:
    """The checkpoint tensor `key` has exactly the shape of the parameters read from it, after the family's
    transformation (`hf_source`): one parameter, transposed or not, or several laid side by side along one
    dimension (GPT-2's q, k, v in c_attn). A config that does not describe the files (an edited config.json, a
    size override) would otherwise read a corner of each matrix, or the bytes of the next tensor."""
    names = ", ".join(name for name, _, _ in parts)
    # the same block read twice is one piece (a tied weight a pipeline stage holds as a parameter of its own)
    parts = list({(source.start, shape): (name, source, shape) for name, source, shape in parts}.values())
    dim = parts[0][1].dim
    model_shape, tiled = list(parts[0][2]), True
    if len(parts) > 1 or parts[0][1].start:  # side by side: each starts where the one before ends
        end = 0
        for _, source, shape in sorted(parts, key=lambda part: part[1].start):
            same_elsewhere = len(shape) == len(model_shape) and all(
                n == m for d, (n, m) in enumerate(zip(shape, model_shape)) if d != dim
            )
            tiled = tiled and same_elsewhere and source.start == end
            end += shape[dim]
        model_shape[dim] = end
    file_shape = list(checkpoint.shape(key))
    if file_shape != model_shape or not tiled:
        raise UserError(
            f"{checkpoint.description}: tensor {key} is {file_shape} in the file, but the model built from the "
            f"config needs {model_shape} for {names}; the config does not describe these weights"
        )


# ----------------------------------------------------------------------------------------------- materialize, load
def materialize(model: nn.Module, device: torch.device, leave: Collection[int] = ()) -> None:
    """Allocate every parameter still on `meta` (this rank's shard of it) on `device`, uninitialised; buffers,
    computed at build time, move there. FSDP-sharded models go through `to_empty`, which FSDP2 supports (its
    sharded parameters are re-registered); others swap each parameter in place, so ties and references hold.
    Parameters whose id is in `leave` stay on `meta` (QLoRA's: quantized as the loader reads them)."""
    from torch.distributed.fsdp import FSDPModule

    buffers = {
        (module, name): buffer
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and not buffer.is_meta
    }
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        model.to_empty(device=device)
    else:
        for param in {id(p): p for p in model.parameters()}.values():
            if param.is_meta and id(param) not in leave:
                torch.utils.swap_tensors(param, nn.Parameter(_empty_like(param, device), param.requires_grad))
    for (module, name), buffer in buffers.items():
        module._buffers[name] = buffer.to(device)


def _empty_like(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(param, DTensor):
        local = torch.empty(param.to_local().shape, dtype=param.dtype, device=device)
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return torch.empty(param.shape, dtype=param.dtype, device=device)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class NewWeights:
    """Initial values of parameters the checkpoint lacks, made by the model's own `_init_weights` on a CPU copy
    of the module that owns each (captured from the unsplit meta model), reseeded per parameter: every layout,
    and one process, get the same numbers."""

    def __init__(self, model: nn.Module, names: list[str], seed: int):
        self.init = model._init_weights
        self.seed = seed
        self.templates = {}
        self.computed: dict[str, Callable[[], torch.Tensor]] = {}  # other new weights (LoRA adapters): whole values
        for name in names:
            module_path, _, leaf = name.rpartition(".")
            self.templates[name] = (copy.deepcopy(model.get_submodule(module_path)), leaf)

    def known(self, name: str) -> bool:
        return name in self.templates or name in self.computed

    def value(self, name: str) -> torch.Tensor:
        if name in self.computed:
            return self.computed[name]()
        template, leaf = self.templates[name]
        module = copy.deepcopy(template).to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            with torch.no_grad():
                self.init(module)
        return getattr(module, leaf).detach()


@torch.no_grad()
def load_weights(
    model: nn.Module,
    plan: LoadPlan,
    checkpoint,
    new: NewWeights | None = None,
    write: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Fill this rank's blocks: each checkpoint block read, converted to the parameter's dtype (fp16/bf16 files
    into fp32 master weights) and copied into place, one block at a time. `write(param, block)` stores a block
    (default: into the local shard)."""
    params = dict(model.named_parameters())
    write = write or (lambda param, block: local_tensor(param).copy_(block))
    for read in plan.reads:
        block = checkpoint.read(read.key, read.box)
        write(params[read.name], block.t() if read.transpose else block)
        del block
    missing = [name for name in plan.new if new is None or not new.known(name)]
    if missing:
        raise UserError(f"the checkpoint lacks {', '.join(missing[:3])} and no initialiser was given")
    for name, box in plan.new.items():
        write(params[name], new.value(name)[_slices(box)])


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """name -> the other names of the same Parameter (tied embeddings), from the unsplit model."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {
        name: [other for other in names if other != name]
        for names in groups.values()
        if len(names) > 1
        for name in names
    }


def weights_source(family: Family, head: HeadKind, hf_config, model_path: str | None) -> Checkpoint:
    """The pretrained files of `model_path`, or (None: a tiny model) the unmodified transformers model initialised
    in memory from the current RNG state, read the same way."""
    prefix = family.model_classes[head].base_model_prefix
    if model_path is not None:
        return open_checkpoint(model_path, prefix)
    initial = family.hf_model(head, hf_config).state_dict()
    return Checkpoint({key: StateDictSource(initial) for key in initial}, prefix, "initialised from the seed")


class Planned(NamedTuple):
    """The first half of a load: the weights, the model built on `meta` (unsplit), the other names of its tied
    weights (a pipeline stage may hold one name only), and the unsplit model's plan."""

    weights: Checkpoint
    model: nn.Module
    aliases: dict[str, list[str]]
    plan: LoadPlan


def plan_whole(family: Family, head: HeadKind, hf_config, model_path: str | None) -> Planned:
    """The first half of every load, on `meta`: the weights (`weights_source`, through transformers' conversion for
    the model when they are files), the model its config builds, and the unsplit model's plan (each tensor's shape
    checked: `check_shape`; a pretrained model's parameters all found: `refuse_missing`). The weights are closed if
    the plan fails; otherwise the caller closes them."""
    weights = weights_source(family, head, hf_config, model_path)
    try:
        model = family.build(head, hf_config)
        if model_path is not None:  # the in-memory model of a tiny run has the model's own names already
            weights.convert(model)
        aliases = tied_aliases(model)
        plan = plan_load(model, family, weights, aliases)
        if model_path is not None:
            refuse_missing(family, head, list(plan.new), weights.description)
        return Planned(weights, model, aliases, plan)
    except BaseException:
        weights.close()
        raise


def refuse_missing(family: Family, head: HeadKind, new: list[str], description: str) -> None:
    """A pretrained model takes every parameter from its checkpoint, except the head its task adds
    (`Family.new_modules`: a classification head on a causal LM or a bare encoder), which starts from the seed.
    Anything else missing would train from random values while looking pretrained: a checkpoint of another
    architecture, an edited or truncated one, or a layout transformers' conversion does not cover."""
    heads = tuple(f"{module}." for module in family.new_modules(head))
    missing = [name for name in new if not name.startswith(heads)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        new_head = (
            f" (only the new {head} head, {', '.join(family.new_modules(head))}, starts from the seed)" if heads else ""
        )
        raise UserError(
            f"{description}: {len(missing)} of the model's parameters are not in the checkpoint: "
            f"{', '.join(missing[:3])}{more}; a pretrained model takes every weight from its checkpoint{new_head}, so "
            f"these files do not hold this {family.name} model's weights (another architecture or an incomplete "
            f"checkpoint)"
        )


def check_fit(family: Family, head: HeadKind, hf_config, model_path: str) -> None:
    """What `--check` asks of a pretrained folder: its tensors (headers only, no weight is read), after transformers'
    conversion, are every parameter of the model its config builds on `meta` (but a new head), in its shapes."""
    plan_whole(family, head, hf_config, model_path).weights.close()
