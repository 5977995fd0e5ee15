"""What the sync and async shells share: a stream's one-time setup and its per-call deadline.

Both shells drive the same :class:`~changestream.machine.ChangeStreamMachine`;
this module makes sure they also configure it identically (target scope,
read preference and concern, timeouts, codecs) and apply CSOT the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta
from typing import Any

import pymongo
from bson.codec_options import CodecOptions

from ._machine import ChangeStreamMachine, StreamSpec
from ._options import (
    ChangeStreamOptions,
    Target,
    check_max_await,
    effective_codec_options,
    effective_timeout_ms,
    event_decoder,
    reply_codec,
)
from ._position import Position
from ._pymongo import csot_context_active


@dataclasses.dataclass(frozen=True)
class StreamSetup:
    """Everything ``watch()`` decides once for a stream."""

    spec: StreamSpec
    codec: CodecOptions[Any]
    """What the user receives (and how :attr:`resume_token` is presented)."""
    wire: CodecOptions[Any]
    """How replies are decoded by the transport."""
    timeout_ms: float | None
    timeout_is_explicit: bool


def stream_setup(target: Target, options: ChangeStreamOptions) -> StreamSetup:
    """Resolve timeouts and codecs and build the machine's spec (raises on bad combinations)."""
    timeout_ms = effective_timeout_ms(options, target.client)
    check_max_await(options, timeout_ms)
    codec = effective_codec_options(options, target)
    wire = reply_codec(codec)
    spec = StreamSpec(
        database=target.database,
        collection=target.collection,
        cluster=target.cluster,
        options=options,
        read_preference=options.read_preference
        if options.read_preference is not None
        else target.read_preference,
        read_concern=options.read_concern
        if options.read_concern is not None
        else target.read_concern,
        retry_reads=target.client.options.retry_reads,
        decode=event_decoder(codec, options.typed, wire),
    )
    return StreamSetup(spec, codec, wire, timeout_ms, options.timeout_ms is not None)


def call_deadline(setup: StreamSetup) -> contextlib.AbstractContextManager[None]:
    """The per-call CSOT budget (``timeout_ms=0`` disables a client-level timeout).

    As in PyMongo, a caller's ``with pymongo.timeout(...)`` block replaces the
    client's ``timeoutMS``; an explicit ``timeout_ms`` still applies (the
    earlier deadline wins). ``pymongo.timeout`` works in sync and async code.
    """
    inherited_but_overridden = not setup.timeout_is_explicit and csot_context_active()
    if setup.timeout_ms is None or inherited_but_overridden:
        return contextlib.nullcontext()
    return pymongo.timeout(setup.timeout_ms / 1000)


def abandon(stream: Any) -> None:
    """``__del__`` of both shells: a stream dropped without ``close()`` cleans up later.

    As PyMongo's own cursors do, the open cursor is queued for the client's
    background killCursors task and the implicit session goes back to the pool;
    no I/O here. Closing the stream is still the way to release the cursor at once.
    """
    try:
        machine, transport, closing = stream._machine, stream._transport, stream._close_requested
    except AttributeError:  # __init__ failed early
        return
    if closing or not machine.alive:
        return
    with contextlib.suppress(Exception):  # at interpreter exit PyMongo may be gone
        transport.abandon(machine.abandon())


class Progress:
    """What both shells show of a stream's progress (read from the machine; no I/O)."""

    _machine: ChangeStreamMachine

    @property
    def position(self) -> Position:
        """Cluster time of the resume token and the newest server time seen (see :attr:`lag`)."""
        return self._machine.position

    @property
    def lag(self) -> timedelta | None:
        """How far the stream is behind the server, from cluster times in the server's replies.

        ``server time - token time``: the newest cluster time any reply of this
        stream carried, minus the cluster time of the last event returned (or of
        the ``postBatchResumeToken`` once a batch is consumed). ``None`` until
        both are known. Second resolution; see :mod:`changestream.position`.
        """
        return self._machine.position.lag

    @property
    def resumes(self) -> int:
        """Automatic resumes so far (after a resumable error or a client-side timeout)."""
        return self._machine.resumes
