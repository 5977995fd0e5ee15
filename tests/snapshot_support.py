"""Helpers for the snapshot-then-stream tests: a sink that applies records as upserts, and writers."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from bson.timestamp import Timestamp
from pymongo import monitoring
from pymongo.collection import Collection


class Sink:
    """Applies records and events keyed by ``documentKey`` (upsert / delete), counting what came."""

    def __init__(self) -> None:
        self.docs: dict[Any, dict[str, Any]] = {}
        self.copied: Counter[Any] = Counter()
        self.events: list[dict[str, Any]] = []
        self.interrupted: list[dict[str, Any]] = []
        self.read_times: set[Timestamp] = set()
        self.stream_after: set[Timestamp] = set()
        self.repeat_flags: list[bool] = []

    def apply(self, record: dict[str, Any]) -> None:
        op = record["operationType"]
        if op == "snapshotInterrupted":
            self.interrupted.append(record)
            return
        if "snapshot" in record:
            key = record["documentKey"]["_id"]
            self.copied[key] += 1
            self.docs[key] = record["fullDocument"]
            self.read_times.add(record["clusterTime"])
            self.stream_after.add(record["_id"]["at"])
            self.repeat_flags.append(record["snapshot"]["eventsMayRepeat"])
            return
        self.events.append(record)
        if op in ("insert", "update", "replace"):
            key = record["documentKey"]["_id"]
            doc = record.get("fullDocument")
            if doc is None:
                self.docs.pop(key, None)
            else:
                self.docs[key] = doc
        elif op == "delete":
            self.docs.pop(record["documentKey"]["_id"], None)

    def data_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["operationType"] in ("insert", "update", "replace", "delete")]


class Writer:
    """Random inserts, updates, replaces and deletes; counts the events they must produce."""

    def __init__(self, coll: Collection[dict[str, Any]], first_new_id: int, seed: int = 7) -> None:
        self.coll = coll
        self.rng = random.Random(seed)
        self.next_id = first_new_id
        self.events = 0

    def write(self, n: int) -> None:
        coll, rng = self.coll, self.rng
        for _ in range(n):
            kind = rng.choice(("insert", "update", "replace", "delete"))
            target = rng.randrange(self.next_id)
            if kind == "insert":
                coll.insert_one({"_id": self.next_id, "v": 0, "born": "late"})
                self.next_id += 1
                self.events += 1
            elif kind == "update":
                self.events += coll.update_one({"_id": target}, {"$inc": {"v": 1}}).modified_count
            elif kind == "replace":
                self.events += coll.replace_one(
                    {"_id": target}, {"v": rng.randrange(10**9), "replaced": True}
                ).modified_count
            else:
                self.events += coll.delete_one({"_id": target}).deleted_count


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def collection_state(coll: Collection[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    return {d["_id"]: d for d in coll.find()}


def make_collection(db: Any, name: str, n: int) -> Collection[dict[str, Any]]:
    """A collection with post-images (``fullDocument: "required"`` gives each event's exact document)."""
    db.create_collection(name, changeStreamPreAndPostImages={"enabled": True})
    coll: Collection[dict[str, Any]] = db[name]
    if n:
        coll.insert_many([{"_id": i, "v": 0} for i in range(n)])
    return coll


class Alternate:
    """A ``server_selector`` choosing the mongoses in turn: a command that selects a server
    (rather than going to the one holding its cursor) lands on the other mongos."""

    def __init__(self) -> None:
        self._turn = 0
        self._lock = threading.Lock()

    def __call__(self, servers: list[Any]) -> list[Any]:
        if len(servers) < 2:
            return servers
        with self._lock:
            self._turn += 1
            turn = self._turn
        ordered = sorted(servers, key=lambda s: s.address)
        return [ordered[turn % len(ordered)]]


class GetMores(monitoring.CommandListener):
    """Which mongos each cursor came from, and where each getMore went."""

    def __init__(self) -> None:
        self.opened: dict[int, Any] = {}
        self.get_mores: list[tuple[int, Any]] = []
        self._lock = threading.Lock()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "getMore":
            with self._lock:
                self.get_mores.append((int(event.command["getMore"]), event.connection_id))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        cursor = event.reply.get("cursor") if event.command_name != "getMore" else None
        if isinstance(cursor, Mapping) and cursor.get("id"):
            with self._lock:
                self.opened[int(cursor["id"])] = event.connection_id

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def check(self) -> int:
        """Every getMore went where its cursor was opened; how many there were."""
        with self._lock:
            for cursor_id, address in self.get_mores:
                assert self.opened.get(cursor_id) == address, f"getMore of {cursor_id} moved"
            return len(self.get_mores)
