"""Every failure a user must fix reads as one line naming its cause and the next step.

The same cause is checked where it surfaces: the library's exception, ``consume``'s
log, the command line (one line on stderr, the exit status) and ``serve``. A last
test checks that none of these messages leaks a credential or an internal name.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

import changestream
from changestream.stores import FileTokenStore, MemoryTokenStore
from changestream.testing import ReplicaSet

CLI = [sys.executable, "-m", "changestream"]
PASSWORD = "s3cret-Pa55"
FAST = {"max_await_time_ms": 50}


def run_cli(*args: str, timeout: float = 90) -> tuple[int, str]:
    """Run the CLI; its exit status and stderr (checked for leaks)."""
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    assert_clean(done.stderr)
    return done.returncode, done.stderr


def one_line(stderr: str) -> str:
    """The CLI's message: exactly one line, and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture(scope="module")
def secured() -> Iterator[ReplicaSet]:
    """A simulated replica set that requires authentication (user ``u``)."""
    with ReplicaSet("8.0", users={"u": PASSWORD}) as rs:
        yield rs


@pytest.fixture(scope="module")
def plain() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as rs:
        yield rs


@pytest.fixture
def coll(plain: ReplicaSet) -> Iterator[Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(plain.uri)
    yield client.db.coll
    client.admin.command("configureFailPoint", "failCommand", mode="off")
    client.close()


def fail_next(coll: Any, command: str, code: int, **extra: Any) -> None:
    coll.database.client.admin.command(
        "configureFailPoint", "failCommand", mode={"times": 1},
        data={"failCommands": [command], "errorCode": code, **extra},
    )


def consume_error(open_stream: Any, store: Any, caplog: pytest.LogCaptureFixture) -> Any:
    """What ``consume`` raises; its log must carry the same message (once, at ERROR)."""
    with caplog.at_level(logging.ERROR, logger="changestream"), pytest.raises(
        changestream.ConsumeError
    ) as info:
        changestream.consume(open_stream, lambda change: None, store, retry_for=30)
    message = str(info.value)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == [message]
    assert_clean(message)
    return info.value


# -- 280: a token that is not in this deployment's history ----------------------------------
def test_a_token_from_another_deployment(coll: Any, tmp_path: Any,
                                         caplog: pytest.LogCaptureFixture) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    with changestream.watch(coll, **FAST) as stream:
        store.save(stream.resume_token)
    opened: list[Any] = []

    def open_stream(token: Any) -> Any:
        opened.append(token)
        return changestream.watch(coll, resume_after=token, **FAST)

    fail_next(coll, "aggregate", 280)
    error = consume_error(open_stream, store, caplog)
    assert isinstance(error, changestream.NotResumableError) and len(opened) == 1
    text = str(error)
    assert "not in this deployment's change history" in text
    assert "another deployment" in text and "backup" in text and "'_id'" in text
    assert f"the token file {tmp_path / 'token.json'} holds" in text
    assert "valid" not in text  # the token is the problem: never called valid


def test_a_stage_that_changed_id_is_named(coll: Any, caplog: pytest.LogCaptureFixture) -> None:
    def open_stream(token: Any) -> Any:
        return changestream.watch(coll, [{"$set": {"_id": "changed"}}], resume_after=token,
                                  **FAST)

    coll.insert_one({"i": 1})  # after the stream opens: the stage modifies its _id
    store = MemoryTokenStore()
    with changestream.watch(coll, **FAST) as stream:
        store.save(stream.resume_token)
    coll.insert_one({"i": 2})
    error = consume_error(open_stream, store, caplog)
    assert "a pipeline stage changed the events' '_id'" in str(error)
    assert "the in-memory token store holds token" in str(error)


def test_cli_token_not_in_history(plain: ReplicaSet, coll: Any, tmp_path: Any) -> None:
    fail_next(coll, "aggregate", 280, errorLabels=["NonResumableChangeStreamError"])
    status, stderr = run_cli("watch", plain.uri, "--db", "db", "--coll", "coll",
                             "--no-status", "--connect-timeout", "20")
    line = one_line(stderr.replace("changestream: watching db.coll from now; Ctrl-C to stop\n",
                                   ""))
    assert status == 1
    assert "not in this deployment's change history (ChangeStreamFatalError, code 280)" in line


# -- credentials -------------------------------------------------------------------------------
def test_no_credentials(secured: ReplicaSet, caplog: pytest.LogCaptureFixture) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(secured.uri)
    error = consume_error(lambda token: changestream.watch(client.db.coll, resume_after=token),
                          MemoryTokenStore(), caplog)
    client.close()
    assert isinstance(error, changestream.NotResumableError)
    assert str(error).startswith("the deployment requires authentication and the client sent "
                                 "no credentials: put the user name and password in the connection string")


def test_cli_no_credentials(secured: ReplicaSet) -> None:
    status, stderr = run_cli("watch", secured.uri, "--no-status", "--connect-timeout", "20")
    lines = [line for line in stderr.splitlines() if "watching" not in line]
    assert status == 1 and len(lines) == 1 and "Traceback" not in stderr
    assert "requires authentication and the client sent no credentials" in lines[0]


def wrong_password_uri(rs: ReplicaSet) -> str:
    return rs.uri.replace("mongodb://", "mongodb://u:wrong-Pa55@")


def test_wrong_credentials_are_not_retried(secured: ReplicaSet,
                                           caplog: pytest.LogCaptureFixture) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(wrong_password_uri(secured))
    opened: list[Any] = []

    def open_stream(token: Any) -> Any:
        opened.append(token)
        return changestream.watch(client.db.coll, resume_after=token)

    # A second client's failure comes as a server selection timeout (the member is
    # unselectable until its next heartbeat): neither is retried.
    with pytest.raises(OperationFailure):
        client.admin.command("ping")
    error = consume_error(open_stream, MemoryTokenStore(), caplog)
    client.close()
    assert isinstance(error, changestream.NotResumableError) and len(opened) == 1
    assert str(error).startswith("authentication failed (code 18): the user name or password")
    assert not [r for r in caplog.records if "reopening" in r.getMessage()]


def test_cli_wrong_credentials(secured: ReplicaSet) -> None:
    status, stderr = run_cli("watch", wrong_password_uri(secured), "--connect-timeout", "60")
    line = one_line(stderr)
    assert status == 1
    assert "authentication failed (code 18)" in line and "fix the credentials" in line


# -- reaching the deployment ----------------------------------------------------------------
def test_cli_wrong_replica_set_name(plain: ReplicaSet) -> None:
    uri = plain.uri.replace("replicaSet=rs0", "replicaSet=other")
    status, stderr = run_cli("watch", uri, "--connect-timeout", "1")
    line = one_line(stderr)
    host = plain.members[0]
    assert status == 1
    assert f"could not reach the deployment ({host}" in line
    assert "no member answered as replica set 'other'" in line and "replicaSet=" in line


def test_cli_names_srv_hosts_as_written() -> None:
    from changestream._cli.common import hosts as _hosts

    assert _hosts("mongodb+srv://u:p@cluster0.example.invalid/?x=1") == (
        "cluster0.example.invalid (SRV)"
    )
    assert _hosts("mongodb://u:p@a:1,b:2/db") == "a:1,b:2"


# -- events over 16 MB ----------------------------------------------------------------------
def test_oversized_event_names_the_option(coll: Any, caplog: pytest.LogCaptureFixture) -> None:
    fail_next(coll, "getMore", 10334, errmsg="BSONObj size: 18874782 (0x1200000) is invalid")
    with changestream.watch(coll, **FAST) as stream, pytest.raises(OperationFailure) as info:
        coll.insert_one({"i": 1})
        stream.next()
    assert info.value.code == 10334  # still the server's error, for code that checks it
    assert_clean(str(info.value))
    assert str(info.value).startswith("a change event is larger than 16 MB (BSONObjectTooLarge")
    assert "reassemble_split_events=True" in str(info.value)

    opened: list[Any] = []

    def open_stream(token: Any) -> Any:
        opened.append(token)
        return changestream.watch(coll, resume_after=token, **FAST)

    fail_next(coll, "getMore", 10334)
    coll.insert_one({"i": 2})
    error = consume_error(open_stream, MemoryTokenStore(), caplog)
    assert isinstance(error, changestream.EventTooLargeError) and len(opened) == 1
    assert "oversize='split'" in str(error)


def test_cli_oversized_event(plain: ReplicaSet, coll: Any) -> None:
    fail_next(coll, "getMore", 10334)
    process = subprocess.Popen(
        [*CLI, "watch", plain.uri, "--db", "db", "--coll", "coll", "--no-status",
         "--max-await-ms", "100"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    assert process.stderr is not None
    assert "watching" in process.stderr.readline()
    coll.insert_one({"big": 1})
    status = process.wait(60)
    stderr = process.stderr.read()
    assert_clean(stderr)
    assert status == 1
    assert "larger than 16 MB" in one_line(stderr) and "--oversize split" in stderr


def test_split_events_are_requested_and_joined() -> None:
    with ReplicaSet("7.0") as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        coll = client.db.big
        coll.insert_one({"_id": 1, "a": "x" * (7 << 20)})
        with changestream.watch(coll, full_document="updateLookup",
                                reassemble_split_events=True, **FAST) as stream:
            coll.update_one({"_id": 1}, {"$set": {"b": "y" * (7 << 20)}})
            change = stream.next()  # about 21 MB: split by the server, joined here
        assert len(change["fullDocument"]["b"]) == 7 << 20
        assert "splitEvent" not in change
        client.close()


@pytest.mark.parametrize("version", ["6.0.8", "5.0"])
def test_split_events_on_an_older_server_refused_at_watch(version: str) -> None:
    with ReplicaSet(version) as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        with pytest.raises(changestream.SplitEventError) as info:
            changestream.watch(client.db.coll, reassemble_split_events=True)
        client.close()
    text = str(info.value)
    assert_clean(text)
    assert text.startswith("reassemble_split_events=True needs $changeStreamSplitLargeEvent, "
                           "which this server does not have (MongoDB 7.0+ or 6.0.9+ have it)")
    assert "\n" not in text


def test_consume_oversize_choice(coll: Any) -> None:
    with pytest.raises(ValueError, match="oversize must be 'fail' or 'split', not 'skip'"):
        changestream.consume(coll, print, MemoryTokenStore(), oversize="skip")
    with pytest.raises(TypeError, match="pass reassemble_split_events=True to watch"):
        changestream.consume(lambda token: None, print, MemoryTokenStore(), oversize="split")


@pytest.mark.parametrize("option", ["resume_after", "start_after", "start_at_operation_time"])
def test_consume_start_options_with_a_snapshot_are_one_line(coll: Any, option: str) -> None:
    """The stream after a copy starts where the copy was read: a start option cannot apply."""
    with pytest.raises(TypeError) as info:
        changestream.consume(coll, print, MemoryTokenStore(), initial_snapshot=True,
                             watch_options={option: None})
    text = str(info.value)
    assert_clean(text)
    assert text == (f"consume(initial_snapshot=True): watch_options must not hold {option!r}: "
                    "the stream starts where the copy was read")


def test_consume_watch_options_must_be_a_mapping(coll: Any) -> None:
    with pytest.raises(TypeError, match="consume\\(\\): watch_options must be a dict, not list"):
        changestream.consume(coll, print, MemoryTokenStore(), watch_options=[("batch_size", 5)])


# -- the command line's own arguments ---------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "token", "expected"),
    [
        ("--resume-after", '{"_data": "zz"}', "'_data' must be a hex string"),
        ("--start-after", '{"_data": 5}', "'_data' must be a hex string, not int 5"),
    ],
)
def test_cli_malformed_token(option: str, token: str, expected: str) -> None:
    status, stderr = run_cli("watch", "mongodb://127.0.0.1:9/", option, token)
    line = one_line(stderr)
    assert status == 2 and f"{option}: not a resume token: {expected}" in line


def test_serve_on_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, stderr = run_cli("serve", "--port", str(port))
    line = one_line(stderr)
    assert status == 1
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port 0" in line


# -- nothing leaks: every message above goes through assert_clean ---------------------------------
def internal_names() -> set[str]:
    """Classes defined in the package's private modules and not exported publicly."""
    import changestream.errors
    import changestream.stores

    public = set(changestream.__all__) | set(changestream.errors.__all__)
    names: set[str] = set()
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not name.startswith("changestream.") or "._" not in name or ".testing" in name:
            continue
        for attribute, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == name and attribute not in public:
                names.add(attribute)
    # Single words (Command, Cursor, Progress) are also English: only compound names count.
    compound = {name for name in names if len(re.findall(r"[A-Z]", name)) > 1}
    return compound | {"MemoryTokenStore", "FileTokenStore", "MongoTokenStore"}


def assert_clean(message: str) -> None:
    """No credential, no internal class name, no traceback in a message a user sees."""
    internal = internal_names()
    assert PASSWORD not in message and "wrong-Pa55" not in message, message
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))
    assert not words & internal, (words & internal, message)
    assert "Traceback" not in message, message


