"""The ``aggregate`` command: change streams, plus modest plain aggregations.

A pipeline that starts with ``$changeStream`` opens a :class:`ChangeStreamCursor`
(``run_aggregate.cpp``: parse the command, lite-parse the stages, check the
read concern, refuse views, parse and validate the stream, run the first batch,
register the cursor). Other pipelines run over a snapshot of the collection's
documents: the per-document stages with the change-stream evaluator, the rest
($sort, $limit, $skip, $group, $count, $unwind, ...) with mongomock.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Final

from ..changestreams.cursor import ChangeStreamCursor
from ..changestreams.pipeline import PER_DOCUMENT_STAGES, compile_stage, type_name
from ..changestreams.stage import (
    CHANGE_STREAM,
    check_plain_pipeline,
    check_read_concern,
    lite_parse,
    parse_change_stream,
)
from ..core._mongomock import STAGE_HANDLERS, OperationFailure
from ..core.context import CommandContext
from ..core.cursors import cursor_reply
from ..core.errors import CommandError
from ..storage import copy_value
from ..storage.sessions import WriteUnit, session_keys, session_uid, transaction_for
from .common import ListCursor, open_cursor
from .crud import insert_one
from .ddl import drop_collection, ensure_collection
from .oplog_stats import is_oplog_coll_stats, oplog_coll_stats
from .snapshot_reads import (
    SnapshotCursor,
    aggregate_source,
    lazy_aggregate,
    reply_first_batch,
    snapshot_read,
)
from .spec import command

if TYPE_CHECKING:
    from ..storage.deployment import Deployment

DEFAULT_BATCH_SIZE: Final = 101
_VIEW_DEPTH_LIMIT: Final = 20


# -- command parsing ---------------------------------------------------------------------------
def _wrong_type(name: str, value: Any, expected: str) -> CommandError:
    return CommandError(
        14,
        f"BSON field 'aggregate.{name}' is the wrong type '{type_name(value)}', "
        f"expected type '{expected}'",
    )


def _target(ctx: CommandContext) -> str | None:
    """The collection, or None for ``{aggregate: 1}``."""
    target = ctx.target
    if isinstance(target, str) and target:
        return target
    if isinstance(target, (int, float)) and not isinstance(target, bool) and target == 1:
        return None
    raise CommandError(
        9,
        f"Invalid command format: the '{ctx.name}' field must specify a collection name or 1",
    )


def _batch_size(body: dict[str, Any]) -> int:
    if "cursor" not in body:
        if body.get("explain"):
            return DEFAULT_BATCH_SIZE
        raise CommandError(
            9, "The 'cursor' option is required, except for aggregate with the explain argument"
        )
    cursor = body["cursor"]
    if not isinstance(cursor, dict):
        raise _wrong_type("cursor", cursor, "object")
    size = cursor.get("batchSize", DEFAULT_BATCH_SIZE)
    if not isinstance(size, (int, float)) or isinstance(size, bool):
        raise CommandError(
            14,
            f"BSON field 'cursor.batchSize' is the wrong type '{type_name(size)}', expected types "
            "'[long, int, decimal, double']",
        )
    if size < 0:
        raise CommandError(
            51024, f"BSON field 'batchSize' value must be >= 0, actual value '{int(size)}'"
        )
    return int(size)


def _check_options(ctx: CommandContext) -> None:
    body = ctx.body
    comment = body.get("comment")
    profile = ctx.deployment.profile
    if comment is not None and not isinstance(comment, str) and not profile.any_type_comment:
        raise CommandError(14, f"comment must be a string, not a {type_name(comment)}")
    collation = body.get("collation")
    if collation is not None and not isinstance(collation, dict):
        raise _wrong_type("collation", collation, "object")


def _generate_v2_tokens(ctx: CommandContext) -> bool | None:
    """The hidden ``$_generateV2ResumeTokens`` flag (6.0+; test commands are enabled)."""
    value = ctx.body.get("$_generateV2ResumeTokens")
    if value is None or not ctx.deployment.profile.expanded_events:
        return None
    if not isinstance(value, bool):
        raise _wrong_type("$_generateV2ResumeTokens", value, "bool")
    return value


def _session_id(ctx: CommandContext) -> bytes | None:
    sid = (ctx.lsid or {}).get("id")
    raw = getattr(sid, "bytes", sid)
    return bytes(raw) if isinstance(raw, (bytes, bytearray)) else None


# -- the command -------------------------------------------------------------------------------
@command("aggregate")
def aggregate(ctx: CommandContext) -> dict[str, Any]:
    body = ctx.body
    coll = _target(ctx)
    if "pipeline" not in body:
        raise CommandError(40414, "BSON field 'aggregate.pipeline' is missing but a required field")
    raw_pipeline = body["pipeline"]
    if not isinstance(raw_pipeline, list):
        raise _wrong_type("pipeline", raw_pipeline, "array")
    ctx.is_change_stream = any(
        isinstance(stage, dict) and CHANGE_STREAM in stage for stage in raw_pipeline
    )
    batch_size = _batch_size(body)
    _check_options(ctx)
    generate_v2 = _generate_v2_tokens(ctx)
    profile = ctx.deployment.profile
    stages = lite_parse(profile, raw_pipeline)
    if ctx.is_change_stream:
        return _change_stream(ctx, coll, stages, batch_size, generate_v2)
    check_plain_pipeline(stages)
    if body.get("explain"):
        return {"stages": [{name: spec} for name, spec in stages]}
    return _plain(ctx, coll, stages, batch_size)


_SCOPES = {"collection": "collection", "database": "db", "cluster": "cluster"}
"""``changeStreams.scope.*`` by the spec's scope."""


