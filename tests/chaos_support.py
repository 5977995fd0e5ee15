"""The chaos workload: ordered writes 0..N-1 while seeded, random faults hit the deployment.

Used by ``tests/chaos`` (watch, consume, aio.consume, the CLI) and
``tests/spark/test_chaos_spark.py`` (both Spark paths). Profiles come from the
environment: ``CHANGESTREAM_CHAOS_EVENTS`` (default 1500 per consumer: the CI
profile), ``CHANGESTREAM_CHAOS_SEED`` (default 14) and
``CHANGESTREAM_CHAOS_FAULT_SPACING`` (mean events written between two faults,
default 40). Faults are injected by the writer between its batches, in an order
drawn from the seed, so a run with the same seed meets the same faults at the
same positions of the workload.
The long profile is ``CHANGESTREAM_CHAOS_EVENTS=1000000 python -m pytest -m chaos -s``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pymongo import MongoClient
from pymongo.errors import BulkWriteError, PyMongoError
from pymongo.write_concern import WriteConcern

EVENTS = int(os.environ.get("CHANGESTREAM_CHAOS_EVENTS", "1500"))
SEED = int(os.environ.get("CHANGESTREAM_CHAOS_SEED", "14"))
FAULT_SPACING = int(os.environ.get("CHANGESTREAM_CHAOS_FAULT_SPACING", "40"))
WRITE_BATCH = 20

SERVER_FAULTS = (
    "getmore_close",
    "aggregate_close",
    "getmore_and_resume_close",
    "cursor_not_found",
    "stepdown_close",
    "stepdown_keep",
    "kill_cursors",
    "kill_restart_primary",
    "stop_restart_primary",
)


class _Skipped(Exception):
    """An extra fault declined to run (returned ``False``): not counted."""


def deadline_for(events: int) -> float:
    """Seconds a run may take: generous for a loaded 2-core machine, but bounded."""
    return 120 + events / 40


@dataclass
class Chaos:
    """Writes ``0..events-1`` in order (``_id`` = ``i``) and injects faults until stopped."""

    rs: Any
    database: str
    collection: str
    events: int = EVENTS
    seed: int = SEED
    faults: Sequence[str] = SERVER_FAULTS
    extra_faults: dict[str, Callable[[], object]] = field(default_factory=dict)
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
            thread.join(60)
        with contextlib.suppress(PyMongoError), self._admin() as admin:
            admin.admin.command("configureFailPoint", "failCommand", mode="off")

    @property
    def writes_done(self) -> bool:
        return self.written >= self.events

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def _admin(self) -> MongoClient[dict[str, Any]]:
        return MongoClient(self.rs.uri, serverSelectionTimeoutMS=30000)

    def _write(self) -> None:
        """Ordered inserts; after an error, continue after the highest ``_id`` present.

        Between batches, once ``FAULT_SPACING`` events (on average) went by, one
        fault drawn from the seeded generator is injected, then the writer
        pauses briefly so the consumers meet it mid-stream.
        """
        rng = random.Random(self.seed)
        kinds = [*self.faults, *self.extra_faults]
        next_fault = rng.randint(FAULT_SPACING // 2, FAULT_SPACING * 3 // 2)
        with self._admin() as client, self._admin() as admin:
            coll = client[self.database].get_collection(
                self.collection, write_concern=WriteConcern("majority")
            )
            next_id = 0
            while next_id < self.events and not self._stop.is_set():
                if next_id >= next_fault:
                    kind = rng.choice(kinds)
                    with contextlib.suppress(PyMongoError, _Skipped):  # e.g. no primary now
                        self._fault(admin, kind)
                        self.counts[kind] += 1
                    next_fault = next_id + rng.randint(FAULT_SPACING // 2,
                                                       FAULT_SPACING * 3 // 2)
                    self._stop.wait(rng.uniform(0.02, 0.2))
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

    def _fault(self, admin: MongoClient[dict[str, Any]], kind: str) -> None:
        def fail(commands: list[str], times: int = 1, **data: Any) -> None:
            admin.admin.command("configureFailPoint", "failCommand", mode={"times": times},
                                data={"failCommands": commands, **data})

        if kind in self.extra_faults:
            if self.extra_faults[kind]() is False:
                raise _Skipped
        elif kind == "getmore_close":
            fail(["getMore"], closeConnection=True)
        elif kind == "aggregate_close":
            fail(["aggregate"], closeConnection=True)
        elif kind == "getmore_and_resume_close":
            fail(["getMore", "aggregate"], times=2, closeConnection=True)
        elif kind == "cursor_not_found":
            fail(["getMore"], errorCode=43)
        elif kind == "stepdown_close":
            self.rs.step_down(close_connections=True)
        elif kind == "stepdown_keep":
            self.rs.step_down(close_connections=False)
        elif kind == "kill_cursors":
            self.rs.kill_cursors()
        elif kind in ("kill_restart_primary", "stop_restart_primary"):
            primary = self.rs.primary
            if primary is None:
                raise _Skipped
            index = self.rs.members.index(primary)
            if kind == "kill_restart_primary":
                self.rs.kill_member(index)  # kill -9: sockets dropped, the next member elected
            else:
                self.rs.stop_member(index)  # SIGTERM: quiesce (91), InterruptedAtShutdown (11600)
            self._stop.wait(0.3)
            self.rs.restart_member(index)
        else:
            raise ValueError(f"unknown fault {kind!r}")


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
        return (f"chaos[{name}] seed {chaos.seed}: {self.events} events, lost {self.lost}, "
                f"duplicated {self.duplicated}, out of order {self.out_of_order}, consumer "
                f"kills {kills}, faults survived {sum(chaos.counts.values())} ({faults}), "
                f"{self.events / self.elapsed:.0f} events/s")
