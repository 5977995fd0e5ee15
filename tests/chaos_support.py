"""The chaos workload: ordered writes 0..N-1 while seeded, random faults hit the deployment.

Used by ``tests/chaos`` (watch, consume, aio.consume, the CLI) and
``tests/spark/test_chaos_spark.py`` (both Spark paths), each against a
simulated replica set (with a ``dbpath``, so it can be restarted whole) and a
simulated sharded cluster (:data:`TOPOLOGIES`). Profiles come from the
environment: ``CHANGESTREAM_CHAOS_EVENTS`` (default 1500 per consumer: the CI
profile), ``CHANGESTREAM_CHAOS_SEED`` (default 14),
``CHANGESTREAM_CHAOS_FAULT_SPACING`` (mean events written between two faults,
default 40) and ``CHANGESTREAM_CHAOS_WRITE_BATCH`` (documents per
``insert_many``, default 20; the writer stays at most 20 batches ahead of a
consumer that reports its progress). Faults are injected by the writer between
its batches, in an order drawn from the seed, so a run with the same seed
meets the same faults at the same positions of the workload.
The long profile runs one client path and topology at a time:
``CHANGESTREAM_CHAOS_EVENTS=1000000 CHANGESTREAM_CHAOS_FAULT_SPACING=2000
CHANGESTREAM_CHAOS_WRITE_BATCH=500 python -m pytest -m chaos -rP tests/chaos
-k "test_consume and replset"``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import BulkWriteError, PyMongoError
from pymongo.write_concern import WriteConcern

EVENTS = int(os.environ.get("CHANGESTREAM_CHAOS_EVENTS", "1500"))
SEED = int(os.environ.get("CHANGESTREAM_CHAOS_SEED", "14"))
FAULT_SPACING = int(os.environ.get("CHANGESTREAM_CHAOS_FAULT_SPACING", "40"))
WRITE_BATCH = int(os.environ.get("CHANGESTREAM_CHAOS_WRITE_BATCH", "20"))
MAX_LAG = 20 * WRITE_BATCH
"""The writer waits while it is this many events ahead of a consumer's progress."""
TOPOLOGIES = ("replset", "sharded")

FAILPOINTS: dict[str, tuple[list[str], int, dict[str, Any]]] = {
    "getmore_close": (["getMore"], 1, {"closeConnection": True}),
    "aggregate_close": (["aggregate"], 1, {"closeConnection": True}),
    "getmore_and_resume_close": (["getMore", "aggregate"], 2, {"closeConnection": True}),
    "cursor_not_found": (["getMore"], 1, {"errorCode": 43}),
}
"""``failCommand`` faults: (commands, times, data)."""
MEMBER_FAULTS = (
    "stepdown_close",
    "stepdown_keep",
    "kill_restart_primary",
    "stop_restart_primary",
)
"""Faults of one replica set (on a sharded cluster: of a shard, drawn from the seed)."""
SERVER_FAULTS = (*FAILPOINTS, "kill_cursors", *MEMBER_FAULTS)
RESTARTS = 3
"""Whole-deployment restarts per run (for a target that has them), evenly spaced: each
reloads every document and oplog entry, too slow to draw at random in the long profile."""


class _Skipped(Exception):
    """A fault declined to run (returned ``False``, or nothing to hit now): not counted."""


def deadline_for(events: int) -> float:
    """Seconds a run may take: generous for a loaded 2-core machine, but bounded.

    At the default batch of 20 the workload runs at about 200 events/s; bigger
    batches go faster, up to what one consumer reads under faults (a few
    thousand events/s), hence the cap on the scale.
    """
    return 120 + events / (2 * min(WRITE_BATCH, 250))


def _replica_set_fault(rs: Any, kind: str, wait: Callable[[float], object]) -> None:
    """Inject one of :data:`MEMBER_FAULTS` into replica set ``rs``."""
    if kind == "stepdown_close":
        rs.step_down(close_connections=True)
    elif kind == "stepdown_keep":
        rs.step_down(close_connections=False)
    else:
        primary = rs.primary
        if primary is None:
            raise _Skipped
        index = rs.members.index(primary)
        if kind == "kill_restart_primary":
            rs.kill_member(index)  # kill -9: sockets dropped, the next member elected
        else:
            rs.stop_member(index)  # SIGTERM: quiesce (91), InterruptedAtShutdown (11600)
        wait(0.3)
        rs.restart_member(index)