def _change_stream(
    ctx: CommandContext,
    coll: str | None,
    stages: list[tuple[str, Any]],
    batch_size: int,
    generate_v2: bool | None,
) -> dict[str, Any]:
    deployment = ctx.deployment
    check_read_concern(deployment.profile, ctx.body.get("readConcern"))
    if coll is not None:
        state = deployment.catalog.get(ctx.db, coll)
        if state is not None and state.is_view:
            raise CommandError(166, f"Namespace {ctx.db}.{coll} is a view, not a collection")
    spec = parse_change_stream(
        deployment.profile,
        stages,
        db=ctx.db,
        coll=coll,
        standalone=deployment.standalone,
        generate_v2_tokens=generate_v2,
    )
    if ctx.body.get("explain"):
        return {"stages": [{name: value} for name, value in stages]}
    from_router = ctx.body.get("fromRouter") is True or ctx.body.get("fromMongos") is True
    options = next(value for name, value in stages if name == "$changeStream")
    deployment.cs_metrics.stream_opened(options, _SCOPES[spec.scope], from_router=from_router)
    ctx.change_stream_cursor = True
    cursor = ChangeStreamCursor(deployment, spec, lsid_id=_session_id(ctx), from_router=from_router)
    batch = cursor.first_batch(batch_size)
    cid = 0 if batch.exhausted else deployment.cursors.register(cursor, ctx.member.name)
    return cursor_reply(cid, cursor.ns, batch, first=True)


