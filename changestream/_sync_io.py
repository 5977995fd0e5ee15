"""The few steps the sync twins do differently from the async ones, under the same names.

The sync modules are written by ``tools/gen_sync.py`` from the
``changestream/aio`` sources, which call these steps through
:mod:`changestream.aio._async_io`; the generated code calls this module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pymongo.synchronous.collection import Collection as PyMongoCollection

from ._api import Collection

__all__ = ["call_handler", "call_store", "pymongo_collection", "stop_setter", "wait_for_stop"]


def call_store(method: Callable[..., Any], *args: Any) -> Any:
    """Call a store method."""
    return method(*args)


def call_handler(handler: Callable[[Any], object], change: Any) -> None:
    """Call the handler."""
    handler(change)


def wait_for_stop(stop: threading.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    stop.wait(seconds)


def stop_setter(stop: threading.Event) -> Callable[[], object]:
    """A function that sets ``stop`` from a signal handler."""
    return stop.set


def pymongo_collection(target: Any) -> PyMongoCollection[Any] | None:
    """The PyMongo ``Collection`` of ``target`` (one, or a :class:`changestream.Collection`), else ``None``."""
    if isinstance(target, Collection):
        return target.pymongo
    return target if isinstance(target, PyMongoCollection) else None
