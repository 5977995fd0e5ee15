"""A tiny wire server that replays one fixed batch of realistic change events, for benchmarks.

    python -m benchmarks.canned_server [--events-per-batch N]   # prints the URI, serves until killed

It answers ``hello`` as the primary of a one-member replica set, ``aggregate``
(any ``$changeStream``) with an empty first batch and cursor id 1, every
``getMore`` with the *same* pre-encoded reply of N insert events (about 490
bytes each: nested documents, arrays, dates, ObjectIds) and anything
else with ``{ok: 1}``. The reply bytes are built once; per ``getMore`` only
the 16-byte header is new, so what a benchmark measures is the client.

Not a MongoDB: no storage, no validation, no auth, loopback only.
"""

from __future__ import annotations

import argparse
import datetime
import random
import socket
import struct
import sys
import threading
from typing import Any

import bson
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

OP_MSG = 2013
OP_QUERY = 2004
OP_REPLY = 1
DATABASE, COLLECTION = "shop", "orders"
MAX_WIRE_VERSION = 21  # MongoDB 7.0


def realistic_events(count: int, seed: int = 16) -> list[dict[str, Any]]:
    """``count`` insert events shaped like an order system's (fixed seed: same bytes every run)."""
    rng = random.Random(seed)
    base = datetime.datetime(2026, 11, 26, 2, 0, tzinfo=datetime.timezone.utc)
    cities = ["Lyon", "Porto", "Leeds", "Graz", "Turku", "Gent", "Brno", "Cork"]
    events = []
    for i in range(count):
        oid = ObjectId(bytes(rng.getrandbits(8) for _ in range(12)))
        seconds = 1_700_000_000 + i // 10
        token = f"82{seconds:08X}{i % 10 + 1:08X}2B042C0100296E5A1004463C5F6964003C{str(oid).upper()}0004"
        created = base + datetime.timedelta(milliseconds=i * 137)
        items = [
            {"sku": rng.randrange(10_000), "qty": rng.randrange(1, 5),
             "price": rng.randrange(100, 10_000) / 100}
            for _ in range(2)
        ]
        events.append({
            "_id": {"_data": token},
            "operationType": "insert",
            "clusterTime": Timestamp(seconds, i % 10 + 1),
            "wallTime": created,
            "fullDocument": {
                "_id": oid,
                "i": i,
                "customer": {
                    "name": f"c{rng.randrange(100_000)}",
                    "city": rng.choice(cities),
                },
                "items": items,
                "status": rng.choice(["new", "paid", "shipped"]),
                "created": created,
                "tags": rng.sample(["gift", "express", "fragile", "promo", "b2b"], 1),
            },
            "ns": {"db": DATABASE, "coll": COLLECTION},
            "documentKey": {"_id": oid},
        })
    return events


class CannedServer:
    """Serves one batch forever; start() returns the port."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self._batch = [bson.encode(event) for event in events]
        self.event_bytes = sum(map(len, self._batch)) / len(self._batch)
        last_token = events[-1]["_id"]
        self._getmore_body = self._body({
            "cursor": {"nextBatch": [RawBSONDocument(b) for b in self._batch],
                       "id": Int64(1), "ns": f"{DATABASE}.{COLLECTION}",
                       "postBatchResumeToken": last_token},
            "ok": 1.0,
        })
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]

    @staticmethod
    def _body(document: dict[str, Any]) -> bytes:
        """OP_MSG flag bits + one kind-0 section."""
        return struct.pack("<iB", 0, 0) + bson.encode(document)

    def _hello(self) -> dict[str, Any]:
        me = f"127.0.0.1:{self.port}"
        return {
            "helloOk": True, "ismaster": True, "isWritablePrimary": True, "setName": "canned",
            "setVersion": 1, "hosts": [me], "me": me, "primary": me,
            "maxBsonObjectSize": 16 * 1024 * 1024, "maxMessageSizeBytes": 48_000_000,
            "maxWriteBatchSize": 100_000, "localTime": datetime.datetime.now(datetime.timezone.utc),
            "logicalSessionTimeoutMinutes": 30, "connectionId": 1, "minWireVersion": 0,
            "maxWireVersion": MAX_WIRE_VERSION, "readOnly": False, "ok": 1.0,
        }

    def _reply_body(self, command: dict[str, Any]) -> bytes:
        name = next(iter(command), "")
        if name == "getMore":
            return self._getmore_body
        if name.lower() in ("hello", "ismaster"):
            return self._body(self._hello())
        if name == "aggregate":
            return self._body({"cursor": {"firstBatch": [], "id": Int64(1),
                                          "ns": f"{DATABASE}.{COLLECTION}",
                                          "postBatchResumeToken": self.events[0]["_id"]},
                               "ok": 1.0})
        if name == "killCursors":
            return self._body({"cursorsKilled": command.get("cursors", []), "ok": 1.0})
        return self._body({"ok": 1.0})

    def serve_forever(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request_id = 0
        with conn:
            while True:
                header = _read(conn, 16)
                if header is None:
                    return
                length, req_id, _, op_code = struct.unpack("<iiii", header)
                body = _read(conn, length - 16)
                if body is None:
                    return
                request_id += 1
                if op_code == OP_QUERY:  # legacy handshake: {ismaster: 1} on admin.$cmd
                    name_end = body.index(b"\x00", 4)
                    document = bson.decode(body[name_end + 9:][:struct.unpack(
                        "<i", body[name_end + 9:name_end + 13])[0]])
                    reply = bson.encode(self._hello() if document else {"ok": 1.0})
                    payload = struct.pack("<iqii", 0, 0, 0, 1) + reply
                    conn.sendall(struct.pack("<iiii", 16 + len(payload), request_id, req_id,
                                             OP_REPLY) + payload)
                    continue
                if op_code != OP_MSG or body[4] != 0:
                    return
                size = struct.unpack("<i", body[5:9])[0]
                command = bson.decode(body[5:5 + size])
                reply_body = self._reply_body(command)
                conn.sendall(struct.pack("<iiii", 16 + len(reply_body), request_id, req_id,
                                         OP_MSG) + reply_body)


def _read(conn: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.canned_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--events-per-batch", type=int, default=1000)
    args = parser.parse_args(argv)
    server = CannedServer(realistic_events(args.events_per_batch))
    print(f"mongodb://127.0.0.1:{server.port}/?directConnection=true "
          f"{server.event_bytes:.0f}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
