"""Panics that native libraries print straight to file descriptor 2, kept off the terminal.

delta-rs (``deltalake``) runs its writers on Rust threads; when a write fails (a full disk,
a lost connection to an object store) those threads may panic, and Rust prints each panic
(and, with ``RUST_BACKTRACE`` set, a backtrace) to file descriptor 2 before the Python
exception arrives. The command already says in one line what failed, so ``mirror`` runs
with :func:`panics_held`: file descriptor 2 goes through a pipe, a panic's lines are dropped
(logged at DEBUG), and every other line reaches the terminal unchanged. Python's own
``sys.stderr`` keeps writing to the terminal itself (the status line redraws in place).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

__all__ = ["PanicFilter", "panics_held"]

log = logging.getLogger("changestream.cli")

_PANIC = re.compile(r"^thread '.*' \(?.*panicked at ")
_PANIC_TAIL = ("stack backtrace:", "note: ", " ", "\t")


class PanicFilter:
    """Line by line: which lines belong to a Rust panic report (no I/O)."""

    def __init__(self) -> None:
        self._in_panic = False
        self._message_due = False
        self._blank: str | None = None
        """A blank line held back: Rust starts each panic report with one."""
        self.panics: list[str] = []
        """The first line of each panic's message (``Already shut down``, ...)."""

    def feed(self, line: str) -> list[str]:
        """The lines to show now, given the next line written."""
        if _PANIC.match(line):
            self._in_panic, self._message_due, self._blank = True, True, None
            return []
        if self._in_panic:
            if self._message_due:
                self._message_due = False
                self.panics.append(line.strip())
                return []
            if not line.strip() or line.startswith(_PANIC_TAIL):
                return []
            self._in_panic = False
        if not line.strip():
            held, self._blank = self._blank, line
            return [] if held is None else [held]
        held, self._blank = self._blank, None
        return [line] if held is None else [held, line]

    def flush(self) -> list[str]:
        """What is held back when the writing ends."""
        held, self._blank = self._blank, None
        return [] if held is None else [held]


@contextlib.contextmanager
def panics_held() -> Iterator[PanicFilter]:
    """File descriptor 2 through a :class:`PanicFilter` while the block runs."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable descriptor 2: nothing to keep clean
        yield PanicFilter()
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    panic_filter = PanicFilter()

    def forward() -> None:
        with os.fdopen(read_end, "r", errors="replace", closefd=True) as lines:
            for line in lines:
                for shown in panic_filter.feed(line):
                    os.write(saved, shown.encode(errors="replace"))
            for shown in panic_filter.flush():
                os.write(saved, shown.encode(errors="replace"))

    forwarder = threading.Thread(target=forward, name="changestream-stderr", daemon=True)
    forwarder.start()
    # Python's own output (log records, the status line with its \r redraws, isatty()) goes
    # straight to the real stderr; only what native code writes to descriptor 2 is filtered.
    python_stderr, sys.stderr = sys.stderr, os.fdopen(
        os.dup(saved), "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None),
        errors="backslashreplace")
    try:
        yield panic_filter
    finally:
        with contextlib.suppress(ValueError, OSError):
            sys.stderr.flush()
            sys.stderr.close()
        sys.stderr = python_stderr
        os.dup2(saved, 2)  # closes the pipe's last write end: the forwarder reads to its end
        forwarder.join(5)
        os.close(saved)
        for message in panic_filter.panics:
            log.debug("a native library's thread panicked (not shown): %s", message)
