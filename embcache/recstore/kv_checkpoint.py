"""The KV client's own checkpoints (RecStore's ``save_checkpoint`` / ``load_checkpoint``): every
tensor's rows in a directory, data only, verified before anything is applied.

Layout: ``manifest.json`` (``format``, the caller's ``metadata``, and per tensor its file, shape
and SHA-256) beside one file of little-endian float32 rows per tensor. A save writes a sibling
directory and renames it into place; a load checks the metadata, every checksum, every name
and shape first, and only then writes rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

FORMAT = "embcache-kv/1"


class RowSource(Protocol):
    """What a checkpoint needs of a KV client."""

    def names(self) -> list[str]: ...

    def export_rows(self, name: str) -> torch.Tensor: ...

    def import_rows(self, name: str, rows: torch.Tensor) -> None: ...


def checked_metadata(metadata: Mapping[str, Any] | str) -> dict[str, Any]:
    """RecStore's checkpoint metadata: JSON (a dict or a string) with ``identity`` (a dict)
    and a non-empty string ``checkpoint_id``.

    Raises:
        TypeError, ValueError: it is not.
    """
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as err:
            raise ValueError(f"checkpoint metadata must be valid JSON: {err}") from None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"checkpoint metadata must be a JSON string or dict, got {metadata!r}")
    metadata = json.loads(json.dumps(dict(metadata), sort_keys=True))
    checkpoint_id = metadata.get("checkpoint_id")
    if not isinstance(metadata.get("identity"), dict) or not (
        isinstance(checkpoint_id, str) and checkpoint_id
    ):
        raise ValueError(
            "checkpoint metadata needs identity (a dict) and a non-empty checkpoint_id"
        )
    return metadata


def save_tensors(client: RowSource, path: str | os.PathLike, metadata: Any) -> Path:
    """Write every tensor of ``client`` into directory ``path`` (replacing what is there)."""
    metadata = checked_metadata(metadata)
    root = Path(os.fspath(path))
    if not str(path):
        raise ValueError("checkpoint path must be non-empty")
    staging = root.with_name(f".{root.name}.saving-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    entries = {}
    for i, name in enumerate(client.names()):
        rows = client.export_rows(name).to(torch.float32).contiguous()
        data = rows.numpy().astype("<f4").tobytes()
        file = f"tensor{i}.bin"
        _write(staging / file, data)
        entries[name] = {
            "file": file,
            "shape": list(rows.shape),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    manifest = {"format": FORMAT, "metadata": metadata, "tensors": entries}
    _write(staging / "manifest.json", json.dumps(manifest, sort_keys=True).encode())
    if root.exists():
        shutil.rmtree(root)
    os.replace(staging, root)
    return root


def load_tensors(client: RowSource, path: str | os.PathLike, metadata: Any) -> None:
    """Restore the tensors `save_tensors` wrote with the same ``metadata``: all or nothing.

    Raises:
        ValueError: another metadata, a missing or corrupt file, a tensor the client does not
            have, or one whose shape differs; no row was written.
    """
    metadata = checked_metadata(metadata)
    root = Path(os.fspath(path))
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{root}: no readable KV checkpoint manifest ({err})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{root}: not a KV checkpoint of format {FORMAT}")
    if manifest.get("metadata") != metadata:
        raise ValueError(
            f"{root}: checkpoint metadata {manifest.get('metadata')} differs from {metadata}"
        )
    known = set(client.names())
    staged = []
    for name, entry in manifest["tensors"].items():
        if name not in known:
            raise ValueError(f"{root}: tensor {name!r} is not declared on this client")
        shape = tuple(entry["shape"])
        current = tuple(client.export_rows(name).shape)
        if shape != current:
            raise ValueError(f"{root}: tensor {name!r} has shape {shape}, the client's {current}")
        file = root / entry["file"]
        if file.parent != root:
            raise ValueError(f"{root}: tensor {name!r} names a file outside the checkpoint")
        data = file.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{root}: tensor {name!r} fails its checksum")
        rows = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(f"{root}: tensor {name!r} holds NaN or Inf values")
        staged.append((name, rows))
    for name, rows in staged:
        client.import_rows(name, rows)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
