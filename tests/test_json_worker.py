"""The Delta sink's JSON worker: a helper process makes a batch's document texts.

Its texts must be the sink's own byte for byte, anything odd must fall back to making
them in process (the real error raised there), and the process must never outlive the
sink's (kill -9 included) nor take the terminal's Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bson
import deltalake
import pytest
from bson import json_util
from bson.code import Code
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from hypothesis import given, settings
from hypothesis import strategies as st

from changestream._delta_rows import RELAXED, json_texts
from changestream._json_worker import LEAST_DOCUMENTS, NICENESS, SHARED_PART, JsonWorker
from tests.test_delta_json import _VALUES

ROOT = Path(__file__).resolve().parents[1]


def gone(pid: int, within: float = 10.0) -> bool:
    """Has process ``pid`` exited (and been reaped, or become a zombie) within ``within`` s?"""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def worker() -> Iterator[JsonWorker]:
    made = JsonWorker(json_texts, least=1)
    yield made
    made.close()


@settings(max_examples=150, deadline=None)
@given(documents=st.lists(st.dictionaries(st.text(alphabet="xyzé\n", min_size=1, max_size=2),
                                          _VALUES, max_size=4), min_size=1, max_size=12),
       others=st.lists(st.sampled_from([None, '{"made": "before"}', {"_id": Code("c")}]),
                       max_size=3))
def test_the_workers_texts_are_the_sinks_own_for_every_bson_type(
    worker: JsonWorker, documents: list[dict[str, Any]], others: list[Any]
) -> None:
    """BSON bytes made into texts by the worker, mixed with what a batch also holds (a
    delete's ``None``, a text made already, a decoded document) in their places."""
    batch: list[Any] = [bson.encode({"_id": n, **doc}) for n, doc in enumerate(documents)]
    for n, other in enumerate(others):
        batch.insert(n * 2, other)
    before = worker.batches
    assert worker(batch, RELAXED) == json_texts(batch, RELAXED)
    assert worker.batches == before + 1  # (not in process)
    assert worker.pid is not None


def test_a_small_batch_or_canonical_json_is_made_in_process() -> None:
    worker = JsonWorker(json_texts)
    small = [bson.encode({"_id": n}) for n in range(LEAST_DOCUMENTS - 1)]
    assert worker(small, RELAXED) == json_texts(small, RELAXED)
    large = [*small, bson.encode({"_id": -1})]
    canonical = json_util.CANONICAL_JSON_OPTIONS
    assert worker(large, canonical) == json_texts(large, canonical)
    assert (worker.batches, worker.pid) == (0, None)  # never started
    assert worker(large, RELAXED) == json_texts(large, RELAXED)
    assert worker.batches == 1
    worker.close()


def test_a_document_the_worker_cannot_make_raises_the_real_error_in_process(
    worker: JsonWorker
) -> None:
    damaged = [bson.encode({"_id": 1}), b"\x07\x00\x00\x00\x10a"]  # a size past its bytes
    with pytest.raises(bson.InvalidBSON):
        json_texts(damaged, RELAXED)
    with pytest.raises(bson.InvalidBSON):
        worker(damaged, RELAXED)
    assert worker.enabled and worker.pid is not None  # the worker itself is fine: kept
    assert worker([bson.encode({"_id": 2})], RELAXED) == ['{"_id": 2}']


def test_a_worker_that_died_leaves_the_sink_in_process_with_one_warning(
    caplog: pytest.LogCaptureFixture
) -> None:
    worker = JsonWorker(json_texts, least=1)
    batch = [bson.encode({"_id": ObjectId(), "n": n}) for n in range(50)]
    assert worker(batch, RELAXED) == json_texts(batch, RELAXED)
    pid = worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert gone(pid)
    with caplog.at_level(logging.WARNING, logger="changestream"):
        assert worker(batch, RELAXED) == json_texts(batch, RELAXED)
        assert worker(batch, RELAXED) == json_texts(batch, RELAXED)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pipe broke" in warnings[0], warnings
    assert (worker.enabled, worker.pid, worker.batches) == (False, None, 1)


def test_a_worker_that_cannot_start_leaves_the_sink_in_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "executable", str(ROOT / "no-such-python"))
    worker = JsonWorker(json_texts, least=1)
    batch = [bson.encode({"_id": n}) for n in range(3)]
    with caplog.at_level(logging.WARNING, logger="changestream"):
        assert worker(batch, RELAXED) == json_texts(batch, RELAXED)
    assert "could not start" in caplog.text and not worker.enabled


