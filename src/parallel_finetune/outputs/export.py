"""Export a (tensor-parallel) model as a plain Hugging Face folder: safetensors + config + tokenizer.

`export_model` is a run's export (hf/, or with peft=lora adapter/ and base/), from the updates' gathered weights;
below it the writers: the gather and `save_hf`, which writes through runfolder.write_folder (staging folder, then
one rename)."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import ModelSection, PeftSection
from ..data.chat import stop_ids
from ..errors import UserError
from ..interfaces import Updates
from ..model import lora
from ..model.pretrained import save_model
from ..parallel.layout import rank0_decides
from ..resolve import Resolved
from ..tasks import LABEL_FILE
from . import integrity
from .runfolder import record_written, sagemaker_folder, write_folder

log = logging.getLogger(__name__)


def export_target(output_dir: str | None, run_folder: Path) -> tuple[Path, bool]:
    """Where a run's export goes: hf/ in the run folder, or in a SageMaker job given no `output_dir`, the job's
    model folder, which it uploads to S3 as the model artifact; and whether a LoRA adapter goes inside that folder
    (SageMaker's, so the artifact holds it) rather than beside it."""
    model_dir = None if output_dir else sagemaker_folder("SM_MODEL_DIR")
    return (model_dir, True) if model_dir is not None else (run_folder / "hf", False)


@dataclass(frozen=True)
class ExportPlace:
    """Where an export goes: `out`, and whether a LoRA adapter (and a tiny base) go `inside` it rather than beside
    it; the exports that lie in `run_folder` go on its record, and its labels.json travels with an adapter."""

    run_folder: Path
    out: Path
    inside: bool = False

    @classmethod
    def of_run(cls, output_dir: str | None, run_folder: Path) -> ExportPlace:
        """A run's export: `export_target`'s place (`output_dir`: the output section's, as the recipe gave it)."""
        return cls(run_folder, *export_target(output_dir, run_folder))


def export_model(
    updates: Updates,
    tokenizer,
    layout,
    place: ExportPlace,
    *,
    model: ModelSection,
    peft: PeftSection,
    resolved: Resolved,
    saved_initial: dict[str, torch.Tensor],
) -> Path:
    """The trained model as a Hugging Face folder at `place`, in the resolved export dtype; with peft=lora the
    adapter instead (`export_lora`; `saved_initial`: builder.BuiltRun's, what a tiny base/ holds of the modules
    to save). Every rank calls it (the gather is a collective); rank 0 writes, and a failure there (NaN weights, a
    full disk) is every rank's one-line error."""
    if peft.method == "lora":
        return export_lora(
            updates, tokenizer, layout, place, model=model, peft=peft, resolved=resolved, saved_initial=saved_initial
        )
    family, out = resolved.family, place.out
    state, module = updates.full_state_dict(resolved.export_dtype), updates.module

    def write():
        _record_exports(place.run_folder, out)
        save_hf(module, family.to_hf_state_dict(state, module.config), tokenizer, out)

    rank0_decides(layout, write)
    log.info("exported a Hugging Face model to %s", out)
    return out


def export_lora(
    updates: Updates,
    tokenizer,
    layout,
    place: ExportPlace,
    *,
    model: ModelSection,
    peft: PeftSection,
    resolved: Resolved,
    saved_initial: dict[str, torch.Tensor],
) -> Path:
    """peft=lora: the adapter (and head) in peft's format in adapter/ beside `place.out` (`inside` it: SageMaker's
    model folder, so the job's model artifact holds it); with lora_export_merged also `place.out` (hf/): the base
    with the update merged in. A tiny base (size=tiny) exists nowhere else, so it is written too (base/), and the
    adapter names it; a pretrained one is named by its resolved model name. base/ is the frozen base: its
    lora_modules_to_save are their values as loaded (`saved_initial`, rank 0's), not the trained ones the adapter
    carries, so that base/ is the model before training (a DPO reference, another adapter's base)."""
    out, inside, run_folder = place.out, place.inside, place.run_folder
    family, tiny = resolved.family, model.size == "tiny"
    dtype, module = resolved.export_dtype, updates.module
    settings = resolved.lora
    whole = peft.lora_export_merged or tiny
    # every rank takes part in the gather; what to gather is the same on all of them
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    state = updates.full_state_dict(dtype, None if whole else trainable)
    adapter, base_dir = (out / "adapter", out / "base") if inside else (out.with_name("adapter"), out.with_name("base"))
    base = str(base_dir.resolve()) if tiny else resolved.model_name

    def write():
        tiny_base, merged = [base_dir] if tiny else [], [out] if peft.lora_export_merged else []
        _record_exports(run_folder, adapter, *tiny_base, *merged)
        if peft.lora_export_merged:  # first: written into an existing `out`, it replaces what `out` held
            merged = lora.merged_state(state, settings.scaling)
            save_hf(module, family.to_hf_state_dict(merged, module.config), tokenizer, out)
        if tiny:
            frozen = {name: tensor for name, tensor in state.items() if ".lora_" not in name}
            # a caller that did not gather them (builder._saved_initial) would write the trained ones
            if bool(settings.modules_to_save) != bool(saved_initial) or not saved_initial.keys() <= frozen.keys():
                wanted = settings.modules_to_save
                raise ValueError(f"base/ needs {wanted}'s initial values; given {sorted(saved_initial)}")
            frozen.update(saved_initial)
            save_hf(module, family.to_hf_state_dict(frozen, module.config), tokenizer, base_dir)
        labels = run_folder / LABEL_FILE  # the head's width and names travel with the adapter (scripts/predict.py)
        write_folder(
            adapter,
            lambda folder: (
                lora.export_adapter(state, family, module.config, settings, resolved.head, base, folder),
                tokenizer.save_pretrained(folder),
                labels.is_file() and shutil.copy(labels, folder / LABEL_FILE),
            ),
        )

    rank0_decides(layout, write)
    log.info(
        "exported the LoRA adapter (peft format) to %s%s",
        adapter,
        f" and the merged model to {out}" if peft.lora_export_merged else "",
    )
    return adapter


def _record_exports(run_folder: Path, *folders: Path) -> None:
    """Put the export folders that lie in the run folder on its record, before writing them (rank 0)."""
    ours = [folder.name for folder in folders if folder.parent.resolve() == run_folder.resolve()]
    if ours:
        record_written(run_folder, *ours)


def save_hf(model: nn.Module, state: dict[str, torch.Tensor], tokenizer, out: Path) -> None:
    """Write a folder that `from_pretrained` loads, built from a fresh, unsharded copy of the model. Weights
    holding NaN/inf are refused; a failed write (a full disk) leaves `out` as it was."""
    bad = integrity.nonfinite(state)
    if bad:
        raise UserError(f"not exporting to {out}: {bad} holds NaN or inf (the run diverged; lower lr)")
    with torch.device("meta"):
        clean = type(model)(model.config)
    clean.load_state_dict(state, assign=True, strict=True)
    clean.tie_weights()  # assign=True replaced tied parameters one by one; tie them again (GPT-2, GPT-Neo)
    clean.config.dtype = next(iter(state.values())).dtype
    _stop_at_end_of_turn(clean, tokenizer)
    write_folder(out, lambda folder: (save_model(clean, folder), tokenizer.save_pretrained(folder)))


def _stop_at_end_of_turn(model: nn.Module, tokenizer) -> None:
    """A chat model's generation_config.json stops at the template's end-of-turn token as well as at EOS (what
    generate_every stops at): transformers' generate and pipelines read it, and without it an answer runs on into
    a made-up next turn until max_new_tokens."""
    if not getattr(tokenizer, "chat_template", None) or not model.can_generate():
        return
    eos, stops = tokenizer.eos_token_id, stop_ids(tokenizer)
    ordered = ([eos] if eos in stops else []) + sorted(stops - {eos})
    if not ordered:  # no EOS and a template that writes nothing after an answer: nothing to stop at
        return
    model.generation_config.eos_token_id = ordered if len(ordered) > 1 else ordered[0]
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
