"""Turn oplog entries into change events, field for field as mongod's transform stage does.

Follows ``change_stream_event_transform.cpp`` (field order, operationDescription,
resume-token identifiers; view DDL read from ``system.views`` writes, as its
``ChangeStreamViewDefinitionEventTransformation`` does),
``document_source_change_stream_unwind_transaction.cpp``
(one event per ``applyOps`` operation, ``txnOpIndex`` counting every operation)
and ``document_source_change_stream_check_invalidate.cpp`` (which commands
invalidate which streams). What differs between releases comes from the
:class:`VersionProfile`. This is the hot path: everything constant for a
stream is computed once, and events share their sub-documents with the oplog
(nothing downstream mutates them).
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime
from typing import Any, Final

from bson.int64 import Int64
from bson.timestamp import Timestamp

from ..core.errors import CommandError
from ..core.oplog import OplogEntry
from ..core.versions import VersionProfile
from .resume_token import ResumeTokenData, encode_event_token, encode_token, event_token
from .stage import SCOPE_CLUSTER, SCOPE_COLLECTION, SCOPE_DATABASE, ChangeStreamSpec
from .update_description import update_description

_INTERNAL_DBS: Final = frozenset({"admin", "config", "local"})
_SYSTEM_VIEWS: Final = "system.views"
_VIEW_EVENTS: Final = {"i": "create", "u": "modify", "d": "drop"}
"""What a write to ``system.views`` means for the view it describes."""
_BUCKETS_PREFIX: Final = "system.buckets."
_RENAME_DROPPED: Final = ("renameCollection", "stayTemp")
_SHARDING_EVENTS: Final = ("shardCollection", "reshardCollection", "refineCollectionShardKey")
"""No-op entries a sharded collection's DDL writes (``o2.<event>``), shown with
showExpandedEvents."""
_EXPANDED_COMMANDS: Final = frozenset(
    {"create", "createIndexes", "commitIndexBuild", "dropIndexes", "collMod"}
)


@dataclasses.dataclass(slots=True)
class RawEvent:
    """One change event as the transform produced it, before images and user stages,
    with the parts of its resume token (its :attr:`token` is only built when asked).

    The cursor shares it between streams of the same shape: never mutate ``doc``
    (the cursor may replace it by the same event with its bytes).
    """

    doc: dict[str, Any]
    cluster_time: Timestamp
    version: int
    txn_op_index: int
    collection_uuid: uuid.UUID | None
    operation_type: str
    """Of the event the token is for (an invalidate's token is the invalidating event's)."""
    document_key: dict[str, Any] | None = None
    operation_description: dict[str, Any] | None = None
    entry: OplogEntry | None = None
    """The CRUD oplog entry (pre/post images live there); None for commands."""
    invalidates: bool = False
    """The stream must be invalidated after this event (drop/rename/dropDatabase)."""
    is_invalidate: bool = False

    @property
    def token(self) -> ResumeTokenData:
        return event_token(
            self.cluster_time,
            self.version,
            self.txn_op_index,
            self.collection_uuid,
            self.operation_type,
            self.document_key,
            self.operation_description,
            from_invalidate=self.is_invalidate,
        )


def _ns_doc(db: str, coll: str) -> dict[str, Any]:
    return {"db": db, "coll": coll}


def _split_ns(ns: str) -> tuple[str, str]:
    db, _, coll = ns.partition(".")
    return db, coll


def _without(doc: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in names}


class EventTransformer:
    """Builds the events one stream sees from each oplog entry."""

    def __init__(self, spec: ChangeStreamSpec, profile: VersionProfile) -> None:
        self._scope = spec.scope
        self._db = spec.db
        self._coll = spec.coll
        self._ns = spec.ns
        self._db_prefix = spec.db + "."
        self._show_system = spec.show_system_events
        self._expanded = spec.show_expanded_events
        self._fields = spec.show_expanded_events or profile.expanded_fields_by_default
        """``collectionUUID``, ``operationDescription`` and ``disambiguatedPaths`` (8.2.0 shows
        them without showExpandedEvents; the DDL events themselves still need it)."""
        self._view_events = spec.show_expanded_events and spec.scope != SCOPE_COLLECTION
        """View DDL events: only whole-db and cluster streams with showExpandedEvents."""
        self._wall = profile.wall_time
        self._legacy_updates = not profile.v2_update_oplog
        self._disambiguated = profile.disambiguated_paths
        self._ns_type = profile.ns_type
        self._raw_updates = spec.show_raw_update_description
        self._reserve_full_document = spec.full_document != "default"
        self._version = spec.token_version
        resume = spec.resume_token
        self._resume_key: tuple[int, int] | None = None
        self.resuming = False
        """Events up to the resume point take the version of the client's token, so they
        depend on where the stream started, not only on the oplog entry."""
        self._resume_version = self._version
        self._resume_txn = 0
        if resume is not None and resume.version != self._version:
            self._resume_key = (resume.cluster_time.time, resume.cluster_time.inc)
            self.resuming = True
            self._resume_version = resume.version
            self._resume_txn = resume.txn_op_index
        self._invalidating = {
            SCOPE_COLLECTION: frozenset({"drop", "rename", "dropDatabase"}),
            SCOPE_DATABASE: frozenset({"dropDatabase"}),
            SCOPE_CLUSTER: frozenset(),
        }[self._scope]
        self._ns_docs: dict[str, dict[str, Any]] = {}
        self._shape_key = "stream " + repr(self.shape)
        self._event_key = "crud " + repr(self.event_shape)

    # -- relevance -----------------------------------------------------------------------------
    def _visible(self, db: str, coll: str) -> bool:
        """Whether a namespace belongs to this stream (mongod's oplog namespace filter)."""
        if self._scope == SCOPE_COLLECTION:
            return db == self._db and coll == self._coll
        if self._scope == SCOPE_DATABASE:
            if db != self._db:
                return False
        elif db in _INTERNAL_DBS:
            return False
        if coll.startswith("$"):
            return False
        return self._show_system or not coll.startswith("system.")

    def _crud_visible(self, ns: str) -> bool:
        if self._scope == SCOPE_COLLECTION:
            return ns == self._ns
        return self._visible(*_split_ns(ns))

    def _db_visible(self, db: str) -> bool:
        if self._scope == SCOPE_CLUSTER:
            return db not in _INTERNAL_DBS
        return db == self._db

    # -- sharing -------------------------------------------------------------------------------------
    def share_key(self, entry: OplogEntry) -> str | None:
        """What, besides ``entry``, decides the events it gives this stream; None: it gives none.

        A CRUD event is the same for every stream that sees it, whatever the stream's
        scope: visibility is decided here, per stream, and streams of every scope with
        the same event options share it (:attr:`event_shape`). Commands and
        transactions (their events depend on the scope: invalidation, filtered
        operations) and view definitions share only with streams of the same
        :attr:`shape`. Not valid while :attr:`resuming`.
        """
        op = entry.op
        if op in ("i", "u", "d"):
            if self._view_events and entry.coll == _SYSTEM_VIEWS and self._db_visible(entry.db):
                return self._shape_key
            return self._event_key if self._crud_visible(entry.ns) else None
        if op == "n":  # a sharded collection's DDL (shardCollection & co.) or nothing
            return self._shape_key if entry.o2 and self._expanded else None
        return self._shape_key if op == "c" else None

    @property
    def event_shape(self) -> tuple[Any, ...]:
        """The options that decide a CRUD event's document (not whether a stream sees it)."""
        return (
            self._expanded, self._raw_updates, self._reserve_full_document, self._version,
            self._wall, self._legacy_updates, self._disambiguated, self._ns_type,
        )  # fmt: skip

    # -- entry point -----------------------------------------------------------------------------
    def events(self, entry: OplogEntry) -> list[RawEvent]:
        """The events ``entry`` produces for this stream (often none)."""
        op = entry.op
        if op in ("i", "u", "d"):
            event = self._write(entry, entry.ts, entry.wall, None, 0)
            return [] if event is None else [event]
        if op == "n":
            noop = self._sharding_event(entry) if entry.o2 and self._expanded else None
            return [] if noop is None else [noop]
        if op != "c":
            return []
        if "applyOps" in entry.o:
            return self._transaction(entry)
        event = self._command(entry, entry.ts, entry.wall, None, 0)
        return [] if event is None else [event]

    def _transaction(self, entry: OplogEntry) -> list[RawEvent]:
        txn: tuple[Int64, Any] | None = None
        if entry.lsid is not None and entry.txn_number is not None:
            txn = (Int64(entry.txn_number), entry.lsid)
        out: list[RawEvent] = []
        for index, inner in enumerate(entry.txn_ops or ()):
            event: RawEvent | None = None
            if inner.op in ("i", "u", "d"):
                event = self._write(inner, entry.ts, entry.wall, txn, index)
            elif inner.op == "c":
                event = self._command(inner, entry.ts, entry.wall, txn, index)
            if event is not None:
                out.append(event)
        return out

    def _write(
        self,
        entry: OplogEntry,
        ts: Timestamp,
        wall: datetime,
        txn: tuple[Int64, Any] | None,
        txn_op_index: int,
    ) -> RawEvent | None:
        """The event of a CRUD entry: a view definition change, a CRUD event, or none."""
        if self._view_events and entry.coll == _SYSTEM_VIEWS and self._db_visible(entry.db):
            return self._view_definition(entry, ts, wall, txn_op_index)
        if not self._crud_visible(entry.ns):
            return None
        return self._crud(entry, ts, wall, txn, txn_op_index)

    # -- building ----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[Any, ...]:
        """Everything besides the oplog entry that decides the events built from it
        (once not :attr:`resuming`)."""
        return (
            self._scope, self._db, self._coll, self._show_system, self._expanded,
            self._raw_updates, self._reserve_full_document, self._version, self._wall,
            self._legacy_updates, self._disambiguated, self._ns_type,
        )  # fmt: skip

    def _ns_doc(self, ns: str) -> dict[str, Any]:
        """The ``ns`` sub-document of ``db.coll``, one shared dict per namespace."""
        doc = self._ns_docs.get(ns)
        if doc is None:
            doc = self._ns_docs[ns] = _ns_doc(*_split_ns(ns))
        return doc

    def _event(
        self,
        ts: Timestamp,
        txn_op_index: int,
        ui: uuid.UUID | None,
        op_type: str,
        wall: datetime,
        txn: tuple[Int64, Any] | None,
        *,
        document_key: dict[str, Any] | None = None,
        op_desc: dict[str, Any] | None = None,
        entry: OplogEntry | None = None,
        to: dict[str, Any] | None = None,
        show_uuid: bool = True,
    ) -> RawEvent:
        """An event with the head of its document: ``[to], [txnNumber, lsid], _id,
        operationType, clusterTime, [collectionUUID], [wallTime]`` (the caller adds the rest)."""
        version = self._version
        if self._resume_key is not None:
            if (ts.time, ts.inc) > self._resume_key:
                self._resume_key = None  # every later event uses the default version
                self.resuming = False
            elif txn_op_index <= self._resume_txn:
                version = self._resume_version
        doc: dict[str, Any] = {}
        if to is not None:
            doc["to"] = to
        if txn is not None:
            doc["txnNumber"] = txn[0]
            doc["lsid"] = txn[1]
        doc["_id"] = encode_event_token(
            ts, version, txn_op_index, ui, op_type, document_key, op_desc
        )
        doc["operationType"] = op_type
        doc["clusterTime"] = ts
        if self._fields and show_uuid and ui is not None:
            doc["collectionUUID"] = ui
        if self._wall:
            doc["wallTime"] = wall
        return RawEvent(doc, ts, version, txn_op_index, ui, op_type, document_key, op_desc, entry)

    def _crud(
        self,
        entry: OplogEntry,
        ts: Timestamp,
        wall: datetime,
        txn: tuple[Int64, Any] | None,
        txn_op_index: int,
    ) -> RawEvent:
        o = entry.o
        update_desc: Any = None
        full_document: Any = None
        op = entry.op
        if op == "i":
            op_type = "insert"
            full_document = o
            document_key = entry.o2 if entry.o2 is not None else {"_id": o.get("_id")}
        elif op == "d":
            op_type = "delete"
            document_key = o
        elif "$v" in o:
            if o["$v"] != 2:
                raise CommandError(6741200, f"Unsupported or missing oplog version, $v: {o['$v']}")
            op_type = "update"
            document_key = entry.o2 or {}
            update_desc = o if self._raw_updates else self._update_description(o, entry)
        else:
            op_type = "replace"
            full_document = o
            document_key = entry.o2 if entry.o2 is not None else {"_id": o.get("_id")}
        event = self._event(
            ts, txn_op_index, entry.ui, op_type, wall, txn, document_key=document_key, entry=entry
        )
        doc = event.doc
        if full_document is not None:
            doc["fullDocument"] = full_document
        elif op_type == "update" and self._reserve_full_document:
            doc["fullDocument"] = None  # the post-image stage fills this slot in place
        doc["ns"] = self._ns_doc(entry.ns)
        doc["documentKey"] = document_key
        if update_desc is not None:
            doc["rawUpdateDescription" if self._raw_updates else "updateDescription"] = update_desc
        return event

    def _update_description(self, o: dict[str, Any], entry: OplogEntry) -> dict[str, Any]:
        try:
            return update_description(
                o["diff"],
                legacy=self._legacy_updates,
                show_expanded_events=self._fields,
                disambiguated_paths_supported=self._disambiguated,
                post_image=entry.post_image,
            )
        except ValueError as exc:  # e.g. a 4.x array resize logged without its post-image
            msg = f"cannot describe the update of {entry.ns} at {entry.ts}: {exc}"
            raise CommandError(1, msg) from exc

    def _command(
        self,
        entry: OplogEntry,
        ts: Timestamp,
        wall: datetime,
        txn: tuple[Int64, Any] | None,
        txn_op_index: int,
    ) -> RawEvent | None:
        o = entry.o
        db = entry.db
        name = next(iter(o), "")
        if name == "drop":
            coll = o["drop"]
            if not self._visible(db, coll):
                return None
            return self._ddl(entry, ts, wall, txn, txn_op_index, "drop", _ns_doc(db, coll))
        if name == "renameCollection":
            return self._rename(entry, ts, wall, txn, txn_op_index)
        if name == "dropDatabase":
            if not self._db_visible(db):
                return None
            return self._ddl(entry, ts, wall, txn, txn_op_index, "dropDatabase", {"db": db})
        if name not in _EXPANDED_COMMANDS or not self._expanded:
            return None
        coll = o[name]
        if not isinstance(coll, str) or not self._visible(db, coll):
            return None
        if name == "create":
            extra = {"nsType": "collection"} if self._ns_type else None
            return self._ddl(
                entry, ts, wall, txn, txn_op_index, "create", _ns_doc(db, coll),
                op_desc=_without(o, "create"), extra=extra,
            )  # fmt: skip
        if name == "createIndexes":
            op_desc = {"indexes": [_without(o, "createIndexes")]}
            op_type = "createIndexes"
        elif name == "commitIndexBuild":
            op_desc = {"indexes": o.get("indexes", [])}
            op_type = "createIndexes"
        elif name == "dropIndexes":
            op_desc = {"indexes": [_without(entry.o2 or {}, "dropIndexes")]}
            op_type = "dropIndexes"
        else:
            op_desc = _without(o, "collMod")
            op_type = "modify"
            old = entry.o2 or {}
            state: dict[str, Any] = {"collectionOptions": old.get("collectionOptions_old")}
            if "indexOptions_old" in old:
                state["indexOptions"] = old["indexOptions_old"]
            return self._ddl(
                entry, ts, wall, txn, txn_op_index, op_type, _ns_doc(db, coll),
                op_desc=op_desc, extra={"stateBeforeChange": state},
            )  # fmt: skip
        return self._ddl(
            entry, ts, wall, txn, txn_op_index, op_type, _ns_doc(db, coll), op_desc=op_desc
        )

    def _ddl(
        self,
        entry: OplogEntry,
        ts: Timestamp,
        wall: datetime,
        txn: tuple[Int64, Any] | None,
        txn_op_index: int,
        op_type: str,
        ns: dict[str, Any],
        *,
        op_desc: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        to: dict[str, Any] | None = None,
    ) -> RawEvent:
        """A command event: ``..., ns, [operationDescription], [stateBeforeChange], [nsType]``."""
        event = self._event(ts, txn_op_index, entry.ui, op_type, wall, txn, op_desc=op_desc, to=to)
        doc = event.doc
        doc["ns"] = ns
        if self._fields and op_desc is not None:
            doc["operationDescription"] = op_desc
        if extra:
            doc.update(extra)
        event.invalidates = op_type in self._invalidating
        return event

    def _sharding_event(self, entry: OplogEntry) -> RawEvent | None:
        """``shardCollection`` & co.: the operation description is ``o2`` without its name."""
        o2 = entry.o2 or {}
        name = next(iter(o2), "")
        if name not in _SHARDING_EVENTS:
            return None
        db, coll = _split_ns(str(o2[name]))
        if not self._visible(db, coll):
            return None
        return self._ddl(
            entry, entry.ts, entry.wall, None, 0, name, _ns_doc(db, coll),
            op_desc=_without(o2, name),
        )  # fmt: skip

    def _rename(
        self,
        entry: OplogEntry,
        ts: Timestamp,
        wall: datetime,
        txn: tuple[Int64, Any] | None,
        txn_op_index: int,
    ) -> RawEvent | None:
        o = entry.o
        src_db, src_coll = _split_ns(o["renameCollection"])
        dst_db, dst_coll = _split_ns(o["to"])
        if not (self._visible(src_db, src_coll) or self._visible(dst_db, dst_coll)):
            return None
        to = _ns_doc(dst_db, dst_coll)
        op_desc = {k: (to if k == "to" else v) for k, v in o.items() if k not in _RENAME_DROPPED}
        return self._ddl(
            entry, ts, wall, txn, txn_op_index, "rename", _ns_doc(src_db, src_coll),
            op_desc=op_desc, to=to,
        )  # fmt: skip

    def _view_definition(
        self, entry: OplogEntry, ts: Timestamp, wall: datetime, txn_op_index: int
    ) -> RawEvent:
        """A view ``create``/``modify``/``drop`` from its ``system.views`` document's write.

        ``_id, operationType, clusterTime, wallTime, ns, [operationDescription],
        [nsType]``: no ``collectionUUID`` (views have none) and no session
        fields; the token carries the ``system.views`` UUID.
        """
        o = entry.o
        view_db, _, view = str(o.get("_id", "")).partition(".")
        op_type = _VIEW_EVENTS[entry.op]
        op_desc = None if entry.op == "d" else _without(o, "_id")
        event = self._event(
            ts, txn_op_index, entry.ui, op_type, wall, None, op_desc=op_desc, show_uuid=False
        )
        doc = event.doc
        doc["ns"] = _ns_doc(view_db, view)
        if op_desc is not None:
            doc["operationDescription"] = op_desc
        if op_type == "create" and self._ns_type:
            view_on = str(o.get("viewOn", ""))
            doc["nsType"] = "timeseries" if view_on.startswith(_BUCKETS_PREFIX) else "view"
        return event

    def invalidate(self, event: RawEvent) -> RawEvent:
        """The ``invalidate`` that follows ``event``: its token with ``fromInvalidate``."""
        invalidate = dataclasses.replace(
            event, doc={}, entry=None, invalidates=False, is_invalidate=True
        )
        doc = invalidate.doc
        doc["_id"] = encode_token(invalidate.token)
        doc["operationType"] = "invalidate"
        doc["clusterTime"] = event.cluster_time
        if self._wall:
            doc["wallTime"] = event.doc["wallTime"]
        return invalidate
