"""A run (scripts/train.py's) that also writes each rank's NF4 shards (their inner tensors: codes, int8 scalers,
factors, mean) to nf4-rank<R>.pt in the output folder after the first backward, and with export=true saves the
trained model's logits on a fixed batch after the export (as export_logits.py): the test compares every layout's
quantized base with one process's bit for bit, and the export with the trained model."""

import sys
from pathlib import Path

import torch

from parallel_finetune.data.batch import padded_batch
from parallel_finetune.loop import run as run_module
from parallel_finetune.model.quantize import NF4Linear, local_nf4
from parallel_finetune.resolve import load_config

INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
RUN = {}
export_model = run_module.export_model


def write_shards(built, step: int) -> None:
    if RUN:
        return
    RUN["built"] = built
    trainer = built.trainer
    layout = trainer.layout
    shards = {
        f"{path}.weight": {key: getattr(local_nf4(module.weight), key).cpu() for key in INNER}
        for path, module in trainer.model.named_modules()
        if isinstance(module, NF4Linear) and local_nf4(module.weight) is not None
    }
    # which part of each stored matrix this rank holds: its tensor-parallel rank, or under FSDP its data-parallel one
    part = layout.dp_rank if layout.dims.fsdp else layout.tp_rank
    where = {"part": part, "tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank, "pp_rank": layout.pp_rank}
    torch.save({"where": where, "shards": shards}, built.output_dir / f"nf4-rank{layout.rank}.pt")


def export_then_save_logits(*args, **kwargs):
    out = export_model(*args, **kwargs)
    built = RUN["built"]
    trainer = built.trainer
    layout, tokenizer = trainer.layout, built.data.tokenizer
    ids = built.data.splits["validation"]["input_ids"][:16]
    batch = padded_batch(ids, pad_id=tokenizer.pad_token_id, padding_side=tokenizer.padding_side)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.runner.forward(batch.to(layout.device))
    if logits is not None and layout.dp_rank == 0 and layout.tp_rank == 0:  # a pipeline's last stage
        saved = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        torch.save({"batch": saved, "logits": logits}, Path(built.output_dir) / "trained_logits.pt")
    return out


if __name__ == "__main__":
    run_module.export_model = export_then_save_logits
    run_module.run(load_config(sys.argv[1], sys.argv[2:]), after_backward=write_shards)
