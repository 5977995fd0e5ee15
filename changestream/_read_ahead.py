"""Reading ahead: the next getMore sent as soon as a batch arrives, while the caller handles it.

Why: a stream's consumer and the server take turns. The server builds a batch
while the consumer waits, then the consumer handles it while the server waits
for the next getMore. ``consume`` asks its stream to read ahead
(:meth:`~changestream.ChangeStream.read_ahead`), so the server builds batch N+1
while the handler works through batch N: a consumer whose handler costs as much
as the server's work then runs at about the rate of the slower of the two,
instead of their sum.

The machine never learns of it: the getMore sent ahead is the very command the
machine will ask for next (the same cursor, the same fields), and its outcome,
success or error, is handed to the machine only when the machine asks, exactly
as if it had just been run. When the machine asks for anything else instead
(a killCursors as the stream closes, or an aggregate to resume), the read-ahead's
outcome is dropped after it arrives (the session is never used by two commands at
once): its changes were never handed out, and the resume starts from the token
of the last change that was. A close first sends its killCursors on a connection of
its own (as a close from another thread does), so a getMore read ahead that waits on
an idle stream ends at once instead of after its await; not behind a load balancer,
where the cursor lives on the one connection the getMore holds.

Off by default: the spec's command sequence (tested command by command by the
unified tests) is one getMore per exhausted batch.

The sync shell runs the getMore on a thread of its own (one per batch, ended with
it), in the context of the call that received the batch (its client-side
timeout); the asyncio shell in a task.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable

from ._actions import Action, ErrorInfo, RunGetMore
from ._pymongo import CommandResult

__all__ = ["READ_AHEAD_BATCH", "TaskAhead", "ThreadAhead", "answers", "reads_ahead"]

READ_AHEAD_BATCH = 2_000
"""``consume``'s getMore batch size when the caller sets none: a backlog comes in
16 MB batches (~25,000 events of 700 bytes), and reading ahead overlaps the server's
work with the handler's only batch by batch, so smaller batches overlap more."""


def reads_ahead(action: Action, outcome: CommandResult) -> bool:
    """Whether to send ``action`` again at once: a getMore that succeeded on a live cursor."""
    if not isinstance(action, RunGetMore) or isinstance(outcome, ErrorInfo):
        return False
    reply = outcome[0]
    try:
        return bool(reply["cursor"]["id"])
    except (KeyError, TypeError):
        return False  # a malformed reply: the machine reports it, nothing more is sent


def answers(sent: RunGetMore, action: Action) -> bool:
    """Whether the getMore read ahead answers the command the machine now asks for: a getMore
    on the same cursor. Its fields are not compared: the cursor has moved past the changes
    the read-ahead brought, so its reply must be used whenever the cursor is the same (the
    machine builds every getMore of a cursor alike, so they never differ anyway)."""
    return (isinstance(action, RunGetMore) and action.address == sent.address
            and action.command["getMore"] == sent.command["getMore"]
            and action.command.get("collection") == sent.command.get("collection"))


class ThreadAhead:
    """A getMore read ahead on a thread of its own (the sync shell)."""

    def __init__(self, run: Callable[[RunGetMore], CommandResult], action: RunGetMore) -> None:
        self.action = action
        self._outcome: CommandResult | None = None
        context = contextvars.copy_context()  # the timeout of the call that got the batch

        def target() -> None:
            self._outcome = context.run(run, action)

        self._thread = threading.Thread(target=target, name="changestream-read-ahead",
                                        daemon=True)
        self._thread.start()

    def outcome(self) -> CommandResult:
        """Wait for the getMore's outcome (the transport returns failures as ``ErrorInfo``)."""
        self._thread.join()
        assert self._outcome is not None
        return self._outcome


class TaskAhead:
    """A getMore read ahead in a task (the asyncio shell)."""

    def __init__(self, run: Callable[[RunGetMore], Awaitable[CommandResult]],
                 action: RunGetMore) -> None:
        self.action = action
        self._task: asyncio.Future[CommandResult] = asyncio.ensure_future(run(action))

    async def outcome(self) -> CommandResult:
        """Wait for the getMore's outcome (cancelling the wait cancels the getMore)."""
        return await self._task
