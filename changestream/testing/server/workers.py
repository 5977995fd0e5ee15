"""Worker threads for the listeners: started on demand for the blocking part of a request
(running a command, which may wait: an awaitable hello, a getMore, a blocked command),
exiting when idle, so threads follow the operations in flight, not the connections open.

Apart from :mod:`.transport` (sockets and framing) because how threads come and go is its
own policy, tested on its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

WORKER_IDLE_SECONDS = 10.0
"""A worker with nothing to do for this long exits."""


class _Slot:
    """An idle worker's mailbox: the pool puts one task (or ``None``: exit) and wakes it."""

    __slots__ = ("ready", "task")

    def __init__(self) -> None:
        self.task: Callable[[], None] | None = None
        self.ready = threading.Event()


class WorkerPool:
    """Threads started on demand for blocking work; idle ones exit after a while.

    A new request starts a thread at once while fewer than ``min_threads``
    workers run quick requests (workers busy for over ``spawn_delay`` are
    taken to be waiting: an awaitable hello, a getMore, a blocked command);
    otherwise a thread is added only when queued work has waited
    ``spawn_delay`` seconds without any worker taking a task. So a burst of
    quick requests is served by a few threads, while operations that wait
    (each holding its worker) never delay the others: mongod also has a
    thread per operation in flight. When a thread
    cannot be started, the work waits in the queue and :meth:`retry` (called
    by the I/O thread) tries again.

    Work goes to the worker that went idle last (a stack, as the cached pools
    of Java and Go do), so the surplus after a burst stays untouched and exits
    after ``idle_seconds``. A shared FIFO queue would hand each idle worker a
    task now and then, and a pool that once grew to hundreds of threads would
    keep them for as long as any traffic went on.
    """

    def __init__(
        self,
        name: str,
        *,
        min_threads: int = 4,
        spawn_delay: float = 0.02,
        idle_seconds: float = WORKER_IDLE_SECONDS,
    ) -> None:
        self.name = name
        self.min_threads = min_threads
        self.spawn_delay = spawn_delay
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._queue: deque[Callable[[], None]] = deque()
        """Work no idle worker could take at once."""
        self._idle: list[_Slot] = []
        """Idle workers, the one idle longest first."""
        self._threads: set[threading.Thread] = set()
        self._names = itertools.count(1)
        self._starved = False
        self._stopping = False
        self._last_take = time.monotonic()
        self._task_started: dict[int, float] = {}
        """When each busy worker (by thread id) started its current task."""
        self.busy = 0

    @property
    def threads(self) -> int:
        with self._lock:
            return len(self._threads)

    @property
    def backlogged(self) -> bool:
        """Work is queued (the I/O thread then calls :meth:`retry` often)."""
        return bool(self._queue)

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                slot = self._idle.pop()
                slot.task = task
                slot.ready.set()
                return
            self._queue.append(task)
            # Workers busy for longer than spawn_delay are waiting (a hello, a getMore):
            # only those still running quick requests count against min_threads.
            now = time.monotonic()
            quick = sum(1 for t in self._task_started.values() if now - t < self.spawn_delay)
        if quick < self.min_threads:
            self._spawn()

    def retry(self) -> None:
        """Add a thread when queued work has waited too long (or none could be started)."""
        with self._lock:
            if not self._queue or time.monotonic() - self._last_take < self.spawn_delay:
                return
            self._last_take = time.monotonic()
        self._spawn()

    def stop(self, deadline: float) -> list[str]:
        """End idle workers, wait for busy ones until ``deadline``; return those still running."""
        with self._lock:
            self._stopping = True
            threads = list(self._threads)
            idle, self._idle = self._idle, []
        for slot in idle:
            slot.ready.set()  # no task: exit
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]

    def _spawn(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"{self.name}-{next(self._names)}", daemon=True
        )
        with self._lock:
            if self._stopping:
                return
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread"
            with self._lock:
                self._threads.discard(thread)
                first = not self._starved
                self._starved = True
            if first:
                log.warning(
                    "%s: cannot start a thread (%s); requests wait for a free worker "
                    "and starting one is retried",
                    self.name,
                    exc,
                )
            return
        if self._starved:
            self._starved = False
            log.warning("%s: threads can be started again", self.name)

    def _take(self) -> Callable[[], None] | None:
        """The next task: queued work, else wait idle (``None``: exit)."""
        with self._lock:
            if self._queue:
                self._last_take = time.monotonic()
                return self._queue.popleft()
            if self._stopping:
                return None
            slot = _Slot()
            self._idle.append(slot)
        if not slot.ready.wait(self.idle_seconds):
            with self._lock:
                if slot.task is None:  # still idle, nothing promised: leave
                    with contextlib.suppress(ValueError):
                        self._idle.remove(slot)
                    return None
        self._last_take = time.monotonic()
        return slot.task

    def _run(self) -> None:
        me = threading.current_thread()
        ident = me.ident or 0
        try:
            while (task := self._take()) is not None:
                with self._lock:
                    self.busy += 1
                    self._task_started[ident] = time.monotonic()
                try:
                    task()
                except Exception:
                    log.exception("%s: a request failed", self.name)
                finally:
                    with self._lock:
                        self.busy -= 1
                        self._task_started.pop(ident, None)
        finally:
            with self._lock:
                self._threads.discard(me)
