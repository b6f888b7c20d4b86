"""The one way this project reads a transformers config or tokenizer from a model folder (or the Hub): never with
code from the folder; and the one way it writes a model folder (`save_model`).

A `config.json` or `tokenizer_config.json` with an `auto_map` names Python classes in files beside it; transformers
asks on stdin whether to run them ("[y/N]") and runs them on "y". Here every `from_pretrained` of a config or
tokenizer passes `trust_remote_code=False`, and a folder that asks for custom code is refused in one line, before
transformers reads it, naming the file and the key. Nothing loaded carries an `auto_map`, so nothing this project
saves (prepared data, checkpoints, exports) can either, and no code file is ever copied.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError

# The files transformers reads an `auto_map` from when it loads a config or a tokenizer.
CODE_POINTERS = ("config.json", "tokenizer_config.json")


def refuse_custom_code(folder: str | Path) -> None:
    """One line if `folder` (a local model or tokenizer folder; anything else is left alone) asks for custom code."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for name in CODE_POINTERS:
        path = folder / name
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: not readable JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
        if isinstance(content, dict) and "auto_map" in content:
            _refuse(str(path), content["auto_map"])


def _refuse(where: str, auto_map) -> None:
    raise UserError(
        f"{where} asks for custom code (auto_map: {json.dumps(auto_map)[:160]}); this project never runs code from "
        f"a model folder: use a model whose config and tokenizer are transformers' own classes"
    )


def load_hf_config(where: str | Path):
    """`AutoConfig.from_pretrained(where)` without custom code (`where`: a local folder or a Hub name)."""
    from transformers import AutoConfig

    refuse_custom_code(where)
    config = AutoConfig.from_pretrained(where, trust_remote_code=False)
    if getattr(config, "auto_map", None):  # a Hub repository: its files were not ours to read first
        _refuse(f"{where}/config.json", config.auto_map)
    return config


def load_hf_tokenizer(where: str | Path):
    """`AutoTokenizer.from_pretrained(where)` without custom code (`where`: a local folder or a Hub name)."""
    from transformers import AutoTokenizer

    refuse_custom_code(where)
    tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False)
    if tokenizer.init_kwargs.get("auto_map"):
        _refuse(f"{where}/tokenizer_config.json", tokenizer.init_kwargs["auto_map"])
    return tokenizer


def save_model(model, folder: str | Path) -> None:
    """`model.save_pretrained(folder)` for a plain transformers model (no DDP, DeepSpeed or compile wrapper).

    save_pretrained first unwraps its model through accelerate, which imports deepspeed (and mlflow with it) when
    deepspeed is installed, as it is here: seconds of imports in every run that exports, and deepspeed's import-time
    set-up in runs that never use it. What this project saves is built unwrapped, so there is nothing to unwrap."""
    with _unwrapping_skipped():
        model.save_pretrained(folder)


@contextmanager
def _unwrapping_skipped():
    from transformers import modeling_utils

    unwrap = modeling_utils.unwrap_model  # an AttributeError here, not a silent no-op, if transformers renames it
    modeling_utils.unwrap_model = _unwrapped
    try:
        yield
    finally:
        modeling_utils.unwrap_model = unwrap


def _unwrapped(model, recursive: bool = False):
    return model
