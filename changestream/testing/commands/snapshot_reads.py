"""Point-in-time reads outside transactions: ``readConcern: {level: "snapshot"[, atClusterTime]}``.

MongoDB 5.0+ runs ``find`` and ``aggregate`` at one cluster time: the given
``atClusterTime``, or one the server picks (its last applied optime) and
reports. Every reply of the cursor, getMores included, carries
``atClusterTime``; the getMores read at the same time. A time older than the
history window (``minSnapshotHistoryWindowInSeconds``) fails with
SnapshotTooOld (239), also when a getMore comes after the time has left the
window. Dropping or renaming the collection kills the cursor
(QueryPlanKilled, 175). Servers before 5.0 allow snapshot reads only inside
transactions.

Documents come from :class:`~changestream.testing.history.History`; a
leading ``$match`` on ``_id`` ranges and ``$sort: {_id: 1}`` (what range
copies send) run without the general matcher.
"""

from __future__ import annotations

import functools
import heapq
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import bson
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ..changestreams.pipeline import PER_DOCUMENT_STAGES, compile_stage
from ..core.context import CommandContext
from ..core.cursors import BatchBytes, CursorBatch, cursor_reply
from ..core.errors import CommandError
from ..storage import (
    CollectionState,
    canonical_type,
    compare_values,
    compile_query,
    copy_value,
    id_equality,
    id_key,
    sort_key,
    values_equal,
)

if TYPE_CHECKING:
    from ..storage.deployment import Deployment

INVALID_OPTIONS = 72
QUERY_PLAN_KILLED = 175
SNAPSHOT_UNAVAILABLE = 246


@dataclass(frozen=True, slots=True)
class SnapshotRead:
    """A read at ``at``: it sees the writes up to write number ``point``."""

    at: Timestamp
    point: int


def snapshot_read(ctx: CommandContext) -> SnapshotRead | None:
    """The command's point-in-time read, or None (not a snapshot read, or in a transaction)."""
    concern = ctx.body.get("readConcern")
    if not isinstance(concern, dict):
        return None
    at = concern.get("atClusterTime")
    level = concern.get("level")
    if level != "snapshot":
        if at is not None:
            raise CommandError(
                INVALID_OPTIONS,
                "readConcern level 'snapshot' or 'majority' is required when 'atClusterTime' is "
                "specified" if level is None else
                f"'atClusterTime' is only compatible with readConcern level 'snapshot', not "
                f"'{level}'",
            )
        return None
    if ctx.autocommit is not None:
        return None  # a transaction's snapshot
    deployment = ctx.deployment
    if deployment.profile.major_minor < (5, 0):
        if at is not None:
            raise CommandError(INVALID_OPTIONS, "atClusterTime is only used for testing")
        raise CommandError(
            INVALID_OPTIONS,
            "readConcern level snapshot is only valid in multi-statement transactions",
        )
    if at is None:
        at = deployment.last_applied()
    elif not isinstance(at, Timestamp):
        raise CommandError(
            14,
            f"BSON field 'atClusterTime' is the wrong type '{type(at).__name__}', expected type "
            "'timestamp'",
        )
    elif at == Timestamp(0, 0):
        raise CommandError(
            INVALID_OPTIONS, "readConcern atClusterTime cannot be the null timestamp"
        )
    else:
        current = deployment.clock.current()
        if (at.time, at.inc) > (current.time, current.inc):
            raise CommandError(
                INVALID_OPTIONS,
                "readConcern atClusterTime value must not be greater than the current "
                f"clusterTime. Requested clusterTime: {_ts(at)}; current clusterTime: "
                f"{_ts(current)}",
            )
    return SnapshotRead(at, deployment.history.read_point(at))


def _ts(ts: Timestamp) -> str:
    return f"{{ ts: Timestamp({ts.time}, {ts.inc}) }}"


# -- documents as they were -----------------------------------------------------------------
def collection_at(
    ctx: CommandContext, read: SnapshotRead, coll: str
) -> CollectionState | None:
    """The collection ``coll`` names, if it existed (as now) at the read time."""
    deployment = ctx.deployment
    state = deployment.catalog.get(ctx.db, coll)
    if state is None:
        return None
    if state.is_view:
        raise CommandError(
            115, f"The simulator does not implement snapshot reads of views ({state.ns})"
        )
    changed = deployment.history.created_after(state.uuid, read.at)
    if changed is None:
        return state
    if deployment.profile.major_minor < (7, 0):
        raise CommandError(
            SNAPSHOT_UNAVAILABLE,
            "Unable to read from a snapshot due to pending collection catalog changes; please "
            f"retry the operation. Snapshot timestamp is Timestamp({read.at.time}, "
            f"{read.at.inc}). Collection minimum is Timestamp({changed.time}, {changed.inc})",
        )
    return None  # 7.0+ looks the namespace up as of the read time: it did not exist yet


