"""Lag against a live deployment: a consumer deliberately slower than the writer falls behind.

The numbers are printed (run with ``-s`` to see them); the assertions only use
generous bounds, since the machine is shared and slow.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from pymongo.collection import Collection

import changestream

BEHIND = timedelta(seconds=3)
DEADLINE = 120.0


def test_a_slow_consumer_shows_growing_lag_and_none_once_caught_up(
    test_coll: Collection[dict[str, Any]],
) -> None:
    test_coll.insert_one({"setup": True})
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            test_coll.insert_one({"i": i})
            i += 1
            stop.wait(0.02)

    with changestream.watch(test_coll, batch_size=2, max_await_time_ms=200) as stream:
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        started = time.monotonic()
        lags: list[float] = []
        try:
            # Slow consumer: 0.2 s per event, about 5 events/s behind a writer of up to 50/s.
            while time.monotonic() - started < DEADLINE:
                if stream.try_next() is not None:
                    time.sleep(0.2)
                lag = stream.lag
                if lag is not None:
                    lags.append(lag.total_seconds())
                    if lag >= BEHIND:
                        break
        finally:
            stop.set()
            writer.join()
        behind_after = time.monotonic() - started
        assert lags and max(lags) >= BEHIND.total_seconds(), f"never {BEHIND} behind: {lags}"
        # Lag is not monotonic within a batch, but it rose from (near) zero.
        assert min(lags) <= 1.0
        # Fast consumer: drain until an empty batch says the stream is at the server's time.
        drained = 0
        caught_up = time.monotonic()
        while time.monotonic() - caught_up < DEADLINE and stream.try_next() is not None:
            drained += 1
        final = stream.lag
        assert final is not None and final <= timedelta(seconds=1), final
        position = stream.position
        assert position.token_time is not None and position.server_time is not None
        print(
            f"\nlag: {BEHIND} behind after {behind_after:.1f} s of a slow consumer "
            f"({len(lags)} samples, max {max(lags):.0f} s); drained {drained} events in "
            f"{time.monotonic() - caught_up:.1f} s; lag then {final.total_seconds():.0f} s "
            f"(token {position.token_time}, server {position.server_time})"
        )
