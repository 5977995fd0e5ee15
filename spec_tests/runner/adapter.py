"""The one place where the runner opens a change stream.

``createChangeStream`` goes through :func:`open_change_stream`, which calls
our library (``changestream.watch``, the default), its asyncio twin
(``changestream.aio.watch`` on an ``AsyncMongoClient`` mirror of the target's
client, through the test's :class:`.async_bridge.AsyncBridge`) or PyMongo's
own ``watch`` helper. Running the suite with ``pymongo`` checks the
simulator's fidelity against a known-good client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pymongo

from . import RunnerError
from .async_bridge import AsyncBridge

ASYNC_CLIENT = "changestream-async"
CLIENTS = ("changestream", ASYNC_CLIENT, "pymongo")
DEFAULT_CLIENT = "changestream"
DEFAULT_CLIENTS = ("changestream", ASYNC_CLIENT)
"""What a plain ``pytest spec_tests`` run covers: every case once per client."""

_ID_SUFFIXES = {"changestream": "", ASYNC_CLIENT: "-async", "pymongo": "-pymongo"}


def id_suffix(client: str) -> str:
    """What a case id gets appended for ``client`` (``[8.0-replicaset-async]``)."""
    _check_client(client)
    return _ID_SUFFIXES[client]


def needs_bridge(client: str) -> bool:
    """Whether tests with ``client`` need an :class:`AsyncBridge` (the async client mode)."""
    _check_client(client)
    return client == ASYNC_CLIENT


def _check_client(client: str) -> None:
    if client not in CLIENTS:
        raise RunnerError(
            f"unknown change-stream client {client!r} (choose from {', '.join(CLIENTS)})"
        )


_OPTION_NAMES = {
    "fullDocument": "full_document",
    "fullDocumentBeforeChange": "full_document_before_change",
    "resumeAfter": "resume_after",
    "startAfter": "start_after",
    "startAtOperationTime": "start_at_operation_time",
    "maxAwaitTimeMS": "max_await_time_ms",
    "batchSize": "batch_size",
    "collation": "collation",
    "comment": "comment",
    "showExpandedEvents": "show_expanded_events",
    "timeoutMS": "timeout_ms",
}
"""Unified-format argument -> PyMongo-style keyword."""


def watch_options(arguments: dict[str, Any]) -> tuple[list[Mapping[str, Any]], dict[str, Any]]:
    """Split createChangeStream arguments into (pipeline, keyword options)."""
    unknown = set(arguments) - set(_OPTION_NAMES) - {"pipeline"}
    if unknown:
        raise RunnerError(f"createChangeStream: unsupported arguments {sorted(unknown)}")
    pipeline = list(arguments.get("pipeline", []))
    options = {_OPTION_NAMES[k]: v for k, v in arguments.items() if k != "pipeline"}
    return pipeline, options


def open_change_stream(
    target: Any,
    arguments: dict[str, Any],
    client: str = DEFAULT_CLIENT,
    bridge: AsyncBridge | None = None,
) -> Any:
    """Open a change stream on a MongoClient, Database or Collection; the aggregate runs now.

    With ``changestream-async`` the stream is opened on the ``bridge``'s
    async mirror of ``target`` and returned as a synchronous
    :class:`.async_bridge.BridgedStream`.
    """
    _check_client(client)
    pipeline, options = watch_options(arguments)
    if client == "changestream":
        try:
            from changestream import watch
        except ImportError as exc:
            raise RunnerError(f"changestream.watch is not available: {exc}") from exc
        return watch(target, pipeline, **options)
    if client == ASYNC_CLIENT:
        if bridge is None:
            raise RunnerError(f"{ASYNC_CLIENT} needs the test's AsyncBridge")
        try:
            from changestream.aio import watch as async_watch
        except ImportError as exc:
            raise RunnerError(f"changestream.aio.watch is not available: {exc}") from exc
        return bridge.open_stream(async_watch(bridge.mirror(target), pipeline, **options))
    return _pymongo_watch(target, pipeline, options)


def _pymongo_watch(target: Any, pipeline: list[Mapping[str, Any]], options: dict[str, Any]) -> Any:
    timeout_ms = options.pop("timeout_ms", None)
    if timeout_ms is None:
        return target.watch(pipeline, **options)
    seconds = timeout_ms / 1000 if timeout_ms else None
    with pymongo.timeout(seconds):
        stream = target.watch(pipeline, **options)
    return _TimedPyMongoStream(stream, seconds)


class _TimedPyMongoStream:
    """PyMongo's ChangeStream with a per-call ``timeoutMS`` (PyMongo has no such kwarg)."""

    def __init__(self, stream: Any, seconds: float | None) -> None:
        self._stream = stream
        self._seconds = seconds

    def next(self) -> Any:
        with pymongo.timeout(self._seconds):
            return self._stream.next()

    __next__ = next

    def __iter__(self) -> _TimedPyMongoStream:
        return self

    def try_next(self) -> Any:
        with pymongo.timeout(self._seconds):
            return self._stream.try_next()

    def close(self) -> None:
        self._stream.close()

    @property
    def alive(self) -> bool:
        return bool(self._stream.alive)

    @property
    def resume_token(self) -> Any:
        return self._stream.resume_token
