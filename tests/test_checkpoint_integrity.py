"""Checkpoints that cannot run code, cannot be silently corrupted and are never half-loaded:
real files, damaged and crafted the ways an operator found."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

import embcache
from embcache.checkpoint import CheckpointError, latest_snapshot
from tests.checkpoint_job import build, train, weights


class _RunsCode:
    """Unpickling this runs ``touch <path>``: what a crafted optimizer file did."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _saved(tmp_path: Path, steps: int = 3) -> tuple[Path, dict[str, torch.Tensor]]:
    model, sparse, dense = build()
    train(model, sparse, dense, start=0, steps=steps)
    ckpt = tmp_path / "ckpt"
    embcache.save(ckpt, model, [sparse, dense])
    return ckpt, weights(model, sparse)


def _trained_elsewhere():
    """A model that holds other weights than the checkpoint, and what it holds."""
    model, sparse, dense = build()
    train(model, sparse, dense, start=0, steps=7)
    return (model, sparse, dense), weights(model, sparse)


def _assert_unchanged(model, sparse, dense, before: dict[str, torch.Tensor]) -> None:
    after = weights(model, sparse)
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} changed by a failed load"


def _reseal(ckpt: Path, edit) -> None:
    """Edit the manifest and record its new checksum in CURRENT, as a crafted checkpoint
    would: the file checksums alone must still catch what the edit did."""
    snap = latest_snapshot(ckpt)
    manifest = json.loads((snap / "manifest.json").read_text())
    edit(manifest, snap)
    text = json.dumps(manifest).encode()
    (snap / "manifest.json").write_bytes(text)
    digest = hashlib.sha256(text).hexdigest()
    (ckpt / "CURRENT").write_text(f"{snap.name}\nsha256 {digest}\n")


def test_a_format_1_checkpoint_with_a_pickle_is_refused_without_running_it(
    tmp_path: Path,
) -> None:
    ckpt, _ = _saved(tmp_path)
    snap = latest_snapshot(ckpt)
    ran = tmp_path / "pwned"
    with open(snap / "optim-0.pt", "wb") as f:
        pickle.dump(_RunsCode(ran), f)
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["version"] = 1  # what the old embcache wrote and read with weights_only=False
    (snap / "manifest.json").write_text(json.dumps(manifest))
    (ckpt / "CURRENT").write_text(snap.name + "\n")
    (model, sparse, dense), before = _trained_elsewhere()
    with pytest.raises(CheckpointError, match="format 1"):
        embcache.load(ckpt, model, [sparse, dense])
    assert not ran.exists(), "loading a checkpoint ran code from it"
    _assert_unchanged(model, sparse, dense, before)


