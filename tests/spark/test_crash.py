"""Kill the whole pipeline process with SIGKILL mid-batch, restart from its state: exactly once.

``pipeline_process.py`` runs in its own session (process group: Python
driver, JVM and Python workers); its sink holds ``func`` after writing the
file of batch 2, and the test kills the group right then, between "output
written" and "progress saved" (batches 0 and 1 are complete). The restart runs in this process from the
same token store / checkpoint and must deliver every event exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from spark_support import PANDAS_WARNING, ParquetSink, current_token, wait_for

from changestream import token_to_json
from changestream.spark_adapter import foreach_batch, stream_opener
from changestream.stores import FileTokenStore

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]

SCRIPT = Path(__file__).with_name("pipeline_process.py")
TOTAL = 600


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group and wait until no member is left (no stray JVM writing on)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)

    def gone() -> bool:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout=30, what="the killed process group to disappear")


@pytest.mark.parametrize("mode", ["helper", "source"])
def test_sigkill_mid_batch_then_restart_delivers_every_event_once(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path, mode: str
) -> None:
    start = current_token(coll)
    out, state = tmp_path / "out", tmp_path / "state"
    state.mkdir()
    log = (tmp_path / "pipeline.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            mode,
            mongodb_uri,
            coll.database.name,
            coll.name,
            token_to_json(start),
            str(out),
            str(state),
            "30",  # hold func long enough to be killed inside it
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=SCRIPT.parent,
    )

    def produce() -> None:
        for i in range(0, TOTAL, 10):
            coll.insert_many([{"_id": j} for j in range(i, i + 10)])
            time.sleep(0.02)

    producer = threading.Thread(target=produce)
    producer.start()
    sink = ParquetSink(out)
    try:
        wait_for(
            lambda: process.poll() is not None or list(out.glob("written-*")),
            timeout=120,
            what="the pipeline process to write its first batch",
        )
        assert process.poll() is None, (tmp_path / "pipeline.log").read_text()[-3000:]
        killed_in = sorted(out.glob("written-*"))[0].name
    finally:
        if process.poll() is None:
            _kill_group(process)
        log.close()
        producer.join()
    before = sink.batches()
    assert sorted(before) == [0, 1, 2] and killed_in == "written-000002"
    assert sum(t.num_rows for t in before.values()) < TOTAL

    if mode == "helper":
        store = FileTokenStore(state / "token.json")
        stored = store.load()
        assert stored is not None and stored.batch_id == 1  # batch 2 ran, was not recorded
        opener = stream_opener(coll, max_await_time_ms=100, batch_size=500)
        foreach_batch(spark, opener, sink, store, max_rows=300, until_idle=True)
    else:
        query = (
            spark.readStream.format("changestream")
            .option("uri", mongodb_uri)
            .option("database", coll.database.name)
            .option("collection", coll.name)
            .option("startup_mode", "token")  # ignored: the checkpoint has offsets
            .option("start_after", token_to_json(start))
            .option("max_rows_per_batch", "300")  # batch 2 is replayed from the offset log
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(state / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(120), "the restarted availableNow query did not end"
        assert before[2].equals(sink.batches()[2])  # batch 2 replayed identically
    ids = sink.ids()
    assert len(ids) == TOTAL, f"{len(ids)} rows for {TOTAL} events"
    assert sorted(ids) == list(range(TOTAL))


def test_sigkill_mid_copy_then_restart_copies_every_document_once(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path
) -> None:
    """``startup_mode=snapshot``: killed inside copy batch 2, the restart replays it and goes on."""
    coll.insert_many([{"_id": i, "v": 0} for i in range(TOTAL)])
    out, state = tmp_path / "out", tmp_path / "state"
    state.mkdir()
    log = (tmp_path / "pipeline.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "snapshot", mongodb_uri, coll.database.name, coll.name,
         "{}", str(out), str(state), "30"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=SCRIPT.parent,
    )
    sink = ParquetSink(out)
    try:
        wait_for(
            lambda: process.poll() is not None or list(out.glob("written-*")),
            timeout=120,
            what="the pipeline process to write copy batch 2",
        )
        assert process.poll() is None, (tmp_path / "pipeline.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            _kill_group(process)
        log.close()
    before = sink.batches()
    assert sorted(before) == [0, 1, 2]
    coll.update_many({"_id": {"$lt": 10}}, {"$set": {"v": 1}})  # after T: events, not copy
    query = (
        spark.readStream.format("changestream")
        .option("uri", mongodb_uri)
        .option("database", coll.database.name)
        .option("collection", coll.name)
        .option("startup_mode", "snapshot")
        .option("full_document", "updateLookup")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(state / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(180), "the restarted availableNow query did not end"
    assert before[2].equals(sink.batches()[2])  # the copy batch replayed identically
    rows = [r for _, t in sorted(sink.batches().items()) for r in t.to_pylist()]
    copied = [r["document_key"] for r in rows if r["resume_token"] == "snapshot"]
    assert len(copied) == TOTAL == len(set(copied))  # every document copied exactly once
    updates = [r for r in rows if r["operation_type"] == "update"]
    assert len(updates) == 10
