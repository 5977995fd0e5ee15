"""How fast the simulator serves change events to one client (a plain script, not a test).

    .venv/bin/python tests/testing/perf_serve.py cursor [--events N] [--batch-size B] [--profile]
    .venv/bin/python tests/testing/perf_serve.py wire [--events N] [--batch-size B] [--runs R]

``cursor``: in this process, N small inserts go through the ``insert`` command
handler, then a change stream opened through the ``aggregate`` handler
(``startAtOperationTime`` before the inserts) is drained with
``cursor.get_more`` and every batch is encoded as the reply the server sends
(``cursor_reply`` + ``wire.encode_document``). Two streams read the same
range: the first builds the events, the second may reuse them. ``--profile``
prints the top functions of the first read under cProfile.

``wire``: the simulator runs in a child process (``python -m
changestream.testing serve``); this process inserts N documents with PyMongo
and then drains them R times with a raw ``aggregate`` + ``getMore`` loop
(``Database.command``, replies kept as ``RawBSONDocument`` so the client's own
decoding cost stays small). Each run is a new stream over the same range.

Documents are ``{_id: ObjectId, i: n, s: <20 chars>}``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bson.codec_options import CodecOptions
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from changestream.testing.commands import REGISTRY, CommandContext, ConnectionInfo, load_all  # noqa: E402
from changestream.testing.cursors import cursor_reply  # noqa: E402
from changestream.testing.deployment import Deployment  # noqa: E402
from changestream.testing.versions import get_profile  # noqa: E402
from changestream.testing.wire import encode_document  # noqa: E402

PAYLOAD = "abcdefghijklmnopqrst"
INSERT_CHUNK = 10_000


def _docs(start: int, count: int) -> list[dict[str, Any]]:
    return [{"_id": ObjectId(), "i": start + k, "s": PAYLOAD} for k in range(count)]


# -- cursor level --------------------------------------------------------------------------------
def _ctx(d: Deployment, body: dict[str, Any]) -> CommandContext:
    return CommandContext(
        deployment=d,
        member=d.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db="db",
        name=next(iter(body)),
        body=body,
    )


def _run(d: Deployment, body: dict[str, Any]) -> dict[str, Any]:
    with d.lock:
        return REGISTRY[next(iter(body))].handler(_ctx(d, body))


def _drain(d: Deployment, start: Timestamp, events: int, batch_size: int) -> tuple[int, int]:
    """Open a stream at ``start`` and read ``events`` events; (events, reply bytes)."""
    reply = _run(
        d,
        {
            "aggregate": "c",
            "pipeline": [{"$changeStream": {"startAtOperationTime": start}}],
            "cursor": {"batchSize": 0},
        },
    )["cursor"]
    cid = int(reply["id"])
    cursor = d.cursors.checkout(cid, d.members[0].name)
    got = size = 0
    ctx = _ctx(d, {"getMore": Int64(cid), "collection": "c"})
    while got < events:
        batch = cursor.get_more(ctx, batch_size, 0)
        size += len(encode_document(cursor_reply(cid, cursor.ns, batch, first=False)))
        got += len(batch.documents)
        if not batch.documents:
            raise RuntimeError(f"the stream ended after {got} of {events} events")
    d.cursors.checkin(cid, drop=True)
    return got, size


def cursor_level(args: argparse.Namespace) -> None:
    load_all()
    d = Deployment(get_profile(args.version))
    _run(d, {"insert": "marker", "documents": [{}]})
    start = d.last_applied()
    for offset in range(0, args.events, INSERT_CHUNK):
        count = min(INSERT_CHUNK, args.events - offset)
        _run(d, {"insert": "c", "documents": _docs(offset, count)})
    for label in ("first read", "second read (same range)"):
        profile = cProfile.Profile() if args.profile and label == "first read" else None
        began = time.perf_counter()
        if profile is not None:
            profile.enable()
        got, size = _drain(d, start, args.events, args.batch_size)
        if profile is not None:
            profile.disable()
        elapsed = time.perf_counter() - began
        print(
            f"cursor {label}: {got:,} events in {elapsed:.3f} s = {got / elapsed:,.0f} events/s "
            f"({size / got:.0f} reply bytes/event)"
        )
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


# -- over the wire -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wire_level(args: argparse.Namespace) -> None:
    from pymongo import MongoClient

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "changestream.testing", "serve", "--port", str(port),
         "--version", args.version],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        uri = server.stdout.readline().strip()
        raw: CodecOptions[RawBSONDocument] = CodecOptions(document_class=RawBSONDocument)
        with MongoClient(uri) as client:
            db = client["perf"]
            with client.start_session() as session:
                db["marker"].insert_one({}, session=session)
                start = session.operation_time
            assert isinstance(start, Timestamp)
            for offset in range(0, args.events, INSERT_CHUNK):
                db["c"].insert_many(_docs(offset, min(INSERT_CHUNK, args.events - offset)))
            for run in range(1, args.runs + 1):
                began = time.perf_counter()
                reply = db.command(
                    {
                        "aggregate": "c",
                        "pipeline": [{"$changeStream": {"startAtOperationTime": start}}],
                        "cursor": {"batchSize": 0},
                    },
                    codec_options=raw,
                )
                cid = reply["cursor"]["id"]
                got = 0
                while got < args.events:
                    batch = db.command(
                        {"getMore": cid, "collection": "c", "batchSize": args.batch_size},
                        codec_options=raw,
                    )["cursor"]["nextBatch"]
                    got += len(batch)
                    if not batch:
                        raise RuntimeError(f"the stream ended after {got} events")
                elapsed = time.perf_counter() - began
                db.command({"killCursors": "c", "cursors": [cid]})
                print(
                    f"wire run {run}: {got:,} events in {elapsed:.3f} s = "
                    f"{got / elapsed:,.0f} events/s"
                )
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("cursor", "wire"))
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--version", default="8.0")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    cursor_level(args) if args.mode == "cursor" else wire_level(args)


if __name__ == "__main__":
    main()
