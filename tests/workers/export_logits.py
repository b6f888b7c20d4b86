"""Trains a few steps under the given layout, exports hf/, and saves the trained (sharded) model's logits on a
fixed batch, so the test can compare them with the exported model reloaded by transformers."""

import sys
from pathlib import Path

import torch

from parallel_finetune.data.batch import padded_batch
from parallel_finetune.loop.builder import RunBuilder
from parallel_finetune.outputs.export import ExportPlace, export_model
from parallel_finetune.resolve import load_config


def main() -> None:
    config = load_config(sys.argv[1], sys.argv[2:])
    built = RunBuilder(config).build()
    trainer, tokenizer = built.trainer, built.data.tokenizer
    trainer.fit()
    export_model(
        trainer.updates,
        tokenizer,
        trainer.layout,
        ExportPlace.of_run(config.output_dir, built.output_dir),
        model=config.model,
        peft=config.peft,
        resolved=built.resolved,
        saved_initial=built.saved_initial,
    )
    ids = built.data.splits["validation"]["input_ids"][:16]
    batch = padded_batch(ids, pad_id=tokenizer.pad_token_id, padding_side=tokenizer.padding_side)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.runner.forward(batch.to(trainer.layout.device))
    layout = trainer.layout  # under pipeline parallelism only the last stage has logits
    if logits is not None and layout.dp_rank == 0 and layout.tp_rank == 0:
        saved = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        torch.save({"batch": saved, "logits": logits}, Path(config.output_dir) / "trained_logits.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