def documents_at(state: CollectionState | None, read: SnapshotRead, deployment: Deployment,
                 keep: Callable[[Any], bool] | None = None) -> list[dict[str, Any]]:
    """The stored documents of ``state`` at the read time (read-only objects); with ``keep``,
    those whose ``_id`` it accepts."""
    if state is None:
        return []
    return deployment.history.versions_at(state.uuid, state.stored_by_key(), read.point, keep)


def find_documents(
    ctx: CommandContext, read: SnapshotRead, coll: str, query: dict[str, Any]
) -> tuple[list[dict[str, Any]], CollectionState | None]:
    """``find``'s matching documents at the read time (stored objects: read-only)."""
    state = collection_at(ctx, read, coll)
    if not query:
        return documents_at(state, read, ctx.deployment), state
    exact, value = id_equality(query)
    if exact:
        key = id_key(value)
        return documents_at(state, read, ctx.deployment, lambda v: id_key(v) == key), state
    on_id = id_filter(query)
    if on_id is not None:
        return documents_at(state, read, ctx.deployment, on_id), state
    match = compile_query(query)
    return [d for d in documents_at(state, read, ctx.deployment) if match(d)], state


def aggregate_source(
    ctx: CommandContext, read: SnapshotRead, coll: str, stages: list[tuple[str, Any]]
) -> tuple[list[dict[str, Any]], list[tuple[str, Any]], CollectionState | None]:
    """The documents after the leading ``_id`` stages (stored objects: read-only), and the
    stages left to run."""
    state = collection_at(ctx, read, coll)
    first = id_filter(stages[0][1]) if stages and stages[0][0] == "$match" else None
    docs = documents_at(state, read, ctx.deployment, first)
    i = 1 if first is not None else 0
    while i < len(stages):
        name, spec = stages[i]
        if name == "$match" and isinstance(spec, dict):
            on_id = id_filter(spec)
            if on_id is None:
                break
            docs = [d for d in docs if on_id(d["_id"])]
        elif name == "$sort" and isinstance(spec, dict) and list(spec) == ["_id"]:
            if spec["_id"] not in (1, -1) or isinstance(spec["_id"], bool):
                break
            limit = stages[i + 1][1] if i + 1 < len(stages) and stages[i + 1][0] == "$limit" \
                else None
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                limit = None  # not a plain positive $limit: the stage runs (and checks) it
            docs = sort_by_id(docs, descending=spec["_id"] == -1, limit=limit)
        else:
            break
        i += 1
    return docs, stages[i:], state


def lazy_aggregate(
    ctx: CommandContext,
    read: SnapshotRead,
    ns: str,
    docs: list[dict[str, Any]],
    stages: list[tuple[str, Any]],
    state: CollectionState | None,
    batch_size: int,
    lsid_id: bytes | None,
) -> dict[str, Any] | None:
    """When every stage left is per-document: a cursor that runs them batch by batch.

    A copy of a large collection then never holds more than one batch of
    results (the source is the list of stored documents). None otherwise.
    """
    if not all(name in PER_DOCUMENT_STAGES for name, _ in stages):
        return None
    compiled = [_fast_stage(name, spec) or compile_stage(name, spec) for name, spec in stages]
    inner = _LazyResults(ns, docs, compiled, lsid_id)
    cursor = SnapshotCursor(inner, ns, lsid_id, read, state)
    return reply_first_batch(ctx, cursor, inner.next_batch(batch_size))


_MISSING = object()
_Expr = Callable[[dict[str, Any]], Any]


def _fast_stage(name: str, spec: Any) -> Callable[[dict[str, Any]], dict[str, Any] | None] | None:
    """``$replaceWith``/``$replaceRoot`` of plain object/field-path/``$literal`` expressions,
    compiled once (what range copies send); None for anything else (the general evaluator)."""
    if name == "$replaceRoot" and isinstance(spec, dict) and list(spec) == ["newRoot"]:
        spec = spec["newRoot"]
    elif name != "$replaceWith":
        return None
    if not isinstance(spec, dict):
        return None
    expr = _compile_expression(spec)
    return expr  # an object expression always yields a document


