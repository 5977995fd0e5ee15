"""Reads: find, count, distinct, and what writes share with them (the documents a query
matches, in natural or sorted order; views evaluated; an index hint's bounds).

Apart from :mod:`.crud` (the writes) because a read logs nothing and takes no write unit:
it only selects documents. ``findAndModify`` and the bulk writes select through here.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ..core._mongomock import run_pipeline
from ..core.context import CommandContext
from ..core.cursors import cursor_reply
from ..core.errors import CommandError
from ..storage import (
    CollectionState,
    compile_query,
    copy_value,
    id_equality,
    id_key,
    matches,
    path_values,
    sort_key,
    type_name,
)
from ..storage.sessions import transaction_for
from ..update import project
from .common import ListCursor, batch_size_arg, collection_arg, lsid_bytes, open_cursor
from .snapshot_reads import (
    SnapshotCursor,
    find_documents,
    reply_first_batch,
    snapshot_read,
    sort_by_id,
)
from .spec import command
from .tailable import OPLOG_NS, TailableCursor, check_tailable, oplog_documents


def matching(
    state: CollectionState | None, query: dict[str, Any], limit: int = 0
) -> list[dict[str, Any]]:
    """Stored documents matching ``query`` in natural order (at most ``limit``; 0: all).

    ``{_id: v}`` is a hashed lookup, not a scan.
    """
    if state is None:
        compile_query(query)  # mongod parses the filter first: a bad operator fails here too
        return []
    exact, value = id_equality(query)
    if exact:
        doc = state.lookup(id_key(value))
        return [doc] if doc is not None else []
    match = compile_query(query)
    if not limit:
        return [doc for doc in state.iter_stored() if match(doc)]
    found: list[dict[str, Any]] = []
    for doc in state.iter_stored():
        if match(doc):
            found.append(doc)
            if len(found) == limit:
                break
    return found


def query_arg(value: Any, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CommandError(
            14,
            f"BSON field '{field}' is the wrong type '{type_name(value)}', expected type 'object'",
        )
    return value


def _sort_value(doc: dict[str, Any], field: str, descending: bool) -> Any:
    """The value a document sorts by: arrays by their smallest (largest) element."""
    values: list[Any] = []
    for value in path_values(doc, field):
        if isinstance(value, list):
            values.extend(value)
        else:
            values.append(value)
    if not values:
        return None
    return max(values, key=sort_key) if descending else min(values, key=sort_key)


def sorted_documents(docs: list[dict[str, Any]], sort: dict[str, Any]) -> list[dict[str, Any]]:
    """``docs`` in ``sort`` order (stable, so ties keep natural order)."""
    for field, direction in reversed(list(sort.items())):
        if isinstance(direction, dict):
            continue  # {$meta: ...}: no text scores in the simulator
        if direction not in (1, -1) or isinstance(direction, bool):
            raise CommandError(
                15975, "$sort key ordering must be 1 (for ascending) or -1 (for descending)"
            )
        if field == "$natural":
            if direction == -1:
                docs = docs[::-1]
            continue
        descending = direction == -1
        docs = sorted(
            docs,
            key=lambda d, f=field, desc=descending: sort_key(_sort_value(d, f, desc)),  # type: ignore[misc]
            reverse=descending,
        )
    return docs


def read_documents(ctx: CommandContext, coll: str, query: dict[str, Any]) -> list[dict[str, Any]]:
    """Documents of a collection or view matching ``query`` (stored objects: read-only)."""
    transaction_for(ctx)  # a read may start (or must belong to) a transaction
    state = ctx.deployment.catalog.get(ctx.db, coll)
    if state is None or not state.is_view:
        return matching(state, query)
    return [doc for doc in _view_documents(ctx, state, 0) if matches(query, doc)]


def _view_documents(ctx: CommandContext, view: CollectionState, depth: int) -> list[dict[str, Any]]:
    """Evaluate a view (possibly on another view) with mongomock's pipeline engine."""
    if depth > 20:
        raise CommandError(
            165,
            "View depth too deep or view cycle detected; maximum depth is 20",
            code_name="ViewDepthLimitExceeded",
        )
    source = ctx.deployment.catalog.get(view.db, view.options["viewOn"])
    if source is None:
        base: list[dict[str, Any]] = []
    elif source.is_view:
        base = _view_documents(ctx, source, depth + 1)
    else:
        base = list(source.documents())
    try:
        return run_pipeline(base, view.options.get("pipeline", []))
    except CommandError:
        raise
    except Exception as exc:  # mongomock's errors
        raise CommandError(2, f"cannot evaluate view {view.ns}: {exc}") from None


