"""The parallel-handling core (``_lanes.Lanes``): per-key order, barriers, the low watermark.

Pure data, so the properties are checked against a model over every
interleaving hypothesis draws (no threads, no clock): the watermark never
passes an unhandled change, one key never runs twice at once nor out of
order, a barrier runs alone and in place, and the dispatcher never stalls
while work is left.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changestream._lanes import (
    BARRIER,
    Job,
    Lanes,
    LanesError,
    default_key,
    default_max_in_flight,
    key_of,
)
from changestream.events import parse_event

KEYS = st.one_of(st.sampled_from(["a", "b", "c", "d"]), st.just(BARRIER))


class Model:
    """What the dispatcher promises, tracked beside it: positions in order and what ran when."""

    def __init__(self, lanes: Lanes) -> None:
        self.lanes = lanes
        self.positions: list[tuple[str, Any]] = []
        """(kind, key) per admitted position, in stream order: kind 'job' or 'mark'."""
        self.done: set[int] = set()
        self.running: dict[int, Job] = {}
        self.started: list[int] = []
        self.last_started_per_key: dict[Hashable, int] = {}

    def admit(self, key: Hashable) -> None:
        position = len(self.positions)
        if self.lanes.full:
            with pytest.raises(LanesError):
                self.lanes.admit(f"change {position}", key, position)
            return
        self.lanes.admit(f"change {position}", key, position)
        self.positions.append(("job", key))

    def mark(self) -> None:
        position = len(self.positions)
        self.positions.append(("mark", None))
        self.done.add(position)
        self.lanes.mark(position)

    def take(self) -> Job | None:
        job = self.lanes.take()
        if job is None:
            return None
        position = job.token
        kind, key = self.positions[position]
        assert kind == "job" and key is job.key and job.change == f"change {position}"
        assert position not in self.done and position not in self.running
        # The same key never runs twice at once, and starts in stream order.
        assert all(other.key != key or key is BARRIER for other in self.running.values())
        assert self.last_started_per_key.get(key, -1) < position
        if key is not BARRIER:
            earlier = [p for p, (k, kk) in enumerate(self.positions[:position]) if kk == key]
            assert all(p in self.done for p in earlier), "a key started before its earlier change"
        # A barrier starts after everything before it finished, and runs alone.
        barriers = [p for p, (k, kk) in enumerate(self.positions) if k == "job" and kk is BARRIER]
        if key is BARRIER:
            assert all(p in self.done for p in range(position)) and not self.running
        else:
            assert not any(p < position and p not in self.done for p in barriers)
            assert not any(self.positions[p][1] is BARRIER for p in self.running)
        self.last_started_per_key[key] = position
        self.running[position] = job
        self.started.append(position)
        assert len(self.running) <= self.lanes.workers
        return job

    def finish(self, position: int) -> None:
        job = self.running.pop(position)
        self.done.add(position)
        self.lanes.done(job)

    def check(self) -> None:
        lanes = self.lanes
        # The watermark: the last position such that it and every earlier one are done.
        expected = None
        for position in range(len(self.positions)):
            if position not in self.done:
                break
            expected = position
        assert lanes.watermark == expected
        # It never passes an unhandled change.
        if lanes.watermark is not None:
            assert all(p in self.done for p in range(lanes.watermark + 1))
        jobs_after = sum(1 for p, (kind, _) in enumerate(self.positions)
                         if kind == "job" and (expected is None or p > expected))
        assert lanes.in_flight == jobs_after <= lanes.max_in_flight
        assert lanes.running == len(self.running)
        # Never stalled: work is left and nothing runs, so something may start.
        unfinished = [p for p, (kind, _) in enumerate(self.positions)
                      if kind == "job" and p not in self.done]
        if unfinished and not self.running:
            assert lanes._ready, "work left but nothing may start"


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_every_interleaving_keeps_order_barriers_and_the_watermark(
    workers: int, max_in_flight: int, data: st.DataObject
) -> None:
    model = Model(Lanes(workers, max_in_flight))
    for _ in range(data.draw(st.integers(0, 60))):
        action = data.draw(st.sampled_from(["admit", "admit", "mark", "take", "finish"]))
        if action == "admit":
            model.admit(data.draw(KEYS))
        elif action == "mark":
            model.mark()
        elif action == "take":
            model.take()
        elif model.running:
            model.finish(data.draw(st.sampled_from(sorted(model.running))))
        model.check()
    # Drain: everything admitted finishes, the watermark reaches the last position.
    while model.running or model.lanes._ready:
        while model.take() is not None:
            pass
        model.finish(min(model.running))
        model.check()
    assert model.lanes.idle
    assert model.lanes.watermark == (len(model.positions) - 1 if model.positions else None)
    assert model.lanes.handled == sum(1 for kind, _ in model.positions if kind == "job")


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(st.tuples(KEYS, st.integers(1, 50)), min_size=1, max_size=80),
)
def test_per_key_order_under_random_handler_delays(
    workers: int, changes: list[tuple[Hashable, int]]
) -> None:
    """A simulated clock: each change's handler takes its drawn time; the completion order
    differs from stream order, yet each key's changes are handled in stream order."""
    lanes = Lanes(workers, default_max_in_flight(workers))
    now = 0
    finishing: list[tuple[int, int, Job]] = []
    handled: list[tuple[Hashable, int, int, int]] = []  # key, position, start, end
    pending = list(enumerate(changes))
    watermarks: list[int] = []
    while pending or finishing or not lanes.idle:
        while pending and not lanes.full:
            position, (key, _) = pending.pop(0)
            lanes.admit(position, key, position)
        while (job := lanes.take()) is not None:
            duration = changes[job.token][1]
            heapq.heappush(finishing, (now + duration, job.token, job))
        end, position, job = heapq.heappop(finishing)
        now = end
        handled.append((job.key, position, end - changes[position][1], end))
        if lanes.done(job):
            watermarks.append(lanes.watermark)
            assert all(p in {h[1] for h in handled} for p in range(lanes.watermark + 1))
    assert sorted(h[1] for h in handled) == list(range(len(changes)))
    for key in {k for k, _ in changes if k is not BARRIER}:
        runs = [h for h in handled if h[0] == key]
        assert [h[1] for h in runs] == sorted(h[1] for h in runs), "a key ran out of order"
        assert all(a[3] <= b[2] for a, b in itertools.pairwise(runs)), "a key ran twice at once"
    for barrier in (h for h in handled if h[0] is BARRIER):
        overlapping = [h for h in handled if h is not barrier
                       and h[2] < barrier[3] and barrier[2] < h[3]]
        assert not overlapping, "a barrier did not run alone"
        assert all(h[3] <= barrier[2] for h in handled if h[1] < barrier[1])
        assert all(h[2] >= barrier[3] for h in handled if h[1] > barrier[1])
    assert watermarks == sorted(watermarks) and watermarks[-1] == len(changes) - 1


