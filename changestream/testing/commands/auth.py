"""Authentication: ``saslStart`` / ``saslContinue`` (SCRAM-SHA-1, SCRAM-SHA-256).

As mongod does, every failure of an exchange is AuthenticationFailed (18)
"Authentication failed.", whatever went wrong (no such user, wrong password,
a malformed message), and the conversation is dropped. Without users
(authentication off) any attempt fails the same way, as for a user that does
not exist. ``hello`` also answers ``saslSupportedMechs`` and (4.4+)
``speculativeAuthenticate`` with :func:`sasl_start`.
"""

from __future__ import annotations

from typing import Any

from bson.binary import Binary

from ..core.auth import MECHANISMS, AuthenticationFailed, ScramConversation
from ..core.context import CommandContext, ConnectionInfo
from ..core.errors import CommandError
from .spec import command

_CONVERSATION_ID = 1
"""mongod numbers a connection's conversations from 1; drivers only echo the number."""


def _failed() -> CommandError:
    return CommandError(18, "Authentication failed.")


def _payload(body: dict[str, Any], command_name: str) -> bytes:
    payload = body.get("payload")
    if isinstance(payload, (bytes, Binary)):
        return bytes(payload)
    if isinstance(payload, str):
        return payload.encode()
    raise CommandError(
        40414, f"BSON field '{command_name}.payload' is missing but a required field"
    )


def _skip_empty_exchange(ctx: CommandContext, body: dict[str, Any]) -> bool:
    """``options.skipEmptyExchange`` (4.4+, SERVER-44857): done after the server's proof."""
    options = body.get("options")
    return (
        ctx.deployment.profile.major_minor >= (4, 4)
        and isinstance(options, dict)
        and options.get("skipEmptyExchange") is True
    )


def sasl_start(ctx: CommandContext, body: dict[str, Any], db: str) -> dict[str, Any]:
    """Begin a SCRAM exchange on the connection; the server-first-message in ``payload``."""
    conn = ctx.connection
    conn.sasl = None
    mechanism = body.get("mechanism")
    if not isinstance(mechanism, str):
        raise CommandError(
            40414, "BSON field 'saslStart.mechanism' is missing but a required field"
        )
    if mechanism not in MECHANISMS:
        raise CommandError(
            334,
            f"Received authentication for mechanism {mechanism} which is unknown or not enabled",
        )
    conversation = ScramConversation(ctx.deployment.users, db, mechanism)
    try:
        server_first = conversation.start(_payload(body, "saslStart"))
    except AuthenticationFailed:
        raise _failed() from None
    conversation.skip_empty_exchange = _skip_empty_exchange(ctx, body)
    conn.sasl = conversation
    return {"conversationId": _CONVERSATION_ID, "done": False, "payload": Binary(server_first)}


@command("saslStart", locks=False, any_member=True, auth=False)
def sasl_start_command(ctx: CommandContext) -> dict[str, Any]:
    return sasl_start(ctx, ctx.body, ctx.db)


@command("saslContinue", locks=False, any_member=True, auth=False)
def sasl_continue(ctx: CommandContext) -> dict[str, Any]:
    conn = ctx.connection
    conversation = conn.sasl
    if conversation is None:
        raise CommandError(17, "No SASL session state found")
    if ctx.body.get("conversationId") != _CONVERSATION_ID:
        conn.sasl = None
        raise CommandError(17, "sasl: Mismatched conversation id")
    payload = _payload(ctx.body, "saslContinue")
    if conversation.done:  # the empty last step of a client that did not skip it
        conn.sasl = None
        if payload:
            raise _failed()
        return {"conversationId": _CONVERSATION_ID, "done": True, "payload": Binary(b"")}
    try:
        server_final = conversation.finish(payload)
    except AuthenticationFailed:
        conn.sasl = None
        raise _failed() from None
    _authenticated(conn, conversation)
    done = conversation.skip_empty_exchange
    if done:
        conn.sasl = None
    return {"conversationId": _CONVERSATION_ID, "done": done, "payload": Binary(server_final)}


def _authenticated(conn: ConnectionInfo, conversation: ScramConversation) -> None:
    assert conversation.user is not None
    conn.user = (conversation.user, conversation.db)
