"""The commands a change stream sends, built from its options (pure functions, no state).

The machine decides *which* command comes next and with which start position
(:meth:`~changestream._machine.ChangeStreamMachine.next_action`); how each one
is spelled for the server (the ``$changeStream`` stage and its options, a
getMore's ``maxTimeMS`` and ``comment``, killCursors) is here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bson.int64 import Int64

from ._actions import KillCursors, RunAggregate, RunGetMore, StreamSpec
from ._options import ChangeStreamOptions

__all__ = ["aggregate_command", "getmore_command", "kill_command", "start_options"]


def aggregate_command(spec: StreamSpec, start: Mapping[str, Any],
                      split_stage: Sequence[Mapping[str, Any]], *, is_resume: bool) -> RunAggregate:
    """The aggregate opening (or resuming, ``is_resume``) the stream at ``start``."""
    options = spec.options
    stage: dict[str, Any] = {}
    if spec.cluster:
        stage["allChangesForCluster"] = True
    if options.full_document is not None:
        stage["fullDocument"] = options.full_document
    if options.full_document_before_change is not None:
        stage["fullDocumentBeforeChange"] = options.full_document_before_change
    stage.update(start)
    if options.show_expanded_events is not None:
        stage["showExpandedEvents"] = options.show_expanded_events
    if options.version is not None:
        stage["version"] = options.version
    if options.ignore_removed_shards is not None:
        stage["ignoreRemovedShards"] = options.ignore_removed_shards
    command: dict[str, Any] = {
        "aggregate": spec.collection if spec.collection is not None else 1,
        "pipeline": [{"$changeStream": stage}, *options.pipeline, *split_stage],
        "cursor": {} if options.batch_size is None else {"batchSize": options.batch_size},
    }
    if options.collation is not None:
        command["collation"] = options.collation
    if options.comment is not None:
        command["comment"] = options.comment
    return RunAggregate(command, spec.database, spec.read_preference, spec.read_concern,
                        is_resume)


def start_options(options: ChangeStreamOptions) -> dict[str, Any]:
    """The caller's start options, verbatim: conflicts are the server's to report."""
    stage: dict[str, Any] = {}
    if options.resume_after is not None:
        stage["resumeAfter"] = options.resume_after
    if options.start_after is not None:
        stage["startAfter"] = options.start_after
    if options.start_at_operation_time is not None:
        stage["startAtOperationTime"] = options.start_at_operation_time
    return stage


def getmore_command(cursor_id: int, collection: str, database: str, address: Any,
                    wire_version: int, options: ChangeStreamOptions) -> RunGetMore:
    """The next getMore on the cursor (``comment`` only where the server takes it: 4.4+)."""
    command: dict[str, Any] = {"getMore": Int64(cursor_id), "collection": collection}
    if options.batch_size:
        command["batchSize"] = options.batch_size
    if options.max_await_time_ms is not None:
        command["maxTimeMS"] = options.max_await_time_ms
    if options.comment is not None and wire_version >= 9:
        command["comment"] = options.comment
    return RunGetMore(command, database, address)


def kill_command(cursor_id: int, collection: str, database: str, address: Any) -> KillCursors:
    """The killCursors of a cursor, run on the server holding it."""
    command = {"killCursors": collection, "cursors": [Int64(cursor_id)]}
    return KillCursors(command, database, address)
