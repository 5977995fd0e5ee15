"""A batch's document texts made in a helper process, while the stream's interpreter reads on.

Why: a mirror is bound by one interpreter lock, which the stream's loop, the reading of
each event and the commits' conversion share. Decoding each key's last document and
making its relaxed Extended JSON text (~15 µs a document) is about a third of that lock's
time at 1M rows (``benchmarks/README.md``); a process of its own takes it to a core the
mirror otherwise leaves idle. The texts are the very ones :func:`._delta_json.relaxed_text`
makes in process, because the worker runs that function.

The worker is ``python -m changestream._json_worker`` on pipes (no ``multiprocessing``:
its spawn and forkserver re-import the user's main module). A request is a batch's
documents as their BSON bytes, back to back; the reply is their texts, one a line (JSON
text holds no newline). Anything odd (the worker would not start, died, replied out of
frame, or failed on a document) makes that batch's texts in process, which raises the
real error if there is one; after a failure of the worker itself the sink stays in
process, with one warning. The worker exits when its input closes, so when the sink's
process ends, even by kill -9; it ignores SIGINT (the terminal's Ctrl-C is the parent's).
It runs at a lower priority (:data:`NICENESS`): its texts are background work until the
stream waits for them, so it takes only what the stream and the server leave of the cores.
While the caller has nothing else to run (the stream waits for the commit), the batch is
shared: the caller makes parts of it in process beside the worker, on two cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import IO, Any, cast

from bson import json_util

try:
    import fcntl
except ImportError:  # (Windows)
    fcntl = None  # type: ignore[assignment]

from ._delta_json import relaxed_text
from ._merge import RELAXED

__all__ = ["LEAST_DOCUMENTS", "NICENESS", "SHARED_PART", "JsonWorker"]

LEAST_DOCUMENTS = 1_000
"""Documents in a batch below which the texts are made in process (a round trip and the
copies cost more than the work they move)."""

NICENESS = 10
"""How much lower than its parent's the worker's priority is (POSIX ``nice``; 0: the same).

Why: a batch's texts are made while the stream reads the next batch, so they are wanted only
by the commit behind it; at the same priority the worker took a core's time from the
stream's loop and from a server on the same machine, which the stream waits for. Niced, it
runs on what they leave, and when the stream does wait for the batch the caller makes parts
of it at its own priority (:meth:`JsonWorker._shared`). Measured: ``benchmarks/README.md``,
"The JSON worker niced"."""

SHARED_PART = 4_096
"""Documents in each part of a batch the worker and an idle caller share (:meth:`JsonWorker.__call__`)."""

_PIPE_BYTES = 1 << 20
_TURN = 256  # documents made in process between two yields of the interpreter lock
_HEADER = 8  # a frame's size, little-endian
_READY = b"R"
_FAILED, _MADE = b"\x01", b"\x00"

_log = logging.getLogger("changestream")


def _read(stream: IO[bytes], size: int) -> bytes:
    """Exactly ``size`` bytes, or ``EOFError``."""
    data = stream.read(size)
    if data is None or len(data) != size:
        raise EOFError(f"the JSON worker's pipe closed after {0 if not data else len(data)} "
                       f"of {size} bytes")
    return data


def _widen(pipe: IO[bytes]) -> None:
    """A pipe of up to 1 MB where Linux allows (64 KB otherwise): a part's frame in one
    system call, not one per 64 KB, each of which takes the interpreter lock again."""
    setting = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if setting is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe.fileno(), setting, _PIPE_BYTES)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Close the worker's input (it exits) and reap it; kill it if it does not go."""
    try:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(timeout=5)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        process.kill()
        process.wait()
    finally:
        if process.stdout is not None:
            process.stdout.close()


