"""A TCP listener for the MongoDB wire protocol: one I/O thread, worker threads per request.

Why this shape (see docs/testing.md, "Connections"): a connection costs what it
costs mongod only if an idle one costs no thread. One I/O thread per listener
waits on every socket with :mod:`selectors` (epoll on Linux), accepts, and reads
each message incrementally against the length its header announces; it never
runs a command. A complete message goes to a worker thread, which may block as
long as the operation needs (an awaitable hello, a change-stream getMore
waiting for events, failCommand's ``blockConnection``). Workers are started on
demand and exit after :data:`~.workers.WORKER_IDLE_SECONDS` idle, so threads follow the
operations in flight, not the connections open: 10,000 idle connections are
one thread, and 10,000 closing together are 10,000 cheap events on that one
thread instead of 10,000 threads fighting for the GIL.

While a worker owns a connection, the I/O thread does not watch it; the worker
hands it back after the reply. Accepting never stops: when the process runs
out of descriptors (EMFILE) the listener stops watching for new connections for
a moment, logs it once, and tries again; when no thread can be started, the
request waits until a worker frees up or a thread can be started. A message
whose bytes do not all arrive within :data:`MESSAGE_TIMEOUT_SECONDS` of its
first byte closes its connection (slowloris), and a header announcing a large
message costs nothing until the bytes really come.

The listener knows framing, not commands: a :class:`Handler` gets each
complete message and the :class:`Connection` to reply on, so a mongod member
and a mongos router can share it.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import resource
import select
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .workers import WorkerPool

log = logging.getLogger(__name__)

MESSAGE_TIMEOUT_SECONDS = 30.0
"""How long the bytes of one message may take to arrive, from its first byte."""
ACCEPT_BACKOFF_SECONDS = (0.05, 1.0)
"""First and longest pause in accepting after the process ran out of descriptors."""
LINGER_SECONDS = 0.2
"""How long a worker that sent a reply waits on that connection for the next request."""
LINGER_WORKERS = 8
"""How many workers of a listener may wait so at a time."""
_RECV_CHUNK = 256 * 1024
_TICK_SECONDS = 0.25
"""How often the I/O thread looks at timeouts and at accepting paused for EMFILE."""
_BACKLOG = 1024
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class FramingError(Exception):
    """The bytes on a connection are not a message: close it."""


HeaderCheck = Callable[[bytes], int]
"""Given a message's first 16 bytes, return its total length or raise :class:`FramingError`
(or any exception) to close the connection."""


class Connection:
    """One accepted connection: its socket, its partly read bytes, the handler's context."""

    __slots__ = (
        "_buf",
        "_check",
        "_expected",
        "busy",
        "closed",
        "context",
        "id",
        "peer",
        "sock",
        "started",
    )

    def __init__(self, conn_id: int, sock: socket.socket, peer: Any, check: HeaderCheck) -> None:
        self.id = conn_id
        self.sock = sock
        self.peer = peer
        self.context: Any = None
        """Whatever the handler keeps per connection."""
        self.closed = False
        self._buf = bytearray()
        self._expected: int | None = None
        self.started: float | None = None
        """``time.monotonic()`` when the first byte of an incomplete message came."""
        self.busy = False
        self._check = check

    def feed(self, data: bytes) -> None:
        self._buf += data

    def take_message(self) -> bytes | None:
        """The next complete message, or None while its bytes are still coming."""
        buf = self._buf
        if self._expected is None:
            if len(buf) < 16:
                return None
            self._expected = self._check(bytes(buf[:16]))
        if len(buf) < self._expected:
            return None
        message = bytes(buf[: self._expected])
        del buf[: self._expected]
        self._expected = None
        return message

    @property
    def pending(self) -> bool:
        """Bytes of an incomplete message are waiting."""
        return bool(self._buf)

    def send(self, data: bytes) -> None:
        """Send all of ``data`` (from a worker); raises OSError once the connection is closed."""
        view = memoryview(data)
        poller: select.poll | None = None
        while view:
            if self.closed:
                raise ConnectionAbortedError("the connection was closed")
            try:
                sent = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent:
                view = view[sent:]
                continue
            if poller is None:
                poller = select.poll()
                poller.register(self.sock, select.POLLOUT)
            poller.poll(_TICK_SECONDS * 1000)

    def shutdown(self) -> None:
        """Mark closed and shut the socket (any thread); the I/O thread closes it."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class Handler(Protocol):
    """What a listener serves."""

    def connection_made(self, conn: Connection) -> None:
        """A new connection (on the I/O thread; must not block)."""

    def handle(self, conn: Connection, message: bytes) -> None:
        """One complete message (on a worker; may block; replies with ``conn.send``)."""

    def connection_lost(self, conn: Connection) -> None:
        """The connection is closed (on the I/O thread; must not block)."""


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; return (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.debug("could not raise the descriptor limit to %d: %s", target, exc)
    return soft, hard


class Listener:
    """Serves ``handler`` on ``host:port`` (0: a free port) until :meth:`stop`."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        check_header: HeaderCheck,
        name: str = "sim",
        message_timeout: float = MESSAGE_TIMEOUT_SECONDS,
    ) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self.name = name
        self.message_timeout = message_timeout
        self.check_header = check_header
        self.total_created = 0
        self.accept_failures = 0
        """How many times accepting was paused for lack of descriptors or memory."""
        self.connection_ids: Iterator[int] = itertools.count(1)
        """Where connection ids come from (each mongod numbers its own from 1)."""
        self._conns: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._idle_cond = threading.Condition(self._lock)
        self._selector: selectors.BaseSelector | None = None
        self._sock: socket.socket | None = None
        self._accepting = False
        self._accept_paused_until = 0.0
        self._accept_backoff = ACCEPT_BACKOFF_SECONDS[0]
        self._draining = False
        self._returned: deque[Connection] = deque()
        self._lingering = 0
        self._calls: deque[tuple[Callable[[], None], threading.Event]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.workers = WorkerPool(f"{name}-worker")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> int:
        """Bind, start the I/O thread, return the bound port."""
        raise_descriptor_limit()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(_BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        selector.register(sock, selectors.EVENT_READ, self)
        self._selector = selector
        self._accepting = True
        thread = threading.Thread(
            target=self._loop, name=f"{self.name}-io-{self.port}", daemon=True
        )
        self._thread = thread
        thread.start()
        return self.port

    def stop_accepting(self) -> None:
        """Close the listening socket (the port is free when this returns)."""
        self._call(self._close_listener)

    def drain(self) -> None:
        """Stop starting new requests: bytes that arrive now stay unread until :meth:`stop`."""
        self._draining = True

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no request is being served (or ``deadline``); True when idle."""
        with self._idle_cond:
            while any(c.busy for c in self._conns.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle_cond.wait(min(left, _TICK_SECONDS))
        return True

    def stop(self, timeout: float = 5.0) -> list[str]:
        """Stop accepting, close every connection, end the threads; return workers still running."""
        deadline = time.monotonic() + timeout
        if self._thread is None:
            return []
        self.stop_accepting()
        self.close_all()
        self.wait_idle(deadline)
        self._stopping.set()
        self._wake()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        left = self.workers.stop(deadline)
        if not self._thread.is_alive():
            for conn in self.connections():  # handed back after the I/O thread ended
                conn.sock.close()
            self._wake_r.close()
            self._wake_w.close()
        return left

    # -- connections -------------------------------------------------------------------------
    @property
    def connection_count(self) -> int:
        with self._lock:
            return len(self._conns)

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._conns.values())

    def busy_count(self) -> int:
        """Connections whose request a worker is serving now."""
        with self._lock:
            return sum(1 for c in self._conns.values() if c.busy)

    def close(self, conn_id: int) -> bool:
        with self._lock:
            conn = self._conns.get(conn_id)
        if conn is None:
            return False
        conn.shutdown()
        self._wake()
        return True

    def close_all(self) -> int:
        conns = self.connections()
        for conn in conns:
            conn.shutdown()
        self._wake()
        return len(conns)

    # -- the I/O thread ------------------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread and wait for it (directly when not running)."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            fn()
            return
        done = threading.Event()
        self._calls.append((fn, done))
        self._wake()
        while not done.wait(_TICK_SECONDS):
            if not thread.is_alive():
                fn()
                return

    def _close_listener(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._accepting and self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
        self._accepting = False
        sock.close()

    def _loop(self) -> None:
        selector = self._selector
        assert selector is not None
        next_tick = 0.0
        try:
            while not self._stopping.is_set():
                backlogged = self.workers.backlogged
                events = selector.select(self.workers.spawn_delay if backlogged else _TICK_SECONDS)
                for key, _mask in events:
                    data = key.data
                    if data is None:
                        with contextlib.suppress(OSError):
                            while self._wake_r.recv(4096):
                                pass
                    elif data is self:
                        self._accept()
                    else:
                        self._read(data)
                self._run_calls()
                self._take_back()
                self.workers.retry()
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + _TICK_SECONDS
                    self._tick(now)
        except Exception:
            log.exception("%s: the I/O thread failed", self.name)
        finally:
            self._close_listener()
            self._run_calls()
            for conn in self.connections():
                self._drop(conn)
            selector.close()

    def _run_calls(self) -> None:
        while self._calls:
            fn, done = self._calls.popleft()
            try:
                fn()
            finally:
                done.set()

    def _tick(self, now: float) -> None:
        if self._sock is not None and not self._accepting and now >= self._accept_paused_until:
            assert self._selector is not None
            self._selector.register(self._sock, selectors.EVENT_READ, self)
            self._accepting = True
        timeout = self.message_timeout
        for conn in self.connections():
            if conn.closed and not conn.busy:
                self._drop(conn)
            elif conn.started is not None and not conn.busy and now - conn.started > timeout:
                log.debug(
                    "%s: closing connection %d: a message took over %.0fs to arrive",
                    self.name,
                    conn.id,
                    timeout,
                )
                self._drop(conn)

    def _accept(self) -> None:
        sock = self._sock
        assert sock is not None
        for _ in range(256):
            try:
                client, peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._pause_accepting(exc)
                    return
                log.debug("%s: accept failed: %s", self.name, exc)
                continue
            if self._accept_backoff != ACCEPT_BACKOFF_SECONDS[0]:
                self._accept_backoff = ACCEPT_BACKOFF_SECONDS[0]
                log.warning("%s:%d accepts connections again", self.host, self.port)
            try:
                client.setblocking(False)
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                client.close()
                continue
            conn = Connection(next(self.connection_ids), client, peer, self.check_header)
            with self._lock:
                self._conns[conn.id] = conn
                self.total_created += 1
            try:
                self.handler.connection_made(conn)
                assert self._selector is not None
                self._selector.register(client, selectors.EVENT_READ, conn)
            except Exception:
                log.exception("%s: could not set up connection %d", self.name, conn.id)
                self._drop(conn)

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of descriptors: stop watching the listening socket for a while (logged once)."""
        self.accept_failures += 1
        if self._accept_backoff == ACCEPT_BACKOFF_SECONDS[0]:
            log.warning(
                "%s:%d cannot accept connections (%s); retrying until it can",
                self.host,
                self.port,
                exc.strerror or exc,
            )
        assert self._selector is not None and self._sock is not None
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._sock)
        self._accepting = False
        self._accept_paused_until = time.monotonic() + self._accept_backoff
        self._accept_backoff = min(self._accept_backoff * 2, ACCEPT_BACKOFF_SECONDS[1])

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data or conn.closed:
            self._drop(conn)
            return
        conn.feed(data)
        self._next_request(conn)

    def _next_request(self, conn: Connection) -> None:
        """Hand a complete message to a worker, or note when an incomplete one started."""
        if self._draining:
            return
        try:
            message = conn.take_message()
        except Exception as exc:
            log.debug("%s: closing connection %d: %s", self.name, conn.id, exc)
            self._drop(conn)
            return
        if message is None:
            if conn.pending and conn.started is None:
                conn.started = time.monotonic()
            elif not conn.pending:
                conn.started = None
            return
        conn.started = None
        assert self._selector is not None
        self._selector.unregister(conn.sock)
        with self._lock:
            conn.busy = True
        self.workers.submit(lambda: self._serve(conn, message))

    def _serve(self, conn: Connection, message: bytes) -> None:
        """On a worker: serve ``message``, then what follows on the connection soon after."""
        try:
            current: bytes | None = message
            while not conn.closed and not self._draining:
                if current is None:
                    current = self._linger(conn)
                    if current is None:
                        break
                self.handler.handle(conn, current)
                current = conn.take_message()
        except Exception as exc:
            if not isinstance(exc, OSError):
                log.debug("%s: closing connection %d: %r", self.name, conn.id, exc)
            conn.shutdown()
        finally:
            with self._idle_cond:
                conn.busy = False
                self._idle_cond.notify_all()
            self._returned.append(conn)
            self._wake()

    def _linger(self, conn: Connection) -> bytes | None:
        """Wait a moment on the worker for the connection's next message (None: hand it back).

        A client in a request/reply loop sends its next request right after
        a reply; the worker still holding the connection is then woken by the
        kernel directly, as a thread per connection would be, instead of the
        I/O thread waking a worker (a second scheduling delay on a busy
        machine). At most :data:`LINGER_WORKERS` workers linger at a time, so
        many connections served once cost no more threads.
        """
        with self._lock:
            if self._lingering >= LINGER_WORKERS:
                return None
            self._lingering += 1
        try:
            deadline = time.monotonic() + LINGER_SECONDS
            poller = select.poll()
            poller.register(conn.sock, select.POLLIN)
            while not conn.closed and not self._draining:
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(min(left, _TICK_SECONDS) * 1000):
                    if left <= 0:
                        return None
                    continue
                try:
                    data = conn.sock.recv(_RECV_CHUNK)
                except (BlockingIOError, InterruptedError):
                    continue
                if not data:
                    conn.shutdown()  # the client left: the I/O thread drops it
                    return None
                conn.feed(data)
                message = conn.take_message()
                if message is not None:
                    return message
            return None
        finally:
            with self._lock:
                self._lingering -= 1

    def _take_back(self) -> None:
        """Watch connections again whose worker is done with them."""
        selector = self._selector
        assert selector is not None
        while self._returned:
            conn = self._returned.popleft()
            if conn.closed:
                self._drop(conn)
                continue
            try:
                selector.register(conn.sock, selectors.EVENT_READ, conn)
            except (KeyError, ValueError, OSError):
                self._drop(conn)
                continue
            if conn.pending:
                self._next_request(conn)

    def _drop(self, conn: Connection) -> None:
        """Forget and close ``conn`` (I/O thread only, so a descriptor is never reused early)."""
        if conn.busy:  # its worker still uses the socket: shut it, close it when handed back
            conn.shutdown()
            return
        conn.closed = True
        with self._lock:
            known = self._conns.pop(conn.id, None) is not None
        if self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        conn.sock.close()
        if known:
            try:
                self.handler.connection_lost(conn)
            except Exception:
                log.exception("%s: connection_lost failed", self.name)
