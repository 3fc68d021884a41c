"""A collection trains from one thread at a time (`embcache.engine.claim`).

Another thread's training forward, backward, step, zero_grad or prefetch while one thread's
step is claimed raises a clear error before anything changes; the claimant's training stays
exact against a single-threaded replay of the steps that ran, and the cache stays flushable.
Reading threads (inference under ``torch.no_grad()``, flush, table_rows) keep working.

No verdict depends on timing: barriers make the threads overlap where a test needs it, loops
are bounded, and every thread is joined with a generous timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import KeyedJaggedTensor

import embcache
from tests.conftest import requires_gpu
from tests.models.conftest import feature_rows, locked_slots, loss_of, random_kjt, table_configs

TABLES = table_configs()  # t0 (dim 6: f0, f1), t1 (dim 6: f2), t2 (dim 3: f3): two caches
ROWS = feature_rows(TABLES)
WIDTH = 21
TIMEOUT_S = 120
ONE_AT_A_TIME = "a collection trains from one thread at a time"

CACHES = {
    "10%-4way": embcache.CacheConfig(load_factor=0.1, ways=4),  # evicts at every batch
    "full": embcache.CacheConfig(load_factor=1.0),
}


# How the rows are trained: the optimizer's step, inside backward (``update_in_backward``), or a
# torch optimizer stepped inside backward by ``apply_optimizer_in_backward`` (on CUDA, autograd
# runs both on its own device thread).
MODES = ["step", "in-backward", "torch-in-backward"]
DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]


def make(cache: str = "10%-4way", mode: str = "step", device: str = "cpu") -> tuple:
    """A collection (rows drawn from seed 0) and its optimizer (None: it steps in backward)."""
    m = embcache.CachedEmbeddingBagCollection(
        tables=TABLES,
        cache=CACHES[cache],
        store=embcache.HostKV(),
        seed=0,
        device=device,
        update_in_backward=mode == "in-backward",
    )
    if mode == "torch-in-backward":
        _apply_optimizer_in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1})
        return m, None
    return m, embcache.SparseAdaGrad([m], lr=0.1)


def batches(seed: int, n: int) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(random_kjt(gen, ROWS, 5), torch.randn(5, WIDTH, generator=gen)) for _ in range(n)]


def backward_and_step(out, opt, coeff: torch.Tensor) -> None:
    values = out.values()
    loss_of(values, coeff.to(values.device)).backward()
    if opt is not None:
        opt.step()


def train_step(m, opt, kjt: KeyedJaggedTensor, coeff: torch.Tensor) -> None:
    backward_and_step(m(kjt), opt, coeff)


def tier(m) -> dict[str, torch.Tensor]:
    """Every row (weights and optimizer state) of every table, after a flush."""
    m.flush()
    return {t.name: m.table_rows(t.name) for t in TABLES}


def replay(steps: list[tuple[KeyedJaggedTensor, torch.Tensor]], **kwargs) -> dict:
    """The tier after ``steps`` trained one after another on one thread."""
    m, opt = make(**kwargs)
    for kjt, coeff in steps:
        train_step(m, opt, kjt, coeff)
    return tier(m)


def assert_tiers_equal(actual: dict, expected: dict) -> None:
    for name in expected:
        diff = (actual[name] - expected[name]).abs().max()
        assert torch.equal(actual[name], expected[name]), f"table {name}: max diff {diff}"


def run_threads(targets: dict[str, Callable[[], None]]) -> None:
    """Run each target on a thread of that name; re-raise the first error any of them hit."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    threads = [threading.Thread(target=guarded(fn), name=name) for name, fn in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def assert_clear(error: BaseException, me: str, owner: str) -> None:
    text = str(error)
    assert isinstance(error, RuntimeError), text
    assert ONE_AT_A_TIME in text and "one collection per thread" in text, text
    assert repr(me) in text and repr(owner) in text, text


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_two_threads_stepping_one_collection_one_is_refused_and_training_stays_exact(
    mode: str, device: str
) -> None:
    """Both threads train the same collection, overlapping: trainer-a's first step holds the
    claim across a barrier, so trainer-b's first forward is refused; afterwards both loop, and
    each forward refused meanwhile changes nothing. The tier equals a single-threaded replay of
    the steps that ran, in the order their forwards claimed the collection, and flushes."""
    m, opt = make(mode=mode, device=device)
    work = {"trainer-a": batches(1, 6), "trainer-b": batches(2, 6)}
    ran: list[tuple[KeyedJaggedTensor, torch.Tensor]] = []  # in claim order
    refused: list[tuple[str, BaseException]] = []
    barrier = threading.Barrier(2, timeout=TIMEOUT_S)

    def attempt(name: str, kjt, coeff) -> None:
        try:
            out = m(kjt)
        except RuntimeError as e:  # changed nothing: the batch is simply not trained
            refused.append((name, e))
            return
        ran.append((kjt, coeff))  # the claim is ours until our step: no other forward runs
        backward_and_step(out, opt, coeff)

    def trainer_a() -> None:
        (kjt, coeff), *rest = work["trainer-a"]
        out = m(kjt)  # claims the collection until this step
        ran.append((kjt, coeff))
        barrier.wait()  # trainer-b tries its forward now
        barrier.wait()
        backward_and_step(out, opt, coeff)
        for kjt, coeff in rest:
            attempt("trainer-a", kjt, coeff)

    def trainer_b() -> None:
        (kjt, coeff), *rest = work["trainer-b"]
        barrier.wait()
        attempt("trainer-b", kjt, coeff)  # refused: trainer-a holds its step
        barrier.wait()
        for kjt, coeff in rest:
            attempt("trainer-b", kjt, coeff)

    run_threads({"trainer-a": trainer_a, "trainer-b": trainer_b})
    assert refused and refused[0][0] == "trainer-b"
    assert_clear(refused[0][1], "trainer-b", "trainer-a")
    for name, error in refused:
        other = "trainer-b" if name == "trainer-a" else "trainer-a"
        assert_clear(error, name, other)
    assert len(ran) + len(refused) == 12
    assert sum(locked_slots(m)) == 0
    assert_tiers_equal(tier(m), replay(ran, mode=mode, device=device))


