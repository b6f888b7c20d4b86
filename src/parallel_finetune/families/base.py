"""What every model family provides. A family module is the only place that knows a model's module names."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import PretrainedConfig
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    create_causal_mask,
    packed_sequence_mask_function,
)

from ..config import ModelSection
from ..errors import UserError
from ..model.hub import resolve_model_path
from ..model.pretrained import load_hf_config

if TYPE_CHECKING:
    from ..tasks.task import HeadKind


class Family:
    name: str = ""
    default_model: str = ""  # full-size Hub name
    tasks: tuple[str, ...] = ("classification", "causal_lm")
    config_class: type[PretrainedConfig]
    model_classes: dict[str, type[nn.Module]]  # task -> transformers class
    tiny_tokenizer: str = "bpe"  # what a tiny model learns from the training sentences: "bpe" or "wordpiece"
    # Sentence pairs: True = the tokenizer's pair template with token type ids (BERT's [CLS] A [SEP] B [SEP]);
    # False = the two texts joined by the EOS token (GPT models have neither a pair template nor token types).
    pair_token_types: bool = False
    # Published checkpoints: Hub name -> the sizes of its config.json, so that the planner and the SageMaker
    # checks build their configs offline (a run itself always reads the model's own config.json).
    published: dict[str, dict] = {}
    # The config's dropout probabilities: synthetic checkpoints write them as 0, parity tests switch them off
    # (dropout draws different random numbers on differently sharded tensors).
    dropout_keys: tuple[str, ...] = ()
    # The class a pretrained checkpoint of this family is saved from (synthetic.py); None: the causal LM.
    checkpoint_class: type[nn.Module] | None = None
    # Sequence classification reads a row at its "last" token (decoders) or its "first" ([CLS], BERT): where a
    # packed batch puts each row's label. `causal`: whether a token attends only to earlier ones.
    pooled_token: str = "last"
    causal: bool = True
    # The module whose output is the classifier's logits at every position (decoders apply `score` to every
    # position before pooling one); a packed batch reads them there, inside the model's own forward.
    position_logits_module: str = "score"

    # --- what a family must define ---
    def sized_config(
        self, vocab_size: int, max_positions: int, hidden: int, layers: int, heads: int
    ) -> PretrainedConfig:
        """A config of these sizes (inner MLP 4 x hidden), dropout as the family's default: the tiny model and
        synthetic checkpoints are made from it."""
        raise NotImplementedError

    def tiny_config(self, vocab_size: int, max_positions: int) -> PretrainedConfig:
        """The small model CPUs and the tests train from scratch."""
        return self.sized_config(vocab_size, max_positions, hidden=128, layers=2, heads=4)

    def tp_dimensions(self, hf_config: PretrainedConfig) -> dict[str, int]:
        """The sizes that tensor parallelism splits, by the config's own names (heads, hidden, inner...)."""
        raise NotImplementedError

    # The Megatron split of every transformer block: these modules (paths inside a block) are sharded by
    # output features, those by input features, so each block needs one all-reduce for attention and one for
    # the MLP in the forward pass.
    block_path: str  # where the ModuleList of blocks lives, e.g. "transformer.h"
    column_wise: tuple[str, ...]
    row_wise: tuple[str, ...]
    # LoRA (lora.py): the default target modules (names inside a block, peft's defaults) and the head trained in
    # full for classification
    lora_targets: tuple[str, ...] = ()
    lora_head: tuple[str, ...] = ("score",)

    def new_modules(self, head: HeadKind) -> tuple[str, ...]:
        """Modules the head adds to a pretrained checkpoint, initialised from the seed: the classification head
        (a causal LM's or a bare encoder's checkpoint has none). Any other parameter a checkpoint lacks is an
        error (weights.refuse_missing)."""
        from ..tasks import HeadKind

        return self.lora_head if HeadKind(head) is HeadKind.CLASSIFICATION else ()

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        """After sharding, attention modules must reshape with the per-rank head count."""
        raise NotImplementedError

    def extra_tp_plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        """Styles for modules outside the blocks (e.g. a vocabulary-sharded embedding); none by default."""
        return {}

    def tp_plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        plan: dict[str, ParallelStyle] = {}
        for i in self.block_numbers(model):
            plan.update({f"{self.block_path}.{i}.{name}": ColwiseParallel() for name in self.column_wise})
            plan.update({f"{self.block_path}.{i}.{name}": RowwiseParallel() for name in self.row_wise})
        plan.update({path: style for path, style in self.extra_tp_plan(model).items() if has_module(model, path)})
        return plan

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer blocks this process holds, in order (a pipeline stage holds some of them)."""
        container = model.get_submodule(self.block_path)
        return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)

    def block_numbers(self, model: nn.Module) -> list[int]:
        """The blocks' numbers in the unsplit model (their parameter names), e.g. [2, 3] on a second stage."""
        container = model.get_submodule(self.block_path)
        return (
            [int(key) for key in container.keys()]
            if isinstance(container, nn.ModuleDict)
            else list(range(len(container)))
        )

    # --- pipeline parallelism: the model as embed -> blocks -> head, so that stages can run pieces of it.
    # Each mirrors the transformers forward (training path: no cache); tests hold them to the unsplit model.
    first_stage_modules: tuple[str, ...]  # what only the first stage holds (embeddings)
    last_stage_modules: tuple[str, ...]  # what only the last stage holds (final norm, heads); absent ones skipped

    def pipeline_embed(
        self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids=None
    ) -> torch.Tensor:
        """`token_type_ids`: given for sentence pairs when the family has `pair_token_types`."""
        raise NotImplementedError

    def pipeline_mask(
        self,
        model: nn.Module,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        packed: bool = False,
    ):
        """The attention mask the blocks take, built from the 2-D padding mask that travels with the activations
        (`packed`: from the restarting positions of a packed batch, so that attention never crosses rows)."""
        if packed:
            return self.packed_mask(model.config, position_ids, hidden.dtype)
        return create_causal_mask(
            config=model.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )

    def pipeline_block(self, block: nn.Module, hidden: torch.Tensor, mask, position_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check_pipeline(self, hf_config: PretrainedConfig, head: HeadKind) -> None:
        """A one-line error when the pipeline pieces cannot reproduce this model's forward. Hand-written families
        are held to it by the tests; a family made from plans checks at run time (plans.py)."""

    def pipeline_head(self, model: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pipeline_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """A language model's final hidden states (the last block's, through the final norm): what its head takes,
        on a pipeline's last stage (the loss computes the head with them: loop/loss.py's HiddenTokenLoss)."""
        raise NotImplementedError

    def pipeline_position_head(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The classifier's logits at every position (rows, length, labels): a packed batch's last stage."""
        raise NotImplementedError

    # --- packed batches (packing.py): attention within rows, logits at every position ---
    def packed_mask(self, hf_config: PretrainedConfig, position_ids: torch.Tensor, dtype: torch.dtype):
        """The attention mask of a packed batch for the model's attention implementation."""
        return packed_attention_mask(hf_config, position_ids, causal=self.causal, dtype=dtype)

    def check_packing(self, hf_config: PretrainedConfig, max_length: int) -> None:
        """A one-line error when packed batches cannot keep this model's rows apart."""
        implementation = hf_config._attn_implementation or "sdpa"  # what transformers picks when none is set
        if implementation.startswith("flash_attention") and not self.causal:
            raise UserError(
                f"packing=true with family={self.name} and attn_implementation={implementation}: its flash "
                "attention takes no per-row mask; use sdpa or eager attention, or packing=false"
            )
        if implementation not in PACKED_ATTENTION and not implementation.startswith("flash_attention"):
            raise UserError(
                f"packing=true with attn_implementation={implementation}: packed rows need a mask this project "
                f"builds for {', '.join(PACKED_ATTENTION)} or flash_attention_*; use one of them, or packing=false"
            )
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and window < max_length:
            layer_types = getattr(hf_config, "layer_types", None) or ()
            if not layer_types or "sliding_attention" in layer_types:
                raise UserError(
                    f"packing=true with a sliding attention window of {window} tokens, shorter than "
                    f"max_length={max_length}: packed masks are full causal ones; use max_length<={window} or "
                    "packing=false"
                )

    def prepare_packing(self, model: nn.Module) -> None:
        """Make the built model compute what packed batches read (every position); nothing by default."""

    def position_logits_hook(self, model: nn.Module, store) -> torch.utils.hooks.RemovableHandle:
        """Hand `store` the classifier's logits at every position during the model's own forward (where FSDP
        has gathered the parameters and tensor-parallel ones are in place)."""
        head = hf_root(model).get_submodule(self.position_logits_module)
        return head.register_forward_hook(lambda module, args, output: store(output))

    def hf_source(self, name: str, hf_config: PretrainedConfig) -> HFSource:
        """Where parameter `name` of the built model lives in a Hugging Face checkpoint of the unmodified class:
        the same name unless `build` did surgery (GPT-2). Loading and export both follow this one description."""
        return HFSource(name)

    # transformers' class holds Conv1D layers (weights stored [in, out]): peft adapters say fan_in_fan_out
    hf_conv1d: bool = False

    def hf_out_features(self, path: str, rows: int, hf_config: PretrainedConfig) -> int:
        """Output width of the transformers module that holds our Linear `path` (`rows` wide): wider where
        surgery split one module into several (GPT-2's c_attn)."""
        return rows

    def surgery(self, model: nn.Module) -> None:
        """Change the built structure (values still come from the loader, through `hf_source`): modules tensor
        parallelism cannot shard as they are (GPT-2), or work the task throws away (BERT); none by default."""

    # --- shared behaviour ---
    def published_config(self, model: str) -> PretrainedConfig | None:
        """The config of a published checkpoint from its values in `published` (any letter case), else None."""
        known = {name.lower(): values for name, values in self.published.items()}
        values = known.get(model.lower())
        return None if values is None else self.config_class(**values)

    def synthetic_checkpoint(
        self, vocab_size: int, max_positions: int, hidden: int, layers: int, heads: int
    ) -> tuple[type[nn.Module], PretrainedConfig]:
        """The class and config of a pretrained-style checkpoint with random weights (synthetic.py), dropout off."""
        config = self.sized_config(vocab_size, max_positions, hidden, layers, heads)
        for key in self.dropout_keys:
            setattr(config, key, 0.0)
        return self.checkpoint_class or self.model_classes["causal_lm"], config

    def hf_config(
        self,
        model: str | None,
        size: str,
        vocab_size: int,
        max_positions: int,
        overrides: dict,
        published: bool = False,
    ) -> PretrainedConfig:
        """`published`: a published checkpoint's config from `published` (offline) instead of its config.json."""
        if size == "tiny":
            config = self.tiny_config(vocab_size, max_positions)
        else:
            name = model or self.default_model
            config = (published and self.published_config(name)) or load_hf_config(resolve_model_path(name))
            if not isinstance(config, self.config_class):
                raise UserError(
                    f"model={model!r} is a {type(config).__name__}, not a {self.name} "
                    f"({self.config_class.__name__}); pick the recipe of its family"
                )
        pretrained = None if size == "tiny" or not overrides else copy.deepcopy(config)
        for key, value in overrides.items():
            if not hasattr(config, key):
                raise UserError(f"model_config.{key}: {type(config).__name__} has no such attribute")
            setattr(config, key, value)
        if pretrained is not None:
            self.refuse_reshaping(pretrained, overrides, model or self.default_model)
        return config

    def refuse_reshaping(self, pretrained: PretrainedConfig, overrides: dict, model: str) -> None:
        """A pretrained model's weights have the sizes of its config.json: an override that changes a parameter's
        shape (width, inner size, vocabulary...) cannot load them, so it is refused, naming the key. Overrides
        that keep every shape (dropout, fewer layers) pass. Shapes come from builds on `meta` (no memory)."""

        def shapes(overridden: dict) -> dict[str, tuple[int, ...]]:
            config = copy.deepcopy(pretrained)
            for key, value in overridden.items():
                setattr(config, key, value)
            try:
                built = self.build(self.tasks[0], config)
            except Exception:  # values no model can have: preflight's checks name them
                return {}
            return {name: tuple(param.shape) for name, param in built.named_parameters()}

        def reshaped(overridden: dict) -> tuple[str, tuple, tuple] | None:
            after = shapes(overridden)
            changed = [name for name in before if name in after and before[name] != after[name]]
            return (changed[0], before[changed[0]], after[changed[0]]) if changed else None

        before = shapes({})
        if not reshaped(overrides):
            return
        culprits = [key for key in overrides if reshaped({key: overrides[key]})] or list(overrides)
        name, was, now = reshaped({key: overrides[key] for key in culprits})
        keys = ", ".join(f"model_config.{key}={overrides[key]!r}" for key in culprits)
        raise UserError(
            f"{keys} changes {name} from {list(was)} to {list(now)}, but model={model!r} is pretrained with its "
            f"config's sizes; drop the override (or train a model of any size from scratch with size=tiny)"
        )

    def check_tp(self, hf_config: PretrainedConfig, tp: int) -> None:
        for what, size in self.tp_dimensions(hf_config).items():
            if size % tp:
                raise UserError(
                    f"tensor_parallel_degree={tp} does not divide {self.name} {what}={size}; "
                    f"valid degrees: {', '.join(str(d) for d in self.valid_tp_degrees(hf_config))}"
                )

    def valid_tp_degrees(self, hf_config: PretrainedConfig) -> list[int]:
        sizes = self.tp_dimensions(hf_config).values()
        return [d for d in range(1, min(sizes) + 1) if all(s % d == 0 for s in sizes)]

    def set_task(self, hf_config: PretrainedConfig, head: HeadKind, pad_token_id: int | None, labels=None) -> None:
        """What the head and tokenizer add to a config: the padding id and, to classify, the head's width, its
        problem type and label names (`labels`: the data's tasks.Task; None: SST-2's two labels, for estimates
        made without data). The names travel into the exported config.json, so transformers' pipeline prints them."""
        from ..tasks.task import HeadKind, configure_head, estimate_task

        hf_config.pad_token_id = pad_token_id
        if HeadKind(head) is HeadKind.CLASSIFICATION:
            configure_head(hf_config, labels or estimate_task())

    def config_for(
        self,
        *,
        model: ModelSection,
        head: HeadKind,
        max_length: int,
        tokenizer_size: int,
        pad_token_id: int | None = None,
        model_path: str | None = None,
        published: bool = False,
        labels=None,
    ) -> PretrainedConfig:
        """The one rule that turns a run's `model:` section into the model's transformers config: a tiny model's
        size (its positions: `max_length`, the data's, at least 128; its vocabulary: `tokenizer_size` rounded up),
        or the pretrained one's (from `model_path`, a local folder, else `model.source`), plus the recipe's
        `model_config` overrides. `published`: a published checkpoint's sizes come from `published`, without
        reading its config.json; `labels`: the data's tasks.Task (the head's width and label names); `head`:
        the model's last layer (resolve.choose_model's)."""
        hf_config = self.hf_config(
            model_path or model.source,
            model.size,
            tiny_vocab_size(tokenizer_size),
            max(max_length, 128),
            model.model_config,
            published,
        )
        self.set_task(hf_config, head, pad_token_id, labels)
        return hf_config

    def build(self, head: HeadKind, hf_config: PretrainedConfig, context=None) -> nn.Module:
        """The model's structure, with the family's surgery, without allocating any weight: parameters live on the
        `meta` device (values come later, shard by shard, see weights.py); buffers (rotary tables, position ids)
        are computed as usual, they are small. `context`: another way to create the parameters (DeepSpeed's
        zero.Init partitions each one as its module is built)."""
        from accelerate import init_empty_weights
        from transformers.initialization import no_init_weights

        # A checkpoint's config.json names the dtype its files are stored in, and transformers' generic task
        # classes (Llama's and every plan family's sequence classification) build their decoder in it: parameters
        # here are fp32 whatever the files hold (the precision decides what is computed in 16-bit).
        hf_config.dtype = torch.float32
        # no_init_weights: transformers would otherwise initialise every `meta` parameter through torch's Python
        # reference kernels (~20 ms of a tiny model's build, growing with its count of tensors), for values never read
        with context if context is not None else init_empty_weights(include_buffers=False), no_init_weights():
            model = self.model_classes[head](hf_config)
            self.surgery(model)
        model.tie_weights()  # each parameter was replaced by a `meta` one: ties (GPT-2, GPT-Neo) are made again
        return model

    def hf_model(self, head: HeadKind, hf_config: PretrainedConfig) -> nn.Module:
        """The unmodified transformers model, initialised in CPU memory from the current RNG state: what a tiny
        run starts from (and, through `hf_source`, loads into any layout as if it were a checkpoint)."""
        return self.model_classes[head](hf_config)

    def to_hf_state_dict(self, state: dict[str, torch.Tensor], hf_config: PretrainedConfig) -> dict[str, torch.Tensor]:
        """Whole tensors by the built model's names -> by the unmodified class's names (undoes the surgery)."""
        pieces: dict[str, list[tuple[HFSource, torch.Tensor]]] = {}
        for name, tensor in state.items():
            source = self.hf_source(name, hf_config)
            pieces.setdefault(source.key, []).append((source, tensor.t() if source.transpose else tensor))
        out = {}
        for key, parts in pieces.items():
            if len(parts) == 1 and parts[0][0].start == 0:
                out[key] = parts[0][1].contiguous()
            else:
                parts.sort(key=lambda part: part[0].start)
                out[key] = torch.cat([tensor for _, tensor in parts], dim=parts[0][0].dim).contiguous()
        return out


@dataclass(frozen=True)
class HFSource:
    """A built model's parameter as a block of a checkpoint tensor: `key`, narrowed along `dim` from `start` (the
    parameter's length), after transposing the parameter when `transpose` (GPT-2's Conv1D stores [in, out])."""

    key: str
    transpose: bool = False
    dim: int = 0
    start: int = 0


def tiny_vocab_size(tokenizer_size: int) -> int:
    """Round the embedding up to a multiple of 64 (as GPT-J does: 50400 rows for 50257 tokens), so that
    any tensor-parallel degree up to 64 that is a power of two divides it."""
    return -(-tokenizer_size // 64) * 64


PACKED_ATTENTION = ("sdpa", "eager", "flex_attention")  # the implementations a packed 4-D mask is built for


def packed_attention_mask(hf_config: PretrainedConfig, position_ids: torch.Tensor, causal: bool, dtype: torch.dtype):
    """The 4-D mask of a packed batch for `hf_config._attn_implementation` (sdpa: bool, eager: float, flex: a
    BlockMask), through transformers' mask interface: causal (or bidirectional) AND within one segment, a segment
    starting wherever `position_ids` is 0 (each row, and the padding tail). None under flash attention, which
    finds the rows from the restarting positions itself (transformers' varlen path)."""
    implementation = hf_config._attn_implementation or "sdpa"
    if implementation.startswith("flash_attention") or implementation == "packed_varlen":
        return None  # model/attention.py's varlen finds the rows from the restarting positions
    segments = (position_ids == 0).cumsum(-1)
    within = and_masks(
        causal_mask_function if causal else bidirectional_mask_function, packed_sequence_mask_function(segments)
    )
    rows, length = position_ids.shape
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=rows,
        q_length=length,
        kv_length=length,
        mask_function=within,
        attention_mask=None,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        dtype=dtype,
        config=hf_config,
        device=position_ids.device,
    )


def hf_root(model: nn.Module) -> nn.Module:
    """The transformers model inside a LoRA wrapper (peft's PeftModel), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_module(model: nn.Module, path: str) -> bool:
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def last_token_logits(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A decoder's sequence classification reads the last real token (transformers finds it from the pad id;
    the padding mask marks the same positions, and it is what travels between stages)."""
    positions = torch.arange(attention_mask.shape[-1], device=logits.device, dtype=torch.int32)
    last = (positions * attention_mask.to(torch.int32)).argmax(-1)
    return logits[torch.arange(logits.shape[0], device=logits.device), last]


class DecoderFamily(Family):
    """GPT-J, GPT-2, GPT-Neo: token (+ position) embeddings, causal blocks, final LayerNorm, LM or score head."""

    first_stage_modules = ("transformer.wte", "transformer.wpe")
    last_stage_modules = ("transformer.ln_f", "lm_head", "score")

    def pipeline_embed(self, model, input_ids, position_ids, token_type_ids=None):
        transformer = model.transformer
        hidden = transformer.wte(input_ids)
        if getattr(transformer, "wpe", None) is not None:
            hidden = hidden + transformer.wpe(position_ids)
        return transformer.drop(hidden)

    def pipeline_head(self, model, hidden, attention_mask):
        hidden = self.pipeline_hidden(model, hidden)
        if getattr(model, "lm_head", None) is not None:
            return model.lm_head(hidden)
        return last_token_logits(model.score(hidden), attention_mask)

    def pipeline_hidden(self, model, hidden):
        return model.transformer.ln_f(hidden)

    def pipeline_position_head(self, model, hidden):
        return model.score(model.transformer.ln_f(hidden))


def localize_heads(module: nn.Module, tp: int, head_attrs: tuple[str, ...], width_attrs: tuple[str, ...] = ()):
    """Divide an attention module's head counts (and widths used in reshapes) by the TP degree."""
    for attr in head_attrs + width_attrs:
        setattr(module, attr, getattr(module, attr) // tp)
