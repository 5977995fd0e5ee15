"""Token stores: exact round trips, atomic file replacement, clear errors, majority writes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import AsyncMongoClient, MongoClient, monitoring

from changestream.stores import (
    AsyncMongoTokenStore,
    FileTokenStore,
    MemoryTokenStore,
    MongoTokenStore,
    StoredToken,
    TokenStore,
    TokenStoreError,
)

OLD = {"_data": "8263A0B1C2000000012B022C0100296E5A1004AA", "_typeBits": b"\x01\x02"}
NEW = {"_data": "8263A0B1C2000000022B022C0100296E5A1004BB"}


def same_bson(a: Any, b: Any) -> bool:
    return bson.encode(a) == bson.encode(b)


def recent(moment: datetime) -> bool:
    return moment.tzinfo is not None and abs(datetime.now(timezone.utc) - moment) < timedelta(
        seconds=30
    )


# -- FileTokenStore -----------------------------------------------------------------------------
def test_file_store_round_trip_keeps_the_exact_token(tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    assert store.load() is None
    store.save(OLD, batch_id=7)
    loaded = store.load()
    assert isinstance(loaded, StoredToken)
    assert same_bson(loaded.token, OLD)
    assert loaded.batch_id == 7 and recent(loaded.saved_at)
    # Canonical Extended JSON: BSON types are spelled out, so any tool reads the same bytes.
    text = (tmp_path / "token.json").read_text()
    record = json.loads(text)
    assert record["token"]["_typeBits"] == {"$binary": {"base64": "AQI=", "subType": "00"}}
    assert "$numberLong" in record["saved_at"]["$date"]
    store.save(RawBSONDocument(bson.encode(NEW)))
    loaded = store.load()
    assert loaded is not None and same_bson(loaded.token, NEW) and loaded.batch_id is None
    assert isinstance(store, TokenStore)


def test_file_store_fsyncs_the_file_and_its_directory(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    FileTokenStore(tmp_path / "t.json").save(NEW)
    if sys.platform.startswith("linux"):
        assert synced == ["file", "dir"]
    else:
        assert synced[0] == "file"


def test_a_failed_rename_leaves_the_old_token_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    store.save(OLD)

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        store.save(NEW)
    loaded = store.load()
    assert loaded is not None and same_bson(loaded.token, OLD)
    assert [p.name for p in tmp_path.iterdir()] == ["token.json"]


def test_a_crash_between_write_and_rename_leaves_the_old_token(tmp_path: Path) -> None:
    path = tmp_path / "token.json"
    FileTokenStore(path).save(OLD)
    crash = f"""