def test_the_leak_check_knows_the_internal_names_and_catches_them() -> None:
    assert {"ChangeStreamMachine", "MemoryTokenStore"} <= internal_names()
    for leaky in (f"auth failed for app:{PASSWORD}", "MemoryTokenStore() holds no token",
                  "Traceback (most recent call last):"):
        with pytest.raises(AssertionError):
            assert_clean(leaky)


# -- a stored token dated in the future -------------------------------------------------------
def dated(token: Any, seconds_ahead: int) -> dict[str, Any]:
    """``token`` with its cluster time moved ``seconds_ahead`` (a corrupted hex digit does this)."""
    data = token["_data"]
    seconds = int(data[2:10], 16) + seconds_ahead
    return {"_data": f"{data[:2]}{seconds:08X}{data[10:]}"}


def present_token(coll: Any) -> Any:
    coll.insert_one({"now": 1})
    with changestream.watch(coll, **FAST) as stream:
        stream.try_next()
        return stream.resume_token


def test_a_token_ahead_of_the_server_is_warned_of_and_shows_in_the_lag(
    coll: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 33, item 3: a token ahead of the deployment opened silently, then every change
    until its time was skipped with lag 0 and nothing logged."""
    token = dated(present_token(coll), 3600)
    with caplog.at_level(logging.WARNING, logger="changestream"), changestream.watch(
        coll, resume_after=token, **FAST
    ) as stream:
        coll.insert_one({"skipped": 1})
        assert stream.try_next() is None
        lag, ahead = stream.lag, stream.position.ahead
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "ahead of the deployment's cluster time" in warning and "1:00:0" in warning
    assert "skips every change" in warning and "\n" not in warning
    assert lag is not None and lag.total_seconds() < -3500
    assert ahead is not None and ahead.total_seconds() > 3500


def test_a_token_a_day_ahead_is_refused(
    coll: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A token years ahead (one corrupted hex digit: 2038) is no position any server reaches."""
    token = dated(present_token(coll), 86_400 * 4000)
    with pytest.raises(changestream.InvalidResumeTokenError) as info:
        changestream.watch(coll, resume_after=token, **FAST)
    assert "more than a day ahead" in str(info.value) and info.value.field == "resumeAfter"
    store = FileTokenStore(tmp_path / "token.json")
    store.save(token)
    error = consume_error(lambda t: changestream.watch(coll, resume_after=t, **FAST), store,
                          caplog)
    assert isinstance(error, changestream.NotResumableError)
    assert "more than a day ahead" in str(error) and str(tmp_path / "token.json") in str(error)
    assert_clean(str(error))


# -- messages that say what to do (issue 33, item 16) -----------------------------------------
def test_a_damaged_token_names_the_damage_and_the_store(
    coll: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    token = present_token(coll)
    cut = {"_data": token["_data"][:20]}  # a token file cut short
    with pytest.raises(OperationFailure) as info:
        changestream.watch(coll, resume_after=cut, **FAST)
    assert info.value.code == 15 and str(info.value).startswith("the resume token is damaged")
    store = FileTokenStore(tmp_path / "token.json")
    store.save(cut)
    error = consume_error(lambda t: changestream.watch(coll, resume_after=t, **FAST), store,
                          caplog)
    assert isinstance(error, changestream.NotResumableError)
    assert "damaged" in str(error) and str(tmp_path / "token.json") in str(error)


@pytest.mark.parametrize("option", ["full_document", "full_document_before_change"])
def test_required_images_that_are_missing_say_how_to_enable_them(coll: Any, option: str) -> None:
    coll.replace_one({"_id": "img"}, {"a": 0}, upsert=True)
    with changestream.watch(coll, **{option: "required"}, **FAST) as stream, pytest.raises(
        OperationFailure
    ) as info:
        coll.update_one({"_id": "img"}, {"$inc": {"a": 1}})
        stream.next()
    text = str(info.value)
    assert info.value.code == 47 and "\n" not in text
    assert text.startswith(f"{option}='required' needs pre- and post-images")
    assert "changeStreamPreAndPostImages" in text and f"{option}='whenAvailable'" in text
    assert_clean(text)


def test_a_standalone_server_says_change_streams_need_a_replica_set(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ReplicaSet("8.0", standalone=True) as server:
        client: MongoClient[dict[str, Any]] = MongoClient(server.uri)
        with pytest.raises(OperationFailure) as info:
            changestream.watch(client.db.coll)
        with caplog.at_level(logging.ERROR, logger="changestream"), pytest.raises(
            OperationFailure
        ) as consumed:
            changestream.consume(client.db.coll, print, MemoryTokenStore(), retry_for=5)
        client.close()
    for text in (str(info.value), str(consumed.value)):
        assert text.startswith("change streams need a replica set or a sharded cluster")
        assert "--replSet" in text and "\n" not in text


def test_a_known_option_value_in_the_wrong_case_names_the_right_one(coll: Any) -> None:
    with pytest.raises(ValueError, match="did you mean 'updateLookup'"):
        changestream.watch(coll, full_document="UpdateLookup")
    with pytest.raises(ValueError, match="did you mean 'whenAvailable'"):
        changestream.watch(coll, full_document_before_change="whenavailable")


def test_a_path_passed_as_the_store_says_which_store_to_use(coll: Any) -> None:
    import asyncio

    with pytest.raises(TypeError) as info:
        changestream.consume(coll, print, "token.json")  # type: ignore[arg-type]
    assert "FileTokenStore('token.json')" in str(info.value)

    async def main() -> None:
        await changestream.aio.consume(lambda token: None, print, "token.json")  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=r"FileTokenStore\('token.json'\)"):
        asyncio.run(main())
    with pytest.raises(TypeError, match=r"store must be a token store .* not dict"):
        changestream.consume(coll, print, {})  # type: ignore[arg-type]


def test_a_watch_of_the_other_kind_of_client_names_the_right_watch(plain: ReplicaSet) -> None:
    import asyncio

    from pymongo import AsyncMongoClient

    async_client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(plain.uri)
    with pytest.raises(TypeError) as info:
        changestream.watch(async_client.db.coll)
    assert "for an AsyncMongoClient use changestream.aio.watch" in str(info.value)
    sync_client: MongoClient[dict[str, Any]] = MongoClient(plain.uri)

    async def main() -> None:
        await changestream.aio.watch(sync_client.db.coll)

    with pytest.raises(TypeError) as async_info:
        asyncio.run(main())
    assert "for a MongoClient use changestream.watch" in str(async_info.value)
    sync_client.close()


@pytest.mark.parametrize(("module", "library", "extra"), [
    ("changestream.exporters.prometheus", "prometheus_client", "prometheus"),
    ("changestream.exporters.otel", "opentelemetry", "opentelemetry"),
])
def test_an_exporter_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, library: str, extra: str
) -> None:
    import importlib

    monkeypatch.setitem(sys.modules, library, None)  # as if not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as info:
        importlib.import_module(module)
    assert f"pip install 'changestream[{extra}]'" in str(info.value)