def test_another_threads_training_calls_are_refused_before_anything_changes() -> None:
    """While the main thread's step is claimed (forward done, backward and step to come),
    another thread's forward with gradients, backward of its own earlier batch, step,
    zero_grad and prefetch each raise, naming both threads; the main thread's step then
    gives the numbers of a run that never saw them."""
    m, opt = make()
    (kjt, coeff), (other_kjt, _), (stale_kjt, stale_coeff) = batches(3, 3)
    main = threading.current_thread().name
    stale: list[torch.Tensor] = []
    run_threads({"helper": lambda: stale.append(m(stale_kjt).values())})
    m.zero_grad()  # the helper's forward is dropped (its thread ended, so its claim too)

    out = m(kjt)  # the main thread claims the step
    before = (locked_slots(m), len(m._trace), m.pending_prefetch)
    seen: dict[str, BaseException] = {}
    calls = {
        "forward": lambda: m(other_kjt),
        "backward": lambda: loss_of(stale[0], stale_coeff).backward(),
        "step": opt.step,
        "zero_grad": opt.zero_grad,
        "reset_trace": m.reset_trace,
        "prefetch": lambda: m.issue_fused_prefetch(other_kjt),
    }

    def intruder() -> None:
        for what, call in calls.items():
            with pytest.raises(RuntimeError) as info:
                call()
            seen[what] = info.value

    run_threads({"intruder": intruder})
    for what, error in seen.items():
        if what == "backward":  # checked by its batch: autograd may run it on its own thread
            assert ONE_AT_A_TIME in str(error) and repr(main) in str(error), str(error)
        else:
            assert_clear(error, "intruder", main)
    assert (locked_slots(m), len(m._trace), m.pending_prefetch) == before
    loss_of(out.values(), coeff).backward()
    opt.step()
    assert sum(locked_slots(m)) == 0
    assert_tiers_equal(tier(m), replay([(kjt, coeff)]))


