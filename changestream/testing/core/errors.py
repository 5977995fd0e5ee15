"""Server errors as mongod reports them: code, codeName, errmsg and labels.

Handlers raise :class:`CommandError`; the dispatcher turns it into the
``{ok: 0, errmsg, code, codeName, [errorLabels]}`` reply, adding the labels
mongod adds (see :func:`change_stream_labels`).
"""

from __future__ import annotations

from typing import Any

from .versions import VersionProfile

CODE_NAMES: dict[int, str] = {
    1: "InternalError",
    2: "BadValue",
    4: "NoSuchKey",
    6: "HostUnreachable",
    7: "HostNotFound",
    8: "UnknownError",
    9: "FailedToParse",
    11: "UserNotFound",
    13: "Unauthorized",
    14: "TypeMismatch",
    15: "Overflow",
    18: "AuthenticationFailed",
    20: "IllegalOperation",
    24: "LockTimeout",
    26: "NamespaceNotFound",
    27: "IndexNotFound",
    31: "RoleNotFound",
    40: "ConflictingUpdateOperators",
    43: "CursorNotFound",
    46: "LockBusy",
    47: "NoMatchingDocument",
    48: "NamespaceExists",
    50: "MaxTimeMSExpired",
    52: "DollarPrefixedFieldName",
    56: "EmptyFieldName",
    57: "DottedFieldName",
    59: "CommandNotFound",
    61: "ShardKeyNotFound",
    63: "StaleShardVersion",
    66: "ImmutableField",
    67: "CannotCreateIndex",
    68: "IndexAlreadyExists",
    72: "InvalidOptions",
    73: "InvalidNamespace",
    79: "UnknownReplWriteConcern",
    85: "IndexOptionsConflict",
    86: "IndexKeySpecsConflict",
    89: "NetworkTimeout",
    91: "ShutdownInProgress",
    96: "OperationFailed",
    106: "CannotSplit",
    100: "UnsatisfiableWriteConcern",
    112: "WriteConflict",
    115: "CommandNotSupported",
    125: "CommandFailed",
    133: "FailedToSatisfyReadPreference",
    134: "ReadConcernMajorityNotAvailableYet",
    136: "CappedPositionLost",
    148: "ReadConcernMajorityNotEnabled",
    150: "StaleEpoch",
    121: "DocumentValidationFailure",
    166: "CommandNotSupportedOnView",
    167: "OptionNotSupportedOnView",
    168: "InvalidPipelineOperator",
    143: "CursorInUse",
    175: "QueryPlanKilled",
    189: "PrimarySteppedDown",
    204: "TimeProofMismatch",
    205: "ClusterTimeFailsRateLimiter",
    211: "KeyNotFound",
    216: "ElectionInProgress",
    225: "TransactionTooOld",
    234: "RetryChangeStream",
    237: "CursorKilled",
    239: "SnapshotTooOld",
    244: "TransactionAborted",
    246: "SnapshotUnavailable",
    251: "NoSuchTransaction",
    256: "TransactionCommitted",
    260: "InvalidResumeToken",
    262: "ExceededTimeLimit",
    263: "OperationNotSupportedInTransaction",
    266: "FailPointSetFailed",
    276: "ChangeStreamInvalidated",
    280: "ChangeStreamFatalError",
    286: "ChangeStreamHistoryLost",
    317: "ConnectionPoolExpired",
    323: "APIStrictError",
    352: "UnsupportedOpQueryCommand",
    358: "InternalTransactionNotSupported",
    384: "ConnectionError",
    402: "ResourceExhausted",
    9001: "SocketException",
    10107: "NotWritablePrimary",
    10334: "BSONObjectTooLarge",
    11000: "DuplicateKey",
    11600: "InterruptedAtShutdown",
    11601: "Interrupted",
    11602: "InterruptedDueToReplStateChange",
    13388: "StaleConfig",
    13435: "NotPrimaryNoSecondaryOk",
    13436: "NotPrimaryOrSecondary",
    40415: "IDLUnknownField",
    50915: "BackupCursorOpenConflictWithCheckpoint",
}
"""codeName by code; codes missing here are reported as ``Location<N>``."""

