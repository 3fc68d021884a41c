"""The files of a checkpoint: data-only tensor files, checksums, and paths kept inside the
checkpoint directory. `embcache.checkpoint` decides what goes into them.

Tensors are stored as safetensors (a JSON header, then the raw bytes: reading one cannot run
code, unlike a pickle). Anything else (optimizer hyper-parameters, the structure of a torch
optimizer's state dict) is JSON: in the manifest, or in the tensor file's header metadata as a
tree in which containers are one-key objects (``{"dict": [[key, value], ...]}``, ``{"list":
[...]}``, ``{"tuple": [...]}``, ``{"tensor": name}``) so that int keys and tuples come back as
they went in.

Every file is listed in the manifest with its size and sha256, and CURRENT holds the sha256 of
the manifest, so a flipped bit anywhere is found before anything is applied. Files are read
through a `Snapshot`: only regular files inside it (no link, FIFO or device), their sizes
checked before a byte is read, from one snapshot that a concurrent `save` leaves in place.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
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
CURRENT_MAX_BYTES = 4096  # a snapshot's name and a checksum line
MANIFEST_MAX_BYTES = 1 << 30
# Files of a checkpoint are opened without following a link (a FIFO or device is then refused
# by `fstat` before a byte is read: O_NONBLOCK keeps the open of a FIFO from waiting).
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC


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
    """Write ``data`` to ``path`` and fsync it (an OSError names ``path``)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


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