def test_a_close_while_a_batch_is_made_waits_for_it(caplog: pytest.LogCaptureFixture) -> None:
    """``finish()`` may close the worker while the batch committed behind is in it: the batch
    gets its texts, and the worker is not taken for broken."""
    worker = JsonWorker(json_texts, least=1)
    batch = [bson.encode({"_id": ObjectId(), "n": n, "s": "x" * 100}) for n in range(100_000)]
    worker(batch[:1], RELAXED)  # started
    made: list[Any] = []
    maker = threading.Thread(target=lambda: made.append(worker(batch, RELAXED)))
    with caplog.at_level(logging.WARNING, logger="changestream"):
        maker.start()
        time.sleep(0.05)
        worker.close()
        maker.join()
    assert made == [json_texts(batch, RELAXED)]
    assert (worker.enabled, worker.batches) == (True, 2)
    assert not caplog.records
    worker.close()


class Counted(JsonWorker):
    """A worker that counts the BSON documents its caller made in process."""

    def __init__(self) -> None:
        super().__init__(self.counted)
        self.here = 0

    def counted(self, documents: Any, json_options: Any) -> list[str | None]:
        self.here += sum(type(doc) is bytes for doc in documents)
        return json_texts(documents, json_options)


def _orders(count: int) -> list[bytes]:
    return [bson.encode({"_id": ObjectId(), "n": n, "s": "x" * 120}) for n in range(count)]


def test_an_idle_caller_makes_parts_of_a_batch_beside_the_worker() -> None:
    """At the end of a backlog the stream waits for the last commit: its thread makes parts
    from the back while the worker makes them from the front, each text in its place."""
    worker = Counted()
    batch: list[Any] = _orders(SHARED_PART * 6)
    batch[5] = None  # a delete's place, kept
    expected = json_texts(batch, RELAXED)
    assert worker(batch, RELAXED, idle=lambda: True) == expected
    assert 0 < worker.here < len(batch) - 1 and worker.batches >= 1, (worker.here, worker)
    worker.close()


def test_a_busy_caller_leaves_the_whole_batch_to_the_worker() -> None:
    worker = Counted()
    batch = _orders(SHARED_PART * 3)
    assert worker(batch, RELAXED, idle=lambda: False) == json_texts(batch, RELAXED)
    assert worker.here == 0 and worker.batches == 3  # one exchange a part
    worker.close()


def test_a_shared_batch_with_a_damaged_document_raises_the_real_error() -> None:
    """Whichever side meets it: the worker's part is made again in process (the worker is
    kept), the caller's raises at once."""
    for at, idle in ((0, False), (SHARED_PART * 4 - 1, True)):
        worker = Counted()
        batch = _orders(SHARED_PART * 4)
        batch[at] = b"\x07\x00\x00\x00\x10a"  # a size past its bytes
        with pytest.raises(bson.InvalidBSON):
            worker(batch, RELAXED, idle=lambda idle=idle: idle)
        assert worker.enabled
        worker.close()


def test_a_worker_killed_during_a_shared_batch_leaves_it_in_process(
    caplog: pytest.LogCaptureFixture
) -> None:
    worker = Counted()
    batch = _orders(SHARED_PART * 8)
    worker(batch[:LEAST_DOCUMENTS], RELAXED)  # started
    pid = worker.pid
    assert pid is not None
    killer = threading.Timer(0.05, os.kill, (pid, signal.SIGKILL))
    with caplog.at_level(logging.WARNING, logger="changestream"):
        killer.start()
        assert worker(batch, RELAXED, idle=lambda: False) == json_texts(batch, RELAXED)
    killer.join()
    assert not worker.enabled and worker.pid is None and gone(pid)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    worker.close()


def test_the_sinks_commit_behind_sees_its_caller_waiting(tmp_path: Path) -> None:
    """The sink tells its text maker whether the stream waits for this commit (``flush``,
    the next save): not while the stream goes on, yes once it waits, and always for a
    commit made on the caller's own thread (``save``)."""
    from changestream.delta import DeltaSink

    seen: list[bool] = []
    called = threading.Event()

    class Watching(JsonWorker):
        def __call__(self, documents: Any, json_options: Any, *,
                     idle: Any = None) -> list[str | None]:
            seen.append(idle())
            called.set()
            deadline = time.monotonic() + 10
            while not idle() and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(idle())
            return super().__call__(documents, json_options, idle=idle)

    worker = Watching(json_texts)
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup", json_worker=worker)
    sink.load()
    documents = [{"_id": ObjectId(), "n": n} for n in range(LEAST_DOCUMENTS * 3)]
    for n, document in enumerate(documents, start=1):
        sink(_change(n, document))
    sink.save_behind({"_data": "82" + "F" * 16})
    assert called.wait(10)  # the commit makes the texts while the stream goes on
    sink.flush()
    assert seen == [False, True]
    assert sink.read_current().num_rows == len(documents)
    for n, document in enumerate(documents, start=len(documents) + 1):  # a commit in save()
        sink(_change(n, {**document, "again": True}))
    sink.save({"_data": "82" + "F" * 17 + "0"})
    assert seen[2:] == [True, True]  # on the caller's own thread: it has nothing else to run
    sink.finish()