# -- plain aggregations --------------------------------------------------------------------------
def _source(deployment: Deployment, db: str, coll: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """The documents to aggregate over and the view pipeline(s) to apply first."""
    prefix: list[Any] = []
    name = coll
    for _ in range(_VIEW_DEPTH_LIMIT):
        state = deployment.catalog.get(db, name)
        if state is None:
            return [], prefix
        if not state.is_view:
            return list(state.documents()), prefix
        prefix = list(state.options.get("pipeline", [])) + prefix
        name = state.options["viewOn"]
    raise CommandError(
        13, f"View depth too deep or view cycle detected; maximum depth is {_VIEW_DEPTH_LIMIT}"
    )


def run_stage(docs: list[dict[str, Any]], name: str, spec: Any) -> list[dict[str, Any]]:
    if name in PER_DOCUMENT_STAGES:
        stage = compile_stage(name, spec)
        return [out for doc in docs if (out := stage(doc)) is not None]
    handler = STAGE_HANDLERS.get(name)
    if handler is None:
        raise CommandError(
            115, f"The simulator does not implement the {name} stage outside change streams"
        )
    try:
        return list(handler(docs, None, spec))
    except (OperationFailure, NotImplementedError, TypeError, ValueError, KeyError) as exc:
        raise CommandError(2, f"Invalid {name} :: caused by :: {exc}") from exc


def _plain(
    ctx: CommandContext, coll: str | None, stages: list[tuple[str, Any]], batch_size: int
) -> dict[str, Any]:
    if coll is None:
        first = stages[0][0] if stages else "the pipeline"
        if first != "$listLocalSessions":
            raise CommandError(
                73, f"{{aggregate: 1}} is not valid for '{first}'; a collection is required."
            )
        docs = _local_sessions(ctx)
        for name, spec in stages[1:]:
            docs = run_stage(docs, name, spec)
        return open_cursor(ctx, f"{ctx.db}.$cmd.aggregate", docs, batch_size)
    if is_oplog_coll_stats(ctx.db, coll, stages):  # how full the oplog is
        docs = oplog_coll_stats(ctx, stages[0][1])
        for name, spec in stages[1:]:
            docs = run_stage(docs, name, spec)
        return open_cursor(ctx, f"{ctx.db}.{coll}", docs, batch_size)
    out = stages[-1][1] if stages and stages[-1][0] == "$out" else None
    if out is not None:
        stages = stages[:-1]
    snapshot = snapshot_read(ctx)
    if snapshot is not None:
        docs, stages, state = aggregate_source(ctx, snapshot, coll, stages)
        lazy = lazy_aggregate(
            ctx, snapshot, f"{ctx.db}.{coll}", docs, stages, state, batch_size, _session_id(ctx)
        )
        if lazy is not None:
            return lazy
        docs = [copy_value(d) for d in docs]
    else:
        transaction_for(ctx)  # the first statement of a transaction may be an aggregate
        docs, view_pipeline = _source(ctx.deployment, ctx.db, coll)
        stages = lite_parse(ctx.deployment.profile, view_pipeline) + stages
    for name, spec in stages:
        docs = run_stage(docs, name, spec)
    ns = f"{ctx.db}.{coll}"
    if out is not None:
        _write_out(ctx, out, docs)
        return open_cursor(ctx, ns, [], batch_size)
    if snapshot is not None:
        cursor = ListCursor(ns, docs, _session_id(ctx))
        pinned = SnapshotCursor(cursor, ns, cursor.lsid_id, snapshot, state)
        return reply_first_batch(ctx, pinned, cursor.next_batch(batch_size))
    return open_cursor(ctx, ns, docs, batch_size)


# -- collectionless stages and $out --------------------------------------------------------------
def _local_sessions(ctx: CommandContext) -> list[dict[str, Any]]:
    """``$listLocalSessions``: the sessions this deployment keeps state for.

    mongod lists every session in its cache; the simulator keeps a session only once
    it ran a transaction or a retryable write, so only those are listed.
    """
    return [
        {"_id": {"id": uuid.UUID(bytes=key), "uid": session_uid(None)}} for key in session_keys(ctx)
    ]


def _write_out(ctx: CommandContext, spec: Any, docs: list[dict[str, Any]]) -> None:
    """``$out``: replace the target collection's documents with ``docs``.

    mongod writes a temporary collection and renames it over the target
    (``document_source_out.cpp``); the simulator drops the target and inserts into a new
    one, so change streams see a drop (and an invalidate) and the inserts, not mongod's
    temporary namespace and rename.
    """
    if isinstance(spec, str):
        db, coll = ctx.db, spec
    elif isinstance(spec, dict) and isinstance(spec.get("coll"), str):
        db, coll = str(spec.get("db", ctx.db)), spec["coll"]
    else:
        raise CommandError(16990, "$out only supports a string or object argument")
    if not ctx.member.is_primary:
        raise CommandError(10107, "not primary")
    unit = WriteUnit.open(ctx, ddl=True)
    catalog = ctx.deployment.catalog
    old = catalog.get(db, coll)
    if old is not None and old.is_view:
        raise CommandError(166, f"Namespace {db}.{coll} is a view, not a collection")
    if old is not None:
        drop_collection(unit, old)
    state = ensure_collection(unit, db, coll)
    for doc in docs:
        insert_one(ctx, unit, state, doc)
