"""What the machine makes of a failed command: resumable, retryable, or a user's mistake to name.

Pure functions of an :class:`~changestream._actions.ErrorInfo` (no state): the spec's
"Resumable Error" and the retryable-reads rules, and the errors whose fix is one of this
client's options or the user's setup, reworded to say which (the server's code is kept, so
code that checks it still works). Also the check of a start token against the server's
clock: a token from the future is warned of, and refused when no server clock reaches it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from ._actions import ErrorInfo
from ._codes import (
    BSON_OBJECT_TOO_LARGE,
    CURSOR_NOT_FOUND,
    NO_MATCHING_DOCUMENT,
    ONLY_ON_REPLICA_SETS,
    OVERFLOW,
    RESUMABLE_CODES_BEFORE_4_4,
    RESUMABLE_LABEL,
    RETRYABLE_READ_CODES,
    RETRYABLE_READ_LABEL,
    UNRECOGNIZED_PIPELINE_STAGE,
)
from ._diagnosis import (
    FUTURE_TOKEN_LIMIT,
    damaged_token_message,
    event_too_large_message,
    future_token_message,
    images_required_message,
    split_unsupported_message,
    standalone_message,
)
from ._options import ChangeStreamOptions
from ._position import reply_cluster_time
from ._token import token_cluster_time
from .errors import InvalidResumeTokenError, SplitEventError, describe_error, reworded

__all__ = ["check_start_token", "explained", "is_resumable", "is_retryable_read"]

log = logging.getLogger("changestream.stream")


def is_resumable(error: ErrorInfo) -> bool:
    """Spec "Resumable Error", using the wire version of the failing connection."""
    if error.is_network or error.code == CURSOR_NOT_FOUND:
        return True
    if error.code is None or error.wire_version is None:
        return False
    if error.wire_version >= 9:
        return RESUMABLE_LABEL in error.labels
    return error.code in RESUMABLE_CODES_BEFORE_4_4


def is_retryable_read(error: ErrorInfo, *, retry_reads: bool) -> bool:
    """Retryable-reads spec: may a failed aggregate be retried once?"""
    if not retry_reads or error.is_timeout or error.is_server_selection:
        return False
    return (
        error.is_network
        or error.code in RETRYABLE_READ_CODES
        or RETRYABLE_READ_LABEL in error.labels
    )


def explained(error: ErrorInfo, options: ChangeStreamOptions, *, joins_fragments: bool,
              adds_split_stage: bool, opens_from_token: bool) -> ErrorInfo:
    """``error`` whose fix is one of this client's options, saying which (codes unchanged).

    ``joins_fragments``: ``reassemble_split_events`` is on; ``adds_split_stage``: the client
    appended the split stage itself; ``opens_from_token``: the failed command is an
    aggregate opening from a token (an ``Overflow`` there means the token is damaged).
    """
    exception = error.exception
    text: str | None = None
    if error.code == BSON_OBJECT_TOO_LARGE and not joins_fragments:
        text = event_too_large_message()
    elif error.code == ONLY_ON_REPLICA_SETS:
        text = standalone_message()
    elif error.code == OVERFLOW and opens_from_token:
        text = damaged_token_message()
    elif error.code == NO_MATCHING_DOCUMENT:
        for name in ("full_document", "full_document_before_change"):
            if getattr(options, name) == "required":
                text = images_required_message(name)
                break
    if text is not None:
        text = f"{text}. Server: {describe_error(exception)}"
        return dataclasses.replace(error, exception=reworded(exception, text))
    if error.code == UNRECOGNIZED_PIPELINE_STAGE and adds_split_stage:
        refused = SplitEventError(split_unsupported_message(describe_error(exception)))
        refused.__cause__ = exception
        return dataclasses.replace(error, exception=refused)
    return error


def check_start_token(option: str, token: Mapping[str, Any], reply: Mapping[str, Any],
                      namespace: str) -> None:
    """A start token ahead of the server's cluster time: the server skips every change
    until its clock reaches it. Warned of; refused beyond ``FUTURE_TOKEN_LIMIT``."""
    token_time, server_time = token_cluster_time(token), reply_cluster_time(reply)
    if token_time is None or server_time is None or token_time.time - server_time.time < 2:
        return  # (one-second resolution: a second ahead is rounding)
    refused = token_time.time - server_time.time > FUTURE_TOKEN_LIMIT
    message = future_token_message(token_time.as_datetime(), server_time.as_datetime(),
                                   refused=refused)
    if refused:
        raise InvalidResumeTokenError(message, field=option, value=token)
    log.warning("%s (%s on %s)", message, option, namespace)
