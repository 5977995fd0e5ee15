"""The one place where the runner opens a change stream.

``createChangeStream`` goes through :func:`open_change_stream`, which calls
either our library (``changestream.watch``, the default) or PyMongo's own
``watch`` helper. Running the suite with ``pymongo`` checks the simulator's
fidelity against a known-good client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pymongo

from . import RunnerError

CLIENTS = ("changestream", "pymongo")
DEFAULT_CLIENT = "changestream"

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


def open_change_stream(target: Any, arguments: dict[str, Any], client: str = DEFAULT_CLIENT) -> Any:
    """Open a change stream on a MongoClient, Database or Collection; the aggregate runs now."""
    pipeline, options = watch_options(arguments)
    if client == "changestream":
        try:
            from changestream import watch
        except ImportError as exc:
            raise RunnerError(f"changestream.watch is not available: {exc}") from exc
        return watch(target, pipeline, **options)
    if client == "pymongo":
        return _pymongo_watch(target, pipeline, options)
    raise RunnerError(f"unknown change-stream client {client!r} (choose from {', '.join(CLIENTS)})")


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
