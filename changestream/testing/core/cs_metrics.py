"""``serverStatus().metrics.changeStreams``: the counters one mongod or mongos keeps.

Paths, shapes and the moments each counter moves are mongod's (issue 32's facts file):

- ``largeEventsSplit`` (5.0.19, 6.0.7, 7.0+; SERVER-67699): once per event
  ``$changeStreamSplitLargeEvent`` has split (``change_stream_split_large_event_stage.cpp``);
  ``largeEventsFailed`` (same releases): once per change event too large to serialize, on
  the node that serializes it (``plan_executor_pipeline.cpp``).
- ``showExpandedEvents`` (7.1+; on mongos also in 9.0, "preserved on mongos at the old path"):
  +1 per stream opened with ``showExpandedEvents: true``.
- 9.0 mongod only: ``option.*`` and ``scope.*`` (+1 per ``$changeStream`` parsed for
  execution; booleans only when true, resume options only when the user gave them),
  ``cursor.totalOpened`` and the throughput sums ``cursor.{docsReturned, bytesReturned,
  batchesReturned, docsExamined, bytesRead}.sum`` (sub-documents, as
  ``change_stream_metrics_util.js`` reads them), ``error.{nonRetriable, retriable}.*`` (errors of an open change-stream cursor, by
  ``incrementChangeStreamErrorCounters``: four named codes, then NonResumableChangeStreamError
  and anything not a RetriableError as ``nonRetriable.other``, RetriableError as
  ``retriable.other``).
- 9.0 mongos only: ``shardTargeting.targeterScope.*`` and ``shardTargeting.controlEvents.*``
  (v2 readers' shard targeters).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Final

from bson.int64 import Int64

from .errors import NON_RESUMABLE_CHANGE_STREAM_CODES, RETRIABLE_CODES
from .versions import VersionProfile

OPTIONS: Final = (
    "showExpandedEvents", "showMigrationEvents", "showSystemEvents", "showRawUpdateDescription",
    "ignoreRemovedShards", "matchCollectionUUIDForUpdateLookup", "startAfter", "resumeAfter",
    "startAtOperationTime", "fullDocument.required", "fullDocument.updateLookup",
    "fullDocument.whenAvailable", "fullDocumentBeforeChange.required",
    "fullDocumentBeforeChange.whenAvailable",
)  # fmt: skip
"""``changeStreams.option.*`` (``document_source_change_stream.cpp``)."""
SCOPES: Final = ("cluster", "db", "collection")
THROUGHPUT: Final = (
    "docsReturned",
    "bytesReturned",
    "batchesReturned",
    "docsExamined",
    "bytesRead",
)
ERRORS: Final = (
    "nonRetriable.changeStreamHistoryLost", "nonRetriable.changeStreamFatalError",
    "nonRetriable.bsonObjectTooLarge", "nonRetriable.other",
    "retriable.interruptedDueToReplStateChange", "retriable.other",
)  # fmt: skip
TARGETING: Final = (
    "targeterScope.collection.dbPresent", "targeterScope.collection.dbAbsent",
    "targeterScope.database.dbPresent", "targeterScope.database.dbAbsent",
    "targeterScope.allDatabases", "controlEvents.moveChunk", "controlEvents.movePrimary",
    "controlEvents.namespacePlacementChanged", "controlEvents.databaseCreated",
)  # fmt: skip
_NOT_COUNTED: Final = frozenset({50, 276})
"""MaxTimeMSExpired and ChangeStreamInvalidated are not counted
(``incrementChangeStreamErrorCounters``; its third, CloseChangeStream, is internal)."""
_NAMED_ERRORS: Final = {
    286: "nonRetriable.changeStreamHistoryLost",
    280: "nonRetriable.changeStreamFatalError",
    10334: "nonRetriable.bsonObjectTooLarge",
    11602: "retriable.interruptedDueToReplStateChange",
}


class ChangeStreamMetrics:
    """One process's counters (thread-safe; every stream of the process adds to them)."""

    def __init__(self, profile: VersionProfile, *, router: bool = False) -> None:
        self._profile = profile
        self.router = router
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, path: str, n: int = 1) -> None:
        self._add_locked([(path, n)])

    def add_many(self, paths: Iterable[str]) -> None:
        self._add_locked((path, 1) for path in paths)

    def _add_locked(self, increments: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            for path, n in increments:
                if n:
                    self._counts[path] = self._counts.get(path, 0) + n

    # -- when mongod moves them ------------------------------------------------------------------
    def stream_opened(self, options: dict[str, Any], scope: str, *, from_router: bool) -> None:
        """A ``$changeStream`` parsed to run: the option and scope counters (mongod)."""
        if not self._profile.option_metrics:
            self.router_stream_opened(options)  # the same old path on mongod before 9.0
            return
        paths = [f"option.{name}" for name in OPTIONS[:6] if options.get(name) is True]
        if not from_router:  # mongos injects its own start time: not the user's intent
            paths += [f"option.{name}" for name in OPTIONS[6:9] if name in options]
        for name in ("fullDocument", "fullDocumentBeforeChange"):
            mode = options.get(name)
            if f"{name}.{mode}" in OPTIONS:
                paths.append(f"option.{name}.{mode}")
        paths.append(f"scope.{scope}")
        paths.append("cursor.totalOpened")
        self.add_many(paths)

    def router_stream_opened(self, options: dict[str, Any]) -> None:
        """mongos (and mongod before 9.0): only the old ``showExpandedEvents`` path (7.1+)."""
        if options.get("showExpandedEvents") is True and self._profile.major_minor >= (7, 1):
            self.add("showExpandedEvents")

    def batch_returned(self, docs: int, size: int, examined: int, read: int) -> None:
        if self._profile.option_metrics and not self.router:
            counts = (docs, size, 1, examined, read)
            self._add_locked(
                (f"cursor.{name}", n) for name, n in zip(THROUGHPUT, counts, strict=True)
            )

    def stream_failed(self, code: int) -> None:
        """An open change-stream cursor failed (9.0 mongod's ``error.*``), split by mongod's
        RetriableError category, not by the resumable label (StaleConfig is resumable but
        ``nonRetriable.other``)."""
        if not self._profile.option_metrics or self.router or code in _NOT_COUNTED:
            return
        path = _NAMED_ERRORS.get(code)
        if path is None:
            retriable = code in RETRIABLE_CODES and code not in NON_RESUMABLE_CHANGE_STREAM_CODES
            path = "retriable.other" if retriable else "nonRetriable.other"
        self.add(f"error.{path}")

    # -- serverStatus --------------------------------------------------------------------------
    def document(self) -> dict[str, Any] | None:
        """``metrics.changeStreams`` as this process reports it (None before 5.0.19/6.0.7)."""
        profile = self._profile
        if not profile.large_event_metrics:
            return None
        with self._lock:
            counts = dict(self._counts)
        paths = ["largeEventsFailed", "largeEventsSplit"]
        if profile.major_minor >= (7, 1) and (self.router or not profile.option_metrics):
            paths.append("showExpandedEvents")
        sums: list[str] = []
        if profile.option_metrics and not self.router:
            paths += [f"option.{name}" for name in OPTIONS]
            paths += [f"scope.{name}" for name in SCOPES]
            paths.append("cursor.totalOpened")
            sums = [f"cursor.{name}" for name in THROUGHPUT]
            paths += [f"error.{name}" for name in ERRORS]
        if profile.precise_shard_targeting and self.router:
            paths += [f"shardTargeting.{name}" for name in TARGETING]
        out: dict[str, Any] = {}
        for path in paths:
            _put(out, path, Int64(counts.get(path, 0)))
        for path in sums:
            _put(out, path, {"sum": Int64(counts.get(path, 0))})
        return out


def _put(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for name in parents:
        doc = doc.setdefault(name, {})
    doc[last] = value
