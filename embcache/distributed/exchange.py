"""Who owns a row, and how ids and rows travel to their owners and back over all_to_all.

Owner of a row. A collection row is named by its fused id ``id | (table_idx << fusion_k)``; its
owner is the rank

    owner(fused) = (mix64(fused ^ OWNER_SALT) & (2**63 - 1)) % world_size

with ``mix64`` splitmix64's finaliser (`embcache.hashing.mix64`) and
``OWNER_SALT = 0x2545F4914F6CDD1D``. The salt decorrelates the owner from the cache set
(`HotCache` hashes the same fused id with the unsalted ``mix64``): unsalted, with 2 ranks and an
even number of sets, each rank's rows would fall into half of its sets. A `ShardedKVClient`
tensor row ``id`` of tensor ``name`` is owned by ``owner(id ^ (crc32(name) << 32))``.

The exchanges. `Comm` wraps a process group. Every sharded call starts with a header, a
``[W, 5]`` all_to_all of per-peer counts, op code, tag, status and the prefetch a forward uses
(`Comm.handshake`), so that calls that do not match across ranks, or a rank's refused input,
raise on every rank, and so that every rank learns whether all of them use the same prefetch;
then the ids travel to their owners, grouped by owner (`Comm.route`, `Comm.send_ids`). Owners
answer each requester with one status row ahead of the rows asked (`with_status`, `Comm.reply`),
so that a failed owner makes every rank raise. A peer that dies or times out turns into a
`CollectiveError` naming the exchange. Used by `ShardedEmbeddingBagCollection`
(`embcache.distributed.sharded`) and `ShardedKVClient` (`embcache.distributed.sharded_kv`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from embcache.hashing import mix64
from embcache.kv.base import table_hash

OWNER_SALT = 0x2545F4914F6CDD1D
_LOW63 = (1 << 63) - 1

OP_FORWARD, OP_INIT, OP_PULL, OP_PUSH, OP_UPDATE, OP_PREFETCH, OP_ADD = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {
    OP_FORWARD: "the sharded collection's forward",
    OP_INIT: "ShardedKVClient.init_data",
    OP_PULL: "ShardedKVClient.pull",
    OP_PUSH: "ShardedKVClient.push",
    OP_UPDATE: "ShardedKVClient.update_async",
    OP_PREFETCH: "the sharded collection's issue_fused_prefetch",
    OP_ADD: "ShardedKVClient.add_async",
}
NO_PREFETCH = -1  # a forward header's prefetch column: this rank resolves in the forward


def owner_of(fused_ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owner rank of each fused id (see the module docstring). int64 ``[n]`` -> int64 ``[n]``."""
    return (mix64(fused_ids.to(torch.int64) ^ OWNER_SALT) & _LOW63) % world_size


