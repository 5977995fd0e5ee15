"""How fast the simulator serves change events to one client (a plain script, not a test).

    .venv/bin/python tests/testing/perf_serve.py cursor [--events N] [--batch-size B] [--profile]
    .venv/bin/python tests/testing/perf_serve.py wire [--events N] [--batch-size B] [--runs R]
        [--client raw|dicts]

``cursor``: in this process, N small inserts go through the ``insert`` command
handler, then change streams opened through the ``aggregate`` handler
(``startAtOperationTime`` before the inserts) are drained with
``cursor.get_more`` and every batch is encoded as the reply the server sends
(``cursor_reply`` + ``wire.encode_document``). Scenarios: the first read of
the range (event cache cleared), a repeated read (a stream of the same shape
read it before), a read after a token-only scan (Spark's double read: a
``$project`` stream read it before), and the first read with the cache
disabled (what caching costs the first reader). Best of R runs each; CPU time
is this process's. ``--profile`` prints the top functions of each scenario's
first run instead of timing it.

``wire``: the simulator runs in a child process (``python -m
changestream.testing serve``); this process inserts N documents with PyMongo
and then drains them R times with a raw ``aggregate`` + ``getMore`` loop
(``Database.command``; replies kept as ``RawBSONDocument`` so the client's own
decoding cost stays small, or ``--client dicts``). Each run is a new stream over
the same range: run 1 reads it first, the others find its events cached.
The server's CPU time per event is read from ``/proc``.

Documents are ``{_id: ObjectId, i: n, s: <20 chars>}``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
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

from changestream.testing.commands import REGISTRY, CommandContext, ConnectionInfo  # noqa: E402
from changestream.testing.core.cursors import cursor_reply  # noqa: E402
from changestream.testing.core.versions import get_profile  # noqa: E402
from changestream.testing.server.wire import encode_document  # noqa: E402
from changestream.testing.storage.deployment import Deployment  # noqa: E402

PAYLOAD = "abcdefghijklmnopqrst"
TOKEN_ONLY = {"$project": {"_id": 1, "operationType": 1}}
"""The Spark source's driver-side scan reads events through this stage first."""
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


def _drain(
    d: Deployment,
    start: Timestamp,
    events: int,
    batch_size: int,
    pipeline: list[dict[str, Any]] | None = None,
) -> tuple[int, int]:
    """Open a stream at ``start`` and read ``events`` events; (events, reply bytes)."""
    reply = _run(
        d,
        {
            "aggregate": "c",
            "pipeline": [{"$changeStream": {"startAtOperationTime": start}}, *(pipeline or [])],
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
    d = Deployment(get_profile(args.version))
    _run(d, {"insert": "marker", "documents": [{}]})
    start = d.last_applied()
    for offset in range(0, args.events, INSERT_CHUNK):
        count = min(INSERT_CHUNK, args.events - offset)
        _run(d, {"insert": "c", "documents": _docs(offset, count)})
    cache = d.event_cache
    bound = cache.max_bytes

    def prepare(scenario: str) -> None:
        cache.clear()
        cache.max_bytes = 0 if scenario == "cache disabled" else bound
        if scenario == "repeated read":
            _drain(d, start, args.events, args.batch_size)
        elif scenario == "read after a token-only scan":
            _drain(d, start, args.events, args.batch_size, [TOKEN_ONLY])

    for scenario in (
        "first read",
        "repeated read",
        "read after a token-only scan",
        "cache disabled",
    ):
        best_wall = best_cpu = float("inf")
        for run in range(args.runs):
            prepare(scenario)
            profile = cProfile.Profile() if args.profile and run == 0 else None
            wall, cpu = time.perf_counter(), time.process_time()
            if profile is not None:
                profile.enable()
            got, size = _drain(d, start, args.events, args.batch_size)
            if profile is not None:
                profile.disable()
                print(f"== {scenario} ==")
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
                continue
            best_wall = min(best_wall, time.perf_counter() - wall)
            best_cpu = min(best_cpu, time.process_time() - cpu)
        print(
            f"cursor, {scenario}: {got / best_wall:,.0f} events/s wall, {got / best_cpu:,.0f} "
            f"events/s CPU ({best_cpu / got * 1e6:.2f} µs/event; best of {args.runs}; "
            f"{size / got:.0f} reply bytes/event)"
        )
    cache.max_bytes = bound


# -- over the wire -------------------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wire_level(args: argparse.Namespace) -> None:
    from pymongo import MongoClient
    from pymongo.database import Database

    server = subprocess.Popen(
        [sys.executable, "-m", "changestream.testing", "serve", "--port", "0",
         "--version", args.version, "--event-cache-mb", "512"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        uri = server.stdout.readline().strip()
        options: CodecOptions[Any] = (
            CodecOptions(document_class=RawBSONDocument) if args.client == "raw" else CodecOptions()
        )
        client: MongoClient[dict[str, Any]]
        with MongoClient(uri) as client:
            db: Database[dict[str, Any]] = client["perf"]
            with client.start_session() as session:
                db["marker"].insert_one({}, session=session)
                start = session.operation_time
            assert isinstance(start, Timestamp)
            for offset in range(0, args.events, INSERT_CHUNK):
                db["c"].insert_many(_docs(offset, min(INSERT_CHUNK, args.events - offset)))
            for run in range(1, args.runs + 1):
                server_cpu = _cpu_seconds(server.pid)
                began = time.perf_counter()
                reply = db.command(
                    {
                        "aggregate": "c",
                        "pipeline": [{"$changeStream": {"startAtOperationTime": start}}],
                        "cursor": {"batchSize": 0},
                    },
                    codec_options=options,
                )
                cid = reply["cursor"]["id"]
                got = 0
                while got < args.events:
                    batch = db.command(
                        {"getMore": cid, "collection": "c", "batchSize": args.batch_size},
                        codec_options=options,
                    )["cursor"]["nextBatch"]
                    got += len(batch)
                    if not batch:
                        raise RuntimeError(f"the stream ended after {got} events")
                elapsed = time.perf_counter() - began
                server_cpu = _cpu_seconds(server.pid) - server_cpu
                db.command({"killCursors": "c", "cursors": [cid]})
                print(
                    f"wire run {run}: {got:,} events in {elapsed:.3f} s = "
                    f"{got / elapsed:,.0f} events/s (server CPU {server_cpu / got * 1e6:.2f} "
                    "µs/event)"
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
    parser.add_argument(
        "--client",
        choices=("raw", "dicts"),
        default="raw",
        help="wire: keep replies as RawBSONDocument, or decode them to dicts",
    )
    args = parser.parse_args()
    cursor_level(args) if args.mode == "cursor" else wire_level(args)


if __name__ == "__main__":
    main()
