"""The change-stream cursor: reads the oplog, applies the stream's stages, hands out batches.

Mirrors the stage chain mongod builds for ``$changeStream`` (oplog scan,
transaction unwind, transform, check-invalidate, resume check, pre/post images,
user stages, split) and the batching of ``run_aggregate.cpp``/``getmore_cmd.cpp``
with ``plan_executor_pipeline.cpp``'s postBatchResumeToken rules. A getMore waits
for new oplog entries without holding ``deployment.lock`` and takes the lock only
to read the catalog (``updateLookup``).

Serving events is the simulator's hot path: each event is encoded once
(:class:`EncodedEvent`: its size is its length and the reply copies its bytes)
and the events an oplog entry makes are shared with the other streams that see
them through the deployment's :class:`EventCache` (a CRUD event by streams of
every scope, see :meth:`EventTransformer.share_key`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import bson
from bson.timestamp import Timestamp

from ..core.codec import ENCODE_OPTIONS
from ..core.context import CLIENT_CHECK_SECONDS
from ..core.cursors import BatchBytes, CursorBatch
from ..core.errors import CommandError
from ..core.event_cache import EventCache
from ..core.oplog import OplogEntry
from .event_cache import EncodedEvent, encode_event
from .pipeline import MISSING, value_to_string
from .resume_token import (
    ResumeTokenData,
    compare_tokens,
    encode_token,
    high_water_mark,
    is_high_water_mark,
)
from .stage import ChangeStreamSpec
from .transform import EventTransformer, RawEvent

if TYPE_CHECKING:
    from ..core.context import CommandContext, ConnectionInfo
    from ..storage.deployment import Deployment

MAX_EVENT_BYTES: Final = 16 * 1024 * 1024 + 16 * 1024
"""Larger events fail with BSONObjectTooLarge (``BSONObjMaxInternalSize``)."""
SPLIT_THRESHOLD: Final = MAX_EVENT_BYTES - 8 * 1024
"""``$changeStreamSplitLargeEvent`` splits events larger than this (``kBSONObjMaxChangeEventSize``)."""
DEFAULT_AWAIT_MS: Final = 1000
_READ_CHUNK: Final = 256

_CHECK_NEXT: Final = 0
_FOUND: Final = 1
_NEEDS_SPLIT: Final = 2
_SURPASSED: Final = 3

_Out = tuple[dict[str, Any], int, Timestamp]
"""An output document, its BSON size and the clusterTime of its token."""


def bson_size(doc: dict[str, Any]) -> int:
    return len(bson.encode(doc, codec_options=ENCODE_OPTIONS))


def _element_size(name: str, value: Any) -> int:
    """Size of ``name: value`` inside a BSON document (mongod's ``BSONElement::size``)."""
    return bson_size({name: value}) - 5


def _bson_string(value: Any) -> str:
    """``BSONObj::toString`` formatting (spaces inside braces), for mongod's messages."""
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{k}: {_bson_string(v)}" for k, v in value.items()) + " }"
    return value_to_string(value)


def _resume_status(event: ResumeTokenData, client: ResumeTokenData) -> int:
    """``compareAgainstClientResumeToken``: where ``event`` stands against the client's token."""
    if client.fragment_num is not None and event.fragment_num is None:
        unsplit = dataclasses.replace(client, fragment_num=None)
        if compare_tokens(event, unsplit) == 0:
            return _NEEDS_SPLIT
    order = compare_tokens(event, client)
    return _FOUND if order == 0 else _CHECK_NEXT if order < 0 else _SURPASSED


def _with_context(err: CommandError, context: str) -> CommandError:
    return CommandError(
        err.code,
        f"{context} :: caused by :: {err.errmsg}",
        code_name=err.code_name,
        labels=err.labels,
        extra=err.extra,
    )


class _Closed(Exception):
    """The stream was invalidated: the batch ends and the cursor is exhausted."""


