"""Builds a QLoRA run, writes each rank's NF4 shards (their inner tensors: codes, int8 scalers, factors, mean) to
nf4-rank<R>.pt in the output folder, trains, and with export=true exports and saves the trained model's logits on
a fixed batch (as export_logits.py), so the test can compare every layout's quantized base with one process's
bit for bit, and the export with the trained model."""

import sys
from pathlib import Path

import torch

from parallel_finetune import data
from parallel_finetune.builder import RunBuilder
from parallel_finetune.export import ExportPlace, export_model
from parallel_finetune.quantize import NF4Linear, is_nf4
from parallel_finetune.resolve import load_config
from parallel_finetune.trainer import Trainer

INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def main() -> None:
    config = load_config(sys.argv[1], sys.argv[2:])
    trainer = Trainer(RunBuilder(config).build())
    layout, out = trainer.layout, Path(config.output_dir)
    shards = {
        f"{path}.weight": {key: getattr(module.weight, key).cpu() for key in INNER}
        for path, module in trainer.model.named_modules()
        if isinstance(module, NF4Linear) and is_nf4(module.weight)
    }
    where = {"tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank, "pp_rank": layout.pp_rank}
    torch.save({"where": where, "shards": shards}, out / f"nf4-rank{layout.rank}.pt")
    trainer.fit()
    if config.export:
        export_model(
            trainer.updates,
            trainer.data.tokenizer,
            layout,
            ExportPlace.of_run(config.output_dir, trainer.output_dir),
            model=config.model,
            peft=config.peft,
            resolved=trainer.resolved,
        )
        ids = data.column(trainer.data.splits["validation"], "input_ids")[:16]
        batch = data.collate(ids, trainer.data.tokenizer.pad_token_id, trainer.data.tokenizer.padding_side)
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.runner.forward({k: v.to(layout.device) for k, v in batch.items()})
        if logits is not None and layout.dp_rank == 0 and layout.tp_rank == 0:  # a pipeline's last stage
            torch.save({"batch": batch, "logits": logits}, out / "trained_logits.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
