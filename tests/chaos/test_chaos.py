"""Chaos: every client path reads ordered writes while the deployment misbehaves.

``python -m pytest -m chaos`` (seeded and bounded in time; see
``tests/chaos_support.py`` for the profiles). Each test runs on a replica set
and on a sharded cluster (through mongos). Faults: closed connections on
getMore and on the resume aggregate, CursorNotFound, step-downs with and
without closing connections, killed cursors, a primary killed or shut down
and restarted; on the replica set the whole set restarted from its dbpath; on
the sharded cluster a mongos killed and restarted and shard cursors killed;
and for the CLI kill -9 of the consumer followed by a restart from its token
file. Asserts 0 lost, 0 out of order, 0 duplicates in-process, and at most
one re-delivery per consumer kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

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
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import PyMongoError

import changestream
import changestream.aio
from changestream.stores import FileTokenStore, MemoryTokenStore, StoredToken

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(deadline_for(EVENTS) + 300)]


@pytest.fixture
def names(target: Target) -> Iterator[tuple[str, str]]:
    database = f"chaos_{uuid.uuid4().hex[:8]}"
    target.prepare(database, "orders")
    yield database, "orders"
    with MongoClient(target.uri) as client:
        client.drop_database(database)


def start_token(target: Target, names: tuple[str, str]) -> Any:
    """A token from before the first write: every consumer starts there."""
    with MongoClient(target.uri) as client, changestream.watch(
        client[names[0]][names[1]], max_await_time_ms=50
    ) as stream:
        return stream.resume_token


def wait_until(condition: Any, chaos: Chaos, what: str,
               seen: Callable[[], list[int]] | None = None) -> None:
    """Poll ``condition`` until the run's deadline; on timeout say how far it got.

    ``seen`` gives the ids received so far: a run that times out then reports
    what was written, received and lost (and where), not only that it hung.
    """
    started = time.monotonic()
    deadline = started + deadline_for(chaos.events)
    while not condition():
        assert not chaos.errors, chaos.errors
        if time.monotonic() >= deadline:
            detail = ""
            if seen is not None:
                received = list(seen())
                verdict = Verdict.of(received, chaos.written, time.monotonic() - started)
                missing = sorted(set(range(chaos.written)) - set(received))
                detail = (f": written {chaos.written}, received {len(received)}, lost "
                          f"{verdict.lost} of the written (first missing ids {missing[:5]}), "
                          f"duplicated {verdict.duplicated}, out of order {verdict.out_of_order}")
            raise AssertionError(f"chaos run timed out waiting for {what}{detail}")
        time.sleep(0.05)


def judge(name: str, received: list[int], chaos: Chaos, started: float,
          kills: int = 0) -> Verdict:
    verdict = Verdict.of(received, chaos.events, time.monotonic() - started)
    print(verdict.report(name, chaos, kills))
    assert verdict.lost == 0
    assert sum(chaos.counts.values()) > 0, "no fault was injected"
    return verdict


def test_watch_with_manual_token_saving(target: Target, names: tuple[str, str]) -> None:
    """The resumability guide's loop: save the token after every try_next, reopen from it."""
    token = start_token(target, names)
    received: list[int] = []
    stop = threading.Event()

    def consumer() -> None:
        nonlocal token
        with MongoClient(target.uri) as client:
            coll = client[names[0]][names[1]]
            while not stop.is_set():
                try:
                    with changestream.watch(coll, resume_after=token,
                                            max_await_time_ms=100) as stream:
                        while not stop.is_set():
                            change = stream.try_next()
                            if change is not None:
                                received.append(change["documentKey"]["_id"])
                            token = stream.resume_token  # saved after every call
                except PyMongoError:
                    time.sleep(0.1)  # the stream's one resume failed: reopen from the token

    chaos = Chaos(target, *names, seed=SEED, progress=received.__len__).start()
    started = time.monotonic()
    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(received) >= EVENTS, chaos, "every event", lambda: received)
    finally:
        stop.set()
        chaos.stop()
        thread.join(60)
    verdict = judge("watch", received, chaos, started)
    assert verdict.duplicated == 0 and verdict.out_of_order == 0