def test_one_slow_change_holds_the_watermark_and_bounds_fetching() -> None:
    lanes = Lanes(workers=4, max_in_flight=3)
    slow = lanes.admit("c0", "slow", "t0")
    assert lanes.take() is slow
    others = [lanes.admit(f"c{i}", f"k{i}", f"t{i}") for i in (1, 2)]
    assert lanes.full
    with pytest.raises(LanesError, match="while full"):
        lanes.admit("c3", "k3", "t3")
    for job in others:
        assert lanes.take() is job
        assert lanes.done(job) is False  # done, but the slow change before it is not
    assert lanes.watermark is None and lanes.full
    assert lanes.done(slow) is True
    assert lanes.watermark == "t2" and not lanes.full and lanes.idle


def test_an_empty_batch_token_waits_behind_unhandled_changes() -> None:
    lanes = Lanes(workers=2, max_in_flight=10, watermark="start")
    job = lanes.admit("c0", "a", "t0")
    assert lanes.mark("pbrt1") is False
    assert lanes.mark("pbrt2") is False
    assert lanes.watermark == "start"
    lanes.done(lanes.take() or job)
    assert lanes.watermark == "pbrt2"
    assert lanes.mark("pbrt3") is True and lanes.watermark == "pbrt3"


def test_abandon_keeps_the_watermark_before_every_dropped_change() -> None:
    lanes = Lanes(workers=1, max_in_flight=10, watermark="w")
    first = lanes.admit("c0", "a", "t0")
    lanes.admit("c1", "a", "t1")
    lanes.admit("c2", BARRIER, "t2")
    lanes.admit("c3", "b", "t3")
    assert lanes.take() is first
    dropped = lanes.abandon()
    assert [job.token for job in dropped] == ["t1", "t2", "t3"]
    assert lanes.take() is None  # nothing more starts
    lanes.done(first)
    assert lanes.watermark == "t0" and lanes.running == 0
    lanes.restart("t0")
    assert lanes.idle and lanes.in_flight == 0 and lanes.handled == 1


def test_finishing_a_job_twice_is_refused() -> None:
    lanes = Lanes(1, 1)
    job = lanes.admit("c", "a", "t")
    with pytest.raises(LanesError, match="never taken"):
        lanes.done(job)
    lanes.done(lanes.take() or job)
    with pytest.raises(LanesError, match="finished twice"):
        lanes.done(job)


