"""The files of a checkpoint: data-only tensor files, checksums, and paths kept inside the
checkpoint directory. `embcache.checkpoint` decides what goes into them.

Tensors are stored as safetensors (a JSON header, then the raw bytes: reading one cannot run
code, unlike a pickle). Anything else (optimizer hyper-parameters, the structure of a torch
optimizer's state dict) is JSON: in the manifest, or in the tensor file's header metadata as a
tree in which containers are one-key objects (``{"dict": [[key, value], ...]}``, ``{"list":
[...]}``, ``{"tuple": [...]}``, ``{"tensor": name}``) so that int keys and tuples come back as
they went in.

Every file is listed in the manifest with its size and sha256, and CURRENT holds the sha256 of
the manifest, so a flipped bit anywhere is found before anything is applied.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT_VERSION = 2
CURRENT = "CURRENT"
SNAPSHOT_RE = re.compile(r"snap-\d{6,}")
_META_KEY = "embcache"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: a file missing, damaged (checksum), malformed, of an
    older format, or pointing outside its directory. The message names the file."""


def sha256_of(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_tensors(
    root: Path, name: str, tensors: dict[str, torch.Tensor], meta: Any = None
) -> dict[str, Any]:
    """Write ``tensors`` (and the JSON ``meta``) as safetensors file ``root / name``.

    Returns:
        The manifest entry: ``{"name", "bytes", "sha256"}``.

    Raises:
        TypeError: a value that is not a tensor, or a dtype safetensors cannot store.
    """
    plain = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: {key!r} is a {type(value).__name__}, not a tensor")
        plain[key] = value.detach().cpu().contiguous().clone()
    header = {_META_KEY: json.dumps(meta)} if meta is not None else None
    try:
        data = st_save(plain, metadata=header)
    except (SafetensorError, ValueError, TypeError) as err:
        raise TypeError(f"{name}: cannot store these tensors as safetensors: {err}") from None
    write_bytes(root / name, data)
    return {"name": name, "bytes": len(data), "sha256": sha256_of(data)}


def member(snap: Path, name: object, what: str) -> Path:
    """``snap / name`` for a file name taken from a manifest, refused when it could lead
    anywhere but a plain file inside the snapshot (absolute, ``..``, a link out)."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise CheckpointError(f"{snap / 'manifest.json'}: {what} names the file {name!r}")
    parts = Path(name).parts
    if any(part in ("..", ".", "") for part in parts):
        raise CheckpointError(f"{snap / 'manifest.json'}: {what} names the file {name!r}")
    path = snap / name
    if not path.resolve().is_relative_to(snap.resolve()):
        raise CheckpointError(f"{path}: {what} resolves outside the checkpoint {snap}")
    return path


def read_verified(snap: Path, entry: object, what: str) -> tuple[Path, bytes]:
    """The bytes of the file a manifest ``entry`` lists, checked against its size and
    sha256; a CheckpointError naming the file otherwise."""
    if not isinstance(entry, dict) or not {"name", "bytes", "sha256"} <= set(entry):
        raise CheckpointError(f"{snap / 'manifest.json'}: malformed entry for {what}: {entry!r}")
    path = member(snap, entry["name"], what)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path} ({what}) cannot be read: {err.strerror or err}") from None
    if len(data) != entry["bytes"]:
        raise CheckpointError(
            f"{path} ({what}) has {len(data)} bytes, the manifest says {entry['bytes']}: "
            f"truncated or replaced"
        )
    if sha256_of(data) != entry["sha256"]:
        raise CheckpointError(
            f"{path} ({what}) does not match its sha256 in the manifest: the file is damaged"
        )
    return path, data


def read_tensors(snap: Path, entry: object, what: str) -> tuple[dict[str, torch.Tensor], Any]:
    """Tensors and JSON metadata of a file `write_tensors` wrote, verified (`read_verified`)."""
    path, data = read_verified(snap, entry, what)
    try:
        tensors = st_load(data)
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        meta_text = (header.get("__metadata__") or {}).get(_META_KEY)
        meta = json.loads(meta_text) if meta_text is not None else None
    except (SafetensorError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path} ({what}) is not a valid tensor file: {err}") from None
    return tensors, meta


# ----------------------------------------------------------------------------------------------
# JSON trees of nested state (a torch optimizer's state_dict)


def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], where: str = "state") -> Any:
    """``obj`` as a JSON tree, its tensors moved into ``tensors`` under generated names.

    Raises:
        TypeError: a value that is neither a tensor, a container nor a JSON scalar, naming
            where it sits.
    """
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj
        return {"tensor": name}
    if isinstance(obj, dict):
        return {
            "dict": [
                [encode_tree(k, tensors, where), encode_tree(v, tensors, f"{where}[{k!r}]")]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, list | tuple):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {kind: [encode_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    raise TypeError(f"{where}: cannot checkpoint a {type(obj).__name__} (not tensor or JSON)")


def decode_tree(tree: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The object `encode_tree` encoded; a CheckpointError naming ``where`` when malformed."""
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, dict) and len(tree) == 1:
        ((kind, body),) = tree.items()
        if kind == "tensor" and isinstance(body, str) and body in tensors:
            return tensors[body]
        if kind == "dict" and isinstance(body, list):
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    break
                key = decode_tree(pair[0], tensors, where)
                if isinstance(key, dict | list | torch.Tensor):
                    break
                out[key] = decode_tree(pair[1], tensors, where)
            else:
                return out
        if kind in ("list", "tuple") and isinstance(body, list):
            items = [decode_tree(v, tensors, where) for v in body]
            return items if kind == "list" else tuple(items)
    raise CheckpointError(f"{where}: malformed state {str(tree)[:80]!r}")