def _compile_expression(expr: Any) -> _Expr | None:
    if isinstance(expr, str):
        if expr == "$$ROOT":
            return lambda doc: doc
        if expr.startswith("$$") or (expr.startswith("$") and "." in expr):
            return None
        if expr.startswith("$"):
            field = expr[1:]
            return lambda doc: doc.get(field, _MISSING)
        return lambda doc: expr
    if isinstance(expr, dict):
        if list(expr) == ["$literal"]:
            value = expr["$literal"]
            if isinstance(value, (dict, list)):
                return lambda doc: copy_value(value)
            return lambda doc: value
        if any(k.startswith("$") for k in expr):
            return None
        fields: list[tuple[str, _Expr]] = []
        for key, sub in expr.items():
            compiled = _compile_expression(sub)
            if compiled is None:
                return None
            fields.append((key, compiled))

        def build(doc: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, compiled in fields:
                value = compiled(doc)
                if value is not _MISSING:
                    out[key] = value
            return out

        return build
    if expr is None or isinstance(expr, (bool, int, float)):
        return lambda doc: expr
    return None


class _LazyResults:
    """Per-document stages applied to ``docs`` as batches are asked for."""

    tailable_await = False

    def __init__(
        self,
        ns: str,
        docs: list[dict[str, Any]],
        stages: list[Callable[[dict[str, Any]], dict[str, Any] | None]],
        lsid_id: bytes | None,
    ) -> None:
        self.ns = ns
        self.lsid_id = lsid_id
        self._docs = docs
        self._stages = stages
        self._pos = 0

    def next_batch(self, batch_size: int | None) -> CursorBatch:
        """Up to ``batch_size`` results (None: as many as fit in 16 MiB, as mongod counts)."""
        out: list[dict[str, Any]] = []
        docs, stages = self._docs, self._stages
        size = BatchBytes()
        while self._pos < len(docs) and (batch_size is None or len(out) < batch_size):
            result: dict[str, Any] | None = copy_value(docs[self._pos])
            for stage in stages:
                if result is None:
                    break
                result = stage(result)
            if result is not None:
                result_size = len(bson.encode(result))
                if not size.fits(result_size):
                    break
                out.append(result)
                size.add(result_size)
            self._pos += 1
        return CursorBatch(out, exhausted=self._pos >= len(docs))

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        return self.next_batch(batch_size)

    def close(self) -> None:
        self._docs = []


_NATIVE = (int, float, str, ObjectId)
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": operator.gt,
    "$gte": operator.ge,
    "$lt": operator.lt,
    "$lte": operator.le,
}


def _native_kind(value: Any) -> type | None:
    """``int`` for every number Python orders natively, else the type if natively ordered."""
    typ = type(value)
    if typ is bool:
        return None
    if isinstance(value, (int, float)):
        return int if value == value else None
    if typ in (str, ObjectId):
        return typ
    return None


def id_filter(query: Any) -> Callable[[Any], bool] | None:
    """A test on ``_id`` for filters made only of ``_id`` comparisons, ``$type``, ``$or`` and
    ``$and`` (what range copies send), with mongod's type bracketing; None for other filters.

    An ``_id`` of the bounds' own kind (numbers, strings or ObjectIds, where Python's order
    is BSON's) is compared natively; any other takes the general, bracketed test. A range
    copy's ``{$or: [{_id: {$gt: v}}, {_id: {$type: [...]}}]}`` then costs one native
    comparison per document.
    """
    general = id_predicate(query)
    if general is None:
        return None
    kinds: set[type | None] = set()
    _bound_kinds(query, kinds)
    if len(kinds) != 1 or None in kinds:
        return general
    kind = kinds.pop()
    assert kind is not None
    native = _native_clause(query, kind)
    if native is None:
        return general
    if native is True or native is False:
        constant = native
        return lambda v: constant if type(v) is kind else general(v)
    test = native
    return lambda v: test(v) if type(v) is kind else general(v)


def _bound_kinds(query: Any, kinds: set[type | None]) -> None:
    if not isinstance(query, dict):
        return
    for name, value in query.items():
        if name in ("$or", "$and") and isinstance(value, list):
            for part in value:
                _bound_kinds(part, kinds)
        elif name == "_id" and isinstance(value, dict):
            kinds.update(_native_kind(b) for op, b in value.items() if op in _OPS)


