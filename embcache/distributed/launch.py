"""Start N local ranks of a torch.distributed job, and fail fast when one of them fails.

    def train(rank: int, steps: int) -> dict:          # a module-level function (picklable)
        ebc = ShardedEmbeddingBagCollection(tables)     # the default process group is ready
        ...
        return {"loss": loss}                           # any picklable value

    results = spawn(train, nproc=2, args=(100,))       # [rank 0's return, rank 1's return]

Each rank is a new process (torch.multiprocessing) that joins a process group over a free
loopback TCP port (``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``; ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` are set as torchrun sets them), calls ``fn(rank, *args)`` and sends its return
value (or its error) back. The default start method is "forkserver": a clean single-threaded
server process imports torch, torchrec and embcache once, and every rank of every later `spawn`
is forked from it in milliseconds instead of importing them again (seconds each); ranks get the
parent's environment as it is at the call. ``start_method="spawn"`` starts each rank from
scratch.

Failure handling. The process group is created with ``timeout``: a collective that waits longer
for a peer raises. A rank that raises reports its traceback and exits at once, which makes a peer
blocked in a collective with it fail immediately (connection closed), and a peer that waits for a
rank that hangs fail after ``timeout``. As soon as one rank fails the parent gives the others
``grace`` seconds (default: ``timeout``) to finish or fail, terminates the rest, and raises
`SpawnError` naming the rank that failed first with its traceback (ranks that only failed because
a peer did are listed after it). `SpawnError.elapsed_s` says how long after that first failure
the parent raised; `SpawnError.headline` is that rank's exception as one line ("Type: message").

Dying with the launcher. No rank outlives the process that called `spawn`, however it dies:
each rank watches that process from a daemon thread (`_watch_launcher`: a pidfd on Linux, its pid
checked twice a second elsewhere) and kills itself with SIGKILL as soon as it is gone, with no
flush and no checkpoint, as if the whole job had been killed: the launcher's SIGKILL means
someone wanted the job gone at once (an out-of-memory killer, a scheduler past its grace time),
and a rank that stopped gracefully without its launcher would still be writing the tier and the
checkpoint while a requeued job resumes. The fork server (which lives while any process it
forked holds its "alive" pipe) and the resource tracker (while any process holds its pipe) end
when the ranks do. A rank also gets SIGTERM when the process it was forked from dies (Linux).

Signals. With ``on_signal``, the parent handles SIGTERM and SIGINT
while it waits: the first is sent on to every rank (each in its own process group, so a
terminal's Ctrl-C reaches them only this way), ``on_signal(signum)`` is called, and the parent
keeps waiting for the ranks (which are expected to stop soon, cleanly); a second kills them
at once and raises `SpawnInterruptedError`.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.util
import os
import pickle
import queue as queue_module
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_POLL_S = 0.05
_EXIT_WAIT_S = 10.0  # how long ranks that all succeeded get to exit by themselves
_PRELOAD = ["torch", "torch.distributed", "embcache.distributed.sharded"]

# Error texts of a collective that failed because of a peer, not because of this rank's code.
_PEER_FAILURE_MARKS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out",
    "timed out",
    "Broken pipe",
    "NCCL communicator was aborted",
)


@dataclass
class RankFailure:
    """How one rank failed."""

    rank: int
    error: str  # the traceback, or what the parent saw (an exit code, a signal)
    at: float  # time.time() of the failure (or of its detection by the parent)
    secondary: bool  # a collective failed because of a peer (probably not the root cause)
    headline: str = ""  # the exception as one line, "Type: message" (or ``error``'s first line)


class SpawnError(RuntimeError):
    """A rank of `spawn` failed.

    Attributes:
        rank: the rank that failed first (preferring a root cause over a rank that only lost
            its peer).
        failures: every failure seen, by rank.
        elapsed_s: seconds from that first failure to this error being raised.
    """

    def __init__(self, failures: dict[int, RankFailure], elapsed_s: float) -> None:
        primary = [f for f in failures.values() if not f.secondary] or list(failures.values())
        first = min(primary, key=lambda f: (f.at, f.rank))
        self.rank = first.rank
        self.failures = failures
        self.elapsed_s = elapsed_s
        lines = first.error.strip().splitlines()
        self.headline = first.headline or (lines[0] if lines else "no error text")
        others = [f for r, f in sorted(failures.items()) if r != first.rank]
        text = f"rank {first.rank} of the spawned job failed:\n{first.error.rstrip()}"
        for f in others:
            head = f.error.strip().splitlines()[0] if f.error.strip() else f.error
            text += f"\n(then rank {f.rank} failed too: {head})"
        super().__init__(text)


class SpawnInterruptedError(RuntimeError):
    """A second SIGTERM/SIGINT reached the parent of `spawn` (given ``on_signal``): the ranks
    were killed at once.

    Attributes:
        signum: the signal.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} again: the ranks were killed")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout: float = 30.0,
    grace: float | None = None,
    threads_per_rank: int | None = None,
    start_method: str = "forkserver",
    on_signal: Callable[[int], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nproc`` local ranks joined in one process group.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        nproc: number of ranks (world size), >= 1.
        backend: ``"gloo"`` (CPU, any machine) or ``"nccl"`` (one CUDA device per rank: rank r
            uses device r).
        args: extra arguments of ``fn`` (picklable).
        timeout: seconds a collective may wait for a peer before it raises (the process
            group's timeout).
        grace: seconds the parent waits for the other ranks once one failed (default
            ``timeout``) before it terminates them.
        threads_per_rank: torch intra-op threads of each rank (default: the CPU count divided
            by ``nproc``, at least 1), so ranks do not oversubscribe the cores.
        start_method: ``"forkserver"`` (default, see the module docstring) or ``"spawn"``.
        on_signal: handle SIGTERM/SIGINT while the ranks run (from the main thread): the first
            is forwarded to the ranks and passed to ``on_signal``, a second kills them (see
            the module docstring).

    Returns:
        The return values of ``fn``, by rank.

    Raises:
        SpawnError: a rank raised, exited without reporting, or was killed.
        SpawnInterruptedError: a second signal (with ``on_signal``).
    """
    _check_spawn_args(nproc, backend, timeout, start_method)
    grace = timeout if grace is None else grace
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Takes effect when the server starts (the first call); it stays up for later calls.
        ctx.set_forkserver_preload(_PRELOAD)
    env = dict(os.environ)
    reports = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_run_rank,
            args=(
                _Launcher.this_process(),
                rank,
                nproc,
                backend,
                port,
                timeout,
                threads,
                env,
                fn,
                tuple(args),
                reports,
                on_signal is not None,
            ),
            name=f"embcache-rank-{rank}",
        )
        for rank in range(nproc)
    ]
    handled = on_signal is not None and threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    forward = _forwarder(procs, on_signal)
    succeeded = False
    try:
        if handled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, forward)
        for p in procs:
            p.start()
        results = _supervise(procs, reports, grace)
        succeeded = True
        return results
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _reap(procs, reports, succeeded)


def _check_spawn_args(nproc: int, backend: str, timeout: float, start_method: str) -> None:
    """`spawn`'s arguments checked: a ValueError that says which is wrong."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        raise ValueError(
            f"backend='nccl' needs one CUDA device per rank: {nproc} ranks, "
            f"{torch.cuda.device_count()} devices"
        )
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")


def _forwarder(
    procs: list, on_signal: Callable[[int], None] | None
) -> Callable[[int, object], None]:
    """The parent's SIGTERM/SIGINT handler while the ranks run (with ``on_signal``): the first
    signal is sent on to every live rank and passed to ``on_signal``; a second kills every
    rank at once and raises `SpawnInterruptedError`."""
    got: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if got:  # the second: no more waiting
            for p in procs:
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(p.pid, signal.SIGKILL)
            raise SpawnInterruptedError(signum)
        got.append(signum)
        for p in procs:
            with contextlib.suppress(ProcessLookupError, TypeError):
                if p.is_alive():
                    os.kill(p.pid, signum)
        on_signal(signum)  # type: ignore[misc]

    return forward


def _reap(procs: list, reports, succeeded: bool) -> None:
    """Every rank's process joined (terminated, then killed, when it does not exit) and the
    report queue closed."""
    # Ranks that all reported success are on their way out (`_run_rank`): let them finish,
    # or a rank stopped before its finalizers leaves its semaphores to the resource tracker.
    deadline = time.monotonic() + (_EXIT_WAIT_S if succeeded else 0.0)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    reports.close()


def _supervise(procs: list, reports, grace: float) -> list[Any]:
    """Collect every rank's report; on a failure, wait ``grace`` then give up on the rest.

    Reports are read by `_take_report`."""
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    deadline: float | None = None
    first_failure: float | None = None
    while len(results) + len(failures) < len(procs):
        if not _take_report(reports, results, failures, _POLL_S):
            for rank, p in enumerate(procs):
                if rank in results or rank in failures or p.is_alive():
                    continue
                # Exited: its report may still be in flight, so look once more before judging.
                if not _take_report(reports, results, failures, 0.5):
                    failures[rank] = RankFailure(
                        rank, _exit_text(p.exitcode), time.time(), secondary=False
                    )
                break
        if failures and deadline is None:
            first_failure = min(f.at for f in failures.values())
            deadline = time.time() + grace
        if deadline is not None and time.time() > deadline:
            for rank in range(len(procs)):
                if rank not in results and rank not in failures:
                    failures[rank] = RankFailure(
                        rank,
                        f"still running {grace:.0f} s after another rank failed; terminated",
                        time.time(),
                        secondary=True,
                    )
            break
    if failures:
        raise SpawnError(failures, time.time() - (first_failure or time.time()))
    return [results[r] for r in range(len(procs))]


def _take_report(reports, results: dict, failures: dict, timeout: float) -> bool:
    """Wait up to ``timeout`` s for one rank's report and record it in ``results`` or
    ``failures``; False when none came.

    A result is the pickle its rank made (`_run_rank`), unpickled here: it comes over the
    multiprocessing queue, itself a pickle channel, from a process this launch started, never
    from a file."""
    try:
        kind, rank, payload, at = reports.get(timeout=timeout)
    except queue_module.Empty:
        return False
    if kind == "ok":
        results[rank] = pickle.loads(payload)
    else:
        text, secondary, headline = payload
        failures[rank] = RankFailure(rank, text, at, secondary, headline)
    return True


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {-exitcode} without reporting an error"
    return f"exited with code {exitcode} without reporting an error"


def _is_peer_failure(e: BaseException) -> bool:
    # By name: importing embcache.distributed.sharded here would import torchrec in a rank
    # that may have failed before needing it.
    names = {c.__name__ for c in type(e).__mro__}
    if names & {"CollectiveError", "DistError"}:
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_FAILURE_MARKS)