def _natural(docs: list[dict[str, Any]], sort: dict[str, Any]) -> list[dict[str, Any]]:
    """``sort`` applied; ``{$natural: 1|-1}`` is insertion order or its reverse."""
    if list(sort) == ["$natural"]:
        return docs[::-1] if sort["$natural"] == -1 else docs
    return sorted_documents(docs, sort)


def hinted_key(state: CollectionState | None, hint: Any) -> dict[str, Any]:
    """The hinted index's key (documents come in its order), ``{}`` without a hint.

    mongod fails a hint naming no index with BadValue "hint provided does not
    correspond to an existing index" (query_planner.cpp); ``{$natural: 1}`` scans.
    """
    if hint is None or hint == {} or (isinstance(hint, dict) and "$natural" in hint):
        return {}
    specs = state.indexes if state is not None else []
    for spec in specs:
        if (isinstance(hint, str) and spec["name"] == hint) or (
            isinstance(hint, dict) and list(spec["key"].items()) == list(hint.items())
        ):
            key = dict(spec["key"])
            ordered = all(v in (1, -1) and not isinstance(v, bool) for v in key.values())
            return key if ordered else {}
    raise CommandError(
        2,
        "error processing query: planner returned error :: caused by :: hint provided does "
        "not correspond to an existing index",
    )


def _index_tuple(doc: dict[str, Any], key: dict[str, Any]) -> list[Any]:
    """``doc``'s index key values as comparable sort keys (missing: null), each field's
    direction applied."""
    out = []
    for field, direction in key.items():
        values = path_values(doc, field)
        out.append((sort_key(values[0] if values else None), direction))
    return out


def _compare(a: list[Any], b: list[Any]) -> int:
    for (x, direction), (y, _) in zip(a, b, strict=True):
        if x != y:
            return (1 if x > y else -1) * (1 if direction >= 0 else -1)
    return 0


def _within_bounds(
    docs: list[dict[str, Any]], key: dict[str, Any], low: Any, high: Any
) -> list[dict[str, Any]]:
    """``min`` (inclusive) and ``max`` (exclusive) bounds on the hinted index's key.

    mongod (4.2+) needs a hint with them (51173) and bounds naming the index's fields in
    its order (51174) (``query_planner.cpp``, ``cursor.min()`` in the manual).
    """
    if low is None and high is None:
        return docs
    if not key:
        raise CommandError(
            51173, "When using min()/max() a hint of which index to use must be provided"
        )
    bounds: list[list[Any] | None] = []
    for bound in (low, high):
        if bound is None:
            bounds.append(None)
            continue
        if not isinstance(bound, dict) or list(bound) != list(key):
            raise CommandError(
                51174,
                "The index chosen is not consistent with min/max. Make sure the index is "
                "valid, and that min and max are consistent with the index key pattern",
            )
        bounds.append(_index_tuple(bound, key))
    lower, upper = bounds
    return [
        doc
        for doc in docs
        if (lower is None or _compare(_index_tuple(doc, key), lower) >= 0)
        and (upper is None or _compare(_index_tuple(doc, key), upper) < 0)
    ]