def test_the_worker_ignores_ctrl_c_and_exits_when_its_sinks_process_is_killed(
    tmp_path: Path
) -> None:
    """Ctrl-C reaches a terminal's whole process group: the worker leaves it to the sink's
    process. Once that process is gone (kill -9: nothing of it runs), so is the worker."""
    script = textwrap.dedent("""
        import sys, time, bson
        from changestream._delta_rows import RELAXED, json_texts
        from changestream._json_worker import JsonWorker
        worker = JsonWorker(json_texts, least=1)
        worker([bson.encode({"_id": 1})], RELAXED)
        print(worker.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              cwd=ROOT, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        os.kill(pid, signal.SIGINT)
        assert not gone(pid, within=1.0)
        parent.kill()
        parent.wait()
        assert gone(pid)
    finally:
        parent.kill()
        parent.wait()


def _change(n: int, document: dict[str, Any]) -> RawBSONDocument:
    return RawBSONDocument(bson.encode(
        {"_id": {"_data": f"82{n:016X}2B042C0100296E5A1004"}, "operationType": "insert",
         "clusterTime": Timestamp(1_800_000_000, n), "ns": {"db": "shop", "coll": "orders"},
         "documentKey": {"_id": document["_id"]}, "fullDocument": document}))


def test_a_sinks_table_is_the_same_with_the_worker_and_without(tmp_path: Path) -> None:
    """A batch large enough for the worker, of documents that take every path of the text
    (code, a NaN for json_util's fallback, non-ASCII): the same rows either way, and
    ``finish()`` stops the worker."""
    from changestream.delta import DeltaSink

    documents = [{"_id": ObjectId(), "n": n, "name": "caf\u00e9 \u2615", "f": Code("x"),
                  **({"nan": float("nan")} if n % 97 == 0 else {})}
                 for n in range(LEAST_DOCUMENTS * 2)]
    tables = {}
    for uses in (True, False):
        sink = DeltaSink(tmp_path / str(uses), full_document="updateLookup", json_worker=uses)
        sink.load()
        for n, document in enumerate(documents, start=1):
            sink(_change(n, document))
        sink.save({"_data": "82" + "F" * 16})
        pid = sink.json_worker.pid
        assert (pid is not None) == uses and sink.json_worker.batches == uses
        sink.finish()
        assert pid is None or gone(pid)
        tables[uses] = deltalake.DeltaTable(str(tmp_path / str(uses))).to_pyarrow_table(
            columns=["_key", "document"]).sort_by("_key").to_pylist()
    assert tables[True] == tables[False]
    assert len(tables[True]) == len(documents)
    expected = {json_util.dumps(d, json_options=json_util.RELAXED_JSON_OPTIONS)
                for d in documents}
    assert {row["document"] for row in tables[True]} == expected


@pytest.mark.parametrize("given_", ["yes", 1, 0.0])
def test_json_worker_takes_only_true_false_or_none(tmp_path: Path, given_: Any) -> None:
    from changestream.delta import DeltaSink

    with pytest.raises(ValueError, match="json_worker must be True, False or None"):
        DeltaSink(tmp_path / "t", json_worker=given_)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no process priorities here (os.getpriority is POSIX)")
@pytest.mark.parametrize("niceness", [NICENESS, 0])
def test_the_worker_runs_niceness_below_its_parents_priority(niceness: int) -> None:
    """Background work: the worker's texts are wanted only by the commit behind the stream,
    so it takes what the stream and a server beside it leave of the cores."""
    made = JsonWorker(json_texts, least=1, niceness=niceness)
    try:
        assert made([bson.encode({"_id": 1})], RELAXED) == ['{"_id": 1}']
        assert made.pid is not None
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, made.pid) == min(19, own + niceness)
    finally:
        made.close()


@pytest.mark.parametrize("given_", [-1, 20, 1.5, True, "10"])
def test_a_workers_niceness_is_an_int_from_0_to_19(given_: Any) -> None:
    with pytest.raises(ValueError, match=r"niceness must be an int from 0 to 19 .*"
                                         + repr(given_).replace(".", r"\.")):
        JsonWorker(json_texts, niceness=given_)