def _run_rank(
    launcher: _Launcher,
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    timeout: float,
    threads: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    reports,
    own_group: bool = False,
) -> None:
    """One rank: join the group, run ``fn``, report, and exit without waiting on peers."""
    _die_with_parent()
    _watch_launcher(launcher)
    if own_group:  # signals reach it from the parent alone, not from a terminal's Ctrl-C
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    _thread_lock_for_progress_bars()
    code = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, *args)
        # Plain pickle bytes, not the object: torch's queue reducers would share a tensor's
        # memory by a file descriptor that is gone once this rank exits; and an unpicklable
        # result fails here, as this rank's error, not on the queue's feeder thread.
        reports.put(("ok", rank, pickle.dumps(result), time.time()))
    except BaseException as e:
        text = f"{type(e).__name__} on rank {rank}: {e}\n\n{traceback.format_exc()}"
        headline = f"{type(e).__name__}: {' '.join(str(e).split())}".rstrip(": ")
        reports.put(("error", rank, (text, _is_peer_failure(e), headline), time.time()))
        code = 1
    reports.close()
    reports.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        # A clean shutdown; a peer that failed meanwhile must not turn success into a hang.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    # os._exit skips what a returning target gets from multiprocessing on its way out: its
    # finalizers, which unlink the semaphores this rank created (tqdm's write lock is one) and
    # tell the resource tracker so; without them it warns of "leaked semaphore objects" when the
    # command ends.
    multiprocessing.util._run_finalizers(0)
    # os._exit: the process group's destructors may abort (or wait) when a peer is gone.
    os._exit(code)