_KIND_RANK = {int: canonical_type(0), str: canonical_type(""), ObjectId: canonical_type(ObjectId(b"\0" * 12))}
_Native = Callable[[Any], bool] | bool


def _native_clause(query: Any, kind: type) -> _Native | None:
    """``query`` for ``_id`` values of ``kind`` alone: a native test, a constant, or None."""
    if not isinstance(query, dict) or not query:
        return None
    parts: list[_Native] = []
    for name, value in query.items():
        if name in ("$or", "$and") and isinstance(value, list) and value:
            subs = [_native_clause(q, kind) for q in value]
            if any(sub is None for sub in subs):
                return None
            parts.append(_combine([sub for sub in subs if sub is not None], name == "$or"))
        elif name == "_id" and isinstance(value, dict) and value:
            part = _native_condition(value, kind)
            if part is None:
                return None
            parts.append(part)
        else:
            return None
    return _combine(parts, False)


def _native_condition(cond: dict[str, Any], kind: type) -> _Native | None:
    if list(cond) == ["$type"]:
        names = cond["$type"] if isinstance(cond["$type"], list) else [cond["$type"]]
        if not all(isinstance(n, str) and n in _TYPE_ALIASES for n in names):
            return None
        return _KIND_RANK[kind] in {_TYPE_ALIASES[n] for n in names}
    if not all(op in _OPS for op in cond):
        return None
    if not all(_native_kind(b) is kind for b in cond.values()):
        return None
    if len(cond) == 1:  # ``bound < v`` for ``v > bound``: a C call, no Python frame per document
        (op, bound), = cond.items()
        return functools.partial(_FLIPPED[op], bound)
    checks = [(_OPS[op], bound) for op, bound in cond.items()]
    return lambda v: all(check(v, bound) for check, bound in checks)


def _combine(parts: list[_Native], any_of: bool) -> _Native:
    """``parts`` joined by OR (``any_of``) or AND, constants folded."""
    if any(part is any_of for part in parts):  # a true part of an OR, a false one of an AND
        return any_of
    tests = [p for p in parts if p is not True and p is not False]
    if not tests:
        return not any_of
    if len(tests) == 1:
        return tests[0]
    if any_of:
        return lambda v: any(t(v) for t in tests)
    return lambda v: all(t(v) for t in tests)


_FLIPPED: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": operator.lt, "$gte": operator.le, "$lt": operator.gt, "$lte": operator.ge,
}
"""Each comparison with its operands swapped."""

_TYPE_ALIASES: dict[str, int] = {
    "minKey": -1, "null": 5, "undefined": 5, "double": 10, "int": 10, "long": 10,
    "decimal": 10, "number": 10, "string": 15, "symbol": 15, "object": 20, "array": 25,
    "binData": 30, "objectId": 35, "bool": 40, "date": 45, "timestamp": 47, "regex": 50,
    "dbPointer": 55, "javascript": 60, "javascriptWithScope": 65, "maxKey": 127,
}
"""``$type`` aliases by canonical rank (numbers are matched as one rank: enough for ``_id`` ranges)."""


def id_predicate(query: Any) -> Callable[[Any], bool] | None:
    """A test on ``_id`` alone for filters made only of ``_id`` comparisons, ``$type``,
    ``$or`` and ``$and`` (what range copies send), with mongod's type bracketing; else None."""
    if not isinstance(query, dict) or not query:
        return None
    tests: list[Callable[[Any], bool]] = []
    for name, value in query.items():
        if name in ("$or", "$and") and isinstance(value, list) and value:
            parts = [id_predicate(q) for q in value]
            if any(p is None for p in parts):
                return None
            checks = [p for p in parts if p is not None]
            if name == "$or":
                tests.append(lambda v, cs=checks: any(c(v) for c in cs))  # type: ignore[misc]
            else:
                tests.append(lambda v, cs=checks: all(c(v) for c in cs))  # type: ignore[misc]
        elif name == "_id":
            cond = _id_condition(value)
            if cond is None:
                return None
            tests.append(cond)
        else:
            return None
    return lambda v: all(t(v) for t in tests)


