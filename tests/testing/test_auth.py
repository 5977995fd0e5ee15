"""Authentication (issue 11, deliverable 7): ``ReplicaSet(users=...)`` / ``serve --auth`` require
SCRAM-SHA-256 or SCRAM-SHA-1 as mongod with ``--auth`` does."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
from bson.binary import Binary
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet
from changestream.testing.core.auth import AuthenticationFailed, ScramConversation, Users

Client = MongoClient[dict[str, Any]]
StartRs = Callable[..., ReplicaSet]
Clients = Callable[..., Client]
PASSWORD = "s3cret-Pa55"


@pytest.fixture
def secured(start_rs: StartRs) -> ReplicaSet:
    return start_rs("8.0", members=2, users={"app": PASSWORD}, noop_interval=0)


@pytest.mark.parametrize("mechanism", [None, "SCRAM-SHA-256", "SCRAM-SHA-1"])
def test_pymongo_authenticates_and_works(
    mechanism: str | None, secured: ReplicaSet, clients: Clients
) -> None:
    options = {} if mechanism is None else {"authMechanism": mechanism}
    client = clients(secured.uri, username="app", password=PASSWORD, **options)
    coll = client.shop.orders
    with coll.watch() as stream:
        coll.insert_one({"_id": 1})
        assert next(stream)["documentKey"] == {"_id": 1}
    status = client.admin.command("connectionStatus")["authInfo"]
    assert status["authenticatedUsers"] == [{"user": "app", "db": "admin"}]


def test_unauthenticated_commands_get_unauthorized(secured: ReplicaSet, clients: Clients) -> None:
    client = clients(secured.uri)
    for allowed in ("ping", "buildInfo", "hello", "isMaster", "connectionStatus", "whatsmyuri"):
        assert client.admin.command(allowed)["ok"] == 1.0
    with pytest.raises(OperationFailure) as exc:
        client.shop.orders.find_one()
    assert exc.value.code == 13
    assert exc.value.details is not None
    assert exc.value.details["codeName"] == "Unauthorized"
    assert exc.value.details["errmsg"] == "Command find requires authentication"
    with pytest.raises(OperationFailure) as exc:
        client.shop.orders.insert_one({"_id": 1})
    assert exc.value.code == 13
    with pytest.raises(OperationFailure) as exc:
        client.shop.orders.watch()
    assert exc.value.code == 13


def test_before_8_0_the_message_is_lower_case(start_rs: StartRs, clients: Clients) -> None:
    client = clients(start_rs("7.0", users={"app": PASSWORD}).uri)
    with pytest.raises(OperationFailure) as exc:
        client.db.command("count", "c")
    assert exc.value.details is not None
    assert exc.value.details["errmsg"] == "command count requires authentication"


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-1"])
def test_a_wrong_password_is_authentication_failed(
    mechanism: str, secured: ReplicaSet, clients: Clients
) -> None:
    client = clients(secured.uri, username="app", password="wrong", authMechanism=mechanism)
    with pytest.raises(OperationFailure) as exc:
        client.admin.command("ping")
    assert exc.value.code == 18
    assert exc.value.details is not None
    assert exc.value.details["errmsg"] == "Authentication failed."


@pytest.mark.parametrize(
    "uri_options", [{"username": "nobody"}, {"username": "app", "authSource": "shop"}]
)
def test_an_unknown_user_is_authentication_failed(
    uri_options: dict[str, str], secured: ReplicaSet, clients: Clients
) -> None:
    client = clients(secured.uri, password=PASSWORD, **uri_options)
    with pytest.raises(OperationFailure) as exc:
        client.admin.command("ping")
    assert exc.value.code == 18


def test_without_users_credentials_fail_as_for_a_missing_user(
    start_rs: StartRs, clients: Clients
) -> None:
    rs = start_rs("8.0")
    with pytest.raises(OperationFailure) as exc:
        clients(rs.uri, username="app", password=PASSWORD).admin.command("ping")
    assert exc.value.code == 18
    assert clients(rs.uri).db.c.insert_one({}).acknowledged, "no users: no --auth"


def test_hello_reports_the_users_mechanisms(secured: ReplicaSet, clients: Clients) -> None:
    client = clients(secured.uri)
    hello = client.admin.command("hello", saslSupportedMechs="admin.app")
    assert hello["saslSupportedMechs"] == ["SCRAM-SHA-1", "SCRAM-SHA-256"]
    assert "saslSupportedMechs" not in client.admin.command(
        "hello", saslSupportedMechs="admin.nobody"
    )


# -- the exchange itself, step by step (RFC 5802 / 7677 with mongod's SHA-1 digest) --------------


def _client_steps(
    mechanism: str, user: str, password: str, server_first: bytes, first_bare: bytes
) -> tuple[bytes, bytes]:
    """The client-final-message and the server signature the client expects."""
    name = "sha256" if mechanism == "SCRAM-SHA-256" else "sha1"
    secret = (
        password
        if name == "sha256"
        else hashlib.md5(f"{user}:mongo:{password}".encode()).hexdigest()
    )
    fields = dict(part.split(b"=", 1) for part in server_first.split(b","))
    salted = hashlib.pbkdf2_hmac(
        name, secret.encode(), base64.b64decode(fields[b"s"]), int(fields[b"i"])
    )
    client_key = hmac.digest(salted, b"Client Key", name)
    without_proof = b"c=biws,r=" + fields[b"r"]
    auth_message = b",".join((first_bare, server_first, without_proof))
    signature = hmac.digest(hashlib.new(name, client_key).digest(), auth_message, name)
    proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
    server_key = hmac.digest(salted, b"Server Key", name)
    expected = b"v=" + base64.b64encode(hmac.digest(server_key, auth_message, name))
    return without_proof + b",p=" + base64.b64encode(proof), expected


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-1"])
def test_the_scram_exchange(mechanism: str) -> None:
    users = Users({"u,=x": "pw"})
    first_bare = b"n=u=2C=3Dx,r=clientnonce"
    conversation = ScramConversation(users, "admin", mechanism)
    server_first = conversation.start(b"n,," + first_bare)
    assert server_first.startswith(b"r=clientnonce")
    final, expected = _client_steps(mechanism, "u,=x", "pw", server_first, first_bare)
    assert conversation.finish(final) == expected
    assert conversation.user == "u,=x"

    wrong = ScramConversation(users, "admin", mechanism)
    server_first = wrong.start(b"n,," + first_bare)
    final, _ = _client_steps(mechanism, "u,=x", "not pw", server_first, first_bare)
    with pytest.raises(AuthenticationFailed):
        wrong.finish(final)
    with pytest.raises(AuthenticationFailed):
        ScramConversation(users, "other", mechanism).start(b"n,," + first_bare)
    with pytest.raises(AuthenticationFailed):
        ScramConversation(users, "admin", mechanism).start(b"p=tls-unique,," + first_bare)


def test_speculative_authentication_in_hello(secured: ReplicaSet, clients: Clients) -> None:
    client = clients(secured.uri)
    first_bare = b"n=app,r=" + base64.b64encode(os.urandom(24))
    hello = client.admin.command(
        "hello",
        speculativeAuthenticate={
            "saslStart": 1,
            "mechanism": "SCRAM-SHA-256",
            "payload": Binary(b"n,," + first_bare),
            "db": "admin",
            "options": {"skipEmptyExchange": True},
        },
    )
    reply = hello["speculativeAuthenticate"]
    assert reply["conversationId"] == 1 and reply["done"] is False
    client_nonce = first_bare.split(b",r=")[1]
    assert bytes(reply["payload"]).startswith(b"r=" + client_nonce)


def test_passwords_must_be_printable_ascii() -> None:
    with pytest.raises(ValueError, match="printable ASCII"):
        ReplicaSet("8.0", users={"app": "pässword"})


# -- the command lines ---------------------------------------------------------------------------


def _reader(stream: IO[str], sink: queue.Queue[str]) -> None:
    for line in stream:
        sink.put(line)


def test_serve_auth_and_watch_never_print_the_password(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "changestream.testing",
            "serve",
            "--port",
            "0",
            "--auth",
            f"app:{PASSWORD}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchers: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        uri = server.stdout.readline().strip()
        host = uri.removeprefix("mongodb://")
        with (
            MongoClient(uri, serverSelectionTimeoutMS=10000) as anonymous,
            pytest.raises(OperationFailure),
        ):
            anonymous.db.c.insert_one({})
        outputs = []
        for password in (PASSWORD, "wrong-" + PASSWORD):
            watcher = subprocess.Popen(
                [
                    *(sys.executable, "-m", "changestream", "watch"),
                    f"mongodb://app:{password}@{host}",
                    *("--db", "db", "--coll", "c", "--max-await-ms", "100"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            watchers.append(watcher)
            assert watcher.stdout is not None and watcher.stderr is not None
            out: queue.Queue[str] = queue.Queue()
            err: queue.Queue[str] = queue.Queue()
            threading.Thread(target=_reader, args=(watcher.stdout, out), daemon=True).start()
            threading.Thread(target=_reader, args=(watcher.stderr, err), daemon=True).start()
            outputs.append((watcher, out, err))
        good, bad = outputs
        with MongoClient(
            uri, username="app", password=PASSWORD, serverSelectionTimeoutMS=10000
        ) as client:
            deadline = time.monotonic() + 60
            lines: list[str] = []
            while not lines:
                client.db.c.insert_one({"n": 1})
                try:
                    lines.append(good[1].get(timeout=0.5))
                except queue.Empty:
                    assert time.monotonic() < deadline, "the authenticated watcher printed nothing"
        assert '"insert"' in lines[0]
        deadline = time.monotonic() + 60
        bad_err: list[str] = []
        while not any("Authentication failed" in line for line in bad_err):
            assert time.monotonic() < deadline, f"no authentication error: {bad_err}"
            with contextlib.suppress(queue.Empty):
                bad_err.append(bad[2].get(timeout=0.5))
        for watcher in watchers:
            if watcher.poll() is None:
                watcher.terminate()
            watcher.wait(timeout=30)
        printed = "".join(lines + bad_err)
        for _, out, err in outputs:
            for sink in (out, err):
                while not sink.empty():
                    printed += sink.get()
        assert PASSWORD not in printed
    finally:
        for proc in [server, *watchers]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_sessions_uid_is_the_users_digest(secured: ReplicaSet, clients: Clients) -> None:
    """mongod writes ``lsid.uid`` = SHA-256 of ``user@db`` for an authenticated session."""
    client = clients(secured.uri, username="app", password=PASSWORD)
    coll = client.shop.orders
    coll.insert_one({"_id": 0})
    with coll.watch() as stream:
        with client.start_session() as session, session.start_transaction():
            coll.insert_one({"_id": 1}, session=session)
        event = next(stream)
    assert event["lsid"]["uid"] == hashlib.sha256(b"app@admin").digest()