def test_inference_from_another_thread_while_one_trains() -> None:
    """A reader under torch.no_grad() looks up batches, flushes and reads whole tables while the
    trainer steps (a barrier starts them together): nothing is refused, and the training is
    exact against a replay without the reader."""
    m, opt = make("full")
    steps = batches(4, 8)
    reads = [kjt for kjt, _ in batches(5, 8)]
    barrier = threading.Barrier(2, timeout=TIMEOUT_S)
    outputs: list[torch.Tensor] = []

    def trainer() -> None:
        barrier.wait()
        for kjt, coeff in steps:
            train_step(m, opt, kjt, coeff)

    def reader() -> None:
        barrier.wait()
        with torch.no_grad():
            for i, kjt in enumerate(reads):
                outputs.append(m(kjt).values())
                if i % 4 == 3:
                    m.flush()
                    m.table_rows("t2")

    run_threads({"trainer": trainer, "reader": reader})
    assert len(outputs) == len(reads)
    assert all(o.shape == (5, WIDTH) and bool(torch.isfinite(o).all()) for o in outputs)
    assert sum(locked_slots(m)) == 0
    assert_tiers_equal(tier(m), replay(steps, cache="full"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_threads_taking_turns_train_one_collection(mode: str, device: str) -> None:
    """The claim ends with each step (inside backward when the update runs there): threads
    that take turns, a lock around each whole step, all train, exactly as the same steps in
    the order the lock gave them. A claim whose thread ended without its step is taken over by
    the next thread, which drops its forward's locks."""
    m, opt = make(mode=mode, device=device)
    steps = batches(6, 6)
    turn = threading.Lock()
    order: list[tuple[KeyedJaggedTensor, torch.Tensor]] = []

    def trainer(part: list) -> Callable[[], None]:
        def run() -> None:
            for kjt, coeff in part:
                with turn:
                    order.append((kjt, coeff))
                    train_step(m, opt, kjt, coeff)

        return run

    run_threads({"first": trainer(steps[:3]), "second": trainer(steps[3:])})
    run_threads({"abandoned": lambda: m(steps[0][0])})  # a forward, then the thread ends
    assert sum(locked_slots(m)) > 0
    m.zero_grad()  # the main thread takes the ended thread's claim over
    assert sum(locked_slots(m)) == 0 and m.engines.claim.thread is None
    assert_tiers_equal(tier(m), replay(order, mode=mode, device=device))


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_pipeline_holds_the_claim_for_its_prefetched_batch(prefetch: bool) -> None:
    """TrainPipeline issues the next batch's prefetch before each step: the step keeps the
    claim for that batch (another thread is refused between steps, not the pipeline), the
    prefetch worker trains nothing and is never refused, and the run ends the claim."""
    m, opt = make("full")
    steps = batches(7, 5)
    refused: list[BaseException] = []

    def probe() -> None:
        try:
            m(steps[0][0])
        except RuntimeError as e:
            refused.append(e)
        else:  # the probe trained instead: drop its forward so the pipeline goes on
            m.zero_grad()

    def on_step(step: int, loss: torch.Tensor) -> None:
        if step == 2:
            run_threads({"probe": probe})

    pipe = embcache.TrainPipeline(
        m,
        opt,
        None,
        features=lambda batch: batch[0],
        loss=lambda model, batch: loss_of(model(batch[0]).values(), batch[1]),
        prefetch=prefetch,
    )
    pipe.run(steps, on_step=on_step)
    assert m.engines.claim.thread is None
    if prefetch:  # between steps 2 and 3 the pipeline held batch 3's prefetch
        assert len(refused) == 1
        assert_clear(refused[0], "probe", threading.current_thread().name)
    else:  # nothing claimed between steps: the probe's forward ran and was dropped
        assert not refused
    assert_tiers_equal(tier(m), replay(steps, cache="full"))
