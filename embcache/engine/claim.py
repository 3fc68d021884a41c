"""StepClaim: which thread a collection's training step belongs to.

A training step is state shared by three calls: the forward with gradients (its slots locked,
its batch recorded), the backward that turns its gradient into the trace, and the optimizer
step that applies the trace and unlocks the slots. Two threads interleaving them would lock,
record and release each other's rows, so a collection trains from one thread at a time: its
first training forward claims it for the calling thread until that thread's step (or
``zero_grad`` / ``reset_trace``) completes. A prefetch (``issue_fused_prefetch``) is the first
half of the step its forward starts: it claims too, and a step that completes while the next
batch's prefetch waits (`TrainPipeline`) keeps the claim for that batch. Meanwhile another
thread's training forward, backward, step, ``zero_grad``, optimizer attach or prefetch raises a
`RuntimeError` naming both threads, before anything changes.

Reading takes no claim: inference under ``torch.no_grad()``, ``flush``, ``embcache.save``,
``state_dict`` and ``table_rows`` run from any thread as before. Neither does the collection's
prefetch worker, which resolves on behalf of the thread that issued the prefetch.

A backward is checked by its batch, not by its thread: autograd runs the backward of CUDA
tensors on its own device threads. The batches the claim's forwards recorded may be
backpropagated from anywhere; a batch from before the claim may not. What runs inside a
backward (``update_in_backward``, a torch optimizer stepped by ``apply_optimizer_in_backward``)
is that backward's step, so it is neither refused nor claimed by autograd's thread.

A claim whose thread has ended is abandoned: the next thread takes it over, with whatever the
ended thread left behind (a trace to step or to drop with ``zero_grad``).
"""

from __future__ import annotations

import threading

import torch

from embcache.engine.batch_state import InFlight

_HOW = (
    "a collection trains from one thread at a time: use one collection per thread, or hold "
    "one lock around each whole step (forward, backward and optimizer step)"
)


class StepClaim:
    """The thread that holds a collection's training step, and the batches its forwards
    recorded.

    Args:
        name: the collection's class name, for messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread: threading.Thread | None = None
        self.batches: list[InFlight] = []
        self.closed = False  # set by the collection's close(): it trains no more
        self._lock = threading.Lock()

    def take(self, what: str) -> bool:
        """Claim the step for the calling thread (already its own: nothing to do).

        Returns:
            Whether the claim is new (the caller releases it if its call fails).

        Raises:
            RuntimeError: another thread, still running, holds the claim; or the collection
                was closed.
        """
        if self.closed:
            self._refuse_closed(what)
        me = threading.current_thread()
        # Already this thread's (every call of a step after its forward): no lock needed, as
        # no other thread takes a claim whose thread is alive.
        if self.thread is me or _in_backward():
            return False  # or the backward's own step (its batch was checked)
        with self._lock:
            if self.thread is me:
                return False
            self._refuse(what, me)
            self.thread = me  # a new claim, or one an ended thread left
            return True

    def check(self, what: str) -> None:
        """Refuse ``what`` from the calling thread if another thread holds the claim, or
        after the collection was closed."""
        if self.closed:
            self._refuse_closed(what)
        me = threading.current_thread()
        if self.thread is me or _in_backward():
            return
        with self._lock:
            if self.thread is not me:
                self._refuse(what, me)

    def held_elsewhere(self) -> bool:
        """Whether another thread, still running, holds the claim."""
        owner = self.thread
        return owner is not None and owner is not threading.current_thread() and owner.is_alive()

    def record(self, batch: InFlight) -> None:
        """A batch the claim's forward recorded: its backward may run from any thread."""
        self.batches.append(batch)

    def check_backward(self, batch: InFlight) -> None:
        """Refuse the backward of a batch looked up before the step that holds the claim
        (its gradient would join that step's trace and its slots are no longer its own)."""
        batches = self.batches
        if batches and batches[-1] is batch:
            return  # the claim's latest forward: a plain loop's every backward
        with self._lock:
            owner = self.thread
            if owner is None or not owner.is_alive() or any(b is batch for b in self.batches):
                return
            raise RuntimeError(
                f"backward (in thread {threading.current_thread().name!r}) of a "
                f"{self.name} batch looked up before the training step that thread "
                f"{owner.name!r} holds now (claimed by its forward until its step, zero_grad "
                f"or reset_trace): {_HOW}"
            )

    def release(self) -> None:
        """End the claim (its step, or zero_grad, completed)."""
        with self._lock:
            self.thread = None
            self.batches = []

    def _refuse_closed(self, what: str) -> None:
        # Its rows were written back and its store closed or flushed: an update now would stay
        # in the cache, never written.
        raise RuntimeError(
            f"{what} on a closed {self.name}: close() ended its training (its rows were written "
            "back); build a new collection to train again"
        )

    def _refuse(self, what: str, me: threading.Thread) -> None:
        owner = self.thread
        if owner is not None and owner.is_alive():
            raise RuntimeError(
                f"{what} of a {self.name} in thread {me.name!r} while thread {owner.name!r} "
                f"is training it (its forward claimed the collection until its step, "
                f"zero_grad or reset_trace completes); nothing was changed: {_HOW}"
            )


def _in_backward() -> bool:
    """Whether the calling thread is running an autograd backward (on CUDA, one of autograd's
    device threads rather than the thread that called ``backward()``)."""
    return torch._C._current_graph_task_id() != -1
