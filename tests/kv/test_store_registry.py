"""A tier defined outside the package: a dict-backed `Store` written here, registered under a
scheme of its own (`embcache.kv.url.register_scheme`), opened through ``open_store("toy://...")``
and held to the whole `Store` contract (`embcache.kv.contract.StoreContract`); and what the
scheme registry refuses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from embcache.kv import url
from embcache.kv.base import Store, TableSpec, checked_ids, checked_rows
from embcache.kv.contract import ContractTier, StoreContract
from embcache.kv.url import StoreRequest, open_store, register_scheme


class DictKV(Store):
    """A tier in Python dicts: each table's stored rows by id, created on first touch."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._specs: dict[str, TableSpec] = {}
        self._rows: dict[str, dict[int, torch.Tensor]] = {}
        self._closed = False

    def _spec(self, table: str) -> TableSpec:
        if self._closed:
            raise RuntimeError(f"DictKV {self.name!r} is closed")
        return self._specs[table]  # KeyError naming it

    def init_table(self, spec: TableSpec) -> None:
        old = self._specs.get(spec.name)
        if old is not None and (old.dim, old.num_embeddings, old.dtype) != (
            spec.dim, spec.num_embeddings, spec.dtype,
        ):  # fmt: skip
            raise ValueError(f"table {spec.name!r} is declared with another layout")
        rows = self._rows.setdefault(spec.name, {})
        if old is not None and (old.state_dim, old.state_init) != (spec.state_dim, spec.state_init):
            fresh = torch.full((1, spec.state_dim), float(spec.state_init))
            for i, row in rows.items():  # keep the weights, reset the state
                rows[i] = spec.pack(old.unpack(row[None])[0], fresh)[0]
        self._specs[spec.name] = spec

    def table_spec(self, table: str) -> TableSpec:
        return self._spec(table)

    def tables(self) -> list[str]:
        return list(self._specs)

    def read(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        spec = self._spec(table)
        ids = checked_ids(spec, ids)
        out = spec.initial_rows(ids)
        held = self._rows[table]
        for k, i in enumerate(ids.tolist()):
            if i in held:
                out[k] = held[i]
        return out

    def get(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        rows = self.read(table, ids)
        held = self._rows[table]
        for i, row in zip(checked_ids(self._spec(table), ids).tolist(), rows, strict=True):
            held.setdefault(i, row.clone())
        return rows

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        spec = self._spec(table)
        ids = checked_ids(spec, ids)
        rows = checked_rows(spec, ids, rows)
        for i, row in zip(ids.tolist(), rows, strict=True):
            self._rows[table][i] = row.clone()

    def export_rows(
        self, table: str, chunk_rows: int = 65536, scores: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        self._spec(table)
        held = self._rows[table]
        ids = sorted(held)
        for start in range(0, len(ids), chunk_rows):
            part = ids[start : start + chunk_rows]
            yield torch.tensor(part, dtype=torch.int64), torch.stack([held[i] for i in part])

    def import_rows(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        self.put(table, ids, rows)

    def close(self) -> None:
        self._closed = True


def _open_toy(request: StoreRequest) -> Store:
    name = request.spec.partition("://")[2]
    if not name:
        raise ValueError("a toy store needs a name: toy://NAME")
    return DictKV(name)


@pytest.fixture
def toy_scheme(monkeypatch: pytest.MonkeyPatch) -> str:
    """``toy://`` registered for the test (the registry is restored after it)."""
    monkeypatch.setattr(url, "SCHEMES", dict(url.SCHEMES))
    register_scheme("toy", _open_toy, "'toy://name' (DictKV, in this process)")
    return "toy"


class TestToyTier(StoreContract):
    @pytest.fixture
    def tier(self, toy_scheme: str) -> ContractTier:
        opened = iter(range(1_000_000))
        return ContractTier(lambda: open_store(f"{toy_scheme}://store-{next(opened)}"))


def test_open_store_opens_a_registered_scheme(toy_scheme: str) -> None:
    store = open_store("toy://mine", owner="job-1")  # a lease token: handed on, ignored here
    assert isinstance(store, DictKV) and store.name == "mine"
    with pytest.raises(ValueError, match="needs a name"):
        open_store("toy://")


def test_an_unknown_scheme_lists_the_registered_ones(toy_scheme: str) -> None:
    for unknown in ("memcached://x", "tiered+toy://x", "TOY://x"):
        with pytest.raises(ValueError, match="unknown store") as err:
            open_store(unknown)
        message = str(err.value)
        assert "'toy://name' (DictKV, in this process)" in message
        assert "registered schemes: redis://, rediss://" in message and "toy://" in message


def test_register_scheme_refuses_a_taken_or_malformed_scheme(toy_scheme: str) -> None:
    for taken in ("toy", "redis", "tiered+redis"):
        with pytest.raises(ValueError, match="registered already"):
            register_scheme(taken, _open_toy)
    for bad in ("", "9p", "to y", "toy://"):
        with pytest.raises(ValueError, match="a letter, then letters"):
            register_scheme(bad, _open_toy)