class ChangeStreamCursor:
    """A tailable, awaitData cursor over the oplog for one change stream."""

    is_change_stream = True
    tailable_await = True

    def __init__(
        self,
        deployment: Deployment,
        spec: ChangeStreamSpec,
        *,
        lsid_id: bytes | None = None,
        from_router: bool = False,
    ) -> None:
        self.ns = spec.ns
        self._from_router = from_router
        """Opened by mongos: resuming only checks resumability here (the token's event may
        be on another shard) and passes the token's event on for mongos to check."""
        self.lsid_id = lsid_id
        self._deployment = deployment
        self._oplog = deployment.oplog
        self._profile = deployment.profile
        self._split_events = spec.split_large_events
        self._transform = EventTransformer(spec, deployment.profile)
        self._pipeline = spec.pipeline if spec.pipeline else None
        self._before = spec.full_document_before_change
        self._after = spec.full_document
        self._images = self._before != "off" or self._after != "default"
        self._version = spec.token_version
        self._cache: EventCache = deployment.event_cache
        self._release = weakref.finalize(self, self._cache.acquire())
        """Tells the cache this stream is gone (on close, or if it is dropped unclosed)."""
        self._release.atexit = False  # no idle timer to start while the interpreter exits
        token = spec.resume_token
        self._client_token: ResumeTokenData | None = None
        self._start_after_invalidate: ResumeTokenData | None = None
        self._token_found = False
        if token is not None and spec.resume_token_doc is not None:
            self._start = token.cluster_time
            self._pbrt: dict[str, Any] = dict(spec.resume_token_doc)
            if not is_high_water_mark(token):
                self._client_token = token
            if spec.start_after and token.from_invalidate:
                self._start_after_invalidate = token
        else:
            if spec.start_at_operation_time is not None:
                self._start = spec.start_at_operation_time
            else:  # one tick after the latest write (getStartTimeForNewStream)
                last = deployment.last_applied()
                self._start = Timestamp(last.time, last.inc + 1)
            self._pbrt = encode_token(high_water_mark(self._start, self._version))
        self._pbrt_ts = self._start
        self._before_start = True
        """Entries may still precede ``_start`` (a start time in the future)."""
        self._seq: int | None = None
        """Seq of the next oplog entry to fetch (None until the first scan)."""
        self._chunk: list[OplogEntry] = []
        self._chunk_seq = 0
        """Seq of ``_chunk[0]``."""
        self._chunk_pos = 0
        self._latest_ts: Timestamp | None = None
        self._out: deque[_Out] = deque()
        self._invalidated_by: dict[str, Any] | None = None
        self._closed = False
        self._metrics = deployment.cs_metrics
        self._examined = 0
        """Oplog entries read since the last batch (``cursor.docsExamined``)."""
        self._read_bytes = 0

    # -- the ServerCursor protocol ------------------------------------------------------------
    def first_batch(self, batch_size: int) -> CursorBatch:
        """The aggregate's batch: what is available now, never waiting."""
        if batch_size == 0:
            return CursorBatch([], post_batch_resume_token=self._pbrt)
        try:
            return self._batch(batch_size, None, None)
        except CommandError as err:
            context = (
                f"Executor error during aggregate command on namespace: {self.ns}"
                if self._profile.major_minor >= (5, 0)
                else "PlanExecutor error during aggregation"
            )
            raise _with_context(err, context) from err

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        """One getMore: wait up to ``max_time_ms`` (default 1 s) for a first event."""
        ctx.is_change_stream = True
        wait_ms = DEFAULT_AWAIT_MS if max_time_ms is None else max_time_ms
        deadline = time.monotonic() + wait_ms / 1000
        try:
            return self._batch(batch_size or None, deadline, ctx.connection)
        except CommandError as err:
            raise _with_context(err, "Executor error during getMore") from err

    def close(self) -> None:
        """Stop (killCursors or exhaustion); wakes a getMore waiting on the oplog."""
        self._closed = True
        self._release()
        self._oplog.notify()

    # -- batching -----------------------------------------------------------------------------
    def _batch(
        self, limit: int | None, deadline: float | None, conn: ConnectionInfo | None
    ) -> CursorBatch:
        batch = self._fill(limit, deadline, conn)
        self._metrics.batch_returned(
            len(batch.documents),
            sum(len(getattr(doc, "raw", b"")) for doc in batch.documents),
            self._examined,
            self._read_bytes,
        )
        self._examined = self._read_bytes = 0
        return batch

    def _fill(
        self, limit: int | None, deadline: float | None, conn: ConnectionInfo | None
    ) -> CursorBatch:
        docs: list[dict[str, Any]] = []
        size = BatchBytes()
        eof = False
        last: _Out | None = None
        try:
            while limit is None or len(docs) < limit:
                item = self._next()
                if item is None:
                    if docs or deadline is None or not self._wait(deadline, conn):
                        eof = True
                        break
                    continue
                doc, doc_size, _ = item
                if not size.fits(doc_size):
                    self._out.appendleft(item)
                    break
                docs.append(doc)
                size.add(doc_size)
                last = item
        except _Closed:
            assert self._invalidated_by is not None
            self._pbrt = self._invalidated_by
            return CursorBatch(
                docs,
                exhausted=True,
                post_batch_resume_token=self._pbrt,
                invalidated=self._profile.invalidated_flag,
            )
        if last is not None:
            self._pbrt = last[0]["_id"]
            self._pbrt_ts = last[2]
        latest = self._latest_ts
        if eof and latest is not None and latest > self._pbrt_ts:
            self._pbrt = encode_token(high_water_mark(latest, self._version))
            self._pbrt_ts = latest
        return CursorBatch(docs, post_batch_resume_token=self._pbrt)

    def _wait(self, deadline: float, conn: ConnectionInfo | None) -> bool:
        """Block until the oplog grows or ``deadline``; False when time is up.

        Checks ``conn`` while it waits: a getMore whose client left ends
        (ClientDisconnected) as mongod kills it, instead of waiting out its maxTimeMS.
        """
        remaining = deadline - time.monotonic()
        if remaining > 0 and not self._closed:
            assert self._seq is not None
            left = remaining
            while not self._oplog.wait_for(self._seq, min(left, CLIENT_CHECK_SECONDS)):
                if self._closed:
                    break
                if conn is not None:
                    conn.check_connected()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
        if self._closed:
            raise CommandError(237, "operation was interrupted")
        return remaining > 0

    def _next(self) -> _Out | None:
        """The next output document, or None when the oplog has nothing more now."""
        out = self._out
        while not out:
            if self._invalidated_by is not None:
                raise _Closed
            pos = self._chunk_pos
            if pos == len(self._chunk):
                if not self._read_chunk():
                    return None
                pos = 0
            entry = self._chunk[pos]
            self._chunk_pos = pos + 1
            if self._before_start:
                if entry.ts < self._start:
                    continue  # appended after the scan opened, still before a future start time
                self._before_start = False
            self._latest_ts = entry.ts
            self._process(entry, self._chunk_seq + pos)
        return out.popleft()

    # -- the oplog scan -----------------------------------------------------------------------
    def _read_chunk(self) -> bool:
        """Fetch the next entries into ``_chunk``; False when the oplog has nothing more now."""
        if self._seq is None:
            self._seq = self._open_scan()
        try:
            chunk = self._oplog.read(self._seq, _READ_CHUNK)
        except LookupError:
            raise self._history_lost() from None
        if not chunk:
            return False
        self._chunk, self._chunk_seq, self._chunk_pos = chunk, self._seq, 0
        self._seq += len(chunk)
        return True

    def _open_scan(self) -> int:
        """Where the scan starts; ChangeStreamHistoryLost if the oplog no longer reaches back."""
        oplog = self._oplog
        first_seq = oplog.first_seq
        try:
            first = oplog.read(first_seq, 1)
        except LookupError:
            raise self._history_lost() from None
        if first and first[0].ts > self._start and not _is_initiating(first[0]):
            raise self._history_lost()
        return oplog.seq_at_or_after(self._start)

    @staticmethod
    def _history_lost() -> CommandError:
        return CommandError(
            286,
            "Resume of change stream was not possible, as the resume point may no longer be in "
            "the oplog.",
        )

    # -- the stage chain ----------------------------------------------------------------------
    def _process(self, entry: OplogEntry, seq: int) -> None:
        """Fill ``_out`` with what ``entry`` (at ``seq``) gives; its events from the cache."""
        self._examined += 1
        self._read_bytes += entry.size
        transform = self._transform
        if transform.resuming:  # the events take the version of the client's token
            events: Sequence[RawEvent] = transform.events(entry)
        else:
            key = transform.share_key(entry)
            if key is None:
                return
            cached = self._cache.get(seq, key)
            if cached is None:
                events = transform.events(entry)
                self._cache.put(seq, key, events, entry.size)
            else:
                events = cached
        for raw in events:
            invalidate = None
            if raw.invalidates:
                invalidate = transform.invalidate(raw)
                after = self._start_after_invalidate
                if after is not None and invalidate.token != after:
                    invalidate = None  # startAfter: this stream was already invalidated once
            self._start_after_invalidate = None
            self._emit(raw)
            if invalidate is not None:
                self._emit(invalidate)

    def _emit(self, raw: RawEvent) -> None:
        skip = 0 if self._client_token is None else self._check_resume(raw)
        if skip is None:
            return
        doc = raw.doc
        if raw.is_invalidate:
            self._invalidated_by = doc["_id"]
        if self._images and raw.entry is not None:
            doc = self._add_images(raw)
        out = doc if self._pipeline is None else self._pipeline.apply(doc)
        if out is None:
            return
        if type(out) is EncodedEvent:  # encoded by an earlier stream (or a stage passed it on)
            event = out
        else:
            event = encode_event(out)
            if out is raw.doc:
                raw.doc = event  # the next stream of this shape copies the bytes
        size = len(event.raw)
        ts = raw.cluster_time
        if size > SPLIT_THRESHOLD and self._split_events:
            fragments = self._split(out, raw.token, skip)
            self._metrics.add("largeEventsSplit")  # once split (a failed split counts nothing)
            self._out.extend((fragment, fragment_size, ts) for fragment, fragment_size in fragments)
            return
        if skip:
            raise CommandError(
                280,
                "Attempted to resume from a split event fragment, but the event in the resumed "
                "stream was not large enough to be split",
            )
        if out is not doc:
            _check_id(out, doc["_id"])
        if size > MAX_EVENT_BYTES:
            self._metrics.add("largeEventsFailed")
            first = next(iter(out.items()), None)
            shown = "EOO" if first is None else f"{first[0]}: {_bson_string(first[1])}"
            raise CommandError(
                10334,
                f"BSONObj size: {size} (0x{size:X}) is invalid. Size must be between 0 and "
                f"{MAX_EVENT_BYTES}(16MB) First element: {shown}",
            )
        self._out.append((event, size, ts))

    def _check_resume(self, raw: RawEvent) -> int | None:
        """Swallow events up to the client's token (None); else how many fragments to skip."""
        client = self._client_token
        if client is None:
            return 0
        status = _resume_status(raw.token, client)
        if status == _CHECK_NEXT:
            return None
        if status == _FOUND:
            self._token_found = True
            if self._from_router:
                self._out.append((raw.doc, bson_size(raw.doc), raw.cluster_time))
            return None
        self._client_token = None
        if status == _NEEDS_SPLIT:
            assert client.fragment_num is not None
            # for mongos, the token's own fragment too: mongos checks the token is present
            return client.fragment_num + (0 if self._from_router else 1)
        if not self._token_found and not self._from_router:
            raise CommandError(
                280,
                "cannot resume stream; the resume token was not found. "
                + value_to_string(raw.doc["_id"]),
            )
        return 0

    # -- images -----------------------------------------------------------------------------------
    def _add_images(self, raw: RawEvent) -> dict[str, Any]:
        """fullDocumentBeforeChange (pre-image stage), then fullDocument (post-image stage).

        Returns a new event: ``raw.doc`` may be shared with other streams.
        """
        doc = dict(raw.doc)
        op_type = doc["operationType"]
        entry = raw.entry
        assert entry is not None
        if self._before != "off" and op_type in ("update", "replace", "delete"):
            pre = entry.pre_image
            if pre is None and self._before == "required":
                raise _image_missing(doc, "a pre-image for all update, delete and replace", "pre")
            doc["fullDocumentBeforeChange"] = pre
        if self._after != "default" and op_type == "update":
            if self._after == "updateLookup":
                post = self._lookup(doc, raw.collection_uuid)
            else:
                post = entry.post_image
                if post is None and self._after == "required":
                    raise _image_missing(doc, "a post-image for all update", "post")
            doc["fullDocument"] = post
        return doc

    def _lookup(
        self, doc: dict[str, Any], collection_uuid: uuid.UUID | None
    ) -> dict[str, Any] | None:
        """updateLookup: the document's current version, found by collection UUID and _id."""
        ns = doc["ns"]
        router_lookup = self._deployment.document_lookup
        if router_lookup is not None:
            return router_lookup(ns["db"], ns["coll"], collection_uuid, doc["documentKey"])
        with self._deployment.lock:
            catalog = self._deployment.catalog
            state = catalog.get(ns["db"], ns["coll"])
            if state is None or state.uuid != collection_uuid:
                renamed = (
                    catalog.get(db, name)
                    for db in catalog.database_names()
                    for name in catalog.collection_names(db)
                )
                state = next(
                    (s for s in renamed if s is not None and s.uuid == collection_uuid), None
                )
            if state is None or state.is_view:
                return None
            return state.find_by_id(doc["documentKey"].get("_id"))

    # -- split events --------------------------------------------------------------------------------
    def _split(
        self, event: dict[str, Any], token: ResumeTokenData, skip: int
    ) -> list[tuple[dict[str, Any], int]]:
        """``splitChangeEvent``: fields by (size, name), packed greedily into fragments."""
        max_size = SPLIT_THRESHOLD - bson_size(encode_token(token))
        fields = sorted(
            (_element_size(name, value), name, value)
            for name, value in event.items()
            if name != "_id"
        )
        if not fields:
            raise CommandError(
                7182502, "Cannot split an empty event or an event containing solely '_id' field"
            )
        fragments: list[dict[str, Any]] = []
        i = 0
        while i < len(fields):
            fragment_id = encode_token(dataclasses.replace(token, fragment_num=len(fragments)))
            fragment: dict[str, Any] = {
                "_id": fragment_id,
                "splitEvent": {"fragment": len(fragments) + 1, "of": 0},
            }
            size = bson_size({**fragment, "$sortKey": [fragment_id]})
            while True:
                field_size, name, value = fields[i]
                fragment[name] = value
                size += field_size
                i += 1
                if i == len(fields) or size + fields[i][0] > max_size:
                    break
            if size > max_size:
                raise CommandError(
                    7182500,
                    f"Splitting change event failed: fragment size {size} is greater than maximum "
                    f"allowed fragment size {max_size}",
                )
            fragments.append(fragment)
        # mongod drops the fragments before the token's (splitChangeEvent's
        # skipFirstFragments) and fails only when none is left; the token's own fragment goes
        # on to EnsureResumeTokenPresent, which swallows it (``skip`` counts it here on a
        # replica set; a shard passes it on for mongos to swallow). So the token of a last
        # fragment is valid: the stream resumes at the next event.
        before = skip if self._from_router else skip - 1
        if skip and before >= len(fragments):
            raise CommandError(
                280,
                "Attempted to resume from a split event, but the resumed stream produced a "
                "different split. Ensure that the pipeline used to resume is the same as the "
                "original",
            )
        out = []
        for fragment in fragments[skip:]:
            fragment["splitEvent"]["of"] = len(fragments)
            out.append((fragment, bson_size(fragment)))
        return out


