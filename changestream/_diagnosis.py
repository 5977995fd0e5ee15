"""What went wrong and what to do next: the one-line messages for failures a user must fix.

A failure no retry can fix (a token from another deployment, missing or wrong
credentials, an event over 16 MB) must say its cause and the next step the same
way wherever it surfaces: the library's exception, ``consume``'s log, the
command line, the Spark source. The wording lives here, once; the policy code
(:func:`changestream._consumer.dead_ends.unrecoverable`, :func:`~changestream._consumer.retry.is_transient`)
decides *when* it applies. Messages name public options and the user's own
things (token file, URI), never an internal class, never a credential.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from pymongo.errors import OperationFailure, PyMongoError

from ._codes import (
    AUTHENTICATION_CODES,
    BSON_OBJECT_TOO_LARGE,
    CHANGE_STREAM_FATAL,
    NO_MATCHING_DOCUMENT,
    ONLY_ON_REPLICA_SETS,
    OVERFLOW,
    UNAUTHORIZED,
)

__all__ = [
    "SPLIT_STAGE",
    "SPLIT_VERSIONS",
    "authentication_failed",
    "damaged_token_message",
    "describe_store",
    "errmsg",
    "event_too_large_message",
    "future_token_message",
    "images_required_message",
    "missing_credentials",
    "missing_credentials_message",
    "not_a_store_message",
    "not_authorized_message",
    "split_unsupported_message",
    "standalone_message",
    "token_not_in_history_message",
    "wrong_client_message",
    "wrong_credentials_message",
]

SPLIT_STAGE = "$changeStreamSplitLargeEvent"
"""The stage ``reassemble_split_events=True`` appends when the pipeline lacks it."""
SPLIT_VERSIONS = "MongoDB 7.0+ or 6.0.9+"
"""The servers that have ``$changeStreamSplitLargeEvent``."""


def authentication_failed(exc: BaseException) -> bool:
    """Did ``exc`` come from failed authentication (wrong user, password or mechanism)?

    PyMongo raises it as an ``OperationFailure`` (code 18) the first time; after
    that the member stays unselectable until its next heartbeat, so a retry
    ends in a ``ServerSelectionTimeoutError`` whose text carries the code name.
    Either way no retry helps: the credentials must change.
    """
    if isinstance(exc, OperationFailure):
        return exc.code in AUTHENTICATION_CODES
    if isinstance(exc, PyMongoError):
        text = str(exc)
        return "'codeName': 'AuthenticationFailed'" in text or "Authentication failed" in text
    return False


def missing_credentials(exc: BaseException) -> bool:
    """Unauthorized (13) because the client did not authenticate at all."""
    return (
        isinstance(exc, OperationFailure)
        and exc.code == UNAUTHORIZED
        and "requires authentication" in errmsg(exc)
    )


def describe_store(store: object) -> str:
    """The token store in the user's terms: a file, a collection, or memory."""
    from .stores import AsyncMongoTokenStore, FileTokenStore, MemoryTokenStore, MongoTokenStore

    inner = getattr(store, "store", None)
    if inner is not None and inner is not store:  # a wrapper (the CLI's): the store it keeps
        return describe_store(inner)
    if isinstance(store, MemoryTokenStore):
        return "the in-memory token store"
    if isinstance(store, FileTokenStore):
        return f"the token file {store.path}"
    if isinstance(store, (MongoTokenStore, AsyncMongoTokenStore)):
        return f"the token store collection {store.namespace} (key {store.key!r})"
    return f"the token store {store!r}"


