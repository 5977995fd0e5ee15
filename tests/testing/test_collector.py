"""The ``serve`` process's full garbage collections run while it is idle (core/collector.py)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable

from changestream.testing.core.collector import IdleCollector


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only a collection frees it


def _old_cycle() -> weakref.ref[_Node]:
    """A dead cycle in the oldest generation (only a full collection frees it)."""
    node = _Node()
    ref = weakref.ref(node)
    gc.collect()  # moves it to the oldest generation
    del node
    gc.collect(1)  # the middle generation: the cycle survives it, and a full one is due
    return ref


def _wait(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_full_collection_runs_once_the_process_is_idle_and_the_collector_comes_back() -> None:
    before = gc.get_threshold()
    with IdleCollector(idle_seconds=0.2) as collector:
        assert gc.get_threshold()[2] > 10**9  # CPython's own full collections: out of reach
        ref = _old_cycle()
        assert ref() is not None  # only a full collection frees it
        assert _wait(lambda: ref() is None and collector.collections >= 1, 5), \
            "an idle process kept its garbage"
        assert gc.get_freeze_count() > 0  # what survived is frozen: the next one is short
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_no_full_collection_while_busy_until_the_longest_interval() -> None:
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            sum(range(1000))

    with IdleCollector(idle_seconds=0.2, busy_seconds=2.0) as collector:
        ref = _old_cycle()
        worker = threading.Thread(target=burn)
        worker.start()
        try:
            time.sleep(1.0)
            assert collector.collections == 0 and ref() is not None  # busy: no pause
            assert _wait(lambda: ref() is None, 5), "garbage kept past the longest interval"
        finally:
            stop.set()
            worker.join()


def _frozen_then_dead(collector: IdleCollector) -> weakref.ref[_Node]:
    """A cycle frozen by the collector's first full collection, then dead (only a sweep,
    which unfreezes everything, frees it)."""
    node = _Node()
    ref = weakref.ref(node)
    gc.collect(1)  # a full collection is due
    assert _wait(lambda: collector.collections >= 1, 5)  # idle: collected, then frozen
    return ref  # (the last reference from outside the cycle goes with this frame)


def test_a_cycle_that_dies_after_it_was_frozen_is_freed_by_the_sweep() -> None:
    with IdleCollector(idle_seconds=0.1, sweep_seconds=1.5, sweep_idle_seconds=0.3) as collector:
        ref = _frozen_then_dead(collector)
        time.sleep(0.5)
        assert ref() is not None and collector.sweeps == 0  # frozen: no collection sees it
        assert _wait(lambda: ref() is None and collector.sweeps >= 1, 5), "the sweep missed it"


def test_a_sweep_waits_for_a_longer_quiet_than_a_clients_pauses() -> None:
    """A sweep walks the whole heap (8 s at 1M documents) and a client that comes meanwhile
    waits for it: pauses of half a second between bursts of work get full collections of
    what is new, never a sweep; a long quiet gets the sweep."""
    # a sweep due by the clock after 2 s; under load regardless of quiet only after 12 s
    with IdleCollector(idle_seconds=0.1, sweep_seconds=2.0, sweep_idle_seconds=1.5) as collector:
        ref = _frozen_then_dead(collector)
        ends = time.monotonic() + 4.0
        while time.monotonic() < ends:  # a client's bursts, and pauses between them
            burst = time.monotonic() + 0.3
            while time.monotonic() < burst:
                sum(range(1000))
            gc.collect(1)  # each burst leaves a full collection due
            time.sleep(0.5)
        assert collector.collections >= 3, "the pauses got no collection of what was new"
        assert collector.sweeps == 0 and ref() is not None, "a pause between bursts got a sweep"
        assert _wait(lambda: ref() is None and collector.sweeps >= 1, 5), \
            "a long quiet got no sweep"