def _is_initiating(entry: OplogEntry) -> bool:
    """The no-op every replica set's oplog starts with: the oplog is complete from there."""
    return entry.op == "n" and entry.o.get("msg") == "initiating set"


def _image_missing(doc: dict[str, Any], what: str, kind: str) -> CommandError:
    summary: dict[str, Any] = {
        "operationType": doc["operationType"],
        "ns": doc["ns"],
        "clusterTime": doc["clusterTime"],
    }
    if "txnNumber" in doc:
        summary["txnNumber"] = doc["txnNumber"]
    return CommandError(
        47,
        f"Change stream was configured to require {what} events, but the {kind}-image was not "
        f"found for event: {value_to_string(summary)}",
    )


def _check_id(out: dict[str, Any], expected: dict[str, Any]) -> None:
    """mongod refuses events whose ``_id`` (the resume token) a user stage changed (280)."""
    found = out.get("_id", MISSING)
    if found is expected:
        return
    if isinstance(found, dict) and list(found.items()) == list(expected.items()):
        return
    shown = "{}" if found is MISSING else _bson_string({"_id": found})
    raise CommandError(
        280,
        "Encountered an event whose _id field, which contains the resume token, was modified by "
        "the pipeline. Modifying the _id field of an event makes it impossible to resume the "
        "stream from that point. Only transformations that retain the unmodified _id field are "
        f"allowed. Expected: {_bson_string({'_id': expected})} but found: {shown}",
    )
