"""The command line under bad input and sick servers: one line, the right exit status, no hang."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

CLI = [sys.executable, "-m", "changestream"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["watch", "--max-await-ms", "-5", "mongodb://127.0.0.1:1"], "--max-await-ms"),
        (["watch", "--max-await-ms", "1e99", "mongodb://127.0.0.1:1"], "--max-await-ms"),
        (["watch", "http://127.0.0.1:27117"], "must start with mongodb://"),
        (["watch", "mongodb://127.0.0.1:99999"], "invalid URI"),
        (["watch", "mongodb://u:secret@127.0.0.1:99999"], "invalid URI"),
        (["watch", "mongodb://127.0.0.1:1", "--token-file", "/nonexistent/dir/t.json"],
         "the directory /nonexistent/dir does not exist"),
        (["watch", "mongodb://127.0.0.1:1", "--call-timeout", "nan"], "--call-timeout"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "0"], "--connect-timeout"),
        (["watch", "mongodb://127.0.0.1:1", "--coll", "c"], "--coll needs --db"),
        (["watch"], "required: URI"),
        (["nonsense"], "invalid choice"),
        (["demo", "--version", "4.2"], "cannot talk to MongoDB 4.2"),
        (["demo", "--version", "9.9"], "unknown version '9.9'"),
        (["serve", "--members", "60", "--port", "65530"], "--members must be between 1 and 50"),
        (["serve", "--members", "3", "--port", "65534"], "above 65535"),
        (["serve", "--port", "70000"], "--port must be between 0 and 65535"),
        # Issue 33 item 10: tracebacks, and names that watched everything or nothing (exit 0).
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1", "--db", "a$b"],
         "--db: 'a$b' is not a database name: it cannot contain '$'"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1", "--db", "a.b"],
         "--db: 'a.b' is not a database name: it cannot contain '.'"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1", "--db", ""],
         "--db: a database name cannot be empty (leave --db out to watch every database)"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1", "--db", "d", "--coll",
          "$cmd"], "--coll: '$cmd' is not a collection name: it cannot contain '$'"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1", "--db", "d", "--coll", ""],
         "--coll: a collection name cannot be empty"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1",
          "--pipeline", "[" * 3000 + "]" * 3000],
         "--pipeline is nested deeper than the 200 levels MongoDB accepts"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1", "--pipeline",
          '[{"$match": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}]"],
         "--pipeline is nested 902 levels deep, deeper than the 200 MongoDB accepts"),
        (["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1", "--pipeline",
          '[{"$match": ' + '{"a": ' * 199 + "1" + "}" * 199 + "}]"],
         "--pipeline is nested 201 levels deep"),
        (["mirror", "mongodb://127.0.0.1:1", "--db", "d", "--coll", "c", "--to", "t",
          "--app-id", ""], "--app-id: must name the writer, not be empty"),
        (["mirror", "mongodb://127.0.0.1:1", "--db", "a$b", "--coll", "c", "--to", "t"],
         "--db: 'a$b' is not a database name"),
        (["mirror", "mongodb://127.0.0.1:1", "--db", "d", "--coll", "$cmd", "--to", "t"],
         "--coll: '$cmd' is not a collection name"),
    ],
)
def test_every_bad_argument_is_one_line_and_exit_2(args: list[str], expected: str) -> None:
    result = run(*args)
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)
    assert expected in line
    assert "secret" not in line, "credentials are never printed"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_a_fifo_token_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "token.fifo"
    os.mkfifo(fifo)
    result = run("watch", "mongodb://127.0.0.1:1", "--token-file", str(fifo), timeout=30)
    assert result.returncode == 2
    assert "not a regular file (a FIFO)" in one_line(result.stderr)


def test_an_unreachable_deployment_fails_fast_with_one_line(tmp_path: Path) -> None:
    token_file = tmp_path / "unreach.token"
    started = time.monotonic()
    result = run("watch", "mongodb://127.0.0.1:1/?replicaSet=rs0", "--connect-timeout", "1",
                 "--token-file", str(token_file))
    assert time.monotonic() - started < 30
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert "could not reach the deployment (127.0.0.1:1) within 1 s" in line
    assert "Topology Description" not in line
    assert not token_file.exists()


@pytest.fixture
def database(mongodb_uri: str) -> Iterator[str]:
    name = f"cli_rel_{uuid.uuid4().hex[:8]}"
    yield name
    with MongoClient(mongodb_uri) as client:
        client.drop_database(name)



def test_server_errors_print_as_code_name_and_message(mongodb_uri: str, database: str,
                                                      fail_point: Any) -> None:
    fail_point({"times": 1}, failCommands=["aggregate"], errorCode=13)
    result = run("watch", mongodb_uri, "--db", database, timeout=120)
    assert result.returncode == 1
    line = one_line(result.stderr.replace("changestream: watching", "").split("\n", 1)[-1]
                    if "watching" in result.stderr.splitlines()[0] else result.stderr)
    assert "13 Unauthorized:" in line
    assert "full error" not in line and "$clusterTime" not in line and "signature" not in line


def test_sigterm_and_sigint_stop_without_a_traceback(mongodb_uri: str, database: str,
                                                     tmp_path: Path) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        process = subprocess.Popen(
            [*CLI, "watch", mongodb_uri, "--db", database, "--max-await-ms", "50"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert process.stderr is not None
            assert "watching" in process.stderr.readline()
            process.send_signal(signum)
            # a second signal while shutting down must not print a traceback either
            time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        assert "Traceback" not in err and "Exception ignored" not in err, err
        assert process.returncode in (0, -signum), (process.returncode, err)
        assert "the token is in" not in err, "no token file was given"



@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_right_after_a_printed_change_stores_its_token(
    mongodb_uri: str, database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    signum: int,
) -> None:
    """Issue 21: Ctrl-C just after a change was printed left the previous token (3 of 3).

    The signal arrives while the change is being written (the worst moment):
    the change was printed, so its token must be in the file when ``watch``
    exits, and a restart must not print it again.
    """
    import io

    from bson import json_util

    import changestream
    from changestream._cli import main
    from changestream.stores import FileTokenStore

    with MongoClient(mongodb_uri) as client:
        coll = client[database]["orders"]
        with changestream.watch(coll, max_await_time_ms=50) as stream:
            start = stream.resume_token
        coll.insert_many([{"n": n} for n in range(3)])

    class SignalOnWrite(io.StringIO):
        def write(self, text: str) -> int:
            written = super().write(text)
            os.kill(os.getpid(), signum)
            return written

    token_file = tmp_path / "printed.token"
    out = SignalOnWrite()
    monkeypatch.setattr(sys, "stdout", out)
    status = main(["watch", mongodb_uri, "--db", database, "--coll", "orders",
                   "--token-file", str(token_file), "--resume-after",
                   json_util.dumps(start), "--no-status", "--max-await-ms", "50"])
    assert status == 0
    printed = [json_util.loads(line) for line in out.getvalue().splitlines()]
    assert len(printed) == 1 and printed[0]["fullDocument"]["n"] == 0
    stored = FileTokenStore(token_file).load()
    assert stored is not None and stored.token == printed[0]["_id"], (
        "the token of the printed change was not stored")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_as_a_getmore_is_about_to_be_sent_exits_0(
    mongodb_uri: str, database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    signum: int,
) -> None:
    """A signal handled after the stream chose its next getMore, before sending it.

    The KeyboardInterrupt left that getMore "in flight" in the stream, whose close
    then refused with a RuntimeError: ``watch`` exited 1 with a traceback (the
    rare exit 1 of the sharded end-to-end test's Ctrl-C, under load). The stream now
    closes on an interrupt there too (``_stream._run``): exit 0, token stored.
    """
    import io

    from bson import json_util

    import changestream
    from changestream._cli import main
    from changestream._machine import ChangeStreamMachine, RunGetMore
    from changestream.stores import FileTokenStore

    with MongoClient(mongodb_uri) as client:
        coll = client[database]["orders"]
        with changestream.watch(coll, max_await_time_ms=50) as stream:
            start = stream.resume_token
        coll.insert_many([{"n": n} for n in range(3)])

    out = io.StringIO()
    next_action = ChangeStreamMachine.next_action
    signalled: list[int] = []

    def signal_before_a_getmore(machine: ChangeStreamMachine) -> Any:
        action = next_action(machine)
        if isinstance(action, RunGetMore) and len(out.getvalue().splitlines()) == 3:
            signalled.append(signum)
            signal.raise_signal(signum)  # handled here, in this thread, before returning
        return action

    monkeypatch.setattr(ChangeStreamMachine, "next_action", signal_before_a_getmore)
    monkeypatch.setattr(sys, "stdout", out)
    token_file = tmp_path / "getmore.token"
    try:
        status = main(["watch", mongodb_uri, "--db", database, "--coll", "orders",
                       "--token-file", str(token_file), "--resume-after",
                       json_util.dumps(start), "--no-status", "--max-await-ms", "50"])
    except KeyboardInterrupt:  # not to pytest, which would end the whole run
        pytest.fail("KeyboardInterrupt escaped main()")
    assert signalled, "no getMore after the three changes"
    assert status == 0
    printed = [json_util.loads(line) for line in out.getvalue().splitlines()]
    assert [change["fullDocument"]["n"] for change in printed] == [0, 1, 2]
    stored = FileTokenStore(token_file).load()
    assert stored is not None and stored.token == printed[-1]["_id"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_as_the_handlers_are_installed_exits_0(
    mongodb_uri: str, database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C right after ``watch`` installed its handlers, before it was ready for them:
    the KeyboardInterrupt escaped ``main()`` (a traceback). It is a stop like any other."""
    from changestream._cli import main
    from changestream._cli.watch import _PrintGuard

    install = signal.signal

    def signal_once_installed(signum: int, handler: Any) -> Any:
        previous = install(signum, handler)
        if signum == signal.SIGTERM and isinstance(getattr(handler, "__self__", None),
                                                   _PrintGuard):
            signal.raise_signal(signal.SIGINT)  # handled here, by the handler just installed
        return previous

    before = [signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)]
    monkeypatch.setattr(signal, "signal", signal_once_installed)
    try:
        status = main(["watch", mongodb_uri, "--db", database, "--no-status"])
    except KeyboardInterrupt:  # not to pytest, which would end the whole run
        pytest.fail("KeyboardInterrupt escaped main()")
    assert status == 0
    assert [signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)] == before