def kv_owner_of(name: str, ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owner rank of each row of the `ShardedKVClient` tensor ``name``."""
    return owner_of(ids.to(torch.int64) ^ (table_hash(name) << 32), world_size)


class CollectiveError(RuntimeError):
    """A collective could not complete because of another rank: it died, timed out, refused
    its input, or failed to serve the rows asked of it."""


@dataclass
class Header:
    """What every rank sent in a header, by rank: the items it sends this rank and the prefetch
    its forward would use (`NO_PREFETCH`: none)."""

    counts: list[int]
    prefetch: list[int]


@dataclass
class Route:
    """Where one rank's unique ids went and what it received from every rank."""

    order: torch.Tensor  # int64 [U]: send position -> local index (send_ids = ids[order])
    send_counts: list[int]  # ids sent to each rank
    recv_counts: list[int]  # ids received from each rank
    recv_ids: torch.Tensor  # int64 [R], grouped by source rank, each in the sender's order


class Comm:
    """all_to_all over a process group, with the header checks and a byte count.

    Tensors travel on the CPU when the group has a gloo backend and on the current CUDA device
    when it is NCCL alone; callers hand tensors on any device and get them back on theirs.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "first (or start the ranks with embcache.distributed.launch.spawn)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        if "gloo" in backend or not torch.cuda.is_available():
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.reset_stats()

    def new_comm(self) -> Comm:
        """A `Comm` over a new process group of the same ranks, backend and timeout, for
        collectives made on another thread (gloo and NCCL do not order the collectives of one
        group across threads). A collective itself: every rank of the group calls it, in the
        same order."""
        try:
            timeout = self.group._get_backend(self.device).options._timeout
        except (AttributeError, RuntimeError):  # a backend that does not say: torch's default
            timeout = None
        group = dist.new_group(
            ranks=dist.get_process_group_ranks(self.group),
            timeout=timeout,
            backend=str(dist.get_backend(self.group)),
            use_local_synchronization=True,
        )
        return Comm(group)

    def reset_stats(self) -> None:
        self.collectives = 0
        self.bytes_sent = 0  # payload of every all_to_all, the chunk to this rank included
        self.bytes_to_peers = 0  # the part that leaves this rank

    def stats(self) -> dict[str, int]:
        return {
            "collectives": self.collectives,
            "bytes_sent": self.bytes_sent,
            "bytes_to_peers": self.bytes_to_peers,
        }

    def run(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise CollectiveError(
                f"rank {self.rank} of {self.world_size}: the {what} failed; "
                f"another rank probably died, raised before reaching it, or did not answer "
                f"within the process group's timeout ({type(e).__name__}: {e})"
            ) from e

    def exchange(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], what: str
    ) -> torch.Tensor:
        """all_to_all of the rows of ``send`` (``send_counts[r]`` rows to rank r, in rank
        order); returns the rows received, on ``send``'s device."""
        out_device = send.device
        send = send.to(self.device).contiguous()
        row = math.prod(send.shape[1:]) * send.element_size()
        if self.world_size == 1:  # gloo's all_to_all costs a millisecond or two even alone
            out = send  # callers only read what they receive
        else:
            out = torch.empty(
                (sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=self.device
            )
            self.run(
                f"all_to_all of {what}",
                lambda: dist.all_to_all_single(
                    out, send, recv_counts, send_counts, group=self.group
                ),
            )
        self.collectives += 1
        self.bytes_sent += send.shape[0] * row
        self.bytes_to_peers += (send.shape[0] - send_counts[self.rank]) * row
        return out.to(out_device)

    def handshake(
        self,
        counts: torch.Tensor,
        op: int,
        tag: int,
        error: BaseException | None,
        names=None,
        prefetch: int = NO_PREFETCH,
    ) -> Header:
        """Exchange per-peer item counts with the op code, a tag, a status and the prefetch
        this rank's forward would use; returns what every rank sent. Raises on every rank when
        the calls do not match or a rank's input was refused (that rank raises ``error``)."""
        W = self.world_size
        sent = torch.stack(
            [
                counts.cpu(),
                torch.full((W,), op),
                torch.full((W,), tag),
                torch.full((W,), int(error is not None)),
                torch.full((W,), prefetch),
            ],
            dim=1,
        )
        got = self.exchange(sent, [1] * W, [1] * W, f"{OP_NAMES[op]}'s header")
        if bool((got[:, 1] != op).any() or (got[:, 2] != tag).any()):
            calls = ", ".join(
                f"rank {r}: {_describe(int(o), int(t), names)}"
                for r, (o, t) in enumerate(got[:, 1:3].tolist())
            )
            raise RuntimeError(
                f"rank {self.rank}: mismatched collective calls ({calls}); every rank must make "
                f"the same sharded calls in the same order"
            )
        if error is not None:
            raise error
        refused = got[:, 3].nonzero().flatten().tolist()
        if refused:
            raise CollectiveError(
                f"rank {self.rank}: rank(s) {refused} refused their input to {OP_NAMES[op]} "
                f"(see their error); nothing was changed on any rank"
            )
        return Header(got[:, 0].tolist(), got[:, 4].tolist())

    def header(
        self, counts: torch.Tensor, op: int, tag: int, error: BaseException | None, names=None
    ) -> list[int]:
        """`handshake` of a call that is not a forward: returns the counts received."""
        return self.handshake(counts, op, tag, error, names).counts

    def route(
        self,
        ids: torch.Tensor,
        owners: torch.Tensor,
        op: int,
        tag: int,
        error: BaseException | None,
        names=None,
    ) -> Route:
        """Send each of ``ids`` (int64 ``[U]``) to its owner: header, then the ids."""
        counts = torch.bincount(owners, minlength=self.world_size)
        recv_counts = self.header(counts, op, tag, error, names)
        return self.send_ids(ids, owners, recv_counts, op)

    def send_ids(
        self, ids: torch.Tensor, owners: torch.Tensor, recv_counts: list[int], op: int
    ) -> Route:
        """The ids of `route` after its header: grouped by owner, to their owners."""
        counts = torch.bincount(owners, minlength=self.world_size)
        order = torch.argsort(owners, stable=True)
        send_counts = counts.tolist()
        recv_ids = self.exchange(ids[order], send_counts, recv_counts, f"{OP_NAMES[op]}'s ids")
        return Route(order, send_counts, recv_counts, recv_ids)

    def reply(
        self,
        reply: torch.Tensor,
        recv_counts: list[int],
        send_counts: list[int],
        error: BaseException | None,
        what: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Owners answer the ids they received with a `with_status` buffer; a failed owner
        (``error``) makes every rank raise.

        Returns:
            The buffer received and the positions in it of the rows this rank asked for, in the
            order it sent the ids.
        """
        got = self.exchange(reply, [c + 1 for c in recv_counts], [c + 1 for c in send_counts], what)
        data, status = _status_layout(send_counts, got.device)
        failed = got[status, 0].nonzero().flatten().tolist()
        if error is not None:
            raise error
        if failed:
            raise CollectiveError(
                f"rank {self.rank}: owner rank(s) {failed} failed to serve the rows of {what} "
                f"(see their error); this call changed nothing"
            )
        return got, data


def with_status(
    source: torch.Tensor | None, index: torch.Tensor, counts: list[int], width: int
) -> torch.Tensor:
    """An owner's reply: per rank r, one status row (0 served; all 1 when ``source`` is None,
    the owner failed) then the ``counts[r]`` rows ``source[index, :width]`` asked by r, in one
    gather."""
    device = index.device
    data, status = _status_layout(counts, device)
    if source is None or not index.numel():
        reply = torch.zeros(data.numel() + len(counts), width, device=device)
    else:
        rows = torch.zeros(data.numel() + len(counts), dtype=torch.int64, device=device)
        rows[data] = index
        reply = source[rows, :width]
    reply[status] = float(source is None)
    return reply


def _status_layout(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the data rows and of the status rows in a buffer of per-rank chunks, chunk
    r holding a status row then ``counts[r]`` data rows."""
    sizes = torch.tensor(counts, device=device) + 1
    status = torch.cumsum(sizes, 0) - sizes
    chunk = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes - 1)
    return torch.arange(chunk.numel(), device=device) + chunk + 1, status


def _describe(op: int, tag: int, names: Mapping[int, str] | None) -> str:
    name = OP_NAMES.get(op, f"op {op}")
    if op == OP_FORWARD:
        return f"{name} ({'training' if tag else 'no_grad'})"
    if op == OP_PREFETCH:
        return f"{name} (#{tag})"
    return f"{name}({(names or {}).get(tag, f'tensor #{tag}')!r})"