def test_default_key_is_the_namespace_and_id_and_barrier_without_a_document_key() -> None:
    insert = {"operationType": "insert", "ns": {"db": "d", "coll": "c"},
              "documentKey": {"_id": 1, "region": "eu"}}
    moved = {"operationType": "update", "ns": {"db": "d", "coll": "c"},
             "documentKey": {"_id": 1, "region": "us"}}  # the shard key changed, not the _id
    assert default_key(insert) == default_key(moved) == ("d", "c", 1)
    other_coll = {**insert, "ns": {"db": "d", "coll": "x"}}
    assert default_key(other_coll) != default_key(insert)
    compound = {**insert, "documentKey": {"_id": {"a": [1, 2]}}}
    assert hash(default_key(compound)) is not None
    for ddl in ({"operationType": "drop", "ns": {"db": "d", "coll": "c"}},
                {"operationType": "invalidate"}, {"operationType": "brandNew"}):
        assert default_key(ddl) is BARRIER
    typed = parse_event({"_id": {"_data": "00"}, **insert})
    assert default_key(typed) == ("d", "c", 1)


def test_a_key_function_returning_none_makes_a_barrier() -> None:
    keyed = key_of(lambda change: change.get("tenant"))
    assert keyed({"tenant": "t1"}) == "t1"
    assert keyed({}) is BARRIER
    assert keyed({"tenant": ["a"]}) == keyed({"tenant": ["a"]})  # unhashable: its BSON
    with pytest.raises(TypeError, match="key must be a function"):
        key_of("documentKey")  # type: ignore[arg-type]


def test_default_max_in_flight() -> None:
    assert default_max_in_flight(1) == 64
    assert default_max_in_flight(32) == 128
    assert default_max_in_flight(1000) == 4000


def test_fetching_resumes_once_a_quarter_is_free_not_per_change() -> None:
    lanes = Lanes(workers=8, max_in_flight=8)
    jobs = [lanes.admit(i, f"k{i}", i) for i in range(8)]
    assert lanes.full and not lanes.roomy
    for job in jobs:
        assert lanes.take() is job
    lanes.done(jobs[0])
    assert not lanes.full and not lanes.roomy  # one free slot: the fetcher keeps waiting
    lanes.done(jobs[1])
    assert lanes.roomy and lanes.in_flight == 6


def test_keys_compare_by_value_nan_ids_share_a_lane() -> None:
    """Issue 33, item 4: NaN != NaN, so each change of a document whose _id is NaN got a
    lane of its own, and 8 calls ran at once for one document, out of order."""
    def change(i: int) -> dict[str, Any]:
        return {"operationType": "update", "ns": {"db": "d", "coll": "c"},
                "documentKey": {"_id": float("nan")}, "i": i}

    assert default_key(change(1)) == default_key(change(2))
    assert default_key({**change(1), "documentKey": {"_id": {"a": float("nan")}}}) == (
        default_key({**change(2), "documentKey": {"_id": {"a": float("nan")}}}))
    lanes = Lanes(workers=8, max_in_flight=64)
    for i in range(8):
        lanes.admit(change(i), default_key(change(i)), i)
    first = lanes.take()
    assert first is not None and first.change["i"] == 0
    assert lanes.take() is None  # the same document: one at a time
    keyed = key_of(lambda change: change["tenant"])
    assert keyed({"tenant": float("nan")}) == keyed({"tenant": float("nan")})
    assert keyed({"tenant": ("t", float("nan"))}) == keyed({"tenant": ("t", float("nan"))})


def test_a_key_that_compares_by_identity_is_refused_naming_key() -> None:
    class Tenant:  # no __eq__/__hash__: every instance is its own key
        def __init__(self, name: str) -> None:
            self.name = name

    def tenant_of(change: Any) -> Any:
        return Tenant(change["tenant"])

    keyed = key_of(tenant_of)
    with pytest.raises(TypeError) as info:
        keyed({"tenant": "t1"})
    message = str(info.value)
    assert message.startswith("key=") and "tenant_of" in message and "\n" not in message
    assert "compares by identity" in message
    with pytest.raises(TypeError, match="key="):
        key_of(lambda change: ("t", Tenant("x")))({})
    with pytest.raises(TypeError, match="neither hashable nor BSON"):
        key_of(lambda change: {1, 2})({})  # a set: unhashable, not BSON

    @dataclasses.dataclass(frozen=True)
    class ByValue:
        name: str

    by_value = key_of(lambda change: ByValue(change["tenant"]))
    assert by_value({"tenant": "a"}) == by_value({"tenant": "a"})
