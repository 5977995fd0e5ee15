"""Parallel handling without threads: which change may run now, and which token may be stored.

``consume(..., workers=N)`` hands changes to N handler threads (or tasks).
Two rules keep that as safe as the sequential loop, and both are decided
here, on plain data, so the thread and task shells only run handler calls:

- **Order per key.** Changes with the same key run one at a time, in stream
  order (a key -> lane mapping, as Kafka partitions do it in a pipeline). A
  change without a key (:data:`BARRIER`: DDL, ``invalidate``, anything
  unknown) waits until everything before it has finished, runs alone, and
  holds back everything after it until it has finished.
- **Low watermark.** The token that may be stored is that of the last change
  such that it and every change before it were handled (NVIDIA/NVSentinel
  #1505): a restart from it loses nothing, and re-delivers at most the
  changes admitted after it. Positions without a change (the
  ``postBatchResumeToken`` of an empty batch) are :meth:`Lanes.mark` ed in
  the same order, so they never pass an unhandled change either.

:class:`Lanes` is a small state machine in the manner of
:func:`changestream._states.transition`: inputs are method calls
(:meth:`~Lanes.admit`, :meth:`~Lanes.mark`, :meth:`~Lanes.take`,
:meth:`~Lanes.done`, :meth:`~Lanes.abandon`), outputs are the values they
return; it has no clock, no lock and no I/O. The sync shell calls it under one
lock, the async shell from the event loop only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final

import bson
from bson.objectid import ObjectId

__all__ = [
    "BARRIER",
    "DEFAULT_MAX_IN_FLIGHT_PER_WORKER",
    "Job",
    "Lanes",
    "LanesError",
    "default_key",
    "default_max_in_flight",
    "key_of",
    "lanes_for",
]

DEFAULT_MAX_IN_FLIGHT_PER_WORKER: Final = 4
"""``max_in_flight`` defaults to this many changes per worker (at least :data:`_MIN_IN_FLIGHT`)."""
_MIN_IN_FLIGHT: Final = 64


def default_max_in_flight(workers: int) -> int:
    """The documented default of ``max_in_flight`` for ``workers`` handlers."""
    return max(_MIN_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_PER_WORKER * workers)


class _Barrier:
    """The key of a change that must run alone (see :data:`BARRIER`)."""

    def __repr__(self) -> str:
        return "BARRIER"


BARRIER: Final[Hashable] = _Barrier()
"""The key of a change that runs alone, after every earlier change and before every later one.

