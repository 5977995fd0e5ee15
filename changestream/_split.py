"""Reassembly of events split by ``$changeStreamSplitLargeEvent``.

The server cuts an event larger than 16 MiB into fragments
``{_id, splitEvent: {fragment: i, of: n}, <some fields>}``; each fragment
carries its own resume token. :class:`SplitReassembler` merges a complete run
back into one event whose ``_id`` is the *last* fragment's token (resuming
after it continues with the next event). It only validates and merges; the
state machine decides what the cached resume token may be while a run is
incomplete (it stays before the first fragment, so a resume re-delivers the
whole event).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import SplitEventError

__all__ = ["SplitReassembler", "split_position"]


def split_position(event: Mapping[str, Any]) -> tuple[int, int] | None:
    """Return ``(fragment, of)`` of a fragment, or ``None`` for an unsplit event."""
    split = event.get("splitEvent")
    if split is None:
        return None
    try:
        fragment, of = split["fragment"], split["of"]
    except (KeyError, TypeError):
        raise SplitEventError(f"malformed splitEvent field: {split!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (fragment, of)):
        raise SplitEventError(f"malformed splitEvent field: {split!r}")
    if not 1 <= fragment <= of:
        raise SplitEventError(f"malformed splitEvent field: {split!r}")
    return fragment, of


class SplitReassembler:
    """Collect the fragments of one split event and merge them when complete."""

    def __init__(self) -> None:
        self._fragments: list[Mapping[str, Any]] = []
        self._of = 0

    @property
    def pending(self) -> bool:
        """True while a run of fragments has started but is not complete."""
        return bool(self._fragments)

    def reset(self) -> None:
        """Forget an incomplete run (the server re-sends it after a resume)."""
        self._fragments = []
        self._of = 0

    def add(self, event: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Feed the next event of the stream.

        Returns the event to deliver (an unsplit event unchanged, or the merged
        event once its last fragment arrived) or ``None`` while a run is
        incomplete. Raises :class:`SplitEventError` on a gap, a repeat or a
        changed fragment count, and forgets the run.
        """
        position = split_position(event)
        expected = len(self._fragments) + 1
        if position is None:
            if self._fragments:
                self.reset()
                raise SplitEventError(
                    f"split event incomplete: expected fragment {expected} of {self._of}, "
                    "got an unsplit event"
                )
            return event
        fragment, of = position
        if fragment != expected or (self._fragments and of != self._of):
            wanted = f"{expected} of {self._of or of}"
            self.reset()
            raise SplitEventError(
                f"split event fragments out of order: expected fragment {wanted}, "
                f"got fragment {fragment} of {of}"
            )
        self._fragments.append(event)
        self._of = of
        if fragment < of:
            return None
        fragments = self._fragments
        self.reset()
        return _merge(fragments)


def _merge(fragments: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One event from its fragments: ``_id`` of the last, other fields in arrival order."""
    merged: dict[str, Any] = {}
    if "_id" in fragments[-1]:
        merged["_id"] = fragments[-1]["_id"]
    for fragment in fragments:
        for key, value in fragment.items():
            if key not in ("_id", "splitEvent"):
                merged[key] = value
    return merged