def member_parts(snap: Path, name: object, what: str) -> tuple[str, ...]:
    """The parts of a file name taken from a manifest, refused when it could lead anywhere but
    a file inside the snapshot (absolute, ``..``, empty parts)."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise CheckpointError(f"{snap / 'manifest.json'}: {what} names the file {name!r}")
    parts = tuple(name.split("/"))
    if any(part in ("..", ".", "") for part in parts):
        raise CheckpointError(f"{snap / 'manifest.json'}: {what} names the file {name!r}")
    return parts


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_regular(
    dir_fd: int, parts: tuple[str, ...], shown: Path, what: str, size: int | None, limit: int
) -> bytes:
    """The bytes of the regular file ``parts`` below the directory ``dir_fd``, reached without
    following a link and opened without blocking (a FIFO or device is refused before a byte is
    read), of exactly ``size`` bytes when given and never more than ``limit``.

    Raises:
        CheckpointError: naming ``shown`` (and ``what``): missing, not a regular file, of
            another size, or unreadable.
    """
    opened: list[int] = []
    try:
        try:
            cur = dir_fd
            for part in parts[:-1]:
                cur = os.open(part, _OPEN_DIR, dir_fd=cur)
                opened.append(cur)
            mode = os.stat(parts[-1], dir_fd=cur, follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                raise CheckpointError(f"{shown} ({what}) is {_kind(mode)}, not a regular file")
            fd = os.open(parts[-1], _OPEN_FILE, dir_fd=cur)
            opened.append(fd)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # replaced between the stat and the open
                raise CheckpointError(f"{shown} ({what}) is {_kind(info.st_mode)}")
            if size is not None and info.st_size != size:
                raise CheckpointError(
                    f"{shown} ({what}) has {info.st_size} bytes, the manifest says {size}: "
                    f"truncated or replaced"
                )
            if info.st_size > limit:
                raise CheckpointError(
                    f"{shown} ({what}) has {info.st_size} bytes, more than the {limit} such a "
                    f"file can hold"
                )
            chunks, left = [], info.st_size + 1  # one byte more: a file that grew is refused
            while left > 0:
                data = os.read(fd, min(left, 1 << 24))
                if not data:
                    break
                chunks.append(data)
                left -= len(data)
        except OSError as err:
            why = "it is a symbolic link" if err.errno == errno.ELOOP else err.strerror or err
            raise CheckpointError(f"{shown} ({what}) cannot be read: {why}") from None
    finally:
        for fd in reversed(opened):
            os.close(fd)
    data = b"".join(chunks)
    if len(data) != info.st_size:
        raise CheckpointError(f"{shown} ({what}) changed size while being read")
    return data


class Snapshot:
    """The snapshot a checkpoint directory's CURRENT names, open for reading: its directory is
    held open and share-locked (`flock`), and `save` never removes a snapshot so locked, so
    every file read comes from this one snapshot even while another process saves into the
    directory. Use as a context manager (closing releases the lock).

    Attributes:
        path: the snapshot directory (for messages and `latest_snapshot`).
        digest: the sha256 of its manifest that CURRENT records (None: format 1).
    """

    def __init__(self, root: Path, attempts: int = 3) -> None:
        self.root = root
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{root} holds no complete checkpoint (no such directory)"
            ) from None
        except OSError as err:
            raise CheckpointError(f"{root} cannot be opened: {err.strerror or err}") from None
        try:
            for attempt in range(attempts):
                name, self.digest = self._pointer(root_fd)
                self.path = root / name
                try:
                    fd = os.open(name, _OPEN_DIR, dir_fd=root_fd)
                except FileNotFoundError:
                    if attempt + 1 < attempts:
                        continue  # removed by a save since CURRENT was read: read it again
                    raise FileNotFoundError(
                        f"checkpoint {self.path} is incomplete (missing)"
                    ) from None
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise CheckpointError(
                            f"{root / CURRENT}: snapshot {self.path} lies outside {root} (a "
                            f"link) or is no directory"
                        ) from None
                    raise CheckpointError(f"{self.path} cannot be opened: {err}") from None
                try:
                    _lock(fd, fcntl.LOCK_SH)
                    same = os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_ino
                except FileNotFoundError:
                    same = None
                except BaseException:
                    os.close(fd)
                    raise
                if same == os.fstat(fd).st_ino:
                    self.fd = fd
                    return
                os.close(fd)  # removed (or replaced) before the lock was taken
            raise CheckpointError(f"{root}: its snapshot kept changing while being opened")
        finally:
            os.close(root_fd)

    def _pointer(self, root_fd: int) -> tuple[str, str | None]:
        """The snapshot CURRENT names and the manifest checksum it records (None: format 1)."""
        current = self.root / CURRENT
        try:
            os.stat(CURRENT, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.root} holds no complete checkpoint (no {CURRENT} file)"
            ) from None
        data = read_regular(root_fd, (CURRENT,), current, "pointer", None, CURRENT_MAX_BYTES)
        try:
            lines = data.decode().split("\n")
        except UnicodeDecodeError as err:
            raise CheckpointError(f"{current} cannot be read: {err}") from None
        name = lines[0].strip()
        if not SNAPSHOT_RE.fullmatch(name):
            raise CheckpointError(
                f"{current} names {name[:80]!r}, not a snapshot of this directory (snap-NNNNNN)"
            )
        digest = lines[1].strip() if len(lines) > 1 and lines[1].strip() else None
        if digest is not None:
            if not digest.startswith("sha256 ") or len(digest) != 7 + 64:
                raise CheckpointError(f"{current}: malformed checksum line {digest[:80]!r}")
            digest = digest[7:]
        return name, digest

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the snapshot (a later save may then remove it)."""
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)  # drops the flock
            self.fd = -1

    def manifest_bytes(self) -> bytes:
        """manifest.json as stored (bounded; its checksum is the caller's to check)."""
        where = self.path / "manifest.json"
        try:
            os.stat("manifest.json", dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"checkpoint {self.path} is incomplete (no manifest.json)"
            ) from None
        limit = MANIFEST_MAX_BYTES
        return read_regular(self.fd, ("manifest.json",), where, "manifest", None, limit)

    def read(self, entry: object, what: str) -> tuple[Path, bytes]:
        """The bytes of the file a manifest ``entry`` lists, checked against its size (before
        reading) and sha256; a CheckpointError naming the file otherwise."""
        if not isinstance(entry, dict) or not {"name", "bytes", "sha256"} <= set(entry):
            raise CheckpointError(
                f"{self.path / 'manifest.json'}: malformed entry for {what}: {entry!r}"
            )
        size = entry["bytes"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(
                f"{self.path / 'manifest.json'}: {what} lists a size of {size!r} bytes"
            )
        parts = member_parts(self.path, entry["name"], what)
        path = self.path / entry["name"]
        data = read_regular(self.fd, parts, path, what, size, size)
        if sha256_of(data) != entry["sha256"]:
            raise CheckpointError(
                f"{path} ({what}) does not match its sha256 in the manifest: the file is damaged"
            )
        return path, data

    def tensors(self, entry: object, what: str) -> tuple[dict[str, torch.Tensor], Any]:
        """Tensors and JSON metadata of a file `write_tensors` wrote, verified (`read`)."""
        path, data = self.read(entry, what)
        try:
            tensors = st_load(data)
            length = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + length])
            meta_text = (header.get("__metadata__") or {}).get(_META_KEY)
            meta = json.loads(meta_text) if meta_text is not None else None
        except (SafetensorError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{path} ({what}) is not a valid tensor file: {err}") from None
        return tensors, meta


def _lock(fd: int, how: int) -> None:
    """``flock`` a directory. Where the file system refuses locks (some network file systems)
    this goes on without one, as before locks were taken: a save may then remove a snapshot
    that a load is reading (the load fails naming the file, and if that happens while rows are
    written, loading again restores them)."""
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        raise
    except OSError:
        pass


def remove_snapshot(path: Path) -> bool:
    """Remove an old snapshot (or a failed save's temporary directory) unless a `Snapshot`
    is reading it; returns whether it is gone (a later save removes one being read)."""
    try:
        fd = os.open(path, _OPEN_DIR)
    except OSError:
        return not os.path.lexists(path)
    try:
        try:
            _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    finally:
        os.close(fd)


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
