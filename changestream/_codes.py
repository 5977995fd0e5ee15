"""Server error codes and error labels the client acts on, named and explained once.

Every rule that looks at a code or a label (the machine's resume and retry
rules, :func:`changestream.consume`'s dead ends and transient failures, the
Spark adapter's errors) imports it from here. Names are the server's own
(``src/mongo/base/error_codes.yml``); the comments say why the client cares.
"""

from __future__ import annotations

__all__ = [
    "AUTHENTICATION_CODES",
    "BSON_OBJECT_TOO_LARGE",
    "CHANGE_STREAM_FATAL",
    "CHANGE_STREAM_HISTORY_LOST",
    "CURSOR_KILLED",
    "CURSOR_NOT_FOUND",
    "NON_RESUMABLE_LABEL",
    "NO_MATCHING_DOCUMENT",
    "ONLY_ON_REPLICA_SETS",
    "OVERFLOW",
    "RESUMABLE_CODES_BEFORE_4_4",
    "RESUMABLE_LABEL",
    "RETRYABLE_READ_CODES",
    "RETRYABLE_READ_LABEL",
    "TRANSIENT_CODES",
    "TRANSIENT_LABELS",
    "UNAUTHORIZED",
    "UNRECOGNIZED_PIPELINE_STAGE",
]

# -- single codes ---------------------------------------------------------------------------
UNAUTHORIZED = 13
"""The user may not run the change stream: no retry helps (consume stops with NotResumableError)."""
CURSOR_NOT_FOUND = 43
"""The server no longer has the cursor (killed, timed out, member restarted): always resumable."""
CURSOR_KILLED = 237
"""killCursors (or killSessions) hit the cursor while a getMore was using it: the getMore
fails with CursorKilled. Not resumable for the stream (spec), but reopening from the
stored token is safe, so consume() retries it."""
CHANGE_STREAM_FATAL = 280
"""ChangeStreamFatalError: the resume token is not in this deployment's history (another
deployment, a restored backup) or a stage modified the events' ``_id``: never retried."""
BSON_OBJECT_TOO_LARGE = 10334
"""BSONObjectTooLarge: a change event over 16 MB. The same event fails every resume, so it
is never retried; ``$changeStreamSplitLargeEvent`` (reassemble_split_events) avoids it."""
UNRECOGNIZED_PIPELINE_STAGE = 40324
"""A stage the server does not know, e.g. ``$changeStreamSplitLargeEvent`` before 7.0/6.0.9."""
CHANGE_STREAM_HISTORY_LOST = 286
"""ChangeStreamHistoryLost: the resume point has fallen off the oplog; the changes since are gone."""

OVERFLOW = 15
"""Overflow ("Invalid advance ... past end of buffer"): the server could not read the resume
token it was given (a token cut short); the same token fails every time."""
NO_MATCHING_DOCUMENT = 47
"""NoMatchingDocument: ``full_document``/``full_document_before_change='required'`` and the
change has no post-/pre-image (the collection has no ``changeStreamPreAndPostImages``)."""
ONLY_ON_REPLICA_SETS = 40573
"""``$changeStream`` on a standalone mongod: change streams need a replica set."""

# -- labels ---------------------------------------------------------------------------------
RESUMABLE_LABEL = "ResumableChangeStreamError"
"""On wire version >= 9 (4.4+) the server labels the errors a change stream may resume after."""
NON_RESUMABLE_LABEL = "NonResumableChangeStreamError"
"""The server says the stream itself is broken (e.g. a stage removed ``_id``): never retried."""
RETRYABLE_READ_LABEL = "RetryableError"
"""Retryable-reads spec: a failed aggregate carrying this label may be retried once."""

# -- code sets ------------------------------------------------------------------------------
AUTHENTICATION_CODES = frozenset({
    11,  # UserNotFound
    18,  # AuthenticationFailed
    334,  # MechanismUnavailable
})
"""The credentials do not work: reported at once, never retried (only new credentials help)."""

_UNAVAILABLE = frozenset({
    6,  # HostUnreachable
    7,  # HostNotFound
    89,  # NetworkTimeout
    91,  # ShutdownInProgress
    189,  # PrimarySteppedDown
    262,  # ExceededTimeLimit
    9001,  # SocketException
    10107,  # NotWritablePrimary
    11600,  # InterruptedAtShutdown
    11602,  # InterruptedDueToReplStateChange
    13435,  # NotPrimaryNoSecondaryOk
    13436,  # NotPrimaryOrSecondary
})
"""The member is unreachable, shutting down or no longer primary: another one may answer."""

RESUMABLE_CODES_BEFORE_4_4 = _UNAVAILABLE | {
    63,  # StaleShardVersion
    150,  # StaleEpoch
    13388,  # StaleConfig
    234,  # RetryChangeStream
    133,  # FailedToSatisfyReadPreference
}
"""Change-streams spec: resumable server codes on connections with wire version < 9 (no labels yet)."""

RETRYABLE_READ_CODES = _UNAVAILABLE | {
    134,  # ReadConcernMajorityNotAvailableYet
}
"""Retryable-reads spec: server codes after which an aggregate is retried once."""

TRANSIENT_CODES = (
    RESUMABLE_CODES_BEFORE_4_4 | RETRYABLE_READ_CODES | {CURSOR_NOT_FOUND, CURSOR_KILLED}
)
"""consume(): a failure with one of these codes may pass; reopen the stream after a backoff."""
TRANSIENT_LABELS = (RESUMABLE_LABEL, RETRYABLE_READ_LABEL)
"""consume(): a failure with one of these labels may pass (unless also NON_RESUMABLE_LABEL)."""
