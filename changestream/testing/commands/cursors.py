"""``getMore`` and ``killCursors`` for every cursor kind (``getmore_cmd.cpp``).

getMore runs without ``deployment.lock``: a change-stream cursor waits for
new oplog entries and takes the lock itself when it needs data. Validation
errors leave the cursor alone; any error after the cursor was checked out
(including ``failGetMoreAfterCursorCheckout``) deletes it, as mongod does.
"""

from __future__ import annotations

from typing import Any

from bson.int64 import Int64

from ..core.context import CommandContext
from ..core.cursors import cursor_reply
from ..core.errors import CommandError
from ..core.failpoints import CommandTarget
from .spec import command


def _bson_type(value: Any) -> str:
    names = {
        bool: "bool",
        int: "int",
        Int64: "long",
        float: "double",
        str: "string",
        dict: "object",
        list: "array",
    }
    return names.get(type(value), type(value).__name__)


def _session_bytes(lsid: dict[str, Any] | None) -> bytes | None:
    """``lsid.id`` as raw bytes (a Binary subtype 4, or a UUID)."""
    if lsid is None:
        return None
    sid = lsid.get("id")
    raw = getattr(sid, "bytes", sid)
    return bytes(raw) if isinstance(raw, (bytes, bytearray)) else None


@command("getMore", locks=False, any_member=True)
def get_more(ctx: CommandContext) -> dict[str, Any]:
    body = ctx.body
    cid = ctx.target
    if not isinstance(cid, Int64):
        raise CommandError(
            14,
            f"BSON field 'getMore.getMore' is the wrong type '{_bson_type(cid)}', expected type 'long'",
        )
    coll = body.get("collection")
    if not isinstance(coll, str):
        raise CommandError(
            14,
            f"BSON field 'getMore.collection' is the wrong type '{_bson_type(coll)}', expected type 'string'",
        )
    batch_size = body.get("batchSize")
    if batch_size is not None:
        if not isinstance(batch_size, (int, float)) or isinstance(batch_size, bool):
            raise CommandError(
                14,
                f"BSON field 'getMore.batchSize' is the wrong type '{_bson_type(batch_size)}', expected type 'long'",
            )
        if batch_size <= 0:
            raise CommandError(
                2, f"Batch size for getMore must be positive, but received: {int(batch_size)}"
            )
        batch_size = int(batch_size)
    ns = f"{ctx.db}.{coll}"
    deployment, member = ctx.deployment, ctx.member
    cursors = deployment.cursors
    cursor = cursors.checkout(int(cid), member.name)
    try:
        if cursor.ns != ns:
            raise CommandError(
                13,
                f"Requested getMore on namespace '{ns}', but cursor belongs to a different namespace {cursor.ns}",
            )
        _check_session(int(cid), cursor.lsid_id, _session_bytes(ctx.lsid))
        if ctx.max_time_ms and not cursor.tailable_await:
            raise CommandError(
                2, "cannot set maxTimeMS on getMore command for a non-awaitData cursor"
            )
    except CommandError:
        cursors.checkin(int(cid))
        raise
    ctx.is_change_stream = ctx.change_stream_cursor = getattr(cursor, "is_change_stream", False)
    try:
        member.failpoints.fail_get_more_after_checkout(
            CommandTarget(("getMore",), ns, ctx.connection.app_name)
        )
        # a cursor opened with maxTimeMS keeps its leftover time limit (getmore_cmd.cpp)
        member.failpoints.check_max_time(
            bool(ctx.max_time_ms or getattr(cursor, "max_time_ms", None))
        )
        batch = cursor.get_more(ctx, batch_size, ctx.max_time_ms)
    except BaseException:
        cursors.checkin(int(cid), drop=True)
        raise
    cursors.checkin(int(cid), drop=batch.exhausted)
    return cursor_reply(int(cid), cursor.ns, batch, first=False)


def _check_session(cid: int, cursor_session: bytes | None, request_session: bytes | None) -> None:
    """A cursor is continued in the session it was opened in, or in none (``validateLSID``)."""
    if cursor_session is None:
        if request_session is not None:
            raise CommandError(
                50736,
                f"Cannot run getMore on cursor {cid}, which was not created in a session, in "
                f"session {_uuid_text(request_session)}",
            )
        return
    shown = _uuid_text(cursor_session)
    if request_session is None:
        raise CommandError(
            50737,
            f"Cannot run getMore on cursor {cid}, which was created in session {shown}, without an lsid",
        )
    if bytes(cursor_session) != request_session:
        raise CommandError(
            50738,
            f"Cannot run getMore on cursor {cid}, which was created in session {shown}, "
            f"in session {_uuid_text(request_session)}",
        )


def _uuid_text(raw: bytes) -> str:
    h = bytes(raw).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(h) == 32 else h


@command("killCursors", any_member=True, locks=False)
def kill_cursors(ctx: CommandContext) -> dict[str, Any]:
    ids = ctx.body.get("cursors")
    if not isinstance(ids, list):
        raise CommandError(
            40414, "BSON field 'killCursors.cursors' is missing but a required field"
        )
    if not all(isinstance(i, Int64) for i in ids):
        raise CommandError(
            14, "BSON field 'killCursors.cursors' contains a value that is not of type 'long'"
        )
    cursors, member = ctx.deployment.cursors, ctx.member
    killed: list[Int64] = []
    not_found: list[Int64] = []
    for cid in ids:
        (killed if cursors.kill(int(cid), member.name) else not_found).append(Int64(cid))
    if killed:
        ctx.deployment.oplog.notify()
    return {
        "cursorsKilled": killed,
        "cursorsNotFound": not_found,
        "cursorsAlive": [],
        "cursorsUnknown": [],
    }