_SECOND_SIGNAL = """
import signal, sys
import changestream._cli as cli
import changestream._cli.watch as watch_command
from changestream import ChangeStream
from pymongo import MongoClient

signum, hook, uri, database = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]

def signal_first(function):
    def signalled(*args, **kwargs):
        signal.raise_signal(signum)  # handled at once, in this thread
        return function(*args, **kwargs)
    return signalled

ChangeStream.try_next = signal_first(ChangeStream.try_next)  # the stop, while watching
if hook == "close":  # then again: while the client closes
    MongoClient.close = signal_first(MongoClient.close)
else:  # or while "stopped" is being said
    watch_command._stopped = signal_first(watch_command._stopped)
sys.argv = ["changestream", "watch", uri, "--db", database, "--max-await-ms", "50"]
raise SystemExit(cli.main())
"""


@pytest.mark.parametrize(("hook", "signum"), [("close", signal.SIGINT),
                                              ("stopped", signal.SIGINT),
                                              ("stopped", signal.SIGTERM)])
def test_a_second_signal_while_exiting_ends_the_program_without_a_traceback(
    mongodb_uri: str, database: str, hook: str, signum: int,
) -> None:
    """The second signal of ``test_sigterm_and_sigint_stop_without_a_traceback``, at the
    moments that printed a KeyboardInterrupt traceback: while the client closed (after
    Python's handler was back) and while "stopped" was said (the first handler raised
    again). Both signals are sent by the program itself, at those exact moments."""
    result = subprocess.run(
        [sys.executable, "-c", _SECOND_SIGNAL, str(int(signum)), hook, mongodb_uri, database],
        capture_output=True, text=True, timeout=60,
    )
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, (
        result.stderr)
    assert result.returncode == -signum, (result.returncode, result.stderr)


