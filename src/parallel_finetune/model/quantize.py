"""QLoRA (Dettmers et al. 2023): the frozen base's Linear layers held in 4-bit NormalFloat (NF4) with double
quantization, dequantized to the compute dtype in each forward and backward; adapters, head and optimizer state
stay in full precision (lora.py).

The format is torchao's `NF4Tensor` (plain PyTorch, runs on a CPU, so the CPU tests run it; bitsandbytes needs
its CUDA kernels): each block of `block_size` consecutive elements of the flattened matrix keeps its absmax as a
scaler; the scalers, minus their mean over the WHOLE matrix, are quantized to int8 in groups of
`scaler_block_size` consecutive blocks. torchao's `from_tensor` takes that mean over the tensor it is given, so a
rank's shard quantized alone would not be the same rows of the whole matrix quantized. Here every layout gets the
one-process bits:

- each rank's shard is a contiguous flat range of the stored matrix, a whole number of scaler groups
  (block_size x scaler_block_size elements): column-wise tensor-parallel layers shard rows; row-wise layers
  (sharded on their input dimension) are stored transposed, in x out, in every layout (one process too), so their
  shard is a range of rows as well;
- the block absmaxes are gathered over the process group that splits the matrix (tensor parallelism's, or
  FSDP's; in rank order: the whole matrix's order) and their mean taken exactly as torchao takes it, so every
  rank holds the whole matrix's mean.

Under FSDP2 the NF4 weight is FSDP's parameter: a meta NF4Tensor (stored shape) that FSDP splits with torchao's
split before anything is allocated; the loader fills each rank's shard, and each forward all-gathers the 4-bit
codes and int8 scalers through torchao's FSDP hooks.

The rest (the NF4 codes, the int8 scalers and their factors) is local to the shard and made by torchao's own
functions, so dequantization is torchao's `get_original_weight`.

Loading: the quantized weights stay on `meta` through `weights.materialize`; the loader hands each rank's block
to `quantizing_writer`, which quantizes it and drops the full-precision copy: a rank's peak is its NF4 shards plus
one block. The NF4 tensor replaces the `weight` parameter as a non-persistent buffer: no gradient, no optimizer
state, never in a checkpoint (a resumed run reads and quantizes the base again, bit for bit the same)."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard

from ..errors import UserError


@dataclass(frozen=True)
class NF4Settings:
    block_size: int  # elements per absmax scaler
    scaler_block_size: int  # scalers per int8 double-quantization group

    @property
    def group(self) -> int:
        """Elements per scaler group: the unit a shard must be a whole number of."""
        return self.block_size * self.scaler_block_size


def torchao_nf4():
    """torchao's NF4 module, imported on first use (only runs with lora_base_quantization=nf4 pay for it)."""
    try:  # (the package's __init__ quiets the kernel-loading lines torchao's import logs)
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as exc:
        raise UserError(
            f"lora_base_quantization=nf4 needs torchao ({exc}); install it with `pip install torchao==0.18.0` "
            "or set lora_base_quantization=none"
        ) from None
    return nf4_tensor