RESUMABLE_CHANGE_STREAM_CODES: frozenset[int] = frozenset(
    {6, 7, 89, 91, 133, 134, 150, 189, 234, 262, 317, 358, 384, 402, 9001, 10107,
     11600, 11602, 13388, 13435, 13436, 50915}
)
"""Codes mongod labels ``ResumableChangeStreamError`` on change-stream commands (4.4+)."""

STALE_SHARD_VERSION_MAX = (6, 0)
"""63 StaleShardVersion existed (and was resumable) up to 6.0."""

NON_RESUMABLE_CHANGE_STREAM_CODES: frozenset[int] = frozenset({280, 286})
"""Codes mongod labels ``NonResumableChangeStreamError`` (any command)."""

RETRIABLE_CODES: frozenset[int] = frozenset(
    {6, 7, 89, 91, 134, 189, 262, 317, 358, 384, 402, 9001, 10107, 11600, 11602, 13435,
     13436, 50915}
)  # fmt: skip
"""mongod's RetriableError category (``ErrorCodes::isA<RetriableError>``): drives the
RetryableWriteError/TransientTransactionError labels and 9.0's ``error.retriable.other``."""


def _name_for(code: int) -> str:
    """mongod's codeName for ``code`` (``Location<N>`` for unnamed codes)."""
    return CODE_NAMES.get(code, f"Location{code}")


class CloseConnection(Exception):
    """Drop the connection without replying (failCommand ``closeConnection``)."""


class ClientDisconnected(CloseConnection):
    """The connection is gone while an operation waited: end it, reply to no one.

    mongod kills such an operation with ClientDisconnect (an awaitable hello,
    a getMore waiting for data, ...) instead of finishing it for a peer that
    left; the simulator also ends the connection's thread and closes its socket.
    """


class CommandError(Exception):
    """A command failed; becomes an ``ok: 0`` reply on the wire.

    ``labels=None`` means "let the dispatcher compute labels as mongod does";
    a list (even empty) means "exactly these labels" (failCommand's
    ``errorLabels`` override).
    """

    def __init__(
        self,
        code: int,
        errmsg: str,
        *,
        code_name: str | None = None,
        labels: list[str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(errmsg)
        self.code = code
        self.errmsg = errmsg
        self.code_name = code_name or _name_for(code)
        self.labels = labels
        self.extra = extra or {}

    def to_reply(self) -> dict[str, Any]:
        """The error reply body, without ``$clusterTime``/``operationTime``."""
        reply: dict[str, Any] = {
            "ok": 0.0,
            "errmsg": self.errmsg,
            "code": self.code,
            "codeName": self.code_name,
        }
        reply.update(self.extra)
        if self.labels:
            reply["errorLabels"] = list(self.labels)
        return reply


code_name = _name_for


def change_stream_labels(
    code: int, profile: VersionProfile, *, is_change_stream_command: bool
) -> list[str]:
    """Labels mongod itself adds to an error (``error_labels.cpp``)."""
    if code in NON_RESUMABLE_CHANGE_STREAM_CODES:
        return ["NonResumableChangeStreamError"]
    if not (is_change_stream_command and profile.resumable_label):
        return []
    resumable = code in RESUMABLE_CHANGE_STREAM_CODES or (
        code == 63 and profile.major_minor <= STALE_SHARD_VERSION_MAX
    )
    return ["ResumableChangeStreamError"] if resumable else []


class ErrmsgError(CommandError):
    """A failure of one of mongod's ``ErrmsgCommandDeprecated`` commands (mongos's ``split``):
    ``{ok: 0, errmsg}`` and no code (``CommandHelpers::appendSimpleCommandStatus``)."""

    def __init__(self, errmsg: str) -> None:
        super().__init__(0, errmsg, labels=[])

    def to_reply(self) -> dict[str, Any]:
        return {"ok": 0.0, "errmsg": self.errmsg}

