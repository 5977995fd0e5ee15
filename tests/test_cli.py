"""The ``changestream`` command line, through real subprocesses."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from pymongo import MongoClient

from changestream.stores import FileTokenStore

CLI = [sys.executable, "-m", "changestream"]


class Process:
    """A running ``changestream`` process whose stdout/stderr lines are read in the background."""

    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen(
            [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stdout: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        assert self.popen.stdout is not None and self.popen.stderr is not None
        threading.Thread(target=self._pump, args=(self.popen.stdout, self.stdout.put),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.popen.stderr, self.stderr.append),
                         daemon=True).start()

    @staticmethod
    def _pump(stream: IO[str], sink: Any) -> None:
        for line in stream:
            sink(line)

    def wait_for_stderr(self, text: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.stderr):
            assert self.popen.poll() is None, f"exited early: {''.join(self.stderr)}"
            assert time.monotonic() < deadline, f"no {text!r} on stderr: {self.stderr}"
            time.sleep(0.02)

    def lines(self, count: int, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        lines = []
        for _ in range(count):
            try:
                line = self.stdout.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                pytest.fail(f"got {len(lines)} of {count} lines; stderr: {''.join(self.stderr)}")
            lines.append(json.loads(line))
        return lines

    def stop(self, signum: int = signal.SIGINT, timeout: float = 20) -> int:
        self.popen.send_signal(signum)
        return self.popen.wait(timeout)

    def finish(self, timeout: float = 60) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        process.kill()


@pytest.fixture
def database(mongo_client: MongoClient[dict[str, Any]]) -> Iterator[str]:
    name = f"cs_cli_{uuid.uuid4().hex[:8]}"
    mongo_client[name].create_collection("coll")
    yield name
    mongo_client.drop_database(name)


def watch(processes: list[Process], uri: str, database: str, token_file: Path,
          *extra: str) -> Process:
    process = Process("watch", uri, "--db", database, "--coll", "coll", "--token-file",
                      str(token_file), "--max-await-ms", "100", *extra)
    processes.append(process)
    process.wait_for_stderr("watching")
    return process


def test_watch_prints_json_lines_keeps_the_token_file_and_resumes(
    mongodb_uri: str, mongo_client: MongoClient[dict[str, Any]], database: str,
    tmp_path: Path, processes: list[Process]
) -> None:
    coll = mongo_client[database].coll
    token_file = tmp_path / "token.json"
    process = watch(processes, mongodb_uri, database, token_file)
    coll.insert_many([{"i": 0}, {"i": 1}])
    coll.update_one({"i": 1}, {"$set": {"x": True}})
    events = process.lines(3)
    assert [e["operationType"] for e in events] == ["insert", "insert", "update"]
    assert events[0]["fullDocument"]["i"] == 0
    assert events[2]["updateDescription"]["updatedFields"] == {"x": True}
    assert isinstance(events[0]["_id"]["_data"], str)  # relaxed Extended JSON
    # The file follows each printed change.
    deadline = time.monotonic() + 10
    while True:
        stored = FileTokenStore(token_file).load()
        if stored is not None and stored.token == events[2]["_id"]:
            break
        assert time.monotonic() < deadline, f"token file not current: {stored}"
        time.sleep(0.02)

    assert process.stop(signal.SIGINT) == 0, "".join(process.stderr)
    assert "stopped" in "".join(process.stderr)
    assert FileTokenStore(token_file).load() is not None

    coll.insert_many([{"i": 2}, {"i": 3}])  # while nobody watches
    again = watch(processes, mongodb_uri, database, token_file)
    assert "after the token in" in "".join(again.stderr)
    coll.insert_one({"i": 4})
    resumed = again.lines(3)
    assert [e["fullDocument"]["i"] for e in resumed] == [2, 3, 4]
    assert again.stop(signal.SIGTERM) == 0
    assert again.stdout.empty()


def test_invalidate_exits_1_and_start_after_continues(
    mongodb_uri: str, mongo_client: MongoClient[dict[str, Any]], database: str,
    tmp_path: Path, processes: list[Process]
) -> None:
    coll = mongo_client[database].coll
    token_file = tmp_path / "token.json"
    process = watch(processes, mongodb_uri, database, token_file)
    coll.insert_one({"i": 0})
    coll.drop()
    assert [e["operationType"] for e in process.lines(2)] == ["insert", "drop"]
    assert process.finish() == 1
    message = "".join(process.stderr)
    assert "invalidated" in message and "--start-after" in message
    suggested = message.split("--start-after '")[1].split("'")[0]
    coll.insert_one({"i": 1})
    again = watch(processes, mongodb_uri, database, token_file, "--start-after", suggested)
    assert again.lines(1)[0]["fullDocument"]["i"] == 1
    assert again.stop() == 0


def test_watch_rejects_bad_arguments(processes: list[Process]) -> None:
    for args, expected in [
        (["watch", "mongodb://127.0.0.1:1", "--coll", "c"], "--coll needs --db"),
        (["watch", "mongodb://127.0.0.1:1", "--pipeline", "{oops"], "--pipeline"),
        (["watch", "mongodb://127.0.0.1:1", "--pipeline", '{"$match": {}}'], "JSON array"),
    ]:
        process = Process(*args)
        processes.append(process)
        assert process.finish() == 2
        assert expected in "".join(process.stderr)


def test_a_corrupt_token_file_is_reported(mongodb_uri: str, database: str, tmp_path: Path,
                                          processes: list[Process]) -> None:
    token_file = tmp_path / "token.json"
    token_file.write_text("{garbage")
    process = Process("watch", mongodb_uri, "--db", database, "--token-file", str(token_file))
    processes.append(process)
    assert process.finish() == 1
    assert str(token_file) in "".join(process.stderr)


def test_demo_runs_and_shows_the_resume(processes: list[Process]) -> None:
    if os.environ.get("MONGODB_URI"):
        print("note: the demo always runs on its own simulator, MONGODB_URI is not used")
    process = Process("demo")
    processes.append(process)
    started = time.monotonic()
    assert process.finish() == 0
    assert time.monotonic() - started < 30
    output = "".join(process.stdout.get() for _ in range(process.stdout.qsize()))
    assert "failover" in output
    assert "[resume] aggregate on" in output and "resumeAfter" in output
    assert "received 6 events (nothing lost, nothing repeated)" in output
    assert output.count("event insert") == 6


def test_serve_delegates_to_the_simulator(processes: list[Process]) -> None:
    process = Process("serve", "--port", "0", "--version", "7.0")
    processes.append(process)
    uri = process.stdout.get(timeout=30)
    assert uri.startswith("mongodb://127.0.0.1:")
    with MongoClient(uri.strip(), serverSelectionTimeoutMS=5000) as client:
        assert client.server_info()["version"].startswith("7.0")
    assert process.stop(signal.SIGTERM) == 0


@pytest.mark.skipif(shutil.which("changestream", path=os.path.dirname(sys.executable)) is None,
                    reason="the changestream console script is not installed next to python")
def test_console_script_entry_point() -> None:
    script = shutil.which("changestream", path=os.path.dirname(sys.executable))
    assert script is not None
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert all(command in result.stdout for command in ("watch", "serve", "demo"))


def test_an_error_event_stops_watch_with_one_line_and_is_not_printed(
    mongodb_uri: str, mongo_client: MongoClient[dict[str, Any]], database: str,
    tmp_path: Path, processes: list[Process]
) -> None:
    """An ``operationType: "error"`` event (9.1, reported; made here by a pipeline stage) is
    no change to print: watch stops with one line, the token file before it."""
    coll = mongo_client[database].coll
    token_file = tmp_path / "token.json"
    as_error = json.dumps([{"$set": {"operationType": {
        "$cond": [{"$eq": ["$fullDocument.bad", True]}, "error", "$operationType"]}}}])
    process = watch(processes, mongodb_uri, database, token_file, "--pipeline", as_error)
    coll.insert_many([{"_id": 1}, {"_id": 2, "bad": True}, {"_id": 3}])
    printed = process.lines(1)
    assert printed[0]["documentKey"] == {"_id": 1}
    assert process.finish() == 1
    errors = [line for line in process.stderr if "operationType 'error'" in line]
    assert len(errors) == 1, process.stderr
    assert process.stdout.empty()
    stored = FileTokenStore(token_file).load()
    assert stored is not None and stored.token == printed[0]["_id"]
