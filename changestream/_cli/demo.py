"""``changestream demo``: watch a simulated replica set survive a failover, in a few seconds.

Starts the embedded simulator (:class:`changestream.testing.ReplicaSet`),
writes orders, prints the change events, crashes the primary (its
connections drop and its cursors die) while more orders are written, and
shows the stream resuming on the new primary with nothing lost and nothing
repeated. A command listener narrates what the driver does.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import pymongo
from pymongo import MongoClient, monitoring
from pymongo.common import MIN_SUPPORTED_WIRE_VERSION

from .. import token_cluster_time, watch
from ..testing import VERSIONS, ReplicaSet

__all__ = ["main", "run"]

ORDERS = [("apple", 3), ("pear", 1), ("plum", 12), ("fig", 5), ("kiwi", 2), ("lime", 7)]


def _short(token: Any) -> str:
    """A resume token as a human reads it: its cluster time, not its hex."""
    cluster_time = token_cluster_time(token) if token is not None else None
    if cluster_time is None:
        return "(none)"
    return f"{cluster_time.as_datetime():%H:%M:%S} #{cluster_time.inc}"


class _Narrator(monitoring.CommandListener):
    """Prints the stream's failed getMores and its resume aggregates as they happen."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.resumes = 0
        self._opened = False

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name != "aggregate":
            return
        stage = event.command["pipeline"][0].get("$changeStream", {})
        if not self._opened:
            self._opened = True
            return
        self.resumes += 1
        key = next((k for k in ("resumeAfter", "startAfter") if k in stage), None)
        where = f"{key} = {_short(stage[key])}" if key else "startAtOperationTime"
        host, port = event.connection_id
        self.say(f"   [resume] aggregate on {host}:{port} with {where}")

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        if event.command_name == "getMore":
            host, port = event.connection_id
            reason = str(event.failure.get("errmsg", event.failure))[:60]
            self.say(f"   [error]  getMore on {host}:{port} failed: {reason}")


def run(version: str = "8.0", say: Callable[[str], None] = print) -> bool:
    """Run the demo, printing with ``say``; ``True`` if every order arrived exactly once."""
    started = time.monotonic()
    narrator = _Narrator(say)
    with ReplicaSet(version, members=3) as rs:
        say(f"changestream demo: a simulated MongoDB {version} replica set, "
            f"members {', '.join(rs.members)}")
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri, event_listeners=[narrator])
        writer: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        with client, writer:
            orders = writer.demo.orders
            received: list[int] = []

            def show(count: int, stream: Any) -> None:
                for _ in range(count):
                    change = stream.next()
                    document = change["fullDocument"]
                    received.append(document["_id"])
                    say(f"   event {change['operationType']:<7} order {document['_id']}: "
                        f"{document['qty']:>2} x {document['item']:<6} "
                        f"token {_short(stream.resume_token)}")

            def write(numbers: range) -> None:
                for number in numbers:
                    item, qty = ORDERS[number - 1]
                    orders.insert_one({"_id": number, "item": item, "qty": qty})
                say(f"   wrote orders {numbers.start}..{numbers.stop - 1}")

            with watch(client.demo.orders, max_await_time_ms=100) as stream:
                say(f"1. watching demo.orders; primary is {rs.primary}")
                write(range(1, 4))
                show(3, stream)
                old = rs.primary
                new = rs.step_down(close_connections=True)
                say(f"2. failover: primary {old} crashed (connections dropped, cursors gone); "
                    f"{new} took over")
                write(range(4, 7))
                say("3. reading on: the stream's cursor died with the old primary, so it "
                    "resumes (once, as the spec says) from its last token:")
                show(3, stream)
    ok = received == list(range(1, 7))
    verdict = "nothing lost, nothing repeated" if ok else f"MISMATCH: {received}"
    say(f"4. done in {time.monotonic() - started:.1f} s: wrote 6 orders, received "
        f"{len(received)} events ({verdict}); the stream resumed {narrator.resumes} time(s)")
    return ok


def main(argv: list[str] | None = None) -> int:
    """``changestream demo [--version V]``; exit status 0 when the demo's check passes."""
    parser = argparse.ArgumentParser(
        prog="changestream demo",
        description="Watch a simulated replica set fail over while a change stream resumes.",
    )
    parser.add_argument("--version", default="8.0", help="emulated server version (default 8.0)")
    args = parser.parse_args(argv)
    usable = [v for v, profile in VERSIONS.items()
              if profile.max_wire_version >= MIN_SUPPORTED_WIRE_VERSION]
    if args.version not in usable:
        why = (f"PyMongo {pymongo.version} cannot talk to MongoDB {args.version}"
               if args.version in VERSIONS else f"unknown version {args.version!r}")
        print(f"changestream demo: error: --version: {why}; choose one of {', '.join(usable)}",
              file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, flush=True)

    return 0 if run(args.version, say) else 1


if __name__ == "__main__":
    sys.exit(main())
