"""Chaos for both Spark paths (``foreach_batch`` and the ``changestream`` source).

Ordered writes with seeded faults (see ``tests/chaos_support.py``) on a replica
set (restarted whole from its dbpath too) and on a sharded cluster, plus SIGKILL
of the whole pipeline process group and a restart from its state. The
idempotent sink is keyed by batch id: every event lands exactly once.
Run with ``python -m pytest -m "chaos and spark" tests/spark``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from chaos_support import (
    EVENTS,
    SEED,
    Chaos,
    Target,
    Verdict,
    deadline_for,
    target_fixture,  # noqa: F401 - the fixture "target"
)
from pymongo import MongoClient
from spark_support import PANDAS_WARNING, ParquetSink, current_token

from changestream import token_to_json

pytestmark = [pytest.mark.spark, pytest.mark.chaos, pytest.mark.filterwarnings(PANDAS_WARNING),
              pytest.mark.timeout(deadline_for(EVENTS) + 600)]

SCRIPT = Path(__file__).with_name("pipeline_process.py")
MAX_KILLS = {"replset": 2, "sharded": 1}
"""A restart costs a JVM start: a few are enough to prove the state survives (the kill
is the client's fault, whatever the topology: once more on the cluster keeps CI short)."""


class Pipeline:
    """``pipeline_process.py`` in its own process group, restartable from its state."""

    def __init__(self, args: list[str], log: Path, max_kills: int) -> None:
        self.args = args
        self.max_kills = max_kills
        self.log = log
        self.kills = 0
        self.lock = threading.Lock()
        """Held while the pipeline is killed and restarted (it is down on purpose then)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def died(self) -> bool:
        """The pipeline exited by itself (not killed by a fault)."""
        with self.lock:
            return self.process is not None and self.process.poll() is not None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(SCRIPT), *self.args], stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, cwd=SCRIPT.parent,
            )

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # no stray JVM may write on
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def kill_and_restart(self) -> bool:
        if self.kills >= self.max_kills:
            return False
        with self.lock:
            self.kill()
            self.kills += 1
            self.start()
        return True


@pytest.mark.parametrize("mode", ["helper", "source"])
def test_spark_under_chaos(target: Target, tmp_path: Path, mode: str) -> None:
    database = f"chaos_spark_{uuid.uuid4().hex[:8]}"
    target.prepare(database, "orders")
    with MongoClient(target.uri) as client:
        coll = client[database]["orders"]
        start = current_token(coll)
        out, state = tmp_path / "out", tmp_path / "state"
        state.mkdir()
        pipeline = Pipeline(
            [mode, target.uri, database, "orders", token_to_json(start), str(out), str(state), "0"],
            tmp_path / "pipeline.log", MAX_KILLS[target.name],
        )
        sink = ParquetSink(out)
        chaos = Chaos(target, database, "orders", seed=SEED + 10,
                      extra_faults={"kill_consumer": pipeline.kill_and_restart})
        started = time.monotonic()
        chaos.start()
        try:
            deadline = time.monotonic() + deadline_for(EVENTS) + 120  # JVM starts
            while len(set(sink.ids())) < EVENTS:
                assert not chaos.errors, chaos.errors
                assert not pipeline.died(), pipeline.log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the Spark chaos run timed out"
                time.sleep(0.5)
        finally:
            chaos.stop()
            pipeline.kill()
        ids = sink.ids()
        verdict = Verdict.of(ids, EVENTS, time.monotonic() - started)
        print(verdict.report(f"spark-{mode}", chaos, pipeline.kills))
        client.drop_database(database)
    assert verdict.lost == 0
    assert verdict.duplicated == 0, "the sink keyed by batch id holds every event once"
    assert ids == sorted(ids), "batches in order, events in order within them"
    assert sum(chaos.counts.values()) > 0
