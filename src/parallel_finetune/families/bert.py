"""BERT (bert-large-uncased, MiniLM): post-norm encoder, sequence classification through pooler + classifier."""

from __future__ import annotations

from torch import nn
from transformers import BertConfig, BertForSequenceClassification
from transformers.masking_utils import create_bidirectional_mask

from .base import Family, localize_heads


class Bert(Family):
    name = "bert"
    default_model = "bert-large-uncased"
    tasks = ("classification",)
    config_class = BertConfig
    model_classes = {"classification": BertForSequenceClassification}
    tiny_tokenizer = "wordpiece"  # the pooler reads the first token, so a tiny BERT needs [CLS] ... [SEP]

    def tiny_config(self, vocab_size: int, max_positions: int) -> BertConfig:
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
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

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        for layer in self.blocks(model):
            localize_heads(
                layer.attention.self, tp, head_attrs=("num_attention_heads",), width_attrs=("all_head_size",)
            )

    first_stage_modules = ("bert.embeddings",)
    last_stage_modules = ("bert.pooler", "classifier")

    def pipeline_embed(self, model, input_ids, position_ids):
        return model.bert.embeddings(input_ids=input_ids, position_ids=position_ids)

    def pipeline_mask(self, model, hidden, attention_mask, position_ids):
        return create_bidirectional_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask)

    def pipeline_block(self, block, hidden, mask, position_ids):
        return block(hidden, mask)

    def pipeline_head(self, model, hidden, attention_mask):
        return model.classifier(model.dropout(model.bert.pooler(hidden)))