def test_consume(target: Target, names: tuple[str, str]) -> None:
    token = start_token(target, names)
    store = MemoryTokenStore(StoredToken(token, None, changestream.stores._now()))
    received: list[int] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def handle(change: Any) -> None:
        received.append(change["documentKey"]["_id"])
        if len(received) >= EVENTS:
            stop.set()

    def consumer() -> None:
        with MongoClient(target.uri) as client:
            coll = client[names[0]][names[1]]
            try:
                changestream.consume(
                    lambda t: changestream.watch(coll, resume_after=t, max_await_time_ms=100),
                    handle, store, stop=stop, retry_for=None, backoff_initial=0.1,
                    backoff_max=1.0, call_timeout=30,
                )
            except BaseException as exc:
                errors.append(exc)

    chaos = Chaos(target, *names, seed=SEED + 1, progress=received.__len__).start()
    started = time.monotonic()
    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    try:
        wait_until(lambda: stop.is_set() or bool(errors), chaos, "every event", lambda: received)
    finally:
        stop.set()
        chaos.stop()
        thread.join(60)
    assert not errors, errors
    verdict = judge("consume", received, chaos, started)
    assert verdict.duplicated == 0 and verdict.out_of_order == 0


def test_aio_consume(target: Target, names: tuple[str, str]) -> None:
    token = start_token(target, names)
    received: list[int] = []
    done = threading.Event()
    errors: list[BaseException] = []

    async def run() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(target.uri)
        coll = client[names[0]][names[1]]
        stop = asyncio.Event()

        async def open_stream(t: Any) -> changestream.aio.AsyncChangeStream[Any]:
            return await changestream.aio.watch(coll, resume_after=t, max_await_time_ms=100)

        def handle(change: Any) -> None:
            received.append(change["documentKey"]["_id"])
            if len(received) >= EVENTS:
                stop.set()

        async def watch_done() -> None:
            while not done.is_set():
                await asyncio.sleep(0.1)
            stop.set()

        watcher = asyncio.create_task(watch_done())
        try:
            await changestream.aio.consume(
                open_stream, handle,
                MemoryTokenStore(StoredToken(token, None, changestream.stores._now())),
                stop=stop, retry_for=None, backoff_initial=0.1, backoff_max=1.0,
                call_timeout=30,
            )
        finally:
            watcher.cancel()
            await client.close()

    def consumer() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    chaos = Chaos(target, *names, seed=SEED + 2, progress=received.__len__).start()
    started = time.monotonic()
    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(received) >= EVENTS or bool(errors), chaos, "every event",
                   lambda: received)
    finally:
        done.set()
        chaos.stop()
        thread.join(60)
    assert not errors, errors
    verdict = judge("aio.consume", received, chaos, started)
    assert verdict.duplicated == 0 and verdict.out_of_order == 0


class CliConsumer:
    """``changestream watch`` with a token file, killed with SIGKILL and restarted at will."""

    def __init__(self, uri: str, names: tuple[str, str], token_file: Path) -> None:
        self.args = [sys.executable, "-m", "changestream", "watch", uri, "--db", names[0],
                     "--coll", names[1], "--token-file", str(token_file),
                     "--max-await-ms", "100", "--call-timeout", "30"]
        self.runs: list[list[int]] = []
        self.kills = 0
        self.lock = threading.Lock()
        self.process: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        process = subprocess.Popen(self.args, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        run: list[int] = []
        self.runs.append(run)
        self.process = process
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(process.stdout, run), daemon=True).start()

    @staticmethod
    def _read(stdout: IO[str], run: list[int]) -> None:
        for line in stdout:
            with contextlib.suppress(ValueError, KeyError):  # a line cut short by SIGKILL
                run.append(json.loads(line)["documentKey"]["_id"])

    def kill_and_restart(self) -> None:
        with self.lock:
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)
            self.kills += 1
            self.start()

    def progress(self) -> int:
        """Events printed so far (by the highest ``_id``: each run prints in order)."""
        return max((run[-1] + 1 for run in self.runs if run), default=0)

    def received(self) -> list[int]:
        return [i for run in self.runs for i in run]

    def stop(self) -> None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(30)
                except subprocess.TimeoutExpired:
                    self.process.kill()