import os
from changestream.stores import FileTokenStore
os.replace = lambda src, dst: os._exit(3)   # the process dies after the temp file is synced
FileTokenStore({str(path)!r}).save({NEW!r})
"""
    result = subprocess.run([sys.executable, "-c", crash], timeout=60)
    assert result.returncode == 3
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "token.json"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")  # the new token, never renamed
    loaded = FileTokenStore(path).load()
    assert loaded is not None and same_bson(loaded.token, OLD)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "is corrupt"),
        ("", "is corrupt"),
        ('{"token": {"x": 1}, "batch_id": null, "saved_at": {"$date": 0}}', "not a resume token"),
        ('[1, 2]', "expected a document"),
        ('{"token": {"_data": "82"}, "batch_id": "7", "saved_at": {"$date": 0}}', "batch_id"),
        ('{"token": {"_data": "82"}, "batch_id": null}', "saved_at"),
    ],
)
def test_a_corrupt_file_is_one_clear_error_naming_the_path(tmp_path: Path, content: str,
                                                           problem: str) -> None:
    _assert_load_fails(tmp_path, content, problem)


def _assert_load_fails(tmp_path: Path, content: str, problem: str) -> None:
    """Loading a file holding ``content`` raises one TokenStoreError naming the file and ``problem``."""
    path = tmp_path / "token.json"
    path.write_text(content)
    with pytest.raises(TokenStoreError) as info:
        FileTokenStore(path).load()
    assert str(path) in str(info.value)
    assert problem in str(info.value)


def test_only_resume_tokens_are_saved(tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "t.json")
    with pytest.raises(ValueError, match="_data"):
        store.save({"x": 1})
    with pytest.raises(TypeError, match="mapping"):
        store.save("8263")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_id"):
        store.save(NEW, batch_id="1")  # type: ignore[arg-type]
    assert not (tmp_path / "t.json").exists()


def test_memory_store_counts_saves() -> None:
    store = MemoryTokenStore()
    assert store.load() is None
    store.save(OLD, batch_id=1)
    store.save(NEW)
    loaded = store.load()
    assert loaded is not None and same_bson(loaded.token, NEW) and store.saves == 2


# -- MongoTokenStore -------------------------------------------------------------------------------
class Writes(monitoring.CommandListener):
    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in ("update", "find"):
            self.commands.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.fixture
def tokens_db(mongodb_uri: str) -> Iterator[str]:
    name = f"cs_tokens_{uuid.uuid4().hex[:8]}"
    yield name
    with MongoClient(mongodb_uri) as client:
        client.drop_database(name)


def test_mongo_store_upserts_one_document_with_majority_writes(mongodb_uri: str,
                                                               tokens_db: str) -> None:
    writes = Writes()
    with MongoClient(mongodb_uri, event_listeners=[writes]) as client:
        store = MongoTokenStore(client[tokens_db].tokens, "orders-consumer")
        assert store.load() is None
        store.save(OLD, batch_id=3)
        store.save(NEW, batch_id=4)
        loaded = store.load()
        assert loaded is not None and same_bson(loaded.token, NEW) and loaded.batch_id == 4
        assert recent(loaded.saved_at)
        documents = list(client[tokens_db].tokens.find())
        assert len(documents) == 1
        assert set(documents[0]) == {"_id", "token", "batch_id", "saved_at"}
        assert documents[0]["_id"] == "orders-consumer"
        updates = [c for c in writes.commands if "update" in c]
        assert updates and all(c["writeConcern"] == {"w": "majority"} for c in updates)
        assert all(c["updates"][0]["upsert"] for c in updates)
        client[tokens_db].tokens.update_one({"_id": "orders-consumer"}, {"$unset": {"token": 1}})
        with pytest.raises(TokenStoreError) as info:
            store.load()
        assert f"{tokens_db}.tokens" in str(info.value) and "orders-consumer" in str(info.value)


def test_async_mongo_store_round_trip(mongodb_uri: str, tokens_db: str) -> None:
    async def scenario() -> StoredToken | None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongodb_uri)
        try:
            store = AsyncMongoTokenStore(client[tokens_db].tokens, "k")
            assert await store.load() is None
            await store.save(OLD, batch_id=9)
            return await store.load()
        finally:
            await client.close()

    loaded = asyncio.run(scenario())
    assert loaded is not None and same_bson(loaded.token, OLD) and loaded.batch_id == 9


def test_mongo_stores_check_their_arguments(mongodb_uri: str) -> None:
    with MongoClient(mongodb_uri) as client:
        with pytest.raises(TypeError, match="pymongo Collection"):
            MongoTokenStore(client.db, "k")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="key"):
            MongoTokenStore(client.db.c, 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="AsyncCollection"):
            AsyncMongoTokenStore(client.db.c, "k")  # type: ignore[arg-type]


# -- FileTokenStore durability: fsync every save, or every fsync_interval seconds ----------------
def json_util_loads(text: str) -> Any:
    from bson import json_util

    return json_util.loads(text)


def counted_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_file_store_fsyncs_every_save_by_default_or_once_per_fsync_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import changestream.stores as stores

    fsyncs = counted_fsyncs(monkeypatch)
    every = FileTokenStore(tmp_path / "every.json")
    for _ in range(10):
        every.save(NEW)
    assert len(fsyncs) == 20 and every.fsync_interval == 0  # the file and its directory

    now = [1000.0]
    monkeypatch.setattr(stores, "time", types.SimpleNamespace(monotonic=lambda: now[0],
                                                              time=stores.time.time))
    fsyncs.clear()
    relaxed = FileTokenStore(tmp_path / "relaxed.json", fsync_interval=2.0)
    for n in range(10):  # 0.5 s apart: the first save, then one every 2 s
        relaxed.save({"_data": f"82{n:08X}"})
        now[0] += 0.5
    assert len(fsyncs) == 2 * 3
    assert (tmp_path / ".relaxed.json.recent").exists()
    loaded = relaxed.load()
    assert loaded is not None and loaded.token == {"_data": f"82{9:08X}"}  # each save is there
    assert "fsync_interval=2.0" in repr(relaxed)


def test_saves_between_fsyncs_survive_the_process_and_a_torn_one_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token.json"
    store = FileTokenStore(path, fsync_interval=3600)
    store.save(OLD)  # the first save is the fsynced replacement
    store.save({"_data": "82AA"}, batch_id=1)  # these overwrite the companion in place
    store.save(NEW, batch_id=2)
    # A process crash loses nothing: another process (a restart) reads the last save.
    loaded = FileTokenStore(path).load()
    assert loaded is not None and same_bson(loaded.token, NEW) and loaded.batch_id == 2
    assert same_bson(json_util_loads(path.read_text())["token"], OLD)  # the file: replaced whole
    companion = tmp_path / ".token.json.recent"
    for damage in (b"", b"\0" * 64, companion.read_bytes()[:40],  # what a power loss may leave
                   companion.read_bytes().replace(b"04BB", b"04BC")):  # a bit flipped
        companion.write_bytes(damage)
        caplog.clear()
        loaded = FileTokenStore(path).load()
        assert loaded is not None and same_bson(loaded.token, OLD)
        if damage:
            assert "is damaged (a crash before its fsync)" in caplog.text
    # The next fsynced save supersedes the companion.
    store = FileTokenStore(path, fsync_interval=3600)
    store.save(NEW)
    store.save(OLD)
    store = FileTokenStore(path, fsync_interval=3600)
    store.save({"_data": "82CC"})
    loaded = store.load()
    assert loaded is not None and loaded.token == {"_data": "82CC"}
    # Deleting the token file starts afresh: the companion is ignored.
    path.unlink()
    assert FileTokenStore(path).load() is None


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1", True, None])
def test_file_store_refuses_a_bad_fsync_interval(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="fsync_interval must be a number of seconds >= 0"):
        FileTokenStore(tmp_path / "t.json", fsync_interval=bad)


# -- FileTokenStore hardening -------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "token.fifo"
    os.mkfifo(path)
    with pytest.raises(TokenStoreError, match=r"token\.fifo is not a regular file \(a FIFO\)"):
        FileTokenStore(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_a_fifo_swapped_in_after_creation_is_refused_on_load_and_save(tmp_path: Path) -> None:
    path = tmp_path / "token.json"
    store = FileTokenStore(path)
    os.mkfifo(path)
    with pytest.raises(TokenStoreError, match="FIFO"):
        store.load()
    with pytest.raises(TokenStoreError, match="FIFO"):
        store.save(NEW)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenStoreError, match="a directory"):
        FileTokenStore(tmp_path)


def test_a_missing_directory_is_one_clear_error_on_save(tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "missing" / "token.json")
    assert store.load() is None
    with pytest.raises(TokenStoreError, match=r"cannot write the token file .*missing"):
        store.save(NEW)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("[" * 20_000, "nested too deeply"),
        ('{"a":' * 20_000, "is corrupt"),
        (" " * 70_000 + "{}", "larger than"),
        ('{"token": {"_data": "zzzz"}, "batch_id": null, "saved_at": {"$date": 0}}',
         "'token._data' must be a hex string, not 'zzzz'"),
        ('{"token": {"_data": 5}, "batch_id": null, "saved_at": {"$date": 0}}',
         "'token._data' must be a hex string, not int 5"),
    ],
    ids=["deep-arrays", "deep-documents", "oversized", "not-hex", "not-a-string"],
)
def test_what_is_loaded_is_validated_naming_the_file(tmp_path: Path, content: str,
                                                     problem: str) -> None:
    _assert_load_fails(tmp_path, content, problem)


def test_a_token_that_could_not_be_loaded_back_is_never_saved(tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "t.json")
    with pytest.raises(ValueError, match="hex string"):
        store.save({"_data": "zzzz"})
    with pytest.raises(ValueError, match="hex string"):
        store.save({"_data": 5})
    assert not (tmp_path / "t.json").exists()


def test_stale_temporary_files_of_killed_saves_are_removed_on_load(tmp_path: Path) -> None:
    path = tmp_path / "t.token"
    store = FileTokenStore(path)
    store.save(NEW)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    old = datetime.now().timestamp() - 120
    for n in range(5):  # what kill -9 between mkstemp and rename leaves behind
        leftover = tmp_path / f".t.token.{dead}.abc{n}.tmp"
        leftover.write_text("{}")
        os.utime(leftover, (old, old))
    fresh = tmp_path / f".t.token.{dead}.new.tmp"  # could still be renamed: kept for now
    fresh.write_text("{}")
    live = tmp_path / f".t.token.{os.getpid()}.live.tmp"  # a live writer's: kept
    live.write_text("{}")
    os.utime(live, (old, old))
    other = tmp_path / ".other.token.1.x.tmp"  # another store's: left alone
    other.write_text("{}")
    os.utime(other, (old, old))
    loaded = store.load()
    assert loaded is not None and same_bson(loaded.token, NEW)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [other.name, fresh.name, live.name, "t.token"]
    )
