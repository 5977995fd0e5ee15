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
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MECHANISMS = ("SCRAM-SHA-1", "SCRAM-SHA-256")
"""What mongod offers in ``saslSupportedMechs`` for a user created with both (its default)."""
_DIGESTS: dict[str, tuple[str, int, int]] = {
    "SCRAM-SHA-1": ("sha1", 10_000, 16),
    "SCRAM-SHA-256": ("sha256", 15_000, 28),
}
"""Mechanism -> hash name, mongod's default iteration count and salt length."""
USER_DB = "admin"
"""The database the users given to a deployment are defined in (``authSource``)."""


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


BUILTIN_ROLES = frozenset(
    {
        "read", "readWrite", "dbAdmin", "dbOwner", "userAdmin", "clusterAdmin", "clusterManager",
        "clusterMonitor", "hostManager", "backup", "restore", "readAnyDatabase",
        "readWriteAnyDatabase", "userAdminAnyDatabase", "dbAdminAnyDatabase", "root",
        "enableSharding", "directShardOperations", "searchCoordinator", "__system",
    }
)  # fmt: skip
"""mongod's built-in roles: the only ones the simulator knows (it has no ``createRole``)."""
DEFAULT_ROLES = ({"role": "root", "db": USER_DB},)
"""The role of the users given to the deployment (``users=``, ``serve --auth``)."""


@dataclass(slots=True)
class User:
    """One user: its credentials per mechanism and its roles (recorded, not enforced)."""

    name: str
    db: str
    user_id: uuid.UUID
    credentials: dict[str, ScramCredential]
    roles: list[dict[str, str]]

    def info(self) -> dict[str, Any]:
        """The user as ``usersInfo`` shows it (``admin.system.users`` without credentials)."""
        return {
            "_id": f"{self.db}.{self.name}",
            "userId": self.user_id,
            "user": self.name,
            "db": self.db,
            "roles": [dict(role) for role in self.roles],
            "mechanisms": [m for m in MECHANISMS if m in self.credentials],
        }


def credentials_for(
    user: str, password: str, mechanisms: Iterable[str] = MECHANISMS
) -> dict[str, ScramCredential]:
    """Fresh salted credentials of ``user`` for ``mechanisms``."""
    _check_printable_ascii(f"the password of user {user!r}", password)
    return {
        mechanism: derive(mechanism, user, password, os.urandom(salt_len), iterations)
        for mechanism, (_, iterations, salt_len) in _DIGESTS.items()
        if mechanism in mechanisms
    }


class Users:
    """A deployment's users (``admin.system.users``) and whether authentication is on.

    ``auth`` is mongod's ``--auth``: on when the deployment was given users
    (``users=``) unless said otherwise; users created later with ``createUser``
    do not turn it on, as on mongod. The lock makes the user commands atomic:
    every mongos of a sharded cluster shares one ``Users``.
    """

    def __init__(self, passwords: Mapping[str, str] | None = None, *, auth: bool | None = None):
        self._users: dict[tuple[str, str], User] = {}
        self.lock = threading.Lock()
        for user, password in (passwords or {}).items():
            if not isinstance(user, str) or not isinstance(password, str):
                raise TypeError("users must map user names (str) to passwords (str)")
            _check_printable_ascii("a user name", user)
            self.put(User(user, USER_DB, uuid.uuid4(), credentials_for(user, password),
                          [dict(role) for role in DEFAULT_ROLES]))  # fmt: skip
        self.auth = bool(passwords) if auth is None else auth

    @property
    def enabled(self) -> bool:
        """mongod's ``--auth``: commands other than the handshake need an authenticated user."""
        return self.auth

    def names(self) -> list[str]:
        return sorted(name for (db, name) in self._users if db == USER_DB)

    def get(self, db: str, user: str) -> User | None:
        return self._users.get((db, user))

    def put(self, user: User) -> None:
        self._users[(user.db, user.name)] = user

    def remove(self, db: str, user: str) -> User | None:
        return self._users.pop((db, user), None)

    def all(self) -> list[User]:
        return sorted(self._users.values(), key=lambda u: (u.db, u.name))

    def credential(self, db: str, user: str, mechanism: str) -> ScramCredential | None:
        found = self._users.get((db, user))
        return None if found is None else found.credentials.get(mechanism)

    def mechanisms(self, db: str, user: str) -> list[str] | None:
        """``saslSupportedMechs`` for ``db.user`` (None: no such user)."""
        found = self._users.get((db, user))
        if found is None:
            return None
        return [m for m in MECHANISMS if m in found.credentials]


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
