"""BERT (bert-large-uncased, MiniLM): post-norm encoder, sequence classification through pooler + classifier."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, BertModel
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import BertLayer, eager_attention_forward

from . import register
from .base import Family, hf_root, localize_heads


class FirstTokenBertLayer(BertLayer):
    """The last encoder layer of a classifier: the pooler reads only the first token ([CLS]) of its output, so
    only that token's query, attention output and feed-forward are computed; keys and values still come from
    every token. Same values and gradients as the full layer (the other rows were computed and thrown away),
    10/12 of the layer's matmul FLOPs fewer. Parameter names and shapes are BertLayer's: loading, tensor
    parallelism, LoRA and export see no difference. A run with packed batches reads every row's first token,
    wherever it sits: `every_position` (Bert.prepare_packing) makes it the full layer again."""

    every_position = False

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, **kwargs):
        if self.every_position:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        attention = self.attention.self
        first = hidden_states[:, :1]
        batch, length, _ = hidden_states.shape
        size = attention.attention_head_size
        query = attention.query(first).view(batch, 1, -1, size).transpose(1, 2)
        key = attention.key(hidden_states).view(batch, length, -1, size).transpose(1, 2)
        value = attention.value(hidden_states).view(batch, length, -1, size).transpose(1, 2)
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = attention_mask[:, :, :1]  # [batch, 1, queries, keys]: the first query's row
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager_attention_forward)
        output, _ = attend(
            attention,
            query,
            key,
            value,
            attention_mask,
            dropout=attention.dropout.p if self.training else 0.0,
            scaling=attention.scaling,
        )
        output = self.attention.output(output.reshape(batch, 1, -1), first)
        return self.feed_forward_chunk(output)


class Bert(Family):
    name = "bert"
    default_model = "bert-large-uncased"
    tasks = ("classification",)
    config_class = BertConfig
    model_classes = {"classification": BertForSequenceClassification}
    tiny_tokenizer = "wordpiece"  # the pooler reads the first token, so a tiny BERT needs [CLS] ... [SEP]
    pair_token_types = True
    published = {
        name: dict(
            vocab_size=30522,
            max_position_embeddings=512,
            type_vocab_size=2,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
        )
        for name, hidden, layers, heads in (("bert-base-uncased", 768, 12, 12), ("bert-large-uncased", 1024, 24, 16))
    }
    dropout_keys = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    checkpoint_class = BertModel  # a bare encoder without the `bert.` prefix, as MiniLM's
    pooled_token = "first"
    causal = False

    def sized_config(self, vocab_size, max_positions, hidden, layers, heads) -> BertConfig:
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=max_positions,
        )

    def tp_dimensions(self, hf_config: BertConfig) -> dict[str, int]:
        return {
            "num_attention_heads": hf_config.num_attention_heads,
            "hidden_size": hf_config.hidden_size,
            "intermediate_size": hf_config.intermediate_size,
        }

    # Embeddings (BERT's 30,522-row vocabulary divides by 2 but not by 4), LayerNorms, pooler and classifier
    # stay replicated.
    block_path = "bert.encoder.layer"
    column_wise = ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense")
    row_wise = ("attention.output.dense", "output.dense")
    lora_targets = ("query", "value")
    lora_head = ("classifier",)

    def surgery(self, model: nn.Module) -> None:
        self.blocks(model)[-1].__class__ = FirstTokenBertLayer

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        for layer in self.blocks(model):
            localize_heads(
                layer.attention.self, tp, head_attrs=("num_attention_heads",), width_attrs=("all_head_size",)
            )

    first_stage_modules = ("bert.embeddings",)
    last_stage_modules = ("bert.pooler", "classifier")

    def pipeline_embed(self, model, input_ids, position_ids, token_type_ids=None):
        return model.bert.embeddings(input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids)

    def pipeline_mask(self, model, hidden, attention_mask, position_ids, packed=False):
        if packed:
            return self.packed_mask(model.config, position_ids, hidden.dtype)
        return create_bidirectional_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask)

    def pipeline_block(self, block, hidden, mask, position_ids):
        return block(hidden, mask)

    def pipeline_head(self, model, hidden, attention_mask):
        return model.classifier(model.dropout(model.bert.pooler(hidden)))

    def pipeline_position_head(self, model, hidden):
        return position_classifier(model, hidden)

    def prepare_packing(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FirstTokenBertLayer):
                module.every_position = True

    def position_logits_hook(self, model, store):
        """The pooler reads the first position only: its input, every position, goes through the pooler's dense
        layer and activation, the dropout and the classifier, as the pooled first token does."""
        root = hf_root(model)
        return root.bert.pooler.register_forward_hook(
            lambda module, args, output: store(position_classifier(root, args[0]))
        )


def position_classifier(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """BertForSequenceClassification's head at every position: pooler dense + tanh, dropout, classifier."""
    pooler = model.bert.pooler
    return model.classifier(model.dropout(pooler.activation(pooler.dense(hidden))))


register(Bert())