def _id_condition(cond: Any) -> Callable[[Any], bool] | None:
    if not isinstance(cond, dict) or not any(k.startswith("$") for k in cond):
        return lambda v: values_equal(v, cond)
    tests: list[Callable[[Any], bool]] = []
    for op, bound in cond.items():
        if op == "$type":
            names = bound if isinstance(bound, list) else [bound]
            if not all(isinstance(n, str) and n in _TYPE_ALIASES for n in names):
                return None
            ranks = {_TYPE_ALIASES[n] for n in names}
            tests.append(lambda v, rs=ranks: canonical_type(v) in rs)  # type: ignore[misc]
        elif op in _OPS or op == "$eq":
            sign = {"$gt": (1,), "$gte": (0, 1), "$lt": (-1,), "$lte": (-1, 0), "$eq": (0,)}[op]
            rank = canonical_type(bound)
            tests.append(
                lambda v, b=bound, r=rank, ok=sign: canonical_type(v) == r  # type: ignore[misc]
                and _sign(compare_values(v, b)) in ok
            )
        else:
            return None
    return lambda v: all(t(v) for t in tests)


def _sign(n: int) -> int:
    return (n > 0) - (n < 0)


_ID = operator.itemgetter("_id")
_ORDERED = {int, str, ObjectId}


def sort_by_id(docs: list[dict[str, Any]], *, descending: bool = False,
               limit: int | None = None) -> list[dict[str, Any]]:
    """``docs`` in ``_id`` order (native keys when the ids are of one ordered kind); with
    ``limit``, only the first ``limit`` of them (a top-k, as mongod walks the ``_id`` index
    and stops: a range copy's ``$sort`` + ``$limit`` no longer sorts the whole remainder)."""
    types = set(map(type, map(_ID, docs)))
    if len(types) <= 1 and types <= _ORDERED:
        native = True  # one kind of a natively ordered type (no float: no NaN)
    elif types <= {int, float}:
        native = all(v == v for v in map(_ID, docs))  # numbers order natively, but for NaN
    else:
        native = False
    key: Callable[[dict[str, Any]], Any] = _ID if native else (lambda d: sort_key(d["_id"]))
    if limit is not None and limit < len(docs):
        pick = heapq.nlargest if descending else heapq.nsmallest
        return pick(limit, docs, key=key)
    return sorted(docs, key=key, reverse=descending)


# -- the cursor --------------------------------------------------------------------------------
class _Inner(Protocol):
    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch: ...

    def close(self) -> None: ...


class SnapshotCursor:
    """A cursor reading at one cluster time: every batch reports it; it dies with its collection."""

    tailable_await = False

    def __init__(
        self,
        inner: _Inner,
        ns: str,
        lsid_id: bytes | None,
        read: SnapshotRead,
        state: CollectionState | None,
    ) -> None:
        self._inner = inner
        self.ns = ns
        self.lsid_id = lsid_id
        self.read = read
        self._state = state
        self._source_ns = state.ns if state is not None else None

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        self.check_alive(ctx.deployment)
        ctx.deployment.history.check(self.read.at)
        batch = self._inner.get_more(ctx, batch_size, max_time_ms)
        batch.at_cluster_time = self.read.at
        return batch

    def check_alive(self, deployment: Deployment) -> None:
        """QueryPlanKilled (175) once the collection was dropped or renamed."""
        state = self._state
        if state is None:
            return
        if deployment.catalog.get(state.db, state.name) is not state:
            raise CommandError(
                QUERY_PLAN_KILLED,
                f"Executor error during getMore :: caused by :: collection dropped. UUID {state.uuid}",
            )
        if state.ns != self._source_ns:
            raise CommandError(
                QUERY_PLAN_KILLED,
                f"Executor error during getMore :: caused by :: collection renamed from "
                f"'{self._source_ns}' to '{state.ns}'. UUID {state.uuid}",
            )

    def close(self) -> None:
        self._inner.close()


def reply_first_batch(
    ctx: CommandContext, cursor: SnapshotCursor, batch: CursorBatch, *, single_batch: bool = False
) -> dict[str, Any]:
    """The first reply: the batch with ``atClusterTime``; the cursor registered if not done."""
    batch.at_cluster_time = cursor.read.at
    if single_batch:
        batch.exhausted = True
    cid = 0 if batch.exhausted else ctx.deployment.cursors.register(cursor, ctx.member.name)
    if batch.exhausted:
        cursor.close()
    return cursor_reply(cid, cursor.ns, batch, first=True)
