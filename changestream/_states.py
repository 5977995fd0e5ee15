"""The change-stream machine's phases and every transition between them, in one table.

:class:`~changestream._machine.ChangeStreamMachine` changes phase only through
:func:`advance`, with the :class:`Step` that happened; a step the table does not
allow from the current phase is a bug and raises at once, instead of leaving the
machine in a state no rule covers. ``docs/resumability.md`` shows the diagram
:func:`mermaid` draws from this table (a test keeps the two equal).

What happens *within* a phase (which command runs next, which token is cached)
is the machine's; this table says only which phase follows which.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

__all__ = ["TRANSITIONS", "Phase", "Step", "advance", "mermaid"]


class Phase(enum.Enum):
    NEW = "new"
    """Before the initial aggregate succeeded."""
    OPEN = "open"
    """A server cursor (or its final buffered batch) exists."""
    RESUME_PENDING = "resume pending"
    """The cursor is unusable (resumable error or timeout); the next step is a resume."""
    CLOSED = "closed"
    """Closed, invalidated, exhausted or failed: nothing more is returned."""


class Step(enum.Enum):
    """What happened to move the machine (the labels of the diagram's arrows)."""

    AGGREGATE_OK = "aggregate ok"
    """The initial or a resume aggregate returned a cursor."""
    GETMORE_RESUMABLE = "getMore: resumable error"
    """Spec "Resumable Error" (network, CursorNotFound, label or code by wire version)."""
    GETMORE_TIMEOUT = "getMore: client timeout"
    """CSOT expired: the stream stays usable, the next call resumes."""
    RESUME_TIMEOUT = "resume aggregate: client timeout"
    """A resume aggregate hit CSOT: still usable, the next call resumes again."""
    CLOSE = "close / error / end"
    """``close()``, a non-resumable error, an aggregate error, the cursor's end."""


TRANSITIONS: Final[Mapping[tuple[Phase, Step], Phase]] = {
    (Phase.NEW, Step.AGGREGATE_OK): Phase.OPEN,
    (Phase.NEW, Step.CLOSE): Phase.CLOSED,
    (Phase.OPEN, Step.GETMORE_RESUMABLE): Phase.RESUME_PENDING,
    (Phase.OPEN, Step.GETMORE_TIMEOUT): Phase.RESUME_PENDING,
    (Phase.OPEN, Step.CLOSE): Phase.CLOSED,
    (Phase.RESUME_PENDING, Step.AGGREGATE_OK): Phase.OPEN,
    (Phase.RESUME_PENDING, Step.RESUME_TIMEOUT): Phase.RESUME_PENDING,
    (Phase.RESUME_PENDING, Step.CLOSE): Phase.CLOSED,
    (Phase.CLOSED, Step.CLOSE): Phase.CLOSED,
}
"""(phase, step) -> next phase; any pair not listed is impossible."""


def advance(phase: Phase, step: Step) -> Phase:
    """The phase after ``step`` in ``phase``; ``RuntimeError`` if the table forbids it."""
    try:
        return TRANSITIONS[phase, step]
    except KeyError:
        raise RuntimeError(f"change stream machine: {step.value!r} cannot happen in phase "
                           f"{phase.value!r}") from None


def mermaid() -> str:
    """The table as a Mermaid state diagram (what ``docs/resumability.md`` shows)."""
    names = {phase: phase.name.title().replace("_", "") for phase in Phase}
    lines = ["stateDiagram-v2", f"    [*] --> {names[Phase.NEW]}"]
    for (phase, step), target in TRANSITIONS.items():
        lines.append(f"    {names[phase]} --> {names[target]}: {step.value}")
    lines.append(f"    {names[Phase.CLOSED]} --> [*]")
    return "\n".join(lines)