def _fail(admin: MongoClient[dict[str, Any]], kind: str) -> None:
    commands, times, data = FAILPOINTS[kind]
    admin.admin.command("configureFailPoint", "failCommand", mode={"times": times},
                        data={"failCommands": commands, **data})


def _failpoints_off(admin: MongoClient[dict[str, Any]]) -> None:
    with contextlib.suppress(PyMongoError):
        admin.admin.command("configureFailPoint", "failCommand", mode="off")


class ReplicaSetTarget:
    """A simulated 3-member replica set with a ``dbpath``: it also meets whole restarts."""

    name = "replset"
    faults = SERVER_FAULTS
    scheduled = ("restart",)

    def __init__(self, rs: Any) -> None:
        self.rs = rs
        self.uri: str = rs.uri
        self._admin: MongoClient[dict[str, Any]] = MongoClient(
            self.uri, serverSelectionTimeoutMS=30000
        )

    def prepare(self, database: str, collection: str) -> None:
        self._admin[database].create_collection(collection)

    def fault(self, kind: str, rng: random.Random, wait: Callable[[float], object]) -> None:
        if kind in FAILPOINTS:
            _fail(self._admin, kind)
        elif kind == "kill_cursors":
            self.rs.kill_cursors()
        elif kind == "restart":  # every member down (SIGTERM), up again from the dbpath
            self.rs.restart()
        else:
            _replica_set_fault(self.rs, kind, wait)

    def clear(self) -> None:
        _failpoints_off(self._admin)

    def close(self) -> None:
        self._admin.close()


class ShardedTarget:
    """A simulated cluster of 2 shards (3-member replica sets) behind 2 mongoses.

    Failpoints are set on every mongos (each has its own); step-downs, member
    kills and shutdowns hit the primary of a shard drawn from the seed; cursors
    are killed on every mongos or on every shard (mongos then meets
    CursorNotFound from the shard); a mongos drawn from the seed is killed and
    restarted on its port.
    """

    name = "sharded"
    faults = (*SERVER_FAULTS, "kill_shard_cursors", "kill_restart_mongos")
    scheduled: tuple[str, ...] = ()

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.uri: str = cluster.uri
        self._admins: list[MongoClient[dict[str, Any]]] = [
            MongoClient(cluster.mongos_uri(i), directConnection=True,
                        serverSelectionTimeoutMS=5000)
            for i in range(len(cluster.mongoses))
        ]

    def prepare(self, database: str, collection: str) -> None:
        """A collection sharded on a hashed ``_id``: the writes spread over both shards."""
        self._admins[0].admin.command("shardCollection", f"{database}.{collection}",
                                      key={"_id": "hashed"})

    def fault(self, kind: str, rng: random.Random, wait: Callable[[float], object]) -> None:
        if kind in FAILPOINTS:
            for admin in self._admins:
                _fail(admin, kind)
        elif kind == "kill_cursors":
            for i in range(len(self._admins)):
                self.cluster.mongos(i).deployment.cursors.kill_all()
        elif kind == "kill_shard_cursors":
            for shard in self.cluster.shards:
                shard.kill_cursors()
        elif kind == "kill_restart_mongos":
            index = rng.randrange(len(self._admins))
            self.cluster.kill_mongos(index)
            wait(0.3)
            self.cluster.restart_mongos(index)
        else:
            _replica_set_fault(rng.choice(self.cluster.shards), kind, wait)

    def clear(self) -> None:
        for admin in self._admins:
            _failpoints_off(admin)

    def close(self) -> None:
        for admin in self._admins:
            admin.close()


Target = ReplicaSetTarget | ShardedTarget


