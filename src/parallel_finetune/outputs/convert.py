"""A checkpoint of any layout converted into a Hugging Face model folder, in one process (scripts/export_hf.py):
the run's settings read back from the checkpoint's config.yaml and resolved by the same function as the run
(resolve.choose_model), the model loaded as a world of one, the checkpoint's tensors read on top, LoRA merged in."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..config import Config
from ..errors import UserError
from ..model import lora, quantize
from ..model.hub import download_model
from ..model.load import load_model
from ..model.precision import DTYPES, EXPORT_DTYPES
from ..model.pretrained import load_hf_tokenizer
from ..resolve import choose_model
from ..tasks import LABEL_FILE, read_label_file
from . import integrity
from .checkpoint import read_tensors, resolve_resume
from .export import save_hf
from .run_files import CONFIG_FILE, LOCK, RECORD
from .runfolder import check_export_target


def check_new_export_folder(out: Path) -> None:
    """OUT of export_hf.py: a new or empty folder outside any checkpoint, never a run's folder or a file."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a folder; choose a new or empty folder for the export")
    check_export_target(out)
    if not out.is_dir():
        return
    run_files = [name for name in (RECORD, LOCK, "metrics.jsonl") if (out / name).exists()]
    if run_files:
        raise UserError(
            f"{out} is a run folder (it holds {', '.join(run_files)}); export into a new or empty folder, "
            f"e.g. {out / 'exported'}"
        )
    if any(out.iterdir()):
        raise UserError(f"{out} already holds files; choose an empty or new folder")


def export_checkpoint(folder: Path, out: Path, dtype: str = "float32") -> Path:
    """A Hugging Face model folder from any layout's checkpoint (a step-… folder, or a folder of them: its newest
    that verifies), in one process (no process group)."""
    check_new_export_folder(out)  # a file, a run folder, a folder inside a checkpoint: refused before any reading
    folder = resolve_resume(str(folder), Path(folder), label="checkpoint")  # verified: sizes, hashes, metadata
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"dtype={dtype!r} is not valid; expected one of {'|'.join(EXPORT_DTYPES)}")
    config = Config.from_flat(yaml.safe_load((folder / CONFIG_FILE).read_text()))
    chosen = choose_model(config)  # as the run resolved it
    family = chosen.family
    tokenizer = load_hf_tokenizer(folder / "tokenizer")
    model_path = None
    if config.model.size == "full":  # its config.json gives the architecture
        model_path = download_model(chosen.model_name, config.model.revision, local_only=True)
    labels = read_label_file(folder) if (folder / LABEL_FILE).is_file() else None  # older checkpoints: SST-2's
    hf_config = family.config_for(
        model=config.model,
        max_length=config.data.max_length,
        tokenizer_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        model_path=model_path,
        labels=labels,
        head=chosen.head,
    )
    # A world of one, made as the run made its model; a LoRA checkpoint holds adapters and head only: the base is
    # loaded again from its source (a tiny one from the seed, as the run made it) and B·A merged in after.
    ready = load_model(
        family,
        chosen.head,
        hf_config,
        model_path,
        seed=config.training.seed,
        adapters=chosen.lora,
        from_checkpoint=True,
    )
    state = {**ready.model.state_dict(), **dict(quantize.dequantized_weights(ready.model))}  # QLoRA: NF4 base
    trainable = ready.parallel.trainable
    held = state if trainable is None else {name: tensor for name, tensor in state.items() if name in trainable}
    try:
        read_tensors({"model": held}, folder)
    except integrity.Refused as exc:
        raise UserError(f"checkpoint {folder}: {exc}") from None
    state.update(held)
    if chosen.lora is not None:
        state = lora.merged_state({name: tensor.detach() for name, tensor in state.items()}, chosen.lora.scaling)
    state = {name: tensor.to(DTYPES[dtype]) if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    save_hf(ready.model, family.to_hf_state_dict(state, hf_config), tokenizer, out)
    return out