def test_cli_with_kill_9_and_restart(target: Target, names: tuple[str, str], tmp_path: Path) -> None:
    token_file = tmp_path / "orders.token"
    FileTokenStore(token_file).save(start_token(target, names))
    cli = CliConsumer(target.uri, names, token_file)
    chaos = Chaos(target, *names, seed=SEED + 3, progress=cli.progress,
                  extra_faults={"kill_consumer": cli.kill_and_restart})
    chaos.start()
    started = time.monotonic()
    try:
        wait_until(lambda: cli.progress() >= EVENTS and len(set(cli.received())) >= EVENTS,
                   chaos, "every event", cli.received)
    finally:
        chaos.stop()
        cli.stop()
    received = cli.received()
    kills = cli.kills
    verdict = judge("cli", received, chaos, started, kills=kills)
    # Within one process, strictly in order; across a kill at most one change again.
    for run in cli.runs:
        assert run == sorted(run) and len(run) == len(set(run))
    assert verdict.duplicated <= kills
    for before, after in itertools.pairwise(cli.runs):
        if before and after:
            assert after[0] in (before[-1], before[-1] + 1), (before[-3:], after[:3])


class ParallelConsumer(CliConsumer):
    """``consume``/``aio.consume`` with workers in a child process, killed -9 and restarted."""

    MAX_IN_FLIGHT = 32

    def __init__(self, uri: str, names: tuple[str, str], token_file: Path, mode: str) -> None:
        script = Path(__file__).with_name("parallel_consumer.py")
        self.args = [sys.executable, str(script), uri, names[0], names[1], str(token_file),
                     mode, "8" if mode == "sync" else "64", str(self.MAX_IN_FLIGHT)]
        self.runs = []
        self.kills = 0
        self.lock = threading.Lock()
        self.process = None
        self.start()

    @staticmethod
    def _read(stdout: IO[str], run: list[int]) -> None:
        for line in stdout:
            with contextlib.suppress(ValueError):  # a line cut short by SIGKILL
                run.append(int(line))

    def progress(self) -> int:
        """Distinct events handled so far (runs are not in global order with workers)."""
        return len(set(self.received()))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parallel_consume_with_kill_9_and_restart(target: Target, names: tuple[str, str],
                                                  tmp_path: Path, mode: str) -> None:
    """Workers (threads, or asyncio tasks): 0 lost, per-key order, re-delivery bounded per kill."""
    token_file = tmp_path / "parallel.token"
    FileTokenStore(token_file).save(start_token(target, names))
    consumer = ParallelConsumer(target.uri, names, token_file, mode)
    chaos = Chaos(target, *names, seed=SEED + (5 if mode == "sync" else 6),
                  progress=consumer.progress,
                  extra_faults={"kill_consumer": consumer.kill_and_restart})
    chaos.start()
    started = time.monotonic()
    try:
        wait_until(lambda: consumer.progress() >= EVENTS, chaos, "every event",
                   consumer.received)
    finally:
        chaos.stop()
        consumer.stop()
    received = consumer.received()
    verdict = Verdict.of(sorted(set(received)), chaos.events, time.monotonic() - started)
    verdict.duplicated = len(received) - len(set(received))
    print(verdict.report(f"consume workers ({mode})", chaos, consumer.kills))
    assert verdict.lost == 0
    assert chaos.counts["kill_consumer"] > 0 and sum(chaos.counts.values()) > 1
    lanes = 16
    for run in consumer.runs:
        for lane in range(lanes):
            ids = [i for i in run if i % lanes == lane]
            assert ids == sorted(ids), f"lane {lane} out of order in one run: {ids[:10]}"
    # A kill re-delivers at most max_in_flight changes (save_every=1: a moved watermark is
    # stored before the next change is admitted), and nothing is handled twice in one run.
    seen: set[int] = set()
    for run in consumer.runs:
        again = [i for i in run if i in seen]
        assert len(again) <= ParallelConsumer.MAX_IN_FLIGHT, (len(again), again[:10])
        assert len(run) == len(set(run))
        seen.update(run)