@pytest.fixture
def lost_history(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A simulated replica set with a 20-entry oplog and a token file its oplog has left behind."""
    if os.environ.get("MONGODB_URI"):
        pytest.skip("needs the simulator's small oplog (MONGODB_URI points at a real deployment)")
    import changestream
    from changestream.stores import FileTokenStore
    from changestream.testing import ReplicaSet

    token_file = tmp_path / "old.token"
    with ReplicaSet("8.0", oplog_max_entries=20) as rs, MongoClient(rs.uri) as client:
        with changestream.watch(client.db.orders, max_await_time_ms=50) as stream:
            FileTokenStore(token_file).save(stream.resume_token)
        client.db.orders.insert_many([{"i": i} for i in range(50)])
        yield rs.uri, token_file


def test_history_lost_advice_names_cli_flags(lost_history: tuple[str, Path]) -> None:
    uri, token_file = lost_history
    result = run("watch", uri, "--db", "db", "--coll", "orders", "--token-file", str(token_file))
    assert result.returncode == 1, result.stderr
    line = one_line(result.stderr)
    assert "history lost (code 286)" in line and str(token_file) in line
    assert "--on-history-lost from-now" in line and "--on-history-lost resnapshot" in line
    assert "--start-at-operation-time" in line
    assert "start_at_operation_time=" not in line and "resume_after" not in line


def test_on_history_lost_from_now_prints_the_gap_then_new_changes(
        lost_history: tuple[str, Path]) -> None:
    uri, token_file = lost_history
    process = subprocess.Popen(
        [*CLI, "watch", uri, "--db", "db", "--coll", "orders", "--token-file", str(token_file),
         "--on-history-lost", "from-now", "--limit", "1", "--max-await-ms", "50"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stderr is not None
        lines = [process.stderr.readline() for _ in range(3)]  # the warning, watching, the gap
        assert any("history lost: the changes after" in line and "were skipped" in line
                   for line in lines), lines
        assert any("watching db.orders from now" in line for line in lines), lines
        with MongoClient(uri) as client:
            client.db.orders.insert_one({"i": 100})
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert '"i": 100' in out and out.count("\n") == 1
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([*CLI, "watch", uri, "--db", "db", "--on-history-lost", "resnapshot"],
                       check=True, capture_output=True, timeout=60)


def test_on_history_lost_resnapshot_prints_every_document_again(
        lost_history: tuple[str, Path]) -> None:
    uri, token_file = lost_history
    result = run("watch", uri, "--db", "db", "--coll", "orders", "--token-file", str(token_file),
                 "--on-history-lost", "resnapshot", "--until-idle", "1", "--max-await-ms", "50")
    assert result.returncode == 0, result.stderr
    from bson import json_util

    printed = [json_util.loads(line) for line in result.stdout.splitlines()]
    kinds = [r["operationType"] for r in printed]  # the copy's bounds: what to drop is known
    assert kinds[0] == "snapshotStart" and kinds[-1] == "snapshotEnd", kinds
    records = printed[1:-1]
    assert sorted(r["fullDocument"]["i"] for r in records) == list(range(50))
    assert all("snapshot" in r for r in records)
    assert "history lost: the changes after" in result.stderr
    assert "printing every document again" in result.stderr


# -- Ctrl-C before a command is ready for it (issue 33, item 16) ------------------------------
_EARLY_SIGNAL = """
import signal, sys, time

moment, external = sys.argv[1], sys.argv[2] == "external"

def interrupt():
    if external:  # the test sends the signal, as a terminal does, while this waits
        print("ready", flush=True)
        time.sleep(60)
    else:
        signal.raise_signal(signal.SIGINT)  # handled at once, in this thread

class InterruptAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == moment:
            sys.meta_path.remove(self)
            interrupt()
        return None

if moment.startswith("call:"):  # interrupt as this function is called
    import importlib
    owner, _, attribute = moment[5:].rpartition(".")
    module, _, cls = owner.rpartition(".")
    holder = getattr(importlib.import_module(module), cls)
    original = getattr(holder, attribute)
    def interrupted(*args, **kwargs):
        interrupt()
        return original(*args, **kwargs)
    setattr(holder, attribute, interrupted)
else:  # interrupt as this module is about to be imported
    sys.meta_path.insert(0, InterruptAtImport())
sys.argv = ["changestream", *sys.argv[3:]]
from changestream._cli import main  # what the `changestream` script runs
sys.exit(main())
"""


@pytest.mark.parametrize(("moment", "command"), [
    ("pymongo", "watch"),  # imported by `import changestream` before: a 19-line traceback
    ("changestream._consumer.run", "watch"),
    ("changestream._cli.watch", "watch"),
    ("call:argparse.ArgumentParser.parse_args", "watch"),
    ("call:pymongo.MongoClient.__init__", "watch"),
    ("changestream._cli.mirror", "mirror"),
    ("call:argparse.ArgumentParser.parse_args", "mirror"),
    ("changestream._cli.demo", "demo"),
])
def test_ctrl_c_before_the_command_is_ready_ends_it_quietly(moment: str, command: str) -> None:
    """Issue 33 item 16: a Ctrl-C in the first half second of ``changestream watch``
    printed a 19-line traceback (6 of 28 tries): it came while ``changestream`` was
    imported, before ``main`` ran. The signal is raised at each early moment in turn;
    the program ends as one killed by SIGINT (the shell shows 130), saying nothing."""
    args = {"watch": ["watch", "mongodb://127.0.0.1:1", "--connect-timeout", "1"],
            "mirror": ["mirror", "mongodb://127.0.0.1:1", "--db", "d", "--coll", "c",
                       "--to", "t", "--connect-timeout", "1"],
            "demo": ["demo"]}[command]
    result = subprocess.run([sys.executable, "-c", _EARLY_SIGNAL, moment, "raise", *args],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr, result.stdout) == (-signal.SIGINT, "", "")


@pytest.mark.parametrize("moment", ["pymongo", "call:pymongo.MongoClient.__init__"])
def test_an_early_ctrl_c_from_the_terminal_ends_it_quietly(moment: str) -> None:
    """The same with a signal sent from outside (as a terminal sends it), while the
    program is held at that moment until it arrives."""
    process = subprocess.Popen(
        [sys.executable, "-c", _EARLY_SIGNAL, moment, "external", "watch",
         "mongodb://127.0.0.1:1", "--connect-timeout", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert (process.returncode, err, out) == (-signal.SIGINT, "", "")


def test_an_early_ctrl_c_of_main_called_as_a_function_returns_130(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Called from Python (not as the program), ``main`` returns the status instead."""
    import argparse

    from changestream._cli import main

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", interrupted)
    assert main(["watch", "mongodb://127.0.0.1:1"]) == 130
