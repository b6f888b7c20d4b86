"""Checkpoint integrity: a manifest of content hashes, and DCP's metadata read without running code.

Every checkpoint folder ends with `manifest.json`, written last: the sha256 and size of every other file. Loading
(resume and `scripts/export_hf.py`) first checks that the folder holds exactly those files with those sizes and
hashes, so a flipped byte, a truncated shard or a half-synced copy is found before a single tensor is read.

DCP stores its `.metadata` (which tensor lives at which offset of which file) as a pickle, and its reader calls
`pickle.load` on it: a crafted file runs any code it likes. We keep DCP's format (checkpoints stay readable by DCP
and its tools, and older ones keep loading) but read it with a restricted unpickler that admits only the
classes DCP's metadata consists of: its own dataclasses, `torch.Size`, dtypes, layouts and paths, all of
which only hold values. Anything else a pickle asks for (`os.system`, `builtins.eval`, ...) is refused before it
is looked up, so it can never be called. The tensors in DCP's `.distcp` files and the RNG states are read with
`torch.load(weights_only=True)`, whose refusal of a pickle asking for more becomes one line naming the file. The
manifest does not authenticate (whoever can write the folder can rewrite it too); the unpicklers are what keep
code out, the manifest what catches corruption.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import UserError, one_line

MANIFEST = "manifest.json"
METADATA = ".metadata"
CHUNK = 16 * 2**20

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name, e.g. "torch.strided"
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),  # the writer's checkpoint_id
    ("collections", "OrderedDict"),
}


class Refused(Exception):
    """Why a checkpoint folder is not used (the caller names the folder)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise Refused(
            f"{METADATA} asks to load {module}.{name}, which DCP metadata never holds; refusing to "
            "read it (a pickle can run code): do not use this checkpoint"
        )


def _load_metadata(path: Path) -> Metadata:
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Refused:
        raise
    except Exception as exc:  # a damaged pickle fails in many ways, none of them worth a traceback
        raise Refused(f"{path.name} is not DCP metadata ({type(exc).__name__})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise Refused(f"{path.name} is not DCP metadata ({type(metadata).__name__})")
    for info in metadata.storage_data.values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).name != relative or relative in ("", ".", ".."):
            raise Refused(f"{path.name} points outside its folder ({relative!r})")
    return metadata


def tensor_refusal(name: str, exc: BaseException) -> Refused:
    """torch.load(weights_only=True)'s refusal of file `name` in one line, without its advice to load the file
    with weights_only=False: a pickle asking for more than tensors, or no tensor file at all."""
    asked = re.search(r"GLOBAL (\S+)", str(exc))
    if isinstance(exc, OSError):
        return Refused(f"{name}: {one_line(exc)}")
    if asked:
        return Refused(
            f"{name} asks to load {asked[1]}, which a tensor file never holds; refusing to read it (a pickle can run "
            "code): do not use this checkpoint"
        )
    return Refused(f"{name} is not a tensor file torch reads with weights_only=True ({type(exc).__name__})")


def load_tensors(path: Path, name: str):
    """torch.load(path, weights_only=True); a file it refuses is a Refused naming `name`."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:
        raise tensor_refusal(name, exc) from None


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata from `path`, unpickled with only DCP's own classes admitted; a UserError otherwise."""
    try:
        return _load_metadata(path)
    except Refused as exc:
        raise UserError(f"checkpoint {path.parent}: {exc}") from None


class SafeReader(FileSystemReader):
    """DCP's file reader with the restricted unpickler above instead of its plain `pickle.load` for the metadata,
    and its tensor files read one at a time, so that a refusal (a pickle among the tensors) names its file."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = _load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if not by_file:
            return super().read_data(plan, planner)
        for name, items in by_file.items():
            try:
                done = super().read_data(dataclasses.replace(plan, items=items), planner)
            except Exception as exc:  # torch.load's refusal, a damaged zip: DCP would wrap its whole traceback
                raise tensor_refusal(name, exc) from None
        return done


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def describe(folder: Path, names) -> dict[str, dict]:
    """Manifest entries (size and sha256) of `names`, paths relative to `folder`."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)} for name in names}