def test_a_pickle_listed_as_a_tensor_file_is_not_unpickled(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    ran = tmp_path / "pwned"
    payload = pickle.dumps(_RunsCode(ran))

    def swap(manifest, snap) -> None:
        (snap / "optim-0.pt").write_bytes(payload)
        manifest["optimizers"][0].update(
            name="optim-0.pt", bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest()
        )

    _reseal(ckpt, swap)
    (model, sparse, dense), before = _trained_elsewhere()
    with pytest.raises(CheckpointError, match=r"optim-0\.pt.*not a valid tensor file"):
        embcache.load(ckpt, model, [sparse, dense])
    assert not ran.exists()
    _assert_unchanged(model, sparse, dense, before)


@pytest.mark.parametrize(
    "target",
    ["tables/0-0-000000.safetensors", "tables/0-1-000000.safetensors", "dense.safetensors",
     "optim-0.safetensors", "optim-1.safetensors", "manifest.json"],
    ids=["table-t0", "table-t1", "dense", "sparse-optim", "dense-optim", "manifest"],
)  # fmt: skip
def test_a_flipped_bit_anywhere_is_found_before_anything_changes(
    tmp_path: Path, target: str
) -> None:
    ckpt, _ = _saved(tmp_path)
    path = latest_snapshot(ckpt) / target
    data = bytearray(path.read_bytes())
    data[len(data) - 3] ^= 0x04  # in the payload: a weight, an id, a state value, JSON
    path.write_bytes(bytes(data))
    (model, sparse, dense), before = _trained_elsewhere()
    name = re.escape(target.split("/")[-1])
    with pytest.raises(CheckpointError, match=rf"{name}.*(sha256|match)"):
        embcache.load(ckpt, model, [sparse, dense])
    _assert_unchanged(model, sparse, dense, before)


@pytest.mark.parametrize("damage", ["truncated", "empty", "directory", "missing"])
def test_a_bad_last_file_leaves_everything_as_it_was(tmp_path: Path, damage: str) -> None:
    """The last table's last chunk is damaged: nothing, not even the first tables, is loaded,
    and the error names the file (no bare OSError or EOFError)."""
    model, sparse, dense = build()
    train(model, sparse, dense, start=0, steps=3)
    ckpt = tmp_path / "ckpt"
    embcache.save(ckpt, model, [sparse, dense], chunk_rows=8)
    last = sorted((latest_snapshot(ckpt) / "tables").glob("0-1-*"))[-1]
    if damage == "truncated":
        last.write_bytes(last.read_bytes()[:-20])
    elif damage == "empty":
        last.write_bytes(b"")
    elif damage == "directory":
        last.unlink()
        last.mkdir()
    else:
        last.unlink()
    (model, sparse, dense), before = _trained_elsewhere()
    with pytest.raises(CheckpointError) as caught:
        embcache.load(ckpt, model, [sparse, dense])
    assert last.name in str(caught.value), caught.value
    _assert_unchanged(model, sparse, dense, before)


@pytest.mark.parametrize(
    "pointer",
    ["../outside", "/tmp", "snap-000001/../../outside", "tables", "snap-x"],
)
def test_current_must_name_a_snapshot_of_this_directory(tmp_path: Path, pointer: str) -> None:
    ckpt, _ = _saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (ckpt / "CURRENT").write_text(pointer + "\n")
    model, sparse, dense = build()
    with pytest.raises(CheckpointError, match="CURRENT"):
        embcache.load(ckpt, model, [sparse, dense])


def test_a_snapshot_linked_from_outside_is_refused(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    snap = latest_snapshot(ckpt)
    moved = tmp_path / "elsewhere"
    snap.rename(moved)
    snap.symlink_to(moved)
    model, sparse, dense = build()
    with pytest.raises(CheckpointError, match="outside"):
        embcache.load(ckpt, model, [sparse, dense])


def test_manifest_file_names_stay_inside_the_snapshot(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)

    def escape(manifest, snap) -> None:
        manifest["dense"]["name"] = "../../../etc/passwd"

    _reseal(ckpt, escape)
    model, sparse, dense = build()
    with pytest.raises(CheckpointError, match=r"etc/passwd"):
        embcache.load(ckpt, model, [sparse, dense])


def test_a_table_listing_no_files_is_refused_not_reset(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)

    def drop_files(manifest, snap) -> None:
        manifest["tables"][0]["files"] = []

    _reseal(ckpt, drop_files)
    (model, sparse, dense), before = _trained_elsewhere()
    with pytest.raises(CheckpointError, match=r"'t0' has \d+ rows but its files list 0"):
        embcache.load(ckpt, model, [sparse, dense])
    _assert_unchanged(model, sparse, dense, before)


def test_a_manifest_not_matching_current_is_refused(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    path = latest_snapshot(ckpt) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["extra"] = {"steps_done": 9}  # a plausible edit that no file checksum covers
    path.write_text(json.dumps(manifest))
    model, sparse, dense = build()
    with pytest.raises(CheckpointError, match=r"manifest\.json does not match"):
        embcache.load(ckpt, model, [sparse, dense])


def test_round_trip_and_extra(tmp_path: Path) -> None:
    model, sparse, dense = build()
    train(model, sparse, dense, start=0, steps=3)
    embcache.save(tmp_path, model, [sparse, dense], extra={"steps_done": 3, "note": "x"})
    assert embcache.checkpoint.read_extra(tmp_path) == {"steps_done": 3, "note": "x"}
    fresh, fsparse, fdense = build()
    assert embcache.load(tmp_path, fresh, [fsparse, fdense])["steps_done"] == 3
    expected, got = weights(model, sparse), weights(fresh, fsparse)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert fdense.state_dict()["state"][0]["step"] == dense.state_dict()["state"][0]["step"]
    assert not list(latest_snapshot(tmp_path).rglob("*.pt")), "no pickle files are written"
    with pytest.raises(TypeError, match="JSON"):
        embcache.save(tmp_path, model, [sparse, dense], extra={"bad": object()})
