"""``expectError``: classifying an exception and checking the assertions on it.

An error "comes from the server" when it carries a server reply: a PyMongo
``OperationFailure`` (incl. ``CursorNotFound``, ``ExecutionTimeout``) or a
``NotPrimaryError``, possibly as the ``__cause__`` of a library error.
Everything else (network errors, timeouts raised by the client, validation)
is a client error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo.errors import BulkWriteError, NotPrimaryError, OperationFailure

from . import RunnerError, SpecFailure
from .matcher import EntityLookup, MatchError, match

_KEYS = frozenset(
    {
        "isError",
        "isClientError",
        "isTimeoutError",
        "errorContains",
        "errorCode",
        "errorCodeName",
        "errorLabelsContain",
        "errorLabelsOmit",
        "errorResponse",
        "expectResult",
    }
)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__
    return seen


def server_reply(exc: BaseException) -> Mapping[str, Any] | None:
    """The server's error reply behind ``exc``, or None for a client-side error."""
    for err in _chain(exc):
        if isinstance(err, OperationFailure):
            return err.details or {"code": err.code, "errmsg": str(err)}
        if isinstance(err, NotPrimaryError) and isinstance(err.details, Mapping):
            return err.details
    return None


def error_code(exc: BaseException) -> int | None:
    for err in _chain(exc):
        if isinstance(err, OperationFailure):
            return err.code
    reply = server_reply(exc)
    code = reply.get("code") if reply else None
    return int(code) if code is not None else None


def has_label(exc: BaseException, label: str) -> bool:
    for err in _chain(exc):
        checker = getattr(err, "has_error_label", None)
        if checker is not None and checker(label):
            return True
    reply = server_reply(exc)
    return bool(reply) and label in (reply or {}).get("errorLabels", [])


def is_timeout(exc: BaseException) -> bool:
    return any(
        getattr(err, "timeout", False) is True or isinstance(err, TimeoutError)
        for err in _chain(exc)
    )


def describe(exc: BaseException) -> str:
    """``OperationFailure 59 (CommandNotFound): no such command [labels]`` or ``Type: message``."""
    reply = server_reply(exc)
    if reply is not None:
        text = f"{type(exc).__name__} {reply.get('code')} ({reply.get('codeName')}): {reply.get('errmsg')}"
        labels = reply.get("errorLabels")
        if labels:
            text += f" {list(labels)}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def check_expected_error(
    expected: dict[str, Any], exc: BaseException, entities: EntityLookup
) -> None:
    """Assert every key of an ``expectedError`` against ``exc``."""
    unknown = set(expected) - _KEYS
    if unknown:
        raise RunnerError(f"expectError keys {sorted(unknown)} are not supported")
    shown = describe(exc)
    reply = server_reply(exc)
    if "isClientError" in expected:
        is_client = reply is None
        if expected["isClientError"] != is_client:
            what = "a client-side" if expected["isClientError"] else "a server"
            raise SpecFailure(f"expected {what} error, got {shown}")
    if "isTimeoutError" in expected and expected["isTimeoutError"] != is_timeout(exc):
        what = "a timeout" if expected["isTimeoutError"] else "a non-timeout"
        raise SpecFailure(f"expected {what} error, got {shown}")
    if "errorContains" in expected:
        needle = expected["errorContains"].lower()
        haystack = str(exc).lower() + " " + str((reply or {}).get("errmsg", "")).lower()
        if needle not in haystack:
            raise SpecFailure(
                f"expected an error containing {expected['errorContains']!r}, got {shown}"
            )
    if "errorCode" in expected:
        code = error_code(exc)
        if code != expected["errorCode"]:
            raise SpecFailure(f"expected error code {expected['errorCode']}, got {code} ({shown})")
    if "errorCodeName" in expected:
        name = (reply or {}).get("codeName")
        if not isinstance(name, str) or name.lower() != expected["errorCodeName"].lower():
            raise SpecFailure(
                f"expected codeName {expected['errorCodeName']}, got {name!r} ({shown})"
            )
    for label in expected.get("errorLabelsContain", []):
        if not has_label(exc, label):
            raise SpecFailure(f"expected error label {label}, got {shown}")
    for label in expected.get("errorLabelsOmit", []):
        if has_label(exc, label):
            raise SpecFailure(f"expected no error label {label}, got {shown}")
    if "errorResponse" in expected:
        if reply is None:
            raise SpecFailure(f"expected a server error response, got {shown}")
        _match(expected["errorResponse"], reply, entities, "errorResponse")
    if "expectResult" in expected:
        if not isinstance(exc, BulkWriteError):
            raise SpecFailure(f"expected an error that carries a result, got {shown}")
        _match(expected["expectResult"], exc.details, entities, "expectError.expectResult")


def _match(expected: Any, actual: Any, entities: EntityLookup, where: str) -> None:
    try:
        match(expected, actual, root=True, entities=entities, path=where)
    except MatchError as exc:
        raise SpecFailure(str(exc)) from None
