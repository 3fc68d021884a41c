"""Several caches' steps run side by side, their host reads made together.

A step that needs a value of the device on the host (a number of misses, the ids a tier must
read) yields a request for it instead of reading it, and `run_together` answers the requests
of every step waiting at once: all the numbers asked for in one host read, all the tensors to
copy in one copy (per device). The reads of a group's caches then do not grow with the number
of caches: a resolve of five caches makes the reads of the one that reads most.

A step is a generator: ``value = yield Counts([...])`` or ``host = yield ToHost([...])``, and
its ``return`` value is its result. A step that raises ends the others (`GeneratorExit` at
their waiting ``yield``: their ``except``/``finally`` clauses undo what they did) before the
error propagates.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from embcache.indexing import true_at


@dataclass
class Counts:
    """Integers to read on the host: each tensor holds one value (any integer or bool dtype);
    the step receives ``list[int]``, one per tensor."""

    values: list[torch.Tensor]


@dataclass
class ToHost:
    """Integer tensors to copy to the host: the step receives them as CPU int64 tensors, in
    order."""

    tensors: list[torch.Tensor]


Step = Generator[Counts | ToHost, Any, Any]


def run_together(steps: Sequence[Step]) -> list[Any]:
    """Run ``steps`` to their ends, answering each round's requests with one host read per
    kind and device; returns their results in order."""
    results: list[Any] = [None] * len(steps)
    waiting: dict[int, Counts | ToHost] = {}
    live = set(range(len(steps)))
    try:
        replies: dict[int, Any] = {i: None for i in range(len(steps))}
        while replies:
            for i, reply in replies.items():
                try:
                    waiting[i] = steps[i].send(reply)
                except StopIteration as done:
                    results[i] = done.value
                    live.discard(i)
            replies = _answer(waiting)
            waiting = {}
    except BaseException:
        for i in sorted(live):
            steps[i].close()
        raise
    return results


def _answer(waiting: dict[int, Counts | ToHost]) -> dict[int, Any]:
    """The replies to one round's requests: one ``tolist`` of every number asked for, one copy
    to the host of every tensor asked for (per device)."""
    replies: dict[int, Any] = {}
    by_device: dict[tuple[type, torch.device], list[int]] = {}
    for i, request in waiting.items():
        parts = _parts(request)
        if not parts:
            replies[i] = []
            continue
        by_device.setdefault((type(request), parts[0].device), []).append(i)
    for (kind, _), who in by_device.items():
        if kind is Counts:
            flat = torch.cat(
                [v.reshape(1).to(torch.int64) for i in who for v in _parts(waiting[i])]
            )
            values = flat.tolist()
            at = 0
            for i in who:
                n = len(_parts(waiting[i]))
                replies[i], at = values[at : at + n], at + n
        else:
            tensors = [t.reshape(-1).to(torch.int64) for i in who for t in _parts(waiting[i])]
            host = torch.cat(tensors).cpu().split([t.numel() for t in tensors])
            at = 0
            for i in who:
                n = len(_parts(waiting[i]))
                replies[i], at = list(host[at : at + n]), at + n
    return replies


def _parts(request: Counts | ToHost) -> list[torch.Tensor]:
    """The tensors a request asks about: a `Counts`' values, a `ToHost`'s tensors."""
    return request.values if isinstance(request, Counts) else request.tensors


def first_true(flags: torch.Tensor, n: int, numpy: bool) -> torch.Tensor:
    """The first ``n`` positions (ascending, int64) where a 1-D bool ``flags`` is True; it
    holds at least ``n`` Trues. No host read: ``n`` was read already. ``numpy``: found through
    numpy (a CPU cache on the compiled passes, where a host read is no synchronisation:
    `SlotStore.numpy_reads`); else, as on the device path and the torch path (the
    specification a GPU runs), through an op of the size known from a `Counts` read."""
    if numpy:
        return true_at(flags)[:n]
    return torch.nonzero_static(flags, size=n).squeeze(1)