def files_in(folder: Path) -> list[str]:
    """Every file under `folder` but the manifest, relative, sorted; anything that is not a regular file or a
    folder (a link, a FIFO that would block a reader, a device) is refused."""
    names = []
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            raise Refused(f"{path.relative_to(folder)} is not a regular file")
        if path.relative_to(folder).as_posix() != MANIFEST:
            names.append(path.relative_to(folder).as_posix())
    return names


def write_manifest(folder: Path, entries: dict[str, dict]) -> None:
    """Written last and atomically: a folder with a manifest holds everything the manifest lists."""
    partial = folder / f".{MANIFEST}.tmp"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump({"format": 1, "hash": "sha256", "files": entries}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, folder / MANIFEST)


def verify(folder: Path, share: tuple[int, int] = (0, 1), contents: bool = True) -> str | None:
    """Why `folder` fails verification, or None. Every caller checks the file list, the sizes and the metadata;
    with `contents`, this caller hashes its `share` = (k, n) of the files (every n-th from the k-th), so n ranks
    together hash each file once."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
        hashes = {name: str(entry["sha256"]) for name, entry in files.items()}
    except FileNotFoundError:
        return f"no {MANIFEST} (never finished, or written before checkpoints carried hashes)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} unreadable ({type(exc).__name__})"
    try:
        present = files_in(folder)
    except Refused as exc:
        return str(exc)
    missing, extra = sorted(set(files) - set(present)), sorted(set(present) - set(files))
    if missing:
        return f"{missing[0]} is missing ({len(missing)} file(s) of the manifest are)"
    if extra:
        return f"{extra[0]} is not in the manifest (added after the checkpoint was written)"
    for name in present:
        size = (folder / name).stat().st_size
        if size != sizes[name]:
            return f"{name} is {size:,} bytes, the manifest says {sizes[name]:,} (truncated or overwritten)"
    if METADATA not in files:
        return f"no DCP {METADATA}"
    try:
        metadata = _load_metadata(folder / METADATA)
    except Refused as exc:
        return str(exc)
    unlisted = {info.relative_path for info in metadata.storage_data.values()} - set(files)
    if unlisted:
        return f"{METADATA} refers to {sorted(unlisted)[0]}, which the manifest does not list"
    if contents:
        k, n = share
        for name in sorted(present, key=lambda name: -sizes[name])[k::n]:  # the big shards spread over the ranks
            if sha256(folder / name) != hashes[name]:
                return f"{name} does not match its sha256 in the manifest (corrupted or modified)"
    return None


def nonfinite(state: dict, prefix: str = "") -> str | None:
    """The name of the first floating tensor in a (nested) state dict that holds a NaN or inf (this rank's
    shards only), or None. Each tensor's largest magnitude, in one fused pass per device and dtype (a NaN or an
    inf survives a maximum, and a maximum of finite values cannot overflow), then one read of the flags: not a
    test and a device sync per tensor (a save checks every weight and moment, hundreds of them)."""
    named = list(_floating_shards(state, prefix))
    groups: dict[tuple, list[int]] = {}
    for index, (_, tensor) in enumerate(named):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    finite = [True] * len(named)
    for indices in groups.values():
        largest = torch._foreach_norm([named[i][1] for i in indices], float("inf"))
        for i, ok in zip(indices, torch.stack(largest).isfinite().tolist(), strict=True):
            finite[i] = ok
    return next((name for (name, _), ok in zip(named, finite, strict=True) if not ok), None)


def _floating_shards(state: dict, prefix: str):
    """(name, this rank's local tensor) of every non-empty floating tensor in a nested state dict, in its order."""
    for name, value in state.items():
        if isinstance(value, dict):
            yield from _floating_shards(value, f"{prefix}{name}.")
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
            yield prefix + name, local
