"""Users and the server side of SCRAM-SHA-1 / SCRAM-SHA-256 (RFC 5802, RFC 7677).

mongod keeps, per user and mechanism, a salt, an iteration count and the
``StoredKey`` / ``ServerKey`` derived from the password; it never keeps the
password. SCRAM-SHA-1 derives from mongod's legacy digest
``md5("<user>:mongo:<password>")``, SCRAM-SHA-256 from the password itself.

Passwords must be printable ASCII: SASLprep (RFC 4013), which mongod applies to
SCRAM-SHA-256 passwords, leaves those unchanged and is not implemented here.
Every failure is the same :class:`AuthenticationFailed`, as mongod reports
every failed authentication as "Authentication failed." without saying why.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

MECHANISMS = ("SCRAM-SHA-1", "SCRAM-SHA-256")
"""What mongod offers in ``saslSupportedMechs`` for a user created with both (its default)."""
_DIGESTS: dict[str, tuple[str, int, int]] = {
    "SCRAM-SHA-1": ("sha1", 10_000, 16),
    "SCRAM-SHA-256": ("sha256", 15_000, 28),
}
"""Mechanism -> hash name, mongod's default iteration count and salt length."""
USER_DB = "admin"
"""The database the simulator's users are defined in (``authSource``)."""


class AuthenticationFailed(Exception):
    """Any failed step of an authentication."""


@dataclass(frozen=True, slots=True)
class ScramCredential:
    """What the server keeps for one user and one mechanism."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes


def _check_printable_ascii(what: str, value: str) -> None:
    if not value or not value.isascii() or not value.isprintable():
        raise ValueError(
            f"{what} must be non-empty printable ASCII (the simulator implements no SASLprep)"
        )


def derive(
    mechanism: str, user: str, password: str, salt: bytes, iterations: int
) -> ScramCredential:
    """The server's keys for ``user`` / ``password`` (RFC 5802 section 3)."""
    name = _DIGESTS[mechanism][0]
    secret = password
    if mechanism == "SCRAM-SHA-1":
        secret = hashlib.md5(f"{user}:mongo:{password}".encode()).hexdigest()
    salted = hashlib.pbkdf2_hmac(name, secret.encode(), salt, iterations)
    client_key = hmac.digest(salted, b"Client Key", name)
    return ScramCredential(
        salt=salt,
        iterations=iterations,
        stored_key=hashlib.new(name, client_key).digest(),
        server_key=hmac.digest(salted, b"Server Key", name),
    )


class Users:
    """The users of a deployment (all in ``admin``); empty means authentication is off."""

    def __init__(self, passwords: Mapping[str, str] | None = None) -> None:
        self._credentials: dict[str, dict[str, ScramCredential]] = {}
        for user, password in (passwords or {}).items():
            if not isinstance(user, str) or not isinstance(password, str):
                raise TypeError("users must map user names (str) to passwords (str)")
            _check_printable_ascii("a user name", user)
            _check_printable_ascii(f"the password of user {user!r}", password)
            self._credentials[user] = {
                mechanism: derive(mechanism, user, password, os.urandom(salt_len), iterations)
                for mechanism, (_, iterations, salt_len) in _DIGESTS.items()
            }

    @property
    def enabled(self) -> bool:
        """mongod's ``--auth``: commands other than the handshake need an authenticated user."""
        return bool(self._credentials)

    def names(self) -> list[str]:
        return sorted(self._credentials)

    def credential(self, db: str, user: str, mechanism: str) -> ScramCredential | None:
        if db != USER_DB:
            return None
        return self._credentials.get(user, {}).get(mechanism)

    def mechanisms(self, db: str, user: str) -> list[str] | None:
        """``saslSupportedMechs`` for ``db.user`` (None: no such user)."""
        if db != USER_DB or user not in self._credentials:
            return None
        return list(MECHANISMS)


def _fields(message: bytes) -> dict[str, str]:
    try:
        text = message.decode("ascii")
    except UnicodeDecodeError:
        raise AuthenticationFailed from None
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or len(key) != 1:
            raise AuthenticationFailed
        out.setdefault(key, value)
    return out


def _b64(data: bytes) -> str:
    return base64.standard_b64encode(data).decode()


class ScramConversation:
    """One connection's SCRAM exchange with the server, step by step."""

    def __init__(self, users: Users, db: str, mechanism: str) -> None:
        self._users = users
        self.db = db
        self.mechanism = mechanism
        self.skip_empty_exchange = False
        """Report ``done`` with the server's proof (the client sent ``skipEmptyExchange``)."""
        self.user: str | None = None
        self._credential: ScramCredential | None = None
        self._auth_message = ""
        self._nonce = ""
        self._gs2_header = ""
        self.done = False

    def start(self, payload: bytes) -> bytes:
        """client-first-message -> server-first-message (unknown user: AuthenticationFailed)."""
        gs2, sep, bare = payload.partition(b",")
        if not sep or gs2 not in (b"n", b"y"):
            raise AuthenticationFailed  # no channel binding over plain TCP
        authzid, sep, bare = bare.partition(b",")
        if not sep or authzid:
            raise AuthenticationFailed
        fields = _fields(bare)
        if "n" not in fields or "r" not in fields:
            raise AuthenticationFailed
        user = fields["n"].replace("=2C", ",").replace("=3D", "=")
        credential = self._users.credential(self.db, user, self.mechanism)
        if credential is None:
            raise AuthenticationFailed
        self.user, self._credential = user, credential
        self._gs2_header = (gs2 + b"," + authzid + b",").decode()
        self._nonce = fields["r"] + _b64(os.urandom(24))
        server_first = f"r={self._nonce},s={_b64(credential.salt)},i={credential.iterations}"
        self._auth_message = f"{bare.decode('ascii')},{server_first}"
        return server_first.encode()

    def finish(self, payload: bytes) -> bytes:
        """client-final-message -> server-final-message (``v=``), or AuthenticationFailed."""
        credential = self._credential
        if credential is None or self.done:
            raise AuthenticationFailed
        without_proof, sep, proof_part = payload.rpartition(b",")
        fields = _fields(payload)
        if not sep or not proof_part.startswith(b"p="):
            raise AuthenticationFailed
        if fields.get("c") != _b64(self._gs2_header.encode()) or fields.get("r") != self._nonce:
            raise AuthenticationFailed
        try:
            proof = base64.b64decode(fields["p"], validate=True)
        except (ValueError, KeyError):
            raise AuthenticationFailed from None
        name = _DIGESTS[self.mechanism][0]
        auth_message = f"{self._auth_message},{without_proof.decode('ascii')}".encode()
        signature = hmac.digest(credential.stored_key, auth_message, name)
        if len(proof) != len(signature):
            raise AuthenticationFailed
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        if not hmac.compare_digest(hashlib.new(name, client_key).digest(), credential.stored_key):
            raise AuthenticationFailed
        self.done = True
        return f"v={_b64(hmac.digest(credential.server_key, auth_message, name))}".encode()