def errmsg(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if isinstance(details, Mapping) and isinstance(details.get("errmsg"), str):
        return str(details["errmsg"])
    return str(exc)


def token_not_in_history_message(where: str, store: str, errmsg: str, *, stored: bool) -> str:
    """ChangeStreamFatalError (280): the token cannot be found, or a stage changed ``_id``."""
    if "_id" in errmsg and "modified" in errmsg:
        return (
            "a pipeline stage changed the events' '_id' (their resume token), so the server "
            "cannot resume this change stream (ChangeStreamFatalError, code 280). Remove or fix "
            f"the stage that sets or removes '_id', then run again: {store} holds {where}, "
            "the last token before it"
        )
    token = f"{store} holds {where}" if stored else "the token the stream was opened with"
    return (
        f"the resume token is not in this deployment's change history (ChangeStreamFatalError, "
        f"code 280): {token}, which this deployment never produced, and running again from it "
        "fails the same way. It comes from (1) another deployment: point the URI at the "
        "deployment the token came from, or clear the token to start from now on this one; "
        "(2) a backup restored after the token was saved: the changes after the backup are not "
        "in its history, so copy the collection again and clear the token to start from now; "
        "(3) a pipeline stage that changed '_id' (the resume token) when the token was saved: "
        "fix the stage, then clear the token and copy the collection again"
    )


def missing_credentials_message(where: str, store: str) -> str:
    """Unauthorized (13) without authentication: the URI has no user."""
    return (
        "the deployment requires authentication and the client sent no credentials: put the "
        "user name and password in the connection string (as USER:PASSWORD@ before the host, "
        "with ?authSource=admin), "
        f"then run again; {store} holds {where}"
    )


def not_authorized_message(where: str, store: str) -> str:
    """Unauthorized (13) for an authenticated user: missing privileges."""
    return (
        "not authorized to watch (code 13): grant the user the 'changeStream' and 'find' "
        f"actions on the watched namespace, then run again; {store} holds {where}"
    )


def wrong_credentials_message(where: str | None = None, store: str | None = None) -> str:
    """AuthenticationFailed (18) and friends: the credentials do not work."""
    held = f"; {store} holds {where}" if store and where else ""
    return (
        "authentication failed (code 18): the user name or password in the connection string "
        "is wrong, or the user is defined in another database than its authSource "
        "(add ?authSource=DB), or the server does not offer the authMechanism; fix the "
        f"credentials, then run again{held}"
    )


def event_too_large_message(where: str | None = None, store: str | None = None) -> str:
    """BSONObjectTooLarge (10334): a change event over the 16 MB BSON limit."""
    held = f"; {store} holds {where}, the last token before it" if store and where else ""
    return (
        f"a change event is larger than 16 MB (BSONObjectTooLarge, code {BSON_OBJECT_TOO_LARGE}), "
        "so the server cannot return it and running again fails the same way. With "
        f"{SPLIT_VERSIONS}, let the server split it: reassemble_split_events=True in watch() "
        "(consume(..., oversize='split'), the CLI's --oversize split); on older servers, "
        "leave the large fields out with a $project stage (e.g. fullDocument, "
        f"fullDocumentBeforeChange, updateDescription.updatedFields){held}"
    )


def split_unsupported_message(server_message: str) -> str:
    """``reassemble_split_events=True`` on a server without ``$changeStreamSplitLargeEvent``."""
    return (
        "reassemble_split_events=True needs $changeStreamSplitLargeEvent, which this server "
        f"does not have ({SPLIT_VERSIONS} have it): upgrade the server, or drop "
        "reassemble_split_events and keep events under 16 MB (leave large fields out with a "
        f"$project stage). Server: {server_message}"
    )


FUTURE_TOKEN_LIMIT = 86_400
"""Seconds a start token may be ahead of the server's cluster time before the stream is
refused: a day is far beyond clock skew between members or mongoses (milliseconds to the
10 s no-op interval), so a token further ahead is corrupted or another deployment's."""


def future_token_message(token_time: datetime, server_time: datetime, *, refused: bool) -> str:
    """A start token dated after the deployment's cluster time: the server skips every change
    until its clock reaches the token (``refused``: more than :data:`FUTURE_TOKEN_LIMIT`)."""
    ahead = token_time - server_time
    head = (
        f"the resume token is dated {token_time:%Y-%m-%d %H:%M:%S} UTC, {ahead} ahead of the "
        f"deployment's cluster time ({server_time:%Y-%m-%d %H:%M:%S} UTC)"
    )
    if refused:
        return (
            f"{head}: more than a day ahead, which no server clock reaches, so the stream is "
            "refused (it would skip every change until then). The token is corrupted or comes "
            "from another deployment: restore the right token, or clear it to start from now "
            "(or open with start_at_operation_time=...)"
        )
    return (
        f"{head}: the stream skips every change until the server's clock reaches it, and the "
        "lag reads negative meanwhile. A token from another deployment or a corrupted one "
        "does this: if so, clear it to start from now"
    )


def wrong_client_message(*, aio: bool) -> str:
    """A sync stream on an async client, or the other way round (``aio``: the asyncio
    ``watch`` was called): which ``watch`` fits."""
    if aio:
        return ("changestream.aio.watch needs a pymongo AsyncMongoClient (or its database or "
                "collection); for a MongoClient use changestream.watch")
    return ("changestream.watch needs a pymongo MongoClient (or its database or collection); "
            "for an AsyncMongoClient use changestream.aio.watch (awaited)")


def not_a_store_message(store: object) -> str:
    """``consume``'s ``store`` is not a token store (a path, most often)."""
    import os

    if isinstance(store, (str, bytes, os.PathLike)):
        return (f"store must be a token store, not the path {store!r}: pass "
                f"changestream.stores.FileTokenStore({store!r}) to keep the token in that file")
    return ("store must be a token store (with load() and save(token), e.g. "
            "changestream.stores.FileTokenStore('token.json') or MongoTokenStore), not "
            f"{type(store).__name__}")


def damaged_token_message(where: str | None = None, store: str | None = None) -> str:
    """Overflow (15) on opening from a token: the server cannot read the token at all."""
    held = f" ({store} holds {where})" if store and where else ""
    return (
        f"the resume token is damaged (cut short or edited): the server cannot read it "
        f"(code {OVERFLOW}) and running again from it fails the same way{held}. Restore the "
        "whole token (a token file holds one line of Extended JSON), or clear it to start from "
        "now"
    )


def images_required_message(option: str) -> str:
    """NoMatchingDocument (47) with ``option='required'``: the change has no pre-/post-image."""
    return (
        f"{option}='required' needs pre- and post-images, and this change has none (code "
        f"{NO_MATCHING_DOCUMENT}): enable them on the collection (MongoDB 6.0+: "
        "db.runCommand({collMod: '<collection>', changeStreamPreAndPostImages: {enabled: "
        f"true}})), which covers changes made after it, or use {option}='whenAvailable' to get "
        "None where an image is missing"
    )


def standalone_message() -> str:
    """``$changeStream`` on a standalone mongod (40573)."""
    return (
        "change streams need a replica set or a sharded cluster, and this server is a "
        f"standalone mongod (code {ONLY_ON_REPLICA_SETS}): restart it as a one-member replica "
        "set (mongod --replSet rs0, then rs.initiate() once in mongosh) and connect with "
        "?replicaSet=rs0 or ?directConnection=true"
    )


CODES_EXPLAINED = (CHANGE_STREAM_FATAL, UNAUTHORIZED, BSON_OBJECT_TOO_LARGE, OVERFLOW,
                   NO_MATCHING_DOCUMENT, ONLY_ON_REPLICA_SETS, *AUTHENTICATION_CODES)
"""The server codes this module has a message for (the docs' error table lists them)."""
