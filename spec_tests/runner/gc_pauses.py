"""Timing-sensitive spec tests run without a garbage collection in their window."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """Run one spec test without a garbage collection in the middle of it.

    The CSOT tests leave 20-50 ms between ``blockTimeMS`` (plus mongod's 1 s
    await) and ``timeoutMS``. A full collection of this process (the whole
    collected suite, the simulators, the clients) takes ~90 ms on a loaded
    2-core machine and used to land inside that window now and then: a
    NetworkTimeout that had nothing to do with the client. So the young
    generations are collected between tests, never during one (a test
    allocates little), and everything alive after collection is frozen out
    of later full collections (``pytest_collection_finish`` in conftest).
    """
    enabled = gc.isenabled()
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