class JsonWorker:
    """The document column's texts of a batch (``json_texts``'s job), made in a helper process.

    A :class:`~changestream.delta.DeltaSink` has one (:attr:`DeltaSink.json_worker`); a
    :class:`~changestream.delta.DatabaseSink`'s tables share one. :attr:`enabled`,
    :attr:`pid` and :attr:`batches` say whether it is used, runs, and how much it made.

    Called as :func:`._delta_rows.json_texts`, which is ``in_process`` (the sink gives it:
    this module stays free of pyarrow). ``enabled=False``: always in process.
    The process starts with the first batch of at least :data:`LEAST_DOCUMENTS` BSON
    documents, and :meth:`close` stops it (the next such batch starts it again). It runs
    ``niceness`` (0-19, default :data:`NICENESS`) below its parent's priority where the
    system has one (POSIX).
    """

    def __init__(self, in_process: Callable[[Sequence[Any], json_util.JSONOptions],
                                            list[str | None]],
                 enabled: bool = True, *, least: int = LEAST_DOCUMENTS,
                 niceness: int = NICENESS) -> None:
        if type(niceness) is not int or not 0 <= niceness <= 19:
            raise ValueError(f"niceness must be an int from 0 to 19 (how much lower than "
                             f"this process's the JSON worker's priority is), not {niceness!r}")
        self.niceness = niceness
        self.in_process = in_process
        self.enabled = enabled
        self.least = least
        self.batches = 0
        """Exchanges with the worker: batches whose texts it made (a shared batch counts
        each part it made)."""
        self._process: subprocess.Popen[bytes] | None = None
        self._stopper: weakref.finalize | None = None  # type: ignore[type-arg]
        self._helper: futures.ThreadPoolExecutor | None = None
        """Runs the worker's side of a shared batch (started with the first such batch)."""
        self._helper_lock = threading.Lock()
        self._lock = threading.RLock()
        """One exchange at a time (commits run on threads); :meth:`close` waits for the one
        under way (re-entrant: a failing exchange stops the process while it holds it)."""

    def __repr__(self) -> str:
        state = "off" if not self.enabled else "running" if self._process else "idle"
        return f"JsonWorker({state}, batches={self.batches})"

    @property
    def pid(self) -> int | None:
        """The worker's process id (``None``: not running)."""
        return None if self._process is None else self._process.pid

    def __call__(self, documents: Sequence[Any], json_options: json_util.JSONOptions, *,
                 idle: Callable[[], bool] | None = None) -> list[str | None]:
        """``json_texts``'s texts. ``idle``: whether the caller's process has nothing else to
        run (a sink's stream waits for this commit); while it does, the caller makes parts
        of the batch in process beside the worker (:meth:`_shared`)."""
        raw = [doc for doc in documents if type(doc) is bytes] \
            if self.enabled and json_options is RELAXED else []
        made = None if len(raw) < self.least else self._exchange(raw) \
            if idle is None or len(raw) < 2 * SHARED_PART else self._shared(raw, idle)
        if made is None:
            return self.in_process(documents, json_options)
        texts = iter(made)  # the rest (None, texts made already, decoded documents): in process
        others = self.in_process([None if type(doc) is bytes else doc for doc in documents],
                                 json_options)
        return [next(texts) if type(doc) is bytes else other
                for doc, other in zip(documents, others, strict=True)]

    def _shared(self, raw: list[bytes], idle: Callable[[], bool]) -> list[str] | None:
        """The texts of ``raw`` in parts: the worker takes them from the front (on a helper
        thread) and, whenever ``idle()``, this thread takes them from the back in process.

        Why: at the end of a backlog the stream waits for the last commit, and its core and
        the server's are free; the worker alone would use one. ``None``: the worker failed
        (the caller makes the batch in process, raising the real error if there is one).
        """
        parts = [raw[at:at + SHARED_PART] for at in range(0, len(raw), SHARED_PART)]
        made: list[list[str] | None] = [None] * len(parts)
        ends = [0, len(parts)]  # the worker's next part; one past this thread's next
        claim = threading.Lock()

        def front() -> bool:
            while True:
                with claim:
                    if ends[0] >= ends[1]:
                        return True
                    at = ends[0]
                    ends[0] += 1
                made[at] = self._exchange(parts[at])
                if made[at] is None:
                    return False

        with self._helper_lock:
            if self._helper is None:
                self._helper = futures.ThreadPoolExecutor(1, "changestream-json-worker")
            worker = self._helper.submit(front)
        try:
            while not worker.done():
                at = None
                if idle():
                    with claim:
                        if ends[1] > ends[0]:
                            at = ends[1] = ends[1] - 1
                if at is None:
                    futures.wait([worker], timeout=0.005)
                else:
                    made[at] = self._in_turns(parts[at])
        finally:
            with claim:
                ends[1] = ends[0]  # (after an error here the worker claims no more)
        if not worker.result():
            return None
        return [text for part in made for text in cast(list[str], part)]

    def _in_turns(self, part: list[bytes]) -> list[str]:
        """``part``'s texts in process, the interpreter lock given up every few hundred: the
        helper thread's exchange needs it for a moment at each step, and would otherwise wait
        for the switch interval each time (the worker idle meanwhile)."""
        texts: list[str] = []
        for at in range(0, len(part), _TURN):
            texts += cast(list[str], self.in_process(part[at:at + _TURN], RELAXED))
            time.sleep(0)
        return texts

    def _exchange(self, raw: Sequence[bytes]) -> list[str] | None:
        """The worker's texts of ``raw``, or ``None``: make them in process."""
        with self._lock:
            if not self.enabled:
                return None  # (it failed while a shared batch was under way)
            process = self._process or self._start()
            if process is None:
                return None
            assert process.stdin is not None and process.stdout is not None
            joined = b"".join(raw)
            try:
                process.stdin.write(len(joined).to_bytes(_HEADER, "little"))
                process.stdin.write(joined)
                process.stdin.flush()
                status = _read(process.stdout, 1)
                body = _read(process.stdout,
                             int.from_bytes(_read(process.stdout, _HEADER), "little"))
            except (OSError, ValueError, EOFError) as exc:
                self._fail(f"its pipe broke ({exc})")
                return None
            if status != _MADE:
                return None  # a document it could not make: in process, with the real error
            texts = body.decode("ascii").split("\n")
            if len(texts) != len(raw):
                self._fail(f"it sent {len(texts)} texts for {len(raw)} documents")
                return None
            self.batches += 1
            return texts

    def _start(self) -> subprocess.Popen[bytes] | None:
        if not sys.executable:
            self._fail("no Python executable is known (sys.executable is empty)")
            return None
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            process = subprocess.Popen([sys.executable, "-m", "changestream._json_worker",
                                        str(self.niceness)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except OSError as exc:
            self._fail(f"it could not start ({exc})")
            return None
        assert process.stdin is not None and process.stdout is not None
        for pipe in (process.stdin, process.stdout):
            _widen(pipe)
        try:
            ready = _read(process.stdout, len(_READY))
        except EOFError:
            ready = b""
        if ready != _READY:
            _stop(process)
            self._fail(f"it exited as it started (exit code {process.returncode})")
            return None
        self._process = process
        self._stopper = weakref.finalize(self, _stop, process)
        return process

    def _fail(self, why: str) -> None:
        _log.warning("changestream: the JSON worker process is not used from now on, %s; "
                     "the sink makes its documents' texts in process", why)
        self.enabled = False
        self._stop_process()  # (the helper thread may be the caller: it is not joined here)

    def close(self) -> None:
        """Stop the worker (it exits once its input closes), after the batch it is making."""
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)
        self._stop_process()

    def _stop_process(self) -> None:
        with self._lock:
            stopper, self._stopper, self._process = self._stopper, None, None
        if stopper is not None:
            stopper()


def lower_priority(niceness: int) -> None:
    """The worker's own priority, ``niceness`` below its parent's (nothing where ``os.nice``
    is missing, or refused)."""
    nice = getattr(os, "nice", None)
    if niceness and nice is not None:
        with contextlib.suppress(OSError):
            nice(niceness)


def serve(source: IO[bytes], sink: IO[bytes]) -> None:
    """The worker's loop: a frame of BSON documents in, their texts out, until ``source`` ends."""
    sink.write(_READY)
    sink.flush()
    while True:
        header = source.read(_HEADER)
        if len(header) < _HEADER:
            return  # the sink's process closed the pipe, or ended
        data = _read(source, int.from_bytes(header, "little"))
        try:
            texts, position, end = [], 0, len(data)
            while position < end:
                size = int.from_bytes(data[position:position + 4], "little")
                if size < 5 or position + size > end:
                    raise ValueError(f"a document's size {size} at byte {position} is out of frame")
                texts.append(relaxed_text(data[position:position + size]))
                position += size
            reply, status = "\n".join(texts).encode("ascii"), _MADE
        except Exception as exc:  # the sink makes this batch in process, with the error
            reply, status = repr(exc).encode(), _FAILED
        sink.write(status + len(reply).to_bytes(_HEADER, "little"))
        sink.write(reply)
        sink.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lower_priority(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    _source, _sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not break the frames
    serve(_source, _sink)
