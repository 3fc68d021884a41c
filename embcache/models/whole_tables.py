"""A single-process collection's whole tables (`LocalTables`): every row of a table read
through the tier, a table's columns overwritten, a copy of its weights. `LocalCollection`'s
`table_rows`, `write_table_rows` and `table_weight` delegate here; state_dict, the fused
optimizer's state and checkpoints read and write the tables through them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embcache.engine.group import EngineGroup
from embcache.engine.tables import Table
from embcache.kv.base import Store, TableSpec

CHUNK_ROWS = 1 << 16  # rows read or written per tier call


class LocalTables:
    """The whole tables of one process's collection, through its caches and its store.

    Args:
        tables: the collection's tables.
        store: its tier.
        engines: its engines (whose caches are written back before a read, and emptied before
            a write).
        device: the collection's device.
    """

    def __init__(
        self, tables: Sequence[Table], store: Store, engines: EngineGroup, device: torch.device
    ) -> None:
        self.tables = {t.name: t for t in tables}
        self.store = store
        self.engines = engines
        self.device = device

    def rows(self, table: str, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table (weights and optimizer
        state), CPU float32 (half-precision weights widened), after its cache's dirty rows were
        written back. Reads through `Store.read`, so rows never trained are computed from the
        initialiser and not created in the tier: a later checkpoint still holds only the
        trained rows.

        Raises:
            ValueError: an unbounded table.
        """
        spec, n = self._bounded_spec(table)
        self.engines.engine_of(table).cache.flush()
        out = torch.empty(n, spec.row_width)
        for lo in range(0, n, chunk_rows):
            ids = torch.arange(lo, min(lo + chunk_rows, n))
            out[lo : lo + ids.numel()] = spec.to_float(self.store.read(table, ids))
        return out

    def write(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of every row of a table (others kept), writing only the rows
        whose value changes (so loading the weights a table already holds, its initial ones
        say, creates no row in the tier); empties the table's cache, and forwards never
        backpropagated lose their locks (their rows are being replaced).

        Raises:
            RuntimeError: gradients await their step.
            ValueError: an unbounded table.
        """
        engines = self.engines
        if engines.has_gradients or any(
            b.backward_done and any(p.locked for p in b.prepared) for b in engines.inflight
        ):
            raise RuntimeError("cannot overwrite tables while gradients await their step")
        spec, n = self._bounded_spec(table)
        engines.release_all()
        engines.engine_of(table).cache.invalidate()
        engines.generation += 1
        rows = rows.to(torch.float32).cpu()
        for lo in range(0, n, CHUNK_ROWS):
            ids = torch.arange(lo, min(lo + CHUNK_ROWS, n))
            current = self.store.read(table, ids)
            new = spec.to_float(current)
            new[:, columns] = rows[lo : lo + ids.numel()]
            new = spec.from_float(new)  # weights rounded to the table's precision
            changed = (new.view(torch.uint8) != current.view(torch.uint8)).any(dim=1)
            if bool(changed.any()):
                self.store.put(table, ids[changed], new[changed])

    def weight(self, table: str) -> torch.Tensor:
        """A copy ``[num_embeddings, dim]`` of a table's weights on the collection's device, in
        its ``data_type`` (a meta tensor on the meta device).

        Raises:
            KeyError: an unknown table.
        """
        t = self.tables.get(table)
        if t is None:
            raise KeyError(f"unknown table {table!r}; tables: {list(self.tables)}")
        if self.device.type == "meta" and t.num_embeddings is not None:
            return torch.empty(t.num_embeddings, t.dim, dtype=t.dtype, device="meta")
        return self.rows(table)[:, : t.dim].to(self.device, t.dtype)

    def _bounded_spec(self, table: str) -> tuple[TableSpec, int]:
        """A table's spec and its number of rows.

        Raises:
            ValueError: an unbounded table.
        """
        spec = self.store.table_spec(table)
        if spec.num_embeddings is None:
            raise ValueError(
                f"table {table!r} is unbounded (num_embeddings=None): it has no whole "
                f"[num_embeddings, dim] tensor; embcache.save / embcache.load hold its rows"
            )
        return spec, spec.num_embeddings
