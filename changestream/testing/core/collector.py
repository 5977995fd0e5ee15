"""The ``serve`` process's garbage collector: full collections while the server is idle.

The simulator keeps its data as Python objects: documents, oplog entries, cached events.
A full collection walks every one of them, and CPython starts one whenever the objects
that survived into the oldest generation have grown by a quarter. At 100,000 documents
and a 512 MB event cache that is a pause of 1.1-1.4 s in the middle of whatever a client
is doing: a change stream read at 14,700 events/s in the run it hit and at 33,000/s in
the runs before and after (``benchmarks/mirror_e2e.py``). mongod has no such pause.

So the ``serve`` process, which owns its interpreter, takes full collections over
(:class:`IdleCollector`): it raises their threshold out of reach and runs them itself when
the process has used almost no CPU for :data:`IDLE_SECONDS`, and at the latest every
:data:`BUSY_SECONDS` under sustained load. After each it freezes what survived
(``gc.freeze``): the next full collection walks only what came since, so even one that a
client's burst runs into is short. Frozen objects that become garbage are freed by their
reference counts as always (the simulator's data are trees); only cycles among them wait
for the sweep that unfreezes everything, which runs at most every :data:`SWEEP_SECONDS`
(under load, every :data:`BUSY_SWEEPS` times that), and only once the process has been idle
for :data:`SWEEP_IDLE_SECONDS`: a sweep walks the whole heap (8 s at 1M documents with a
300,000-change backlog and its events cached), and a client that comes meanwhile waits for
all of it. After a quarter of a second of quiet, the pause between two steps of a client's
work, one did: ten minutes into a ``benchmarks/mirror_e2e.py`` run a change stream read at
a third of its rate, the simulator spending three times its CPU per event. The young
generations are collected as always. A simulator started inside another process (a test
suite's ``ReplicaSet``) leaves that process's collector alone.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Final

__all__ = ["BUSY_SECONDS", "BUSY_SWEEPS", "IDLE_SECONDS", "SWEEP_IDLE_SECONDS", "SWEEP_SECONDS",
           "IdleCollector"]

IDLE_SECONDS: Final = 0.25
"""How long the process must have been (almost) idle before a full collection runs."""
BUSY_SECONDS: Final = 60.0
"""The longest time between full collections under sustained load."""
SWEEP_SECONDS: Final = 600.0
"""The longest time (while idle) between sweeps of the whole heap, frozen objects included."""
SWEEP_IDLE_SECONDS: Final = 30.0
"""How long the process must have been (almost) idle before a sweep runs: longer than a
client pauses between two steps of its work (a test's set-up, a benchmark's next run)."""
BUSY_SWEEPS: Final = 6
"""Under sustained load, a sweep is due after this many :data:`SWEEP_SECONDS` all the same."""
IDLE_SHARE: Final = 0.05
"""CPU used per second of wall time below which the process counts as idle."""
_NEVER: Final = 2**31 - 1
"""A full-collection threshold (collections of the middle generation) never reached."""


class IdleCollector:
    """Runs the full collections of this process when it is idle (see the module)."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS, busy_seconds: float = BUSY_SECONDS,
                 sweep_seconds: float = SWEEP_SECONDS, idle_share: float = IDLE_SHARE,
                 sweep_idle_seconds: float = SWEEP_IDLE_SECONDS) -> None:
        self.idle_seconds = idle_seconds
        self.sweep_idle_seconds = sweep_idle_seconds
        self.busy_seconds = busy_seconds
        self.sweep_seconds = sweep_seconds
        self.idle_share = idle_share
        self.collections = 0
        """Full collections run so far."""
        self.sweeps = 0
        """Of those, the sweeps of the whole heap."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thresholds: tuple[int, int, int] | None = None

    def start(self) -> IdleCollector:
        young, middle, _ = self._thresholds = gc.get_threshold()
        gc.set_threshold(young, middle, _NEVER)
        self._thread = threading.Thread(target=self._run, name="simulator-idle-gc", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread and gives the process its collector back (thresholds, nothing frozen)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._thresholds is not None:
            gc.unfreeze()
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def __enter__(self) -> IdleCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        step = min(0.1, self.idle_seconds / 2)
        last = last_sweep = time.monotonic()
        idle_since: float | None = None
        quiet_since: float | None = None  # idle since (a collection meanwhile is not work)
        cpu, wall = time.process_time(), time.monotonic()
        while not self._stop.wait(step):
            now_cpu, now = time.process_time(), time.monotonic()
            busy = (now_cpu - cpu) > self.idle_share * (now - wall)
            cpu, wall = now_cpu, now
            if busy:
                idle_since = quiet_since = None
            else:
                idle_since = now if idle_since is None else idle_since
                quiet_since = now if quiet_since is None else quiet_since
            idle = idle_since is not None and now - idle_since >= self.idle_seconds
            quiet = quiet_since is not None and now - quiet_since >= self.sweep_idle_seconds
            due = gc.get_count()[2] > 0  # the middle generation was collected since
            since = now - last_sweep
            sweep = since >= self.sweep_seconds and (
                quiet or since >= BUSY_SWEEPS * self.sweep_seconds)
            if (idle and due) or sweep or now - last >= self.busy_seconds:
                if sweep:
                    gc.unfreeze()
                gc.collect()
                gc.freeze()
                self.collections += 1
                self.sweeps += sweep
                last = time.monotonic()
                last_sweep = last if sweep else last_sweep
                idle_since = None
                cpu, wall = time.process_time(), time.monotonic()  # not the collection's CPU