@pytest.fixture(name="target", scope="module", params=TOPOLOGIES)
def target_fixture(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """Each topology of :data:`TOPOLOGIES`, started, with its faults (import it: the ``target`` fixture)."""
    if os.environ.get("MONGODB_URI"):
        pytest.skip("chaos needs the simulator's fault injection (MONGODB_URI is set)")
    from changestream.testing import ReplicaSet, ShardedCluster

    chaos_target: Target
    with contextlib.ExitStack() as stack:
        if request.param == "replset":
            rs = ReplicaSet("8.0", members=3, dbpath=tmp_path_factory.mktemp("dbpath"))
            chaos_target = ReplicaSetTarget(stack.enter_context(rs))
        else:
            cluster = ShardedCluster("8.0", shards=2, mongoses=2, members_per_shard=3,
                                     noop_interval=0.5)
            chaos_target = ShardedTarget(stack.enter_context(cluster))
        stack.callback(chaos_target.close)
        yield chaos_target


@dataclass
class Chaos:
    """Writes ``0..events-1`` in order (``_id`` = ``i``) and injects faults until stopped.

    ``progress`` (how many events the consumer has, or ``None``) holds the
    writer back while it is more than :data:`MAX_LAG` events ahead, so the
    faults keep meeting the consumer mid-stream whatever the write batch.
    """

    target: Target
    database: str
    collection: str
    events: int = EVENTS
    seed: int = SEED
    extra_faults: dict[str, Callable[[], object]] = field(default_factory=dict)
    progress: Callable[[], int] | None = None
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    written: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def start(self) -> Chaos:
        thread = threading.Thread(target=self._guard, args=(self._write,), daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        self.target.clear()

    @property
    def writes_done(self) -> bool:
        return self.written >= self.events

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def _write(self) -> None:
        """Ordered inserts; after an error, continue after the highest ``_id`` present.

        Between batches, once ``FAULT_SPACING`` events (on average) went by, one
        fault drawn from the seeded generator is injected, then the writer
        pauses briefly so the consumers meet it mid-stream. The target's
        scheduled faults (the replica set's whole restart) come :data:`RESTARTS`
        times, evenly spaced over the run.
        """
        rng = random.Random(self.seed)
        kinds = [*self.target.faults, *self.extra_faults]
        next_fault = rng.randint(FAULT_SPACING // 2, FAULT_SPACING * 3 // 2)
        scheduled = [(self.events * (k + 1) // (RESTARTS + 1), kind)
                     for k in range(RESTARTS) for kind in self.target.scheduled]
        with MongoClient(self.target.uri, serverSelectionTimeoutMS=30000) as client:
            coll = client[self.database].get_collection(
                self.collection, write_concern=WriteConcern("majority")
            )
            next_id = 0
            while next_id < self.events and not self._stop.is_set():
                while scheduled and next_id >= scheduled[0][0]:
                    self._fault(scheduled.pop(0)[1], rng)
                if next_id >= next_fault:
                    self._fault(rng.choice(kinds), rng)
                    next_fault = next_id + rng.randint(FAULT_SPACING // 2,
                                                       FAULT_SPACING * 3 // 2)
                    self._stop.wait(rng.uniform(0.02, 0.2))
                self._wait_for_consumer(next_id)
                end = min(next_id + WRITE_BATCH, self.events)
                try:
                    coll.insert_many([{"_id": i, "i": i} for i in range(next_id, end)])
                    next_id = end
                except (BulkWriteError, PyMongoError):
                    time.sleep(0.05)
                    with contextlib.suppress(PyMongoError):
                        last = coll.find_one(sort=[("_id", -1)])
                        next_id = 0 if last is None else last["_id"] + 1
                self.written = next_id

    def _wait_for_consumer(self, next_id: int) -> None:
        progress = self.progress
        while progress is not None and next_id - progress() > MAX_LAG:
            if self._stop.wait(0.01):
                return

    def _fault(self, kind: str, rng: random.Random) -> None:
        """Inject ``kind`` and count it (unless it could not run now, e.g. no primary)."""
        with contextlib.suppress(PyMongoError, _Skipped):
            if kind in self.extra_faults:
                if self.extra_faults[kind]() is False:
                    raise _Skipped
            else:
                self.target.fault(kind, rng, self._stop.wait)
            self.counts[kind] += 1


@dataclass
class Verdict:
    """What a consumer saw, judged against ``0..events-1``."""

    events: int
    lost: int
    duplicated: int
    out_of_order: int
    elapsed: float

    @classmethod
    def of(cls, received: Sequence[int], events: int, elapsed: float) -> Verdict:
        seen = set(received)
        out_of_order = sum(1 for a, b in itertools.pairwise(received) if b < a)
        return cls(events, len(set(range(events)) - seen), len(received) - len(seen),
                   out_of_order, elapsed)

    def report(self, name: str, chaos: Chaos, kills: int = 0) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(chaos.counts.items()))
        return (f"chaos[{name} on {chaos.target.name}] seed {chaos.seed}: {self.events} "
                f"events, lost {self.lost}, duplicated {self.duplicated}, out of order "
                f"{self.out_of_order}, consumer kills {kills}, faults survived "
                f"{sum(chaos.counts.values())} ({faults}), "
                f"{self.events / self.elapsed:.0f} events/s, {self.elapsed:.0f} s")
