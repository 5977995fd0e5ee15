"""Typed change events: immutable dataclasses read from change-stream documents.

One frozen, slotted dataclass per ``operationType`` so applications can use
``match``/``isinstance`` instead of string keys. Parsing is forward compatible
and lossless: an unknown ``operationType`` becomes :class:`UnknownEvent`, every
top-level field a class does not model (or whose value has an unexpected type)
is kept in ``extra``, and ``raw`` is the original document object (for events
a typed stream reads from raw BSON, the event decoded with the stream's codec).
Documents that no longer look like events (a user ``$project`` dropped or
renamed ``operationType``) are returned unchanged. Nothing here does I/O.

Events are lazy: a typed stream delivers each one as an instance of its class
holding the event's raw BSON, and the first field read decodes it (see
:class:`EventParser`). This module is the public face: the declarations live
in :mod:`changestream._event_types`, the reading in
:mod:`changestream._event_build`.
"""

from __future__ import annotations

from ._event_build import EventParser, parse_event
from ._event_types import _EVENT_CLASSES as _EVENT_CLASSES  # the API reference reads it
from ._event_types import (
    ChangeEvent,
    CreateEvent,
    CreateIndexesEvent,
    DeleteEvent,
    DropDatabaseEvent,
    DropEvent,
    DropIndexesEvent,
    InsertEvent,
    InvalidateEvent,
    ModifyEvent,
    Namespace,
    OperationType,
    RefineCollectionShardKeyEvent,
    RenameEvent,
    ReplaceEvent,
    ReshardCollectionEvent,
    ShardCollectionEvent,
    SplitEvent,
    TruncatedArray,
    UnknownEvent,
    UpdateDescription,
    UpdateEvent,
    event_namespace,
)
from ._event_types import _ReadOnlyMapping as _ReadOnlyMapping  # pickles of ``extra`` name it

__all__ = [
    "ChangeEvent",
    "CreateEvent",
    "CreateIndexesEvent",
    "DeleteEvent",
    "DropDatabaseEvent",
    "DropEvent",
    "DropIndexesEvent",
    "EventParser",
    "InsertEvent",
    "InvalidateEvent",
    "ModifyEvent",
    "Namespace",
    "OperationType",
    "RefineCollectionShardKeyEvent",
    "RenameEvent",
    "ReplaceEvent",
    "ReshardCollectionEvent",
    "ShardCollectionEvent",
    "SplitEvent",
    "TruncatedArray",
    "UnknownEvent",
    "UpdateDescription",
    "UpdateEvent",
    "event_namespace",
    "parse_event",
]
