"""The save schedule of a consume run: which token is safe to store, and when to store it.

The token of the last *handled* change (or of an empty batch, the
postBatchResumeToken) is stored every ``save_every`` changes or
``save_interval`` seconds, so a restart resumes there and every change is
handled at least once. With parallel handlers, the low watermark is what may
be stored (:class:`changestream._lanes.Lanes`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from bson.raw_bson import RawBSONDocument

from .._token import ResumeToken

__all__ = ["SaveSchedule", "check_save_options"]


def _key(token: Any) -> ResumeToken | None:
    return ResumeToken.maybe(token)


@dataclasses.dataclass
class SaveSchedule:
    """Which token is safe to store and when to store it (one per run)."""

    save_every: int
    save_interval: float | None
    _token: Any = dataclasses.field(default=None, init=False)
    _carried: Any = dataclasses.field(default=None, init=False)
    """A raw event's bytes holding :attr:`token`, presented when the token is read (most
    changes' tokens never are: the store takes one in ``save_every``)."""
    handled: int = 0
    advanced: bool = False
    """The current stream handled a change or moved its token (resets the retry budget)."""
    _saved: ResumeToken | None = dataclasses.field(default=None, init=False)
    _unsaved: int = dataclasses.field(default=0, init=False)
    _last_save: float = dataclasses.field(default_factory=time.monotonic, init=False)
    _watermark: Any = dataclasses.field(default=None, init=False)
    """The workers' watermark at the last :meth:`on_watermark` (moved or not)."""
    full: Callable[[], bool] | None = None
    """The store's own bound of a batch (:class:`~changestream.stores.BatchingTokenStore`):
    ``True`` saves now, whatever ``save_every`` says."""
    present: Callable[[Any], Any] | None = dataclasses.field(default=None, init=False)
    """The stream's token presentation: workers get raw tokens or the raw events holding
    them (most are never stored), and the one taken as :attr:`token` becomes a token
    in the stream's document class here."""

    @property
    def token(self) -> Any:
        """Token of the last handled change or empty batch: restarting there loses nothing."""
        carried = self._carried
        if carried is not None:
            self._token = carried if self.present is None else self.present(carried)
            self._carried = None
        return self._token

    @token.setter
    def token(self, token: Any) -> None:
        self._token, self._carried = token, None

    def start(self, token: Any) -> None:
        """The token loaded from the store."""
        self.token = token
        self._saved = _key(token)

    def on_change(self, token: Any) -> bool:
        """A change was handled, ``token`` after it (as :meth:`~changestream._stream_view.StreamView.carried_token` gives it: the
        raw event's bytes, or a raw token, are presented only if read); ``True``: save now."""
        if type(token) is bytes or type(token) is RawBSONDocument:
            self._carried = token
        else:
            self.token = token
        self.handled += 1
        self._unsaved += 1
        self.advanced = True
        due = self.save_interval is not None and (
            time.monotonic() - self._last_save >= self.save_interval
        )
        return self._unsaved >= self.save_every or due or (self.full is not None and self.full())

    def on_watermark(self, token: Any, handled: int, *, healthy: bool = True) -> bool:
        """Parallel handlers: ``handled`` changes so far, ``token`` their low watermark;
        ``True``: save now (as :meth:`on_change` for changes, :meth:`on_idle` for a moved mark)."""
        newly = handled - self.handled
        self.handled = handled
        if newly:
            self._unsaved += newly
            self.advanced = True
        # Only a watermark that moved since the last call counts: after a reopen the workers
        # still hold the previous stream's (e.g. before a lost history), never to be stored.
        moved, self._watermark = token is not self._watermark, token
        if token is None or not moved:
            return False
        if self.present is not None:
            token = self.present(token)
        if not newly and _key(token) == _key(self.token):
            return False  # (a watermark past newly handled changes is a new token: no compare)
        self.token = token
        if not newly and not self._unsaved:
            # Only an empty batch's token moved: saved at once, as without workers.
            self.advanced = self.advanced or healthy
            return True
        due = self.save_interval is not None and (
            time.monotonic() - self._last_save >= self.save_interval
        )
        return self._unsaved >= self.save_every or due

    def on_idle(self, token: Any, *, healthy: bool = True) -> bool:
        """No change came (empty batch, or a new stream): ``True``: save the new token now.

        A token that moved only because the stream resumed (``healthy`` false:
        no getMore succeeded since) is saved but is no progress: a server that
        accepts every resume and fails every getMore must exhaust ``retry_for``.
        """
        if token is not None:
            self.token = token
        if self.pending:
            self.advanced = self.advanced or healthy
            return True
        return False

    @property
    def pending(self) -> bool:
        return self.token is not None and _key(self.token) != self._saved

    def saved(self) -> None:
        self._saved = _key(self.token)
        self._unsaved = 0
        self._last_save = time.monotonic()


def check_save_options(save_every: int, save_interval: float | None) -> None:
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
        raise ValueError(f"save_every must be an integer >= 1, not {save_every!r}")
    if save_interval is not None and save_interval < 0:
        raise ValueError(f"save_interval must be >= 0 or None, not {save_interval!r}")