:func:`default_key` gives it to changes without a ``documentKey``; a ``key=``
function gives it by returning ``None``.
"""


class LanesError(RuntimeError):
    """A call the dispatcher does not allow (admitting while full, finishing a job twice): a bug."""


class Job:
    """One admitted change: its place in stream order, its key, the change and the token after it."""

    __slots__ = ("change", "done", "key", "running", "seq", "token")

    def __init__(self, seq: int, key: Hashable, change: Any, token: Any) -> None:
        self.seq = seq
        self.key = key
        self.change = change
        self.token = token
        self.done = False
        self.running = False

    def __repr__(self) -> str:
        state = "done" if self.done else "running" if self.running else "pending"
        return f"Job(seq={self.seq}, key={self.key!r}, {state})"


class _Mark:
    """A position without a change (an empty batch's token): done as soon as it is reached."""

    __slots__ = ("token",)
    done: Final = True

    def __init__(self, token: Any) -> None:
        self.token = token


class Lanes:
    """The key -> lane dispatcher and low-watermark tracker of one parallel consume run.

    ``workers`` bounds the jobs running at once (:meth:`take` returns ``None``
    beyond it); ``max_in_flight`` bounds the changes admitted after the low
    watermark (:attr:`full`): fetching waits then, so a hot key or one slow
    change cannot grow memory, and a crash re-delivers at most that many (the consume
    loop stores a moved watermark before it admits the next change).
    """

    def __init__(self, workers: int, max_in_flight: int, watermark: Any = None) -> None:
        if workers < 1 or max_in_flight < 1:
            raise LanesError(f"workers ({workers}) and max_in_flight ({max_in_flight}) must be >= 1")
        self.workers = workers
        self.max_in_flight = max_in_flight
        self._resume_at = max_in_flight - max(1, max_in_flight // 4)
        self.handled = 0
        """Jobs finished (done, whatever the handler's outcome was)."""
        self._reset(watermark)

    def _reset(self, watermark: Any) -> None:
        self.watermark: Any = watermark
        """Token of the last position such that it and everything before it are handled."""
        self._seq = 0
        self._order: collections.deque[Job | _Mark] = collections.deque()
        """Every position after the watermark, in stream order (done or not)."""
        self._jobs_after_watermark = 0
        self._ready: collections.deque[Job] = collections.deque()
        """Jobs that may start now, in stream order of becoming ready."""
        self._lanes: dict[Hashable, collections.deque[Job] | None] = {}
        """Keys owning a ready or running job -> their later jobs, waiting their turn (``None``
        until a second job of the key comes: most keys never need a queue)."""
        self._routed = 0
        """Jobs routed (ready, running or waiting in a lane) and not done."""
        self._barrier: Job | None = None
        """The barrier routed and not yet done; everything admitted after it is held."""
        self._held: collections.deque[Job] = collections.deque()
        self._running = 0
        """Jobs taken and not yet done (each has ``running`` set: a flag, not a set, as
        this runs twice per change)."""

    # -- queries ------------------------------------------------------------------------------
    @property
    def full(self) -> bool:
        """``max_in_flight`` changes wait after the watermark: admit no more until one is done."""
        return self._jobs_after_watermark >= self.max_in_flight

    @property
    def roomy(self) -> bool:
        """Room for a run of admissions again after :attr:`full` (a quarter of
        ``max_in_flight`` free): the fetching side is woken once per run, not per change."""
        return self._jobs_after_watermark <= self._resume_at

    @property
    def in_flight(self) -> int:
        """Changes admitted after the watermark (handled or not): what a crash would re-deliver."""
        return self._jobs_after_watermark

    @property
    def free(self) -> int:
        """Changes that may be admitted now before :attr:`full`."""
        return self.max_in_flight - self._jobs_after_watermark

    @property
    def running(self) -> int:
        """Jobs taken and not yet done."""
        return self._running

    @property
    def ready(self) -> int:
        """Jobs that may start now (up to the free workers)."""
        return len(self._ready)

    @property
    def idle(self) -> bool:
        """Every admitted change is done (the watermark is the last admitted position)."""
        return self._routed == 0 and not self._held

    # -- inputs -------------------------------------------------------------------------------
    def admit(self, change: Any, key: Hashable, token: Any) -> Job:
        """A change came from the stream, with its key and the token after it."""
        if self._jobs_after_watermark >= self.max_in_flight:
            raise LanesError(f"admit() while full ({self.max_in_flight} changes in flight)")
        job = Job(self._seq, key, change, token)
        self._seq += 1
        self._order.append(job)
        self._jobs_after_watermark += 1
        if self._barrier is not None:
            self._held.append(job)
        else:
            self._route(job)
        return job

    def mark(self, token: Any) -> bool:
        """A position without a change; ``True``: the watermark moved to it at once."""
        if token is None:
            return False
        if not self._order:
            moved = bool(token != self.watermark)
            self.watermark = token
            return moved
        last = self._order[-1]
        if isinstance(last, _Mark):
            last.token = token  # consecutive marks: only the newest matters
        else:
            self._order.append(_Mark(token))
        return False

    def take(self) -> Job | None:
        """The next job to start (``None``: none may start now); it counts as running."""
        if self._running >= self.workers or not self._ready:
            return None
        job = self._ready.popleft()
        job.running = True
        self._running += 1
        return job

    def done(self, job: Job) -> bool:
        """A taken job finished; ``True``: the watermark moved."""
        if not job.running:
            raise LanesError(f"done({job!r}): not running (never taken, or finished twice)")
        job.running = False
        self._running -= 1
        job.done = True
        job.change = None  # the change is no longer needed: free it while it waits in order
        self.handled += 1
        self._routed -= 1
        if job.key is BARRIER:
            self._barrier = None
            self._release_held()
        else:
            lanes = self._lanes
            lane = lanes.pop(job.key)  # (one hash per call: keys hash in Python, e.g. ObjectId)
            if lane:
                self._ready.append(lane.popleft())
                lanes[job.key] = lane  # the key passes to that job
            if self._barrier is not None and self._routed == 1:
                self._ready.append(self._barrier)  # everything before it has finished
        return self._advance()

    def fail(self, job: Job) -> list[Job]:
        """A taken job failed for good: it stays unhandled (the watermark stops before it) and
        every job not yet taken is dropped (:meth:`abandon`, returned)."""
        if not job.running:
            raise LanesError(f"fail({job!r}): not running")
        job.running = False
        self._running -= 1
        return self.abandon()

    def abandon(self) -> list[Job]:
        """Drop every job not yet taken (after a failure or a stop); returns them, in order.

        The watermark stays before the first of them, so a restart or a reopen
        delivers them again. Running jobs stay running until :meth:`done`.
        """
        jobs = [job for job in self._order if isinstance(job, Job) and not job.done]
        running = [job for job in jobs if job.running]
        dropped = [job for job in jobs if not job.running]
        self._ready.clear()
        self._held.clear()
        self._lanes = {job.key: None for job in running if job.key is not BARRIER}
        self._barrier = next((job for job in running if job.key is BARRIER), None)
        self._routed = len(running)
        return dropped

    def restart(self, watermark: Any) -> None:
        """Nothing runs any more: start over from ``watermark`` (a reopened stream's position)."""
        if self.running:
            raise LanesError(f"restart() with {self.running} jobs running")
        self._reset(watermark)

    # -- internals ----------------------------------------------------------------------------
    def _route(self, job: Job) -> None:
        self._routed += 1
        key = job.key
        if key is BARRIER:
            self._barrier = job
            if self._routed == 1:
                self._ready.append(job)
            return
        lanes = self._lanes
        size = len(lanes)
        lane = lanes.setdefault(key, None)  # (one hash: see done())
        if len(lanes) != size:
            self._ready.append(job)  # the key's first job
        elif lane is None:
            lanes[key] = collections.deque((job,))
        else:
            lane.append(job)

    def _release_held(self) -> None:
        held = self._held
        while held and self._barrier is None:
            self._route(held.popleft())

    def _advance(self) -> bool:
        order = self._order
        moved = False
        while order and order[0].done:
            entry = order.popleft()
            if isinstance(entry, Job):
                self._jobs_after_watermark -= 1
            self.watermark = entry.token
            moved = True
        return moved


# -- keys ------------------------------------------------------------------------------------
KeyFunction = Callable[[Any], Hashable | None]


def default_key(change: Any) -> Hashable:
    """The namespace and ``documentKey._id`` of ``change`` (dict or typed event), else :data:`BARRIER`.

    Only ``_id`` is used (not the shard key fields of a sharded collection's
    ``documentKey``), since an update may change a document's shard key but
    never its ``_id``: one document always maps to one lane.
    """
    if type(change) is dict:  # the common case, checked without the ABC machinery
        document_key = change.get("documentKey")
        ns = change.get("ns")
        if type(ns) is dict and type(document_key) is dict and "_id" in document_key:
            return (ns.get("db"), ns.get("coll"), hashable(document_key["_id"]))
    if isinstance(change, Mapping):
        document_key = change.get("documentKey")
        ns = change.get("ns")
        db, coll = (ns.get("db"), ns.get("coll")) if isinstance(ns, Mapping) else (None, None)
    else:
        document_key = getattr(change, "document_key", None)
        ns = getattr(change, "ns", None)
        db, coll = getattr(ns, "db", None), getattr(ns, "coll", None)
    if not isinstance(document_key, (dict, Mapping)) or (
            "_id" not in document_key):
        return BARRIER
    return (db, coll, hashable(document_key["_id"]))


_SCALARS = (str, int, float, bytes, ObjectId)


class _NaN:
    """The one key of every NaN: ``NaN != NaN``, so each change of a document whose ``_id``
    is NaN would get a lane of its own (and run out of order)."""

    def __repr__(self) -> str:
        return "NaN"


_NAN: Final[Hashable] = _NaN()


def hashable(value: Any) -> Hashable:
    """``value`` itself when it can be a dict key, else its BSON bytes (documents, arrays).

    Keys compare by value: a NaN is :data:`_NAN` (documents and arrays holding one
    encode to the same bytes).
    """
    kind = type(value)
    if kind in _SCALARS:
        if kind is float and value != value:
            return _NAN
        return value  # type: ignore[no-any-return]
    if isinstance(value, (Mapping, list)):
        return bson.encode({"": value})
    try:
        hash(value)
    except TypeError:
        return bson.encode({"": value})
    return value  # type: ignore[no-any-return]


def _by_value(value: Any, key: Callable[..., Any]) -> Hashable:
    """A ``key=`` result as a key that compares by value; one line naming ``key`` if it cannot be.

    An object whose class keeps ``object``'s identity hash would give every change a
    lane of its own: per-key order would silently not hold.
    """
    kind = type(value)
    if kind in _SCALARS:
        return hashable(value)
    if kind is tuple:
        return tuple(_by_value(item, key) for item in value)
    if isinstance(value, (Mapping, list)):
        return hashable(value)
    if getattr(kind, "__hash__", None) is object.__hash__:
        raise TypeError(_not_a_key(key, value, "compares by identity (its class defines no "
                                               "__eq__ and __hash__), so every change would "
                                               "get a lane of its own"))
    try:
        return hashable(value)
    except Exception:  # unhashable and not BSON: no key at all
        raise TypeError(_not_a_key(key, value, "is neither hashable nor BSON")) from None


def _not_a_key(key: Callable[..., Any], value: Any, why: str) -> str:
    name = getattr(key, "__qualname__", None) or repr(key)
    return (f"key={name} returned {type(value).__name__} {value!r:.80}, which {why}: return a "
            "value that compares by value (a str, a number, an ObjectId, a tuple of them, a "
            "document) or None for a change that runs alone")


def key_of(key: KeyFunction | None) -> Callable[[Any], Hashable]:
    """The key function a run uses: ``key`` (``None`` from it means :data:`BARRIER`) or the default."""
    if key is None:
        return default_key
    if not callable(key):
        raise TypeError(f"key must be a function of the change, not {type(key).__name__}")

    def keyed(change: Any) -> Hashable:
        value = key(change)
        if value is None:
            return BARRIER
        if type(value) is str:  # the common case, no further check
            return value
        return _by_value(value, key)

    return keyed


def lanes_for(workers: object, max_in_flight: object) -> Lanes | None:
    """The dispatcher for ``consume(workers=..., max_in_flight=...)`` (``None``: one at a time)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be an integer from 1 to {MAX_WORKERS}, not {workers!r}")
    if max_in_flight is None:
        max_in_flight = default_max_in_flight(workers)
    elif (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
          or max_in_flight < 1):
        raise ValueError(f"max_in_flight must be an integer >= 1 or None, not {max_in_flight!r}")
    if workers == 1:
        return None
    return Lanes(workers, max_in_flight)


MAX_WORKERS: Final = 100_000