def _thread_lock_for_progress_bars() -> None:
    """Give tqdm a thread lock in this rank. Its default is a multiprocessing lock, a named
    semaphore: a rank that the launcher kills (a peer failed first) cannot unlink it, and the
    resource tracker then warns of "leaked semaphore objects" as the command ends. A rank's bars
    are written by its own threads only, so a thread lock is all they need."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when the process that started it (the fork
    server, or the launcher) dies, so that no rank outlives its job; elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class _Launcher:
    """The process that called `spawn`, as its ranks identify it: its pid and, on Linux, its
    start time in clock ticks since boot (``/proc/PID/stat``), so that a pid the kernel gave
    to another process after the launcher died is not taken for it."""

    pid: int
    start_ticks: int | None

    @staticmethod
    def this_process() -> _Launcher:
        return _Launcher(os.getpid(), _start_ticks(os.getpid()))

    def alive(self) -> bool:
        """Whether the launcher is still running (a zombie, dead but not yet reaped by its
        parent, counts as gone)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        except OSError:  # no /proc (not Linux): the pid alone
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        fields = stat.rsplit(")", 1)[1].split()
        return fields[0] not in ("Z", "X") and (
            self.start_ticks is None or int(fields[19]) == self.start_ticks
        )


def _start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat``: when the process started; None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _watch_launcher(launcher: _Launcher) -> None:
    """Kill this rank (SIGKILL) as soon as ``launcher`` is gone, from a daemon thread.

    PR_SET_PDEATHSIG cannot do it: a rank's parent is the fork server, which outlives the
    launcher for as long as the ranks hold its pipe. The thread waits on a pidfd of the
    launcher (Linux 5.3+: readable once it exits, nothing polled), opened and then checked
    against the launcher's start time, so a launcher that died before the pidfd was opened is
    not mistaken for a new process with its pid; elsewhere it checks twice a second."""
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(launcher.pid)
    if not launcher.alive():  # died before the watch began (or its pid is another's now)
        _kill_self()

    def watch() -> None:
        if pidfd is not None:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while not poller.poll():
                pass
        else:
            while launcher.alive():
                time.sleep(0.5)
        _kill_self()

    threading.Thread(target=watch, name="embcache-launcher-watch", daemon=True).start()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
