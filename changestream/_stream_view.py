"""What the consumers of a stream read of it: one typed seam instead of private names.

``consume`` (both loops), the hub, the stats timer, the oplog headroom probe and
the Spark prefetcher need more of a stream than a user does: whether it is
stalled in resumes, the token after a change in its cheapest form, a buffered
batch without I/O, the client to read the oplog through. Every stream class
(:class:`~changestream.ChangeStream`, :class:`~changestream.aio.AsyncChangeStream`,
:class:`~changestream.SnapshotThenWatch` and its asyncio twin) implements
:class:`StreamView`, so those consumers name no private member and a stream class
that lacks a member fails ``tests/client/test_stream_view.py`` (and ``mypy``
where a stream is passed as a :class:`StreamView`) instead of silently taking a
slower path.

The polling calls themselves (``try_next``, ``close``) are not here: they are
awaited on one side and not on the other, and the loops are written per side.
:meth:`StreamView.interrupt` is the one call that is (awaited on the asyncio side): the
sync stop watcher calls it from its own thread.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ._position import Position

__all__ = ["StreamView"]


@runtime_checkable
class StreamView(Protocol):
    """The members of a stream its consumers use beside polling (no I/O in any of them)."""

    @property
    def resume_token(self) -> Any:
        """The token a resume would use now (``None`` before the stream has one)."""

    @property
    def alive(self) -> bool:
        """False once closed, cancelled or invalidated."""

    @property
    def buffered(self) -> int:
        """Changes received and not yet returned (a poll needs no I/O while two or more wait)."""

    @property
    def position(self) -> Position | None:
        """The stream's position and lag (``None`` while a snapshot is copied)."""

    @property
    def resumes(self) -> int:
        """Automatic resumes so far."""

    @property
    def stalled(self) -> bool:
        """The stream resumed and no getMore succeeded since: a moved token is no progress."""

    @property
    def client(self) -> Any:
        """The client the stream reads through (``None`` until it has one): the headroom
        probe reads the oplog through it."""

    def carried_token(self) -> Any:
        """The token after the last change returned, as cheaply as it can be carried: the raw
        event's ``bytes`` when the token is inside it (see :meth:`present_token`)."""

    def present_token(self, carried: Any) -> Any:
        """A token from :meth:`carried_token` or :meth:`take_carried` as a token in the
        stream's document class (what a store saves)."""

    def interrupt(self) -> Any:
        """End a poll waiting on the server, from another thread or task (awaited on the
        asyncio side): safe while that poll runs, and it never touches state the poll uses.
        A change stream closes (its getMore's cursor is killed aside); a snapshot closes only
        its change stream, if one is open (the copy's session stays with the copy)."""

    def take_carried(self, limit: int) -> list[tuple[Any, Any]]:
        """Up to ``limit`` buffered changes, each with its carried token; no I/O, ``[]`` when
        the buffer cannot answer without a command (or another call is under way)."""
