"""The ``dbpath`` snapshot fails loudly (issue 22, deliverable 2).

Cut at any byte, any byte changed, any record duplicated: a :class:`DbPathError` naming the
file and the fault, never a deployment with data missing or wrong. Data of a newer emulated
version is refused, as mongod refuses data files of a newer version. A failed write (disk
full) names the file, leaves no temporary file and keeps the previous snapshot.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet, ShardedCluster
from changestream.testing.core.versions import get_profile
from changestream.testing.storage import persist
from changestream.testing.storage.deployment import Deployment
from changestream.testing.storage.persist import SNAPSHOT, DbPathError

Client = MongoClient[dict[str, Any]]
StartRs = Callable[..., ReplicaSet]
Clients = Callable[..., Client]


def _small_snapshot(tmp_path: Path, clients: Clients) -> bytes:
    rs = ReplicaSet("8.0", dbpath=tmp_path, users={"app": "pw"}, noop_interval=0).start()
    client = clients(rs.uri, username="app", password="pw")
    client.db.c.insert_many([{"_id": i, "v": f"value-{i:05d}"} for i in range(3)])
    client.db.c.create_index("v", unique=True)
    client.close()
    rs.stop()
    return (tmp_path / SNAPSHOT).read_bytes()


def _load(dbpath: Path, data: bytes) -> DbPathError | None:
    """What restoring ``data`` raises (None: it loaded)."""
    (dbpath / SNAPSHOT).write_bytes(data)
    try:
        Deployment(get_profile("8.0"), dbpath=dbpath).close(save=False)
    except DbPathError as exc:
        return exc
    return None


def _record_bounds(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of the header and every record, read independently of the reader."""
    bounds = []
    offset = len(persist.MAGIC)
    while offset < len(data) - 48:
        length = int.from_bytes(data[offset : offset + 4], "little")
        bounds.append((offset, offset + length))
        offset += length
    return bounds


def test_the_snapshot_loads_whole(tmp_path: Path, clients: Clients) -> None:
    data = _small_snapshot(tmp_path / "a", clients)
    assert _load(tmp_path / "a", data) is None
    assert data.startswith(b"CSSIMDB\x00") and data[-48:-40] == b"CSSIMEND"


def test_a_cut_at_any_byte_is_reported(tmp_path: Path, clients: Clients) -> None:
    data = _small_snapshot(tmp_path, clients)
    path = str(tmp_path / SNAPSHOT)
    for size in range(len(data)):
        error = _load(tmp_path, data[:size])
        assert error is not None, f"a file cut at byte {size} of {len(data)} loaded"
        assert path in str(error)
        if size >= 56:
            assert "truncated" in str(error)


def test_a_changed_byte_anywhere_is_reported(tmp_path: Path, clients: Clients) -> None:
    data = _small_snapshot(tmp_path, clients)
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x20  # 'e' <-> 'E', as in 'valuX'
        error = _load(tmp_path, bytes(damaged))
        assert error is not None, f"a file changed at byte {position} loaded"
        assert str(tmp_path / SNAPSHOT) in str(error)


def test_a_duplicated_record_is_reported(tmp_path: Path, clients: Clients) -> None:
    data = _small_snapshot(tmp_path, clients)
    bounds = _record_bounds(data)
    assert len(bounds) > 10
    for start, end in bounds:
        error = _load(tmp_path, data[:end] + data[start:end] + data[end:])
        assert error is not None and "duplicated or lost" in str(error), (start, error)