_LUTS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _nf4_codebook(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torchao's 16 NF4 values in `dtype`: from_tensor makes them inline, so they are taken from a tiny
    quantization (two blocks of two elements) rather than copied here."""
    key = (dtype, device)
    if key not in _LUTS:
        sample = torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=dtype, device=device)
        _LUTS[key] = torchao_nf4().NF4Tensor.from_tensor(sample, 2, 2).nf4
    return _LUTS[key]


def whole_block_absmax(local_absmax: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole matrix's block absmaxes, in its flat order: this rank's, gathered over `group` in rank order
    (each rank's shard is the rank-th contiguous range); None: the shard is the whole matrix."""
    if group is None or dist.get_world_size(group) == 1:
        return local_absmax
    parts = [torch.empty_like(local_absmax) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local_absmax.contiguous(), group=group)
    return torch.cat(parts)


def quantize_shard(shard: torch.Tensor, settings: NF4Settings, scaler_mean: torch.Tensor | None = None):
    """`shard` (2-D, a contiguous flat range of whole scaler groups of a stored matrix) as an NF4Tensor, its
    scalers centred on `scaler_mean` (the whole matrix's mean block absmax; None: `shard` is the whole matrix).
    The same steps as torchao's NF4Tensor.from_tensor / double_quantize_scalers, with the mean given."""
    nf4_tensor = torchao_nf4()
    block, scaler_block = settings.block_size, settings.scaler_block_size
    shard = shard.contiguous()
    flat = shard.flatten()
    n_blocks = flat.numel() // block
    scalers = nf4_tensor.get_block_absmax(flat, block)
    mean = scalers.mean() if scaler_mean is None else scaler_mean.to(scalers.dtype)
    centred = scalers - mean
    n_scaler_blocks = centred.numel() // scaler_block
    scaler_absmax = nf4_tensor.get_block_absmax(centred, scaler_block)
    factor = 256 / (2 * scaler_absmax.unsqueeze(-1).expand(n_scaler_blocks, scaler_block))
    quantized_scalers = (centred.view(n_scaler_blocks, scaler_block) * factor).round().clamp(-128, 127)
    codebook = _nf4_codebook(shard.dtype, shard.device)
    data = nf4_tensor.NF4Tensor.convert_to_norm_float_weight(shard, n_blocks, block, codebook)
    meta = nf4_tensor.SubclassTensorArgs(shard.size(), shard.stride(), 0, shard.dtype, shard.device, False)
    return nf4_tensor.NF4Tensor(
        meta,
        block,
        n_blocks,
        scaler_block,
        quantized_scalers.flatten().to(torch.int8),
        factor[:, 0].contiguous(),
        mean,
        data,
        codebook,
    )


def quantize_sharded(shard: torch.Tensor, settings: NF4Settings, group: dist.ProcessGroup | None):
    """`shard` quantized as its part of the whole matrix split over `group` (None: not split)."""
    local = torchao_nf4().get_block_absmax(shard.contiguous().flatten(), settings.block_size)
    return quantize_shard(shard, settings, whole_block_absmax(local, group).mean())


# ----------------------------------------------------------------------------------------------- the layer
class _DequantizedMatmul(torch.autograd.Function):
    """x·Wᵀ (stored out x in) or x·W (stored transposed, in x out) with W dequantized from NF4 in the forward and
    again in the backward: the full-precision weight is never kept between them. No gradient for the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, nf4: torch.Tensor, transposed: bool) -> torch.Tensor:
        ctx.nf4, ctx.transposed = nf4, transposed
        weight = _dequantized(nf4, x)
        return torch.matmul(x, weight) if transposed else F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = original_weight(ctx.nf4).to(grad.dtype)
        return (grad @ weight.t() if ctx.transposed else grad @ weight), None, None


def _dequantized(nf4: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    weight = original_weight(nf4)
    # under autocast the matmul casts; without it the weight is dequantized to the input's dtype
    return weight if torch.is_autocast_enabled(x.device.type) else weight.to(x.dtype)


@dataclass(frozen=True)
class NF4Layout:
    """An NF4 weight's block sizes, shape and dtype (what dequantize_nf4 needs besides its tensors)."""

    block_size: int
    scaler_block_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def dequantize_nf4(codes, scalers, factors, scaler_mean, table, layout: NF4Layout):
    """torchao's NF4Tensor.get_original_weight as one function of its inner tensors, the same operations in the
    same dtypes: two 4-bit codes per byte looked up in the NF4 table, times their block's scaler (the int8 scalers
    over their group's factor, plus the mean). Eager on a CPU; on CUDA compiled into one kernel per layout
    (`original_weight`), where the eager version's int64 code indices and fp32 intermediates (tens of launches and
    bytes per weight) made QLoRA's step slow."""
    first, second = table[(codes >> 4).to(torch.long)], table[(codes & 0b1111).to(torch.long)]
    block_scalers = scalers.view(-1, layout.scaler_block_size) / factors.unsqueeze(-1)
    block_scalers = block_scalers.flatten().to(layout.dtype) + scaler_mean
    repeated = block_scalers.unsqueeze(-1).expand(block_scalers.size(0), layout.block_size // 2).flatten()
    return torch.stack([first * repeated, second * repeated], dim=-1).reshape(layout.shape)


# Device types whose dequantization is compiled (tests put "cpu" here to run the CUDA branch on a CPU).
COMPILED_DEVICES: frozenset[str] = frozenset({"cuda"})
# Inductor's settings under which the compiled kernel computes what eager computes, operation by operation (so
# that it is torchao's values bit for bit): without them a fused kernel keeps bf16/fp16 intermediates in fp32 and
# contracts a multiply and an add (on a CPU a tenth to a quarter of the bf16 values differed, by up to 0.031);
# Triton's x / y is an approximate division (div.full) unless asked for eager's rounded one, and it flushes
# denormals, which eager keeps. (On one H200, Triton's kernel was torchao's bit for bit on 3 weight shapes.)
EAGER_NUMERICS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}
# One compiled function per (layout, device), each on a code object of its own: dynamo keeps a function's graphs on
# its code object, 8 at most (recompile_limit), and one function compiled for every weight shape reached 8 with 3
# shapes (a graph per shape and per grad/autocast state it was called under); past the limit it runs eager. A copy
# of the code per layout gives each its own count on every release (torch.compile's isolate_recompiles does the
# same from 2.13 only; the GPU image's 2.11 refused it).
_COMPILED: dict[tuple[NF4Layout, torch.device], Callable] = {}
_GRAPHS = [0]  # graphs compiled for the dequantization in this process (compiled_graphs)


def nf4_layout(nf4, shape: tuple[int, ...] | None = None) -> NF4Layout:
    """`nf4`'s layout; `shape`: the shape its forward dequantizes, when not its own (FSDP's whole weight)."""
    return NF4Layout(nf4.block_size, nf4.scaler_block_size, tuple(nf4.shape) if shape is None else shape, nf4.dtype)


def _inner(nf4) -> tuple[torch.Tensor, ...]:
    return nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor, nf4.scaler_mean, nf4.nf4


def _stand_in(layout: NF4Layout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Inner tensors shaped as torchao makes them (and FSDP's all-gather) for an NF4 weight of `layout`: one
    dimension each, the mean a scalar; what a layout is compiled on before any weight of it exists on this rank
    (FSDP's whole weights exist only inside a forward)."""
    blocks = math.prod(layout.shape) // layout.block_size
    return (
        torch.zeros(blocks * layout.block_size // 2, dtype=torch.uint8, device=device),
        torch.zeros(blocks, dtype=torch.int8, device=device),
        torch.ones(blocks // layout.scaler_block_size, dtype=layout.dtype, device=device),
        torch.zeros((), dtype=layout.dtype, device=device),
        torch.zeros(16, dtype=layout.dtype, device=device),
    )


def _own_code(function: Callable) -> Callable:
    """`function` on a copy of its code object: a cache of dynamo's graphs of its own."""
    code = function.__code__.replace()
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)  # fmt: skip
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    return copy


def _run_compiled(function: Callable, inputs: tuple[torch.Tensor, ...], layout: NF4Layout) -> torch.Tensor:
    # Dynamo guards the global state a graph was traced under: the forward runs with autocast on and gradients
    # off, the backward with autocast off, evaluation under no_grad, and each would be a graph of its own. The
    # values depend on neither (no input needs a gradient, autocast casts none of these operations), so every
    # call runs under one state: one graph per layout.
    with torch.no_grad(), torch.autocast(inputs[0].device.type, enabled=False):
        return function(*inputs, layout)


def _compiled(layout: NF4Layout, device: torch.device) -> Callable:
    """The dequantization of `layout` on `device`, compiled (its one graph made now, on stand-in tensors)."""
    key = (layout, device)
    if key not in _COMPILED:
        from torch._dynamo.utils import counters

        function = torch.compile(_own_code(dequantize_nf4), fullgraph=True, dynamic=False, options=EAGER_NUMERICS)
        before = counters["stats"]["unique_graphs"]
        _run_compiled(function, _stand_in(layout, device), layout)
        _GRAPHS[0] += counters["stats"]["unique_graphs"] - before
        _COMPILED[key] = function
    return _COMPILED[key]


def compiled_graphs() -> int:
    """How many graphs torch.compile made for the dequantization in this process (one per layout and device)."""
    return _GRAPHS[0]


def original_weight(nf4) -> torch.Tensor:
    """An NF4 weight dequantized (dequantize_nf4; compiled on COMPILED_DEVICES, once per layout). Inside a
    compiled block (compile=true) the plain function is traced into the block's graph and compiled with it."""
    layout = nf4_layout(nf4)
    if nf4.device.type not in COMPILED_DEVICES or torch.compiler.is_compiling():
        return dequantize_nf4(*_inner(nf4), layout)
    return _run_compiled(_compiled(layout, nf4.device), _inner(nf4), layout)


def forward_layouts(model: nn.Module) -> set[tuple[NF4Layout, torch.device]]:
    """(layout, device) of every weight `model`'s NF4Linears dequantize in their forward: this rank's NF4 shard, or
    under FSDP2 the whole weight (its all-gather makes one NF4Tensor of the DTensor's global shape)."""
    layouts = set()
    for module in model.modules():
        local = local_nf4(module.weight) if isinstance(module, NF4Linear) else None
        if local is not None:
            layouts.add((nf4_layout(local, tuple(module.weight.shape)), local.device))
    return layouts


def warm_up(model: nn.Module) -> int:
    """Compile the dequantization of each distinct layout of `model`'s NF4 weights that is dequantized compiled,
    now (at load, before any step is timed) rather than inside the first forward. Returns how many layouts."""
    layouts = [(layout, device) for layout, device in forward_layouts(model) if device.type in COMPILED_DEVICES]
    for layout, device in layouts:
        _compiled(layout, device)
    return len(layouts)


class NF4Linear(nn.Linear):
    """A frozen Linear whose `weight` is this rank's NF4 shard (a non-persistent buffer; under FSDP2 the parameter
    FSDP all-gathers to the whole NF4 weight for the forward), with its
    LoRA adapter if it has one: y = W x + scaling * B(A(dropout(x))) + b. Under tensor parallelism the NF4 shard is
    a plain local tensor: the input's local tensor is multiplied and the output made the DTensor the layer's plan
    expects (column-wise: sharded on the last dim; row-wise: a partial sum, reduced with the adapter's by the
    layer's one all-reduce)."""

    nf4_transposed: bool  # stored in x out (row-wise layers, in every layout)
    nf4_style: str  # column | row | none: how tensor parallelism splits this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            # column-wise: x is replicated, each rank's input gradient is a partial sum of it
            grad_placements = [Partial()] if self.nf4_style == "column" else None
            local = x.to_local(grad_placements=grad_placements)
            out = _DequantizedMatmul.apply(local, self.weight, self.nf4_transposed)
            placement = Shard(-1) if self.nf4_style == "column" else Partial()
            out = DTensor.from_local(out, x.device_mesh, [placement], run_check=False)
        else:
            out = _DequantizedMatmul.apply(x, self.weight, self.nf4_transposed)
        if "lora_A" in self._modules:
            out = out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scaling
        return out + self.bias if self.bias is not None else out


@dataclass
class Pending:
    """A Linear whose weight is still on `meta`, to be quantized as the loader reads this rank's block."""

    path: str  # the weight's name in the model
    module: NF4Linear
    group: dist.ProcessGroup | None  # the process group splitting it; None: this rank holds it whole
    fsdp: bool = False  # FSDP2 holds it: the parameter is a DTensor whose local shard is an NF4Tensor


def block_linears(model: nn.Module, family) -> Iterator[tuple[str, str, nn.Linear]]:
    """(path, path inside its block, module) of every Linear in the blocks this process holds, adapters aside:
    what QLoRA quantizes and what LoRA's targets are chosen from."""
    for number, block in zip(family.block_numbers(model), family.blocks(model)):
        for relative, module in block.named_modules():
            if isinstance(module, nn.Linear) and relative and "lora_" not in relative:
                yield f"{family.block_path}.{number}.{relative}", relative, module


def check_quantizable(model: nn.Module, family) -> None:
    """The base has Linear layers in its blocks: nothing else is quantized (embeddings, norms and heads stay)."""
    if next(block_linears(model, family), None) is None:
        raise UserError(
            f"lora_base_quantization=nf4 quantizes the Linear layers of the {family.name} blocks, and they have "
            "none; set lora_base_quantization=none"
        )


def _block_hint(elements: int, settings: NF4Settings) -> str:
    """A valid (block size, scaler block size) pair for a shard of `elements`, near the chosen one."""
    largest = elements & -elements  # the largest power of two dividing it

    def power_of_two_at_most(n: int) -> int:
        return 1 << (max(n, 1).bit_length() - 1)

    # powers of two both, so that they divide `largest` (a chosen 48 would not divide a power of two)
    block = max(2, min(power_of_two_at_most(settings.block_size), largest // 2))
    scaler = max(1, min(power_of_two_at_most(settings.scaler_block_size), largest // block))
    return f"nf4_block_size={block}, nf4_scaler_block_size={scaler}"


def _check_blocks(path: str, stored: tuple[int, ...], settings: NF4Settings) -> None:
    elements = math.prod(stored)
    if elements % settings.group:
        raise UserError(
            f"lora_base_quantization=nf4: {path}'s shard on this rank is {list(stored)} ({elements} elements), "
            f"not a whole number of nf4_block_size x nf4_scaler_block_size = {settings.block_size} x "
            f"{settings.scaler_block_size} = {settings.group}; e.g. {_block_hint(elements, settings)}"
        )


def _fsdp_shard(path: str, stored: tuple[int, ...], ranks: int, *, tensor_parallel: bool) -> tuple[int, int]:
    """The rows of `stored` (this rank's shape of a weight, as stored) that FSDP gives each of its `ranks`."""
    if tensor_parallel:
        raise UserError(
            "lora_base_quantization=nf4 with sharding=full and tensor_parallel_degree > 1 is not supported (an "
            "NF4 shard of a shard); use one of them, or pipeline stages with either"
        )
    if stored[0] % ranks:
        raise UserError(
            f"lora_base_quantization=nf4: {path} ({list(stored)} as stored) has {stored[0]} rows, which FSDP "
            f"cannot split evenly over {ranks} ranks; use sharding=none|optimizer"
        )
    return stored[0] // ranks, stored[1]


def check_shards(model: nn.Module, family, settings: NF4Settings, *, tp: int, fsdp: int) -> None:
    """`--check`'s version of what `prepare` refuses, from the unsplit meta model: each block Linear's shard
    under `tp`-way tensor parallelism (the family's column-wise and row-wise layers) and `fsdp`-way FSDP (1: none)
    holds whole scaler groups."""
    for path, relative, module in block_linears(model, family):
        transposed, split = relative in family.row_wise, relative in (*family.column_wise, *family.row_wise)
        stored = (module.in_features, module.out_features) if transposed else (module.out_features, module.in_features)
        if split and tp > 1:
            stored = (stored[0] // tp, stored[1])
        if fsdp > 1:
            stored = _fsdp_shard(path, stored, fsdp, tensor_parallel=split and tp > 1)
        _check_blocks(path, stored, settings)


def meta_nf4(shape: tuple[int, int], dtype: torch.dtype, settings: NF4Settings) -> torch.Tensor:
    """An NF4Tensor of `shape` on `meta` (its inner tensors too), for FSDP2 to shard before anything is
    allocated: torchao's split gives each rank its rows' codes, scalers and factors."""
    nf4_tensor = torchao_nf4()
    elements = math.prod(shape)

    def empty(size, inner_dtype):
        return torch.empty(size, dtype=inner_dtype, device="meta")

    meta = nf4_tensor.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, torch.device("meta"), False)
    return nf4_tensor.NF4Tensor(
        meta,
        settings.block_size,
        elements // settings.block_size,
        settings.scaler_block_size,
        empty(elements // settings.block_size, torch.int8),
        empty(elements // settings.group, dtype),
        empty((), dtype),
        empty(elements // 2, torch.uint8),
        empty(16, dtype),
    )


def prepare(model: nn.Module, family, settings: NF4Settings, fsdp_mesh: DeviceMesh | None = None) -> list[Pending]:
    """On `meta`, after tensor parallelism, LoRA and freezing, before FSDP (`fsdp_mesh`: the 1-D mesh it will
    shard over): every Linear of this rank's blocks becomes an NF4Linear, its weight still on meta until loaded
    (`quantizing_writer`); under FSDP the weight becomes a meta NF4Tensor parameter (stored shape) for FSDP to
    shard. A shard that is not a whole number of scaler groups is refused."""
    pending: list[Pending] = []
    for path, relative, module in block_linears(model, family):
        weight, transposed = module.weight, relative in family.row_wise
        mesh: DeviceMesh | None = None
        style = "none"
        if isinstance(weight, DTensor) and weight.device_mesh.size() > 1 and weight.placements[0].is_shard():
            mesh, dim = weight.device_mesh, weight.placements[0].dim
            style = "column" if dim == 0 else "row"
            if dim != (1 if transposed else 0):  # a family plan that splits a layer unlike its column/row name
                raise UserError(f"lora_base_quantization=nf4: {path} is split on dim {dim}, unlike its plan")
        local_shape = tuple(weight.to_local().shape if isinstance(weight, DTensor) else weight.shape)
        stored = local_shape[::-1] if transposed else local_shape
        if fsdp_mesh is not None:
            stored = _fsdp_shard(path, stored, fsdp_mesh.size(), tensor_parallel=mesh is not None)
            mesh = fsdp_mesh
        _check_blocks(path, stored, settings)
        module.__class__ = NF4Linear
        module.nf4_transposed, module.nf4_style = transposed, style
        if fsdp_mesh is not None:
            whole = tuple(weight.shape[::-1] if transposed else weight.shape)
            module.weight = nn.Parameter(meta_nf4(whole, weight.dtype, settings), requires_grad=False)
        group = mesh.get_group() if mesh is not None else None
        pending.append(Pending(f"{path}.weight", module, group, fsdp_mesh is not None))
    return pending


def load_shapes(pending: list[Pending], box_of: Callable) -> tuple[Callable, Callable]:
    """(box_of, global shape) for the loader's plan: an FSDP-held NF4 weight of a row-wise layer is stored
    transposed, so its box and shape are turned back to the checkpoint's out x in."""
    transposed = {id(entry.module.weight) for entry in pending if entry.fsdp and entry.module.nf4_transposed}

    def box(param: torch.Tensor):
        offsets, shape = box_of(param)
        return (offsets[::-1], shape[::-1]) if id(param) in transposed else (offsets, shape)

    def global_shape(param: torch.Tensor) -> tuple[int, ...]:
        shape = tuple(getattr(param, "ds_shape", param.shape))
        return shape[::-1] if id(param) in transposed else shape

    return box, global_shape


def loading(
    pending: list[Pending], settings, device: torch.device, box_of: Callable, write: Callable | None
) -> tuple[Callable | None, Callable, Callable | None]:
    """The loader's (write, box_of, global shape), given its own (`box_of`, `write`), for a model with `pending`
    weights (once allocated; `settings`: lora.LoraSettings): other parameters' blocks go where they always go."""
    if not pending:
        return write, box_of, None

    def copy(param: torch.Tensor, block: torch.Tensor) -> None:
        (param.to_local() if isinstance(param, DTensor) else param).copy_(block)

    writer = quantizing_writer(pending, settings.quantization, device, write or copy)
    return (writer, *load_shapes(pending, box_of))


def quantizing_writer(
    pending: list[Pending],
    settings: NF4Settings,
    device: torch.device,
    fallback: Callable[[torch.Tensor, torch.Tensor], None],
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The loader's `write` (made once the parameters are allocated): a pending weight's block (this rank's
    shard, out x in) is quantized in the weight's dtype and replaces the meta parameter (under FSDP: fills the
    local NF4 shard FSDP allocated); any other parameter goes to `fallback`."""
    waiting = {id(entry.module.weight): entry for entry in pending}

    def write(param: torch.Tensor, block: torch.Tensor) -> None:
        entry = waiting.pop(id(param), None)
        if entry is None:
            fallback(param, block)
            return
        data = block.to(device=device, dtype=param.dtype)
        if entry.module.nf4_transposed:
            data = data.t()
        nf4 = quantize_sharded(data, settings, entry.group)
        del data
        entry.module.nf4_group = entry.group
        if entry.fsdp:
            local = param._local_tensor  # FSDP's own shard object (to_local() would be an alias)
            for key in ("quantized_data", "quantized_scalers", "quantization_factor"):
                getattr(local, key).copy_(getattr(nf4, key))
            local.scaler_mean, local.nf4 = nf4.scaler_mean, nf4.nf4  # FSDP's allocation leaves these on meta
            return
        del entry.module._parameters["weight"]
        entry.module.register_buffer("weight", nf4, persistent=False)

    return write


def local_nf4(weight) -> torch.Tensor | None:
    """The NF4Tensor this rank holds of a weight (FSDP's: the local shard of its DTensor), or None."""
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    return local if is_nf4(local) else None


def nf4_weights(model: nn.Module) -> list[torch.Tensor]:
    """This rank's NF4 weights (local shards)."""
    found = [local_nf4(m.weight) for m in model.modules() if isinstance(m, NF4Linear)]
    return [weight for weight in found if weight is not None]


def is_nf4(tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def dequantized_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole weight out x in) of every NF4 weight of this process's model, dequantized in its dtype; a
    collective over each weight's tensor-parallel group (every rank of it gets the whole weight)."""
    for path, module in model.named_modules():
        if not isinstance(module, NF4Linear) or local_nf4(module.weight) is None:
            continue
        local = local_nf4(module.weight).get_original_weight()
        group = getattr(module, "nf4_group", None)
        if group is not None and dist.get_world_size(group) > 1:
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            local = torch.cat(parts)
        yield f"{path}.weight", local.t().contiguous() if module.nf4_transposed else local
