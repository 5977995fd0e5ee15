"""``changestream mirror`` end to end: what the table holds when it exits (``--until-idle``)
and changes over 16 MB (``--oversize``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

pytest.importorskip("deltalake", reason="the delta extra is not installed")

from delta_support import assert_mirrors

from changestream.testing import ReplicaSet


def mirror(*args: str, timeout: float = 180,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("7.0") as replica_set:
        yield replica_set


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[MongoClient[dict[str, Any]]]:
    with MongoClient(rs.uri) as mongo:
        yield mongo


def test_until_idle_returns_with_a_backlog_applied(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """The table is current as of the start when ``--until-idle`` exits 0: a snapshot and a
    backlog of updates made while no mirror ran are all in it, with a short idle time."""
    coll = client.db.backlog
    coll.insert_many([{"_id": i, "v": 0, "pad": "x" * 150} for i in range(3000)])
    target = str(tmp_path / "t")
    args = [rs.uri, "--db", "db", "--coll", "backlog", "--to", target]
    first = mirror(*args, "--until-idle", "0.2")
    assert first.returncode == 0, first.stderr
    assert_mirrors(target, coll, "changestream-mirror")
    for round_ in range(1, 4):  # a backlog, applied in several commits
        coll.update_many({"_id": {"$gte": round_ * 500}}, {"$inc": {"v": 1}})
    coll.delete_many({"_id": {"$lt": 100}})
    second = mirror(*args, "--until-idle", "0.2", "--batch", "500")
    assert second.returncode == 0, second.stderr
    assert_mirrors(target, coll, "changestream-mirror")


def test_oversize_split_gets_a_change_over_16_mb_into_the_table(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    coll = client.db.big
    coll.insert_one({"_id": 1, "a": "x" * (7 << 20)})
    target = str(tmp_path / "t")
    args = [rs.uri, "--db", "db", "--coll", "big", "--to", target, "--until-idle", "0.5"]
    assert mirror(*args).returncode == 0  # the snapshot: the document is under 16 MB
    coll.update_one({"_id": 1}, {"$set": {"b": "y" * (7 << 20)}})  # an event of about 21 MB
    coll.insert_one({"_id": 2, "small": True})
    refused = mirror(*args)
    assert refused.returncode == 1
    said = [line for line in refused.stderr.splitlines() if "larger than 16 MB" in line]
    assert len(said) == 1 and "--oversize split" in said[0], refused.stderr  # once, one line
    joined = mirror(*args, "--oversize", "split")
    assert joined.returncode == 0, joined.stderr
    assert_mirrors(target, coll, "changestream-mirror")


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs (needs root, as CI runs; else the test is skipped, saying why)."""
    import os

    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs: mounting one needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_exit_1(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tiny_disk: Path
) -> None:
    import os

    coll = client.db.full
    coll.insert_many([{"_id": i, "p": os.urandom(400).hex()} for i in range(3000)])
    result = mirror(rs.uri, "--db", "db", "--coll", "full", "--to", str(tiny_disk / "t"),
                    "--until-idle", "0.5", env={**os.environ, "RUST_BACKTRACE": "1"})
    assert result.returncode == 1
    said = [line for line in result.stderr.splitlines()
            if not line.startswith(("changestream: mirroring", "changestream: oplog headroom"))]
    assert len(said) == 1, result.stderr
    assert said[0].startswith(f"changestream: the disk holding {tiny_disk / 't'} is full")
    assert "Traceback" not in result.stderr and "panicked" not in result.stderr


PANIC = """
thread 'tokio-rt-worker' (12847) panicked at /cargo/object_store-0.13.2/src/buffered.rs:369:41:
Already shut down
stack backtrace:
   0: rust_begin_unwind
             at /rustc/library/std/src/panicking.rs:665:5
note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.
"""


def test_panic_reports_are_held_back_and_the_rest_passes() -> None:
    from changestream._cli.native_stderr import PanicFilter

    panic_filter = PanicFilter()
    lines = ["changestream: before\n", *PANIC.splitlines(keepends=True), "\n",
             "changestream: after\n", "  indented, not a panic\n"]
    shown = [out for line in lines for out in panic_filter.feed(line)] + panic_filter.flush()
    assert shown == ["changestream: before\n", "changestream: after\n",
                     "  indented, not a panic\n"]  # the report's blank lines go with it
    assert panic_filter.panics == ["Already shut down"]


def test_mirror_shows_its_status_line_on_a_terminal(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """The panic filter takes file descriptor 2, not Python's stderr: the status line is drawn
    on a terminal (it was never shown under mirror)."""
    import os
    import pty

    client.db.shown.insert_many([{"_id": i} for i in range(2000)])
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "db", "--coll",
             "shown", "--to", str(tmp_path / "t"), "--until-idle", "2"],
            stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        process.communicate(timeout=180)
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
    screen = terminal.decode()
    assert process.returncode == 0, screen
    assert "\r\x1b[K" in screen and "events" in screen, screen
