"""Families made from a model's own parallel plans: any transformers decoder whose config class declares
`base_model_tp_plan` (which module of a block is column- or row-wise) and, for pipelines, `base_model_pp_plan`
(embeddings -> layers -> final norm, with their inputs and outputs). Llama, Qwen 3 and Mistral are named families
made this way (llama.py, qwen3.py, mistral.py: a default checkpoint and its sizes); `family: auto` or a model type
as the family name (e.g. `family: olmo2`) makes one for any other architecture with plans.

What comes from where:
- tensor parallelism: the config's `base_model_tp_plan` entries `layers.*.<module>` with their style (STYLES);
  a style this project does not implement, or a mixture-of-experts one, is refused by name when TP > 1. The token
  embedding is vocabulary-sharded and the LM head column-sharded (gathered) when they are not tied and the
  vocabulary divides; tied ones stay replicated, so the tie survives;
- the TP degree must divide the attention heads, the key/value heads (grouped-query attention) and the MLP width;
- pipelines: the `base_model_pp_plan` order (modules before `layers` on the first stage, after it on the last)
  plus what every stage recomputes from the positions that travel with the activations: the rotary position
  embeddings (`rotary_emb`, per layer type where the model has several) and the attention masks (causal, or sliding
  window per `layer_types`). Before the first pipeline is cut, `check_pipeline` runs these pieces and the model's
  own forward on a shrunk copy of the config (2 to 4 layers, width 64): an architecture whose forward does more
  than its plan says (a logit scale the pieces miss) is refused for pipelines by name instead of training wrong;
- LoRA: peft's default targets for the model type (q_proj, v_proj for Llama-like models), else every column-wise
  module of the plan.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import TYPE_CHECKING

import torch
import transformers
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.auto import modeling_auto

from ..errors import UserError
from .base import Family, has_module, last_token_logits
from .styles import ReplicatedWithGradAllReduce

if TYPE_CHECKING:
    from ..tasks.task import HeadKind

log = logging.getLogger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"
IMPLEMENTED_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "replicated_with_grad_allreduce",
)
EXPERT_STYLES = ("moe_tp_experts", "moe_identity_expert", "ep_router", "grouped_gemm")
# The widths tensor parallelism splits, by transformers' common config names (those a config has are checked).
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
CHECK_TOLERANCE = 1e-5  # relative, fp32 on a width-64 copy: the same math agrees to ~1e-7
LOGIT_BOOST = 300.0
TINY_KV_HEADS = 2  # tiny and synthetic models use grouped-query attention, as the real ones


def style_for(name: str) -> ParallelStyle:
    """Our DTensor style for a transformers plan style (see IMPLEMENTED_STYLES)."""
    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        # the whole output on every rank (attention then runs on all heads: for norms across heads, e.g. OLMo 2)
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # a whole input, split on the rank before its block of the weight
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # per-head norms (Qwen 3's q_norm/k_norm): replicated weights whose gradient each rank computes from its
        # own heads only, so the gradients are summed over the TP ranks
        "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce,
    }[name]()


def model_classes_for(model_type: str) -> dict[str, type[nn.Module]]:
    """transformers' causal-LM and sequence-classification classes of a model type (those it has)."""
    classes = {}
    for task, mapping in (
        ("classification", modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
        ("causal_lm", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    ):
        name = mapping.get(model_type)
        if isinstance(name, str) and hasattr(transformers, name):
            classes[task] = getattr(transformers, name)
    return classes


def plan_problem(config_class: type[PretrainedConfig]) -> str | None:
    """Why no family can be made from this config class (None: one can)."""
    model_type = config_class.model_type
    if not getattr(config_class, "base_model_tp_plan", None):
        return f"transformers' {config_class.__name__} ({model_type}) declares no base_model_tp_plan"
    if not model_classes_for(model_type):
        return f"transformers has no causal-LM or sequence-classification class for {model_type}"
    return None


class PlanFamily(Family):
    """A decoder family read off a transformers config class and its model classes (see the module's docstring)."""

    def __init__(
        self,
        config_class: type[PretrainedConfig],
        name: str | None = None,
        default_model: str = "",
        published: dict[str, dict] | None = None,
        tie_tiny: bool = False,
    ):
        problem = plan_problem(config_class)
        if problem:
            raise UserError(f"family={name or config_class.model_type!r}: {problem}, so no parallel plan can be made")
        self.config_class = config_class
        self.model_type = config_class.model_type
        self.name = name or self.model_type
        self.default_model = default_model
        self.published = published or {}
        self.tie_tiny = tie_tiny
        self.model_classes = model_classes_for(self.model_type)
        self.tasks = tuple(task for task in ("classification", "causal_lm") if task in self.model_classes)
        any_class = next(iter(self.model_classes.values()))
        self.prefix = any_class.base_model_prefix  # "model": where the decoder sits in the task classes
        self.block_styles = {
            key.removeprefix("layers.*."): style
            for key, style in config_class.base_model_tp_plan.items()
            if key.startswith("layers.*.")
        }
        self.column_wise = tuple(name for name, style in self.block_styles.items() if style == "colwise")
        self.row_wise = tuple(name for name, style in self.block_styles.items() if style == "rowwise")
        self.pp_plan = list(getattr(config_class, "base_model_pp_plan", None) or {})
        # transformers names the blocks `layers` in every plan; without a pp plan no stage is cut
        self.block_path = f"{self.prefix}.layers"
        cut = self.pp_plan.index("layers") if "layers" in self.pp_plan else len(self.pp_plan)
        before, after = self.pp_plan[:cut], self.pp_plan[cut + 1 :]
        self.first_stage_modules = tuple(f"{self.prefix}.{key}" for key in before)
        self.last_stage_modules = tuple(f"{self.prefix}.{key}" for key in after) + ("lm_head", "score")
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

        peft_targets = PEFT_TARGETS.get(self.model_type)
        self.lora_targets = tuple(peft_targets) if peft_targets else self.column_wise
        defaults = _default_values(config_class)
        self.dropout_keys = tuple(
            key
            for key, value in defaults.items()
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float)
        )
        self._pipeline_checked: set[tuple] = set()

    lora_head = ("score",)

    # --- sizes ---
    def sized_config(self, vocab_size, max_positions, hidden, layers, heads) -> PretrainedConfig:
        values = dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=min(TINY_KV_HEADS, heads),  # grouped-query attention, as the real models
            head_dim=hidden // heads,
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            tie_word_embeddings=self.tie_tiny,
        )
        known = _default_values(self.config_class)
        return self.config_class(**{key: value for key, value in values.items() if key in known or key in SPLIT_SIZES})

    def hf_config(self, model, size, vocab_size, max_positions, overrides, published=False) -> PretrainedConfig:
        config = super().hf_config(model, size, vocab_size, max_positions, overrides, published)
        layer_types = getattr(config, "layer_types", None)
        layers = config.num_hidden_layers
        if layer_types and "layer_types" not in overrides and len(layer_types) != layers:
            # model_config.num_hidden_layers alone: every block looks up its own entry of `layer_types`. Fewer
            # layers keep the first ones' kinds (those whose weights load); more follow the config class's rule.
            if layers > len(layer_types):
                layer_types = self.config_class(**{**config.to_dict(), "layer_types": None}).layer_types
            config.layer_types = list(layer_types[:layers])
        return config

    def tp_dimensions(self, hf_config: PretrainedConfig) -> dict[str, int]:
        sizes = {key: getattr(hf_config, key) for key in SPLIT_SIZES if getattr(hf_config, key, None)}
        if shards_vocabulary(hf_config):
            sizes["vocab_size"] = hf_config.vocab_size
        return sizes

    def check_tp(self, hf_config: PretrainedConfig, tp: int) -> None:
        if tp > 1:
            self.refuse_unimplemented_styles()
        super().check_tp(hf_config, tp)

    def refuse_unimplemented_styles(self) -> None:
        plan = self.config_class.base_model_tp_plan.items()
        # experts first: their plans list the packed expert weights (packed_colwise) before the experts' own style
        for key, style in plan:
            if style in EXPERT_STYLES or style.startswith("moe"):
                raise UserError(
                    f"family={self.name}: {self.config_class.__name__}'s tensor-parallel plan shards mixture-of-"
                    f"experts layers ({key}: {style}), which this project does not train yet; use "
                    f"tensor_parallel_degree=1 (FSDP and pipelines work without it)"
                )
        for key, style in plan:
            if style not in IMPLEMENTED_STYLES:
                raise UserError(
                    f"family={self.name}: {self.config_class.__name__}'s tensor-parallel plan names style "
                    f"{style!r} for {key}, which this project does not implement (implemented: "
                    f"{', '.join(IMPLEMENTED_STYLES)}); use tensor_parallel_degree=1"
                )

    # --- tensor parallelism ---
    def tp_plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        self.refuse_unimplemented_styles()
        plan: dict[str, ParallelStyle] = {}
        for number in self.block_numbers(model):
            for relative, style in self.block_styles.items():
                path = f"{self.block_path}.{number}.{relative}"
                if has_module(model, path):
                    plan[path] = style_for(style)
        if shards_vocabulary(model.config):
            for path in self.first_stage_modules[:1]:
                if has_module(model, path) and isinstance(model.get_submodule(path), nn.Embedding):
                    plan[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            if getattr(model, "lm_head", None) is not None:
                plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        return plan

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        """Nothing to do: these attention modules reshape with -1 heads (`view(*shape, -1, head_dim)`), so a rank
        holding heads/tp of q and k/v heads/tp of k and v computes its heads, keeping heads per k/v group."""

    # --- pipelines ---
    def build(self, head: HeadKind, hf_config: PretrainedConfig, context=None) -> nn.Module:
        model = super().build(head, hf_config, context)
        for number, block in enumerate(self.blocks(model)):
            block.attention_kind = mask_kind(hf_config, number)  # what mask the block takes, whatever stage holds it
        return model

    def pipeline_embed(self, model, input_ids, position_ids, token_type_ids=None):
        hidden = input_ids
        for path in self.first_stage_modules:
            hidden = model.get_submodule(path)(hidden)
        return hidden

    def pipeline_mask(self, model, hidden, attention_mask, position_ids, packed=False):
        """Per attention kind the stage's blocks take: (mask, rotary position embeddings); `packed`: every kind
        the packed batch's mask (check_packing refuses windows shorter than a packed sequence)."""
        config, base = model.config, model.get_submodule(self.prefix)
        kinds = {block.attention_kind for block in self.blocks(model)}
        builders = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
        rotary = getattr(base, "rotary_emb", None)
        per_kind = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        inputs = {}
        for kind in kinds:
            mask = (
                self.packed_mask(config, position_ids, hidden.dtype)
                if packed
                else builders[kind](
                    config=config,
                    inputs_embeds=hidden,
                    attention_mask=attention_mask,
                    past_key_values=None,
                    position_ids=position_ids,
                )
            )
            if rotary is None:
                positions = None
            elif per_kind:
                positions = rotary(hidden, position_ids, kind)
            else:
                positions = inputs[next(iter(inputs))][1] if inputs else rotary(hidden, position_ids)
            inputs[kind] = (mask, positions)
        return inputs

    def pipeline_block(self, block, hidden, mask, position_ids):
        attention_mask, positions = mask[block.attention_kind]
        extra = {} if positions is None else {"position_embeddings": positions}
        out = block(hidden, attention_mask=attention_mask, position_ids=position_ids, **extra)
        return out[0] if isinstance(out, tuple) else out

    def pipeline_position_head(self, model, hidden):
        return model.score(self.pipeline_hidden(model, hidden))

    def pipeline_hidden(self, model, hidden):
        for path in self.last_stage_modules:
            if path.startswith(f"{self.prefix}."):
                hidden = model.get_submodule(path)(hidden)
        return hidden

    def pipeline_head(self, model, hidden, attention_mask):
        hidden = self.pipeline_hidden(model, hidden)
        if getattr(model, "lm_head", None) is None:
            return last_token_logits(model.score(hidden), attention_mask)
        logits = model.lm_head(hidden)
        cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2 and 3's causal LMs
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def check_pipeline(self, hf_config: PretrainedConfig, head: HeadKind) -> None:
        """Refuse, in one line, an architecture whose forward the pipeline pieces do not reproduce: both run on a
        shrunk copy of `hf_config` (same architecture flags, width 64, 2 to 4 layers) in fp32, on padded rows."""
        from ..tasks.task import HeadKind

        if "layers" not in self.pp_plan:
            raise UserError(
                f"family={self.name}: transformers' {self.config_class.__name__} declares no base_model_pp_plan, "
                f"so pipelines are refused for it; use pipeline_parallel_degree=1"
            )
        key = (head, hf_config.to_json_string(use_diff=False))
        if key in self._pipeline_checked:
            return
        small = shrunk(hf_config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = self.model_classes[head](small).eval()
            # logits of tens, not of randomly initialised hundredths: a soft cap or a scale the pieces missed shows
            last = getattr(model, "lm_head", None) or model.score
            last.weight.data.mul_(LOGIT_BOOST)
            for number, block in enumerate(self.blocks(model)):
                block.attention_kind = mask_kind(small, number)
            input_ids = torch.randint(1, small.vocab_size, (2, 12))
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 8:] = 0
        input_ids[1, 8:] = small.pad_token_id if small.pad_token_id is not None else 0
        position_ids = torch.arange(12).expand(2, 12)
        with torch.no_grad():
            expected = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            hidden = self.pipeline_embed(model, input_ids, position_ids)
            inputs = self.pipeline_mask(model, hidden, attention_mask, position_ids)
            for block in self.blocks(model):
                hidden = self.pipeline_block(block, hidden, inputs, position_ids)
            got = self.pipeline_head(model, hidden, attention_mask)
        if HeadKind(head) is HeadKind.CAUSAL_LM:
            expected, got = expected[attention_mask.bool()], got[attention_mask.bool()]
        difference = (expected - got).abs().max().item() if expected.shape == got.shape else float("inf")
        if not difference <= CHECK_TOLERANCE * max(1.0, expected.abs().max().item()):
            raise UserError(
                f"family={self.name}: {type(model).__name__}'s forward does more than its pipeline plan "
                f"({' -> '.join(self.pp_plan) or 'none'}) plus rotary positions and masks (a shrunk copy differs by "
                f"{difference:.2g}), so pipelines are refused for it; use pipeline_parallel_degree=1 "
                f"(tensor parallelism and sharding use the model's own forward)"
            )
        self._pipeline_checked.add(key)


def shards_vocabulary(config: PretrainedConfig) -> bool:
    """Untied embeddings are sharded by vocabulary rows (the embedding) and columns (the LM head), as GPT-J's; a
    tied pair (small Qwen 3 models, Gemma) stays replicated: one Parameter cannot be sharded two ways."""
    return not getattr(config, "tie_word_embeddings", False)


def mask_kind(config: PretrainedConfig, number: int) -> str:
    """The attention mask block `number` takes: its `layer_types` entry, else sliding when the config has a
    window (Mistral's rule), else causal."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[number] if layer_types[number] in (FULL, SLIDING) else FULL
    return SLIDING if getattr(config, "sliding_window", None) else FULL


def shrunk(config: PretrainedConfig) -> PretrainedConfig:
    """The same architecture (every flag of `config`) at width 64, 4 heads (2 k/v heads), vocabulary 128 and
    at most 4 layers keeping one of each layer type."""
    small = copy.deepcopy(config)
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    )
    for key, value in sizes.items():
        if hasattr(small, key) and getattr(small, key) is not None:
            setattr(small, key, value)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types:
        keep = sorted({layer_types.index(kind) for kind in set(layer_types)} | {0, 1} & set(range(len(layer_types))))
        small.layer_types = [layer_types[i] for i in keep][:4]
        small.num_hidden_layers = len(small.layer_types)
    else:
        small.num_hidden_layers = min(config.num_hidden_layers, 2)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(small, key, None)
        if isinstance(value, int) and value >= 128:
            setattr(small, key, 0)
    if small.pad_token_id is None:  # a config not yet given its tokenizer's (--check): classifiers need one
        small.pad_token_id = 0
    small._attn_implementation = "eager"
    small.dtype = torch.float32  # not the checkpoint's 16-bit storage dtype (see Family.build)
    return small


def _default_values(config_class: type[PretrainedConfig]) -> dict:
    """A config class's defaults; quietly (some defaults, e.g. StarCoder2's token ids, make transformers warn)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return config_class().to_dict()
    finally:
        transformers.logging.set_verbosity(verbosity)
