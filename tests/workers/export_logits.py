"""Trains a few steps under the given layout, exports hf/, and saves the trained (sharded) model's logits on a
fixed batch, so the test can compare them with the exported model reloaded by transformers."""

import sys
from pathlib import Path

import torch

from parallel_finetune import data
from parallel_finetune.builder import RunBuilder
from parallel_finetune.export import ExportPlace, export_model
from parallel_finetune.resolve import load_config
from parallel_finetune.trainer import Trainer


def main() -> None:
    config = load_config(sys.argv[1], sys.argv[2:])
    trainer = Trainer(RunBuilder(config).build())
    trainer.fit()
    export_model(
        trainer.updates,
        trainer.data.tokenizer,
        trainer.layout,
        ExportPlace.of_run(config.output_dir, trainer.output_dir),
        model=config.model,
        peft=config.peft,
        resolved=trainer.resolved,
    )
    dev = trainer.data.splits["validation"]
    ids = data.column(dev, "input_ids")[:16]
    batch = data.collate(ids, trainer.data.tokenizer.pad_token_id, trainer.data.tokenizer.padding_side)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.runner.forward({k: v.to(trainer.layout.device) for k, v in batch.items()})
    layout = trainer.layout  # under pipeline parallelism only the last stage has logits
    if logits is not None and layout.dp_rank == 0 and layout.tp_rank == 0:
        torch.save({"batch": batch, "logits": logits}, Path(config.output_dir) / "trained_logits.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