def test_data_of_a_newer_version_is_refused(tmp_path: Path, start_rs: StartRs) -> None:
    start_rs("8.0", dbpath=tmp_path).stop()
    with pytest.raises(
        DbPathError, match=r"holds the data of MongoDB 8\.0\.\d+, newer than this"
    ) as exc:
        ReplicaSet("6.0", dbpath=tmp_path)
    assert "mongod refuses" in str(exc.value)
    start_rs("8.2", dbpath=tmp_path).stop()  # an upgrade starts


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes were written."""

    def __init__(self, real: IO[bytes], room: int) -> None:
        self._real, self._room = real, room

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self._real.close()


def _fill_disk(monkeypatch: pytest.MonkeyPatch, room: int) -> None:
    def full_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        real = open(path, mode, *args, **kwargs)  # noqa: SIM115 - closed by the wrapper
        return _FullDisk(real, room) if "w" in mode else real

    monkeypatch.setattr(persist, "open", full_open, raising=False)


def test_disk_full_keeps_the_old_snapshot_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rs = ReplicaSet("8.0", dbpath=tmp_path, noop_interval=0).start()
    with MongoClient(rs.uri) as client:
        client.db.c.insert_one({"_id": "old"})
        rs.restart()
        client.db.c.insert_one({"_id": "new"})
    _fill_disk(monkeypatch, room=200)
    with pytest.raises(DbPathError) as exc:
        rs.stop()
    assert str(tmp_path / SNAPSHOT) in str(exc.value) and "No space left" in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SNAPSHOT, "mongod.lock"]
    monkeypatch.undo()
    # the client closes before the set stops (closed after it, it waits 5 s to end sessions)
    with ReplicaSet("8.0", dbpath=tmp_path, noop_interval=0) as again, \
            MongoClient(again.uri) as client:
        assert [d["_id"] for d in client.db.c.find()] == ["old"]


def test_a_failed_restart_says_the_set_is_stopped(
    tmp_path: Path, clients: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    rs = ReplicaSet("8.0", dbpath=tmp_path, noop_interval=0).start()
    with MongoClient(rs.uri) as client:
        client.db.c.insert_one({"_id": 1})
    _fill_disk(monkeypatch, room=0)
    with pytest.raises(DbPathError, match="restart failed, the replica set is stopped"):
        rs.restart()
    with pytest.raises(RuntimeError, match="not started"):
        rs.uri  # noqa: B018 - the set says it is down


def test_serve_on_a_full_disk_exits_1_with_one_line(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import errno, os, sys
        from changestream.testing.storage import persist
        real_open = open
        class Full:
            def __init__(self, f): self.f = f
            def write(self, data): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            def __getattr__(self, name): return getattr(self.f, name)
            def __enter__(self): return self
            def __exit__(self, *a): self.f.close()
        persist.open = lambda p, m="r", *a, **k: Full(real_open(p, m)) if "w" in m else real_open(p, m)
        from changestream.testing.cli import main
        sys.exit(main(["serve", "--port", "0", "--dbpath", {str(tmp_path)!r}]))
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline().startswith("mongodb://")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
        lines = [line for line in proc.stderr.read().splitlines() if line.startswith("error")]
        assert len(lines) == 1 and SNAPSHOT in lines[0] and "No space left" in lines[0]
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(tmp_path.glob("*.partial"))


def _count(rs: ReplicaSet) -> int:
    state = rs.deployment.catalog.get("db", "c")
    return 0 if state is None else len(list(state.iter_stored()))


def test_a_whole_sharded_cluster_restarts_from_its_dbpath(tmp_path: Path) -> None:
    """Every shard, the config server (routing table) and the cluster time are kept: a token
    from before the restart resumes after it with nothing lost."""
    with ShardedCluster("8.0", shards=2, mongoses=1, dbpath=tmp_path, noop_interval=0.5) as first:
        port = int(first.mongoses[0].rsplit(":", 1)[1])
        with MongoClient(first.uri) as client:
            client.admin.command("shardCollection", "db.c", key={"k": "hashed"})
            coll = client.db.c
            with coll.watch() as stream:
                coll.insert_many([{"_id": i, "k": i} for i in range(20)])
                seen = [next(stream)["documentKey"]["_id"] for _ in range(5)]
                token = stream.resume_token
            coll.insert_many([{"_id": i, "k": i} for i in range(20, 30)])
            before = client.admin.command("ping")["$clusterTime"]["clusterTime"]
            per_shard = sorted(_count(rs) for rs in first.shards)
    with (
        ShardedCluster(
            "8.0", shards=2, mongoses=1, dbpath=tmp_path, noop_interval=0.5, port=port
        ) as second,
        MongoClient(second.uri) as client,
    ):
        coll = client.db.c
        assert client.config.collections.find_one({"_id": "db.c"})["key"] == {"k": "hashed"}
        assert sorted(_count(rs) for rs in second.shards) == (per_shard)
        assert coll.count_documents({}) == 30
        assert isinstance(second.state.table.collections["db.c"].uuid, uuid.UUID)
        coll.insert_many([{"_id": i, "k": i} for i in range(30, 35)])
        with coll.watch(resume_after=token) as stream:
            after = [next(stream)["documentKey"]["_id"] for _ in range(30)]
        now = client.admin.command("ping")["$clusterTime"]["clusterTime"]
    assert sorted(seen + after) == list(range(35)) and len(set(after)) == 30
    assert now > before


def _serve_sharded(dbpath: Path) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    argv = ["serve", "--sharded", "--port", "0", "--dbpath", str(dbpath), "--auth", "app:pw"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "changestream.testing", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_serve_sharded_keeps_its_data_and_requires_auth(tmp_path: Path) -> None:
    proc, uri = _serve_sharded(tmp_path)
    try:
        with MongoClient(uri, serverSelectionTimeoutMS=10000) as anonymous:
            with pytest.raises(OperationFailure) as exc:
                anonymous.db.c.insert_one({"_id": "no"})
            assert exc.value.code == 13
        with MongoClient(uri, username="app", password="pw") as client:
            client.db.c.insert_one({"_id": "kept"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config", "shard0", "shard1"]
        proc, uri = _serve_sharded(tmp_path)
        with MongoClient(uri, username="app", password="pw") as client:
            assert list(client.db.c.find()) == [{"_id": "kept"}]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- a sharded dbpath with a part missing or stale (issue 33, item 19) ---------------------------


def _cluster_with_data(dbpath: Path, docs: range) -> None:
    """A two-shard cluster in ``dbpath`` holding ``docs`` in ``db.c`` (hashed: both shards)."""
    with (
        ShardedCluster("8.0", shards=2, mongoses=1, dbpath=dbpath, noop_interval=0) as cluster,
        MongoClient(cluster.uri) as client,
    ):
        if "db.c" not in cluster.state.table.collections:
            client.admin.command("shardCollection", "db.c", key={"_id": "hashed"})
        client.db.c.insert_many([{"_id": i} for i in docs])


def _start_fails(dbpath: Path) -> str:
    cluster = ShardedCluster("8.0", shards=2, mongoses=1, dbpath=dbpath, noop_interval=0)
    with pytest.raises(DbPathError) as exc:
        cluster.start()
    return str(exc.value)


def _files(dbpath: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dbpath)): p.read_bytes() for p in sorted(dbpath.rglob(SNAPSHOT))}


@pytest.mark.parametrize("part", ["shard file", "shard directory"])
def test_a_sharded_dbpath_missing_a_shard_fails_naming_it(tmp_path: Path, part: str) -> None:
    _cluster_with_data(tmp_path, range(100))
    shard1 = tmp_path / "shard1"
    if part == "shard file":
        (shard1 / SNAPSHOT).unlink()
        missing = shard1 / SNAPSHOT
    else:
        for path in shard1.iterdir():
            path.unlink()
        shard1.rmdir()
        missing = shard1
    kept = _files(tmp_path)
    message = _start_fails(tmp_path)
    assert message.startswith(f"{missing} is missing: the config server lists shard 'shard1' (")
    assert "chunks of db.c" in message
    assert _files(tmp_path) == kept, "a failed start leaves the files as they were"


def test_a_sharded_dbpath_missing_the_config_server_fails_naming_it(tmp_path: Path) -> None:
    _cluster_with_data(tmp_path, range(100))
    for path in (tmp_path / "config").iterdir():
        path.unlink()
    (tmp_path / "config").rmdir()
    message = _start_fails(tmp_path)
    assert message.startswith(f"{tmp_path / 'config' / SNAPSHOT} is missing, but {tmp_path} ")
    assert "shard0, shard1" in message


def test_a_shard_file_from_an_older_stop_fails_naming_it(tmp_path: Path) -> None:
    _cluster_with_data(tmp_path, range(50))
    old = (tmp_path / "shard0" / SNAPSHOT).read_bytes()
    _cluster_with_data(tmp_path, range(50, 100))
    (tmp_path / "shard0" / SNAPSHOT).write_bytes(old)
    message = _start_fails(tmp_path)
    assert message.startswith(
        f"{tmp_path / 'shard0' / SNAPSHOT} is from another stop of this cluster than the "
        "config server's data (generation 1, the config server's 2)"
    )


def test_the_files_of_one_stop_start_together_again(tmp_path: Path) -> None:
    _cluster_with_data(tmp_path, range(50))
    _cluster_with_data(tmp_path, range(50, 100))
    with (
        ShardedCluster("8.0", shards=2, mongoses=1, dbpath=tmp_path, noop_interval=0) as cluster,
        MongoClient(cluster.uri) as client,
    ):
        assert client.db.c.count_documents({}) == 100
    assert {persist.snapshot_generation(p.parent) for p in tmp_path.rglob(SNAPSHOT)} == {(True, 3)}