def _non_negative(value: Any, name: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CommandError(
            14,
            f"BSON field '{name}' is the wrong type '{type_name(value)}', expected types "
            "'[long, int, decimal, double]'",
        )
    if value < 0:
        raise CommandError(
            51024, f"BSON field '{name}' value must be >= 0, actual value '{int(value)}'"
        )
    return int(value)


@command("find")
def find(ctx: CommandContext) -> dict[str, Any]:
    coll = collection_arg(ctx)
    body = ctx.body
    query = query_arg(body.get("filter"), "FindCommandRequest.filter")
    sort = query_arg(body.get("sort"), "FindCommandRequest.sort")
    projection = query_arg(body.get("projection"), "FindCommandRequest.projection")
    skip = _non_negative(body.get("skip"), "skip")
    limit = _non_negative(body.get("limit"), "limit")
    batch_size = batch_size_arg(body.get("batchSize"), "find", 101)
    single_batch = bool(body.get("singleBatch", False))
    tailable, await_data = check_tailable(ctx, coll)
    if tailable:
        if f"{ctx.db}.{coll}" == OPLOG_NS:
            first = oplog_documents(ctx.deployment.oplog, query) if skip or limit else []
        else:
            first = read_documents(ctx, coll, query)
        if limit:  # the cursor ends at its limit, tailable or not
            docs = [
                project(d, projection, query=query) if projection else copy_value(d)
                for d in first[skip : skip + limit]
            ]
            return open_cursor(ctx, f"{ctx.db}.{coll}", docs, min(batch_size or limit, limit))
        first = first[skip:]
        tail = TailableCursor(
            ctx, f"{ctx.db}.{coll}", query, projection, await_data=await_data, first=first
        )
        batch = tail.next_batch(batch_size)
        cid = ctx.deployment.cursors.register(tail, ctx.member.name)
        return cursor_reply(cid, tail.ns, batch, first=True)
    snapshot = snapshot_read(ctx)
    if snapshot is not None:
        found, state = find_documents(ctx, snapshot, coll, query)
        if list(sort) == ["_id"] and sort["_id"] in (1, -1) and not isinstance(sort["_id"], bool):
            docs = sort_by_id(found, descending=sort["_id"] == -1)
        else:
            docs = sorted_documents(found, sort)
    elif f"{ctx.db}.{coll}" == OPLOG_NS:
        docs = _natural(oplog_documents(ctx.deployment.oplog, query), sort)
    else:
        docs = read_documents(ctx, coll, query)
        key = hinted_key(ctx.deployment.catalog.get(ctx.db, coll), body.get("hint"))
        docs = _within_bounds(docs, key, body.get("min"), body.get("max"))
        docs = _natural(docs, sort or key)
    docs = docs[skip:]
    if limit:
        docs = docs[:limit]
        if batch_size is None or batch_size > limit:
            batch_size = limit
    if projection:
        docs = [project(doc, projection, query=query) for doc in docs]
    else:
        docs = [copy_value(doc) for doc in docs]
    ns = f"{ctx.db}.{coll}"
    if snapshot is not None:
        inner = ListCursor(ns, docs, lsid_bytes(ctx))
        cursor = SnapshotCursor(inner, ns, inner.lsid_id, snapshot, state)
        return reply_first_batch(
            ctx, cursor, inner.next_batch(batch_size), single_batch=single_batch
        )
    return open_cursor(
        ctx, ns, docs, batch_size, single_batch=single_batch, open_after_full_batch=not limit
    )


@command("count")
def count(ctx: CommandContext) -> dict[str, Any]:
    coll = collection_arg(ctx)
    query = query_arg(ctx.body.get("query"), "count.query")
    skip = _non_negative(ctx.body.get("skip"), "skip")
    raw_limit = ctx.body.get("limit", 0)
    limit = abs(int(raw_limit)) if isinstance(raw_limit, (int, float)) else 0
    n = max(len(read_documents(ctx, coll, query)) - skip, 0)
    return {"n": min(n, limit) if limit else n}


@command("distinct")
def distinct(ctx: CommandContext) -> dict[str, Any]:
    coll = collection_arg(ctx)
    key = ctx.body.get("key")
    if not isinstance(key, str):
        raise CommandError(
            14,
            f"BSON field 'distinct.key' is the wrong type '{type_name(key)}', expected type "
            "'string'",
        )
    query = query_arg(ctx.body.get("query"), "distinct.query")
    seen: dict[Hashable, Any] = {}
    snapshot = snapshot_read(ctx)
    if snapshot is not None:  # a point-in-time read reports its time (distinct.cpp)
        found, _ = find_documents(ctx, snapshot, coll, query)
    else:
        found = read_documents(ctx, coll, query)
    for doc in found:
        for value in path_values(doc, key):
            for item in value if isinstance(value, list) else [value]:
                seen.setdefault(id_key(item), item)
    reply: dict[str, Any] = {"values": [copy_value(v) for v in sorted(seen.values(), key=sort_key)]}
    if snapshot is not None:
        reply["atClusterTime"] = snapshot.at
    return reply
