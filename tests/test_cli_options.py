"""``changestream watch`` options (start points, batch size, expanded events, --limit,
--until-idle, logging, --version) and ``serve``'s banner, oplog size and no-op interval,
all through real subprocesses.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.errors import OperationFailure

import changestream
from changestream._cli.progress import parse_operation_time

CLI = [sys.executable, "-m", "changestream"]
TIMEOUT = 120


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT)


def printed(result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture
def written(simulator: Any) -> tuple[str, Timestamp, MongoClient[dict[str, Any]]]:
    """Five inserts into shop.orders; the cluster time just before them."""
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    with client.start_session() as session:
        client.shop.orders.insert_one({"i": -1}, session=session)
        before = session.operation_time
    assert before is not None
    client.shop.orders.insert_many([{"i": i} for i in range(5)])
    return simulator.uri, Timestamp(before.time, before.inc + 1), client


def test_version() -> None:
    for args in (["--version"], ["watch", "--version"]):
        result = run(*args)
        assert result.returncode == 0
        assert result.stdout.strip().startswith(f"changestream {changestream.__version__} (PyMongo")


def test_limit_batch_size_and_the_token_file(written: Any, tmp_path: Path) -> None:
    uri, before, _ = written
    token_file = str(tmp_path / "token.json")
    ns = ["--db", "shop", "--coll", "orders", "--token-file", token_file]
    first = run("watch", uri, *ns, "--start-at-operation-time", f"{before.time}:{before.inc}",
                "--limit", "3", "--batch-size", "2")
    assert first.returncode == 0, first.stderr
    assert [c["fullDocument"]["i"] for c in printed(first)] == [0, 1, 2]
    assert f"from cluster time {before}" in first.stderr
    # The token file holds the third change: the next run starts at the fourth.
    second = run("watch", uri, *ns, "--limit", "2")
    assert second.returncode == 0, second.stderr
    assert [c["fullDocument"]["i"] for c in printed(second)] == [3, 4]


def test_until_idle_exits_once_caught_up(written: Any) -> None:
    uri, before, _ = written
    started = time.monotonic()
    result = run("watch", uri, "--db", "shop", "--start-at-operation-time",
                 f"{before.time}:{before.inc}", "--until-idle", "1", "--max-await-ms", "100")
    assert result.returncode == 0, result.stderr
    assert [c["fullDocument"]["i"] for c in printed(result)] == [0, 1, 2, 3, 4]
    assert "no change for 1 s; stopped after 5 changes" in result.stderr
    assert time.monotonic() - started < TIMEOUT


def test_resume_after_and_debug_logging(written: Any) -> None:
    uri, before, client = written
    with changestream.watch(client.shop.orders, start_at_operation_time=before) as stream:
        second = next(stream) and next(stream)
    token = changestream.token_to_json(second["_id"])
    result = run("watch", uri, "--db", "shop", "--coll", "orders", "--resume-after", token,
                 "--limit", "1", "--log-level", "debug", "--no-status")
    assert result.returncode == 0, result.stderr
    assert [c["fullDocument"]["i"] for c in printed(result)] == [2]
    assert "stored the resume token (cluster time Timestamp(" in result.stderr
    quiet = run("watch", uri, "--db", "shop", "--coll", "orders", "--resume-after", token,
                "--limit", "1")
    assert "stored the resume token" not in quiet.stderr


def test_show_expanded_events(written: Any) -> None:
    uri, _, client = written
    with client.start_session() as session:
        client.shop.command("ping", session=session)
        now = session.operation_time
    assert now is not None
    client.shop.orders.create_index("i")
    args = ["watch", uri, "--db", "shop", "--start-at-operation-time", f"{now.time}:{now.inc}",
            "--until-idle", "1", "--max-await-ms", "100"]
    plain, expanded = run(*args), run(*args, "--show-expanded-events")
    assert plain.returncode == 0 and expanded.returncode == 0, expanded.stderr
    assert "createIndexes" not in [c["operationType"] for c in printed(plain)]
    assert "createIndexes" in [c["operationType"] for c in printed(expanded)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "0"], "--limit: must be at least 1, not 0"),
        (["--batch-size", "x"], "--batch-size: 'x' is not an integer"),
        (["--until-idle", "-1"], "--until-idle: must be a number of seconds > 0"),
        (["--start-at-operation-time", "yesterday"], "is not a cluster time: use SECONDS"),
        (["--start-after", "{}", "--resume-after", "{}"], "not allowed with argument"),
        (["--log-level", "loud"], "--log-level: invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_clear_line(args: list[str], message: str) -> None:
    result = run("watch", "mongodb://127.0.0.1:1/", *args)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


def test_operation_time_forms() -> None:
    assert parse_operation_time("1700000000") == Timestamp(1700000000, 0)
    assert parse_operation_time("1700000000:7") == Timestamp(1700000000, 7)
    assert parse_operation_time("2023-11-14T22:13:20Z") == Timestamp(1700000000, 0)
    assert parse_operation_time("2023-11-14T22:13:20") == Timestamp(1700000000, 0)
    with pytest.raises(ValueError, match="ISO-8601"):
        parse_operation_time("1:2:3")


def test_help_names_the_command_as_typed_and_shows_defaults() -> None:
    serve = run("serve", "--help")
    assert serve.stdout.startswith("usage: changestream serve ")
    assert "(default 8.0)" in serve.stdout and "(default 10.0)" in serve.stdout
    module = subprocess.run([sys.executable, "-m", "changestream.testing", "serve", "--help"],
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert module.stdout.startswith("usage: python -m changestream.testing serve ")
    watch = run("watch", "--help")
    assert watch.stdout.startswith("usage: changestream watch ")
    assert "(default 1000)" in watch.stdout


def serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([*CLI, "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, err
    return err


def test_serve_banner_ready_line_and_noop_interval() -> None:
    process, uri = serve("--members", "2", "--noop-interval", "0.2")
    try:
        assert uri.startswith("mongodb://127.0.0.1:") and "replicaSet=rs0" in uri
        with MongoClient(uri, serverSelectionTimeoutMS=10000) as client:
            client.db.coll.insert_one({"x": 1})
            with changestream.watch(client.db.coll, max_await_time_ms=50) as stream:
                start = stream.position.token_time
                deadline = time.monotonic() + 60
                # No writes: only the periodic no-op moves the stream's token forward.
                while stream.position.token_time == start and time.monotonic() < deadline:
                    assert stream.try_next() is None
                assert stream.position.token_time != start
    finally:
        err = stop(process)
    lines = err.splitlines()
    assert lines[0] == (
        "changestream simulator: MongoDB 8.0 replica set 'rs0', 2 members; oplog unbounded; "
        "no-op every 0.2 s; in memory"
    )
    assert lines[1].startswith("ready: listening on 127.0.0.1:") and "Ctrl-C to stop" in lines[1]


def test_serve_oplog_mb_truncates_the_oplog() -> None:
    process, uri = serve("--oplog-mb", "0.05", "--noop-interval", "0")
    try:
        with MongoClient(uri, serverSelectionTimeoutMS=10000) as client:
            coll = client.db.coll
            with client.start_session() as session:
                coll.insert_one({"first": True}, session=session)
                first = session.operation_time
            coll.insert_many([{"pad": "x" * 1000} for _ in range(200)])  # ~200 KB of oplog
            with pytest.raises(OperationFailure) as lost:
                changestream.watch(coll, start_at_operation_time=first).try_next()
            assert lost.value.code == 286
    finally:
        err = stop(process)
    assert "oplog 0.05 MB; no periodic no-ops" in err


def test_status_line_on_a_terminal_and_not_in_a_pipe(written: Any) -> None:
    import os
    import pty

    uri, before, _ = written
    args = [*CLI, "watch", uri, "--db", "shop", "--start-at-operation-time",
            f"{before.time}:{before.inc}", "--until-idle", "2.5", "--max-await-ms", "100"]
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        out, _ = process.communicate(timeout=TIMEOUT)
        terminal = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            terminal += chunk
    finally:
        os.close(master)
    assert process.returncode == 0 and len(out.splitlines()) == 5
    screen = terminal.decode()
    # Redrawn in place ("\r" + erase line), then erased before the last message.
    assert "\r\x1b[K5 events  " in screen and "/s  lag 0 s  resumes 0" in screen, screen
    assert screen.rstrip().endswith("stopped after 5 changes")
    piped = run(*args[3:])
    assert "events" not in piped.stderr and "\x1b[K" not in piped.stderr


def _stats(handled: int, token_time: Timestamp | None) -> changestream.ConsumeStats:
    position = None if token_time is None else changestream.Position(token_time, token_time)
    return changestream.ConsumeStats(handled, 0.0, None, position, 0, 0, 0, None, 0.0)


def test_until_idle_waits_for_the_cluster_time_read_at_the_start() -> None:
    """Idle is not caught up: a quiet moment in a snapshot (no position yet) or in a backlog
    (a commit that takes seconds, the token still behind) must not end ``--until-idle``."""
    import threading

    from changestream._cli.progress import WatchProgress

    now = [0.0]
    stop = threading.Event()
    progress = WatchProgress(stop, None, 1.0, clock=lambda: now[0])
    progress.caught_up_to = Timestamp(2000, 1)
    progress(_stats(10, None))  # copying the snapshot: no stream position yet
    now[0] = 5.0
    progress(_stats(10, None))
    assert not stop.is_set(), "stopped while copying the snapshot"
    progress(_stats(20, Timestamp(1500, 1)))  # a backlog: a long commit, nothing handled
    now[0] = 10.0
    progress(_stats(20, Timestamp(1500, 1)))
    assert not stop.is_set(), "stopped with a backlog older than the start"
    progress(_stats(30, Timestamp(2000, 1)))  # caught up; then nothing for 1 s
    assert not stop.is_set()
    now[0] = 11.5
    progress(_stats(30, Timestamp(2000, 1)))
    assert stop.is_set() and progress.idle_stop


def test_large_changes_with_a_token_file_are_printed_once(simulator: Any, tmp_path: Path) -> None:
    """Issue 33, item 1: changes of 100 kB come in a reply PyMongo hands over as a
    memoryview; --token-file then stopped with "token must be a document (mapping), not
    memoryview" and every run printed the same change again."""
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    with client.start_session() as session:
        client.shop.big.insert_one({"i": -1}, session=session)
        before = session.operation_time
    assert before is not None
    client.shop.big.insert_many([{"i": i, "pad": "x" * 100_000} for i in range(3)])
    ns = ["--db", "shop", "--coll", "big", "--token-file", str(tmp_path / "token.json"),
          "--oversize", "split", "--until-idle", "1", "--max-await-ms", "100", "--no-status"]
    first = run("watch", simulator.uri, *ns, "--start-at-operation-time",
                f"{before.time}:{before.inc + 1}")
    assert first.returncode == 0, first.stderr
    assert [c["fullDocument"]["i"] for c in printed(first)] == [0, 1, 2]
    client.shop.big.insert_one({"i": 3, "pad": "y" * 100_000})
    second = run("watch", simulator.uri, *ns)
    assert second.returncode == 0, second.stderr
    assert [c["fullDocument"]["i"] for c in printed(second)] == [3]
    client.close()
