"""The consume loop's stats timer: reports on their interval, also while a poll or a reopen waits.

The loop itself reports after each poll, but during an outage no poll returns
(server selection, backoff between reopens), and the reports are wanted most
then: the lag keeps growing (:class:`changestream.Position`) and the reopen
count moves. The timer runs beside the loop (a task of the event loop in
asyncio, a daemon thread in the sync twin), calls
:meth:`~changestream._metrics.StatsReporter.tick` and, every
:data:`~changestream._headroom.PROBE_EVERY` seconds, reads how full the oplog
is and its oldest entry for the headroom, and (for the reports) the server's
change-stream counters (``serverStatus``).

It runs also without ``on_stats``: then it only samples the lag every
``stats_interval`` seconds and, while the lag grows, reads the oplog, so the time
to history loss is estimated and its WARNING comes before the history is lost, in
every ``consume`` (no ``serverStatus``: nothing would read it; no oplog read for a
consumer that keeps up). It ends once the oplog cannot be read
here (said once, INFO) and nothing is reported, or never starts with
``server_probes=False``. :func:`stop_stats_timer` ends it with the loop: the
task is cancelled and awaited, the thread woken and joined, so none outlives
``consume``.

This asyncio module is the one source of both timers: ``tools/gen_sync.py``
writes ``changestream/_sync/_stats_timer.py`` from it.
"""

from __future__ import annotations

import asyncio  # sync: import threading
from typing import Any

import pymongo
from pymongo.errors import PyMongoError

from .._consumer.run import Run
from .._headroom import OPLOG_QUERY, OPLOG_STATS, log, oplog_client
from .._metrics import StatsReporter
from .._server_metrics import SERVER_STATUS

__all__ = ["start_stats_timer", "stop_stats_timer"]

PROBE_TIMEOUT = 10.0
"""Seconds one read of the oplog or of ``serverStatus`` may take."""


def start_stats_timer(run: Run) -> None:
    """Start reporting ``run``'s stats on their interval (or sampling them), until the loop ends."""
    stats = run.stats
    if not stats.wanted or stats.timer is not None:
        return
    stats.timer = asyncio.get_running_loop().create_task(_tick(run, stats))  # sync: stats.timer = threading.Thread(target=_tick, args=(run, stats), name="changestream-stats", daemon=True)
    # sync-only: begin
    # stats.timer.start()
    # sync-only: end


async def stop_stats_timer(run: Run) -> None:
    """End the timer (after the loop's final report): none outlives ``consume``.

    A read in flight is abandoned (async: cancelled) or, in the sync twin, waited for (at
    most :data:`PROBE_TIMEOUT`: a thread cannot be interrupted).
    """
    stats = run.stats
    stats.ended = True
    stats.ending.set()
    timer = stats.timer
    if timer is None:
        return
    # async-only: begin
    timer.cancel()
    await asyncio.wait([timer])  # (a cancel of consume itself still propagates)
    # async-only: end
    # sync-only: begin
    # timer.join(PROBE_TIMEOUT + 1.0)
    # sync-only: end


async def _tick(run: Run, stats: StatsReporter) -> None:
    """Sleep until the next report is due, report (or sample), repeat; stop once the loop has
    ended or nothing is left to do."""
    while not stats.ended:
        await asyncio.sleep(min(stats.due_in(), 1.0) or 0.05)  # sync: stats.ending.wait(min(stats.due_in(), 1.0) or 0.05)
        if stats.ended:
            return
        if stats.probes:
            try:
                await _probe_headroom(stats)
            except Exception:  # the probe is best effort; the report matters more
                log.debug("reading the oplog headroom failed", exc_info=True)
        if stats.probes and stats.reporting and not stats.ended:  # only the reports read it
            try:
                await _probe_server(stats)
            except Exception:  # best effort too
                log.debug("reading serverStatus failed", exc_info=True)
        if not stats.wanted:
            return  # no callback, and the oplog cannot be read here: nothing to estimate
        stats.tick(run.progress.handled, max(run.opened - 1, 0))


async def _probe_headroom(stats: StatsReporter) -> None:
    """Read how full the oplog is and its oldest entry if it is time to (see
    :mod:`changestream._headroom`; without a callback only while the lag grows)."""
    probe = stats.headroom
    if not probe.due():
        return
    client, why_not = oplog_client(stats.stream)  # (no I/O: the topology the client knows)
    if why_not is not None:
        probe.give_up(why_not)
    if client is None or not stats.reading_oplog:
        return
    try:  # how full first: the oldest entry of an oplog that is not full is no risk
        with pymongo.timeout(PROBE_TIMEOUT):
            reply: Any = await client.local.command(dict(OPLOG_STATS))
    except PyMongoError as exc:
        probe.failed(exc, stats=True)
        return
    probe.read_fill(reply)
    if probe.unavailable is not None or stats.ended:
        return
    try:
        with pymongo.timeout(PROBE_TIMEOUT):
            entry: Any = await client.local["oplog.rs"].find_one({}, **OPLOG_QUERY)
    except PyMongoError as exc:
        probe.failed(exc)
        return
    probe.read(entry)


async def _probe_server(stats: StatsReporter) -> None:
    """Read ``serverStatus().metrics.changeStreams`` if it is time to (through mongos:
    mongos's own; see :mod:`changestream._server_metrics`)."""
    probe = stats.server
    stream = stats.stream
    if not probe.due() or stream is None or stream.client is None:
        return
    try:
        with pymongo.timeout(PROBE_TIMEOUT):
            reply: Any = await stream.client.admin.command(dict(SERVER_STATUS))
    except PyMongoError as exc:
        probe.failed(exc)
        return
    probe.read(reply)
