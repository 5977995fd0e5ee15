"""The shells' buffered fast path (``next_buffered``) must be indistinguishable from an operation.

Same documents, same cached resume token after every document (the spec's
caching rules: a document's ``_id``, except the last of a batch, which gives
way to the postBatchResumeToken), and it must step aside wherever the full
path has work to do.
"""

from __future__ import annotations

from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from test_machine import event, getmore_reply, opened, raised, token

from changestream._machine import NOT_BUFFERED, Deliver
from changestream.errors import ChangeStreamError


def _drain(driver: Any, *, fast: bool, batches: list[list[dict[str, Any]]]) -> list[Any]:
    """Every (document, cached token) pair, reading all batches."""
    seen: list[Any] = []
    pending = list(batches[1:])
    while True:
        while driver.machine.buffered:
            document = driver.machine.next_buffered() if fast else NOT_BUFFERED
            if document is NOT_BUFFERED:
                result = driver.next()
                assert isinstance(result, Deliver)
                document = result.document
            seen.append((document, driver.machine.resume_token))
        if not pending:
            return seen
        batch = pending.pop(0)
        result = driver.try_next(getmore_reply(batch, token(90_000 + len(seen))))
        assert isinstance(result, Deliver)
        seen.append((result.document, driver.machine.resume_token))


BATCHES = [[event(i) for i in range(0, 5)], [event(i) for i in range(5, 6)],
           [event(i) for i in range(6, 12)]]


@pytest.mark.parametrize("raw", [False, True])
def test_fast_path_delivers_the_same_documents_and_tokens(raw: bool) -> None:
    def prepare(batch: list[dict[str, Any]]) -> list[Any]:
        return [RawBSONDocument(bson.encode(d)) for d in batch] if raw else batch

    batches = [prepare(b) for b in BATCHES]
    runs = []
    for fast in (False, True):
        driver = opened(*batches[0], pbrt=token(80_000))
        runs.append(_drain(driver, fast=fast, batches=batches))
    slow, fast_run = runs
    assert [bson.encode(doc) == bson.encode(other) for (doc, _), (other, _) in
            zip(slow, fast_run, strict=True)] == [True] * len(slow)
    assert [dict(t) for _, t in slow] == [dict(t) for _, t in fast_run]
    # The last document of each batch caches the postBatchResumeToken, the others their _id.
    assert dict(slow[4][1]) == token(80_000)
    assert dict(slow[0][1]) == token(0)


def test_fast_path_leaves_the_last_document_of_a_batch_to_the_operation() -> None:
    driver = opened(event(1), event(2), pbrt=token(99))
    assert driver.machine.next_buffered()["_id"] == token(1)
    assert driver.machine.next_buffered() is NOT_BUFFERED  # last one: the PBRT rule applies
    assert driver.machine.resume_token == token(1)


def test_fast_path_steps_aside_for_split_reassembly_and_missing_tokens() -> None:
    split = opened(event(1), event(2), event(3), reassemble_split_events=True,
                   pipeline=[{"$changeStreamSplitLargeEvent": {}}])
    assert split.machine.next_buffered() is NOT_BUFFERED
    missing = opened({"operationType": "insert"}, event(2), event(3))
    assert missing.machine.next_buffered() is NOT_BUFFERED
    assert missing.machine.buffered == 3  # the operation will raise and close the stream


def test_fast_path_is_unused_while_an_operation_is_in_progress() -> None:
    driver = opened(event(1), event(2), event(3))
    driver.machine.begin_next()
    assert driver.machine.next_buffered() is NOT_BUFFERED



@pytest.mark.parametrize("fast", [False, True])
def test_a_raw_events_token_is_its_exact_id_bytes_and_pins_nothing(fast: bool) -> None:
    """The token of a raw event is copied out only when used, byte for byte its ``_id``."""
    batch = [RawBSONDocument(bson.encode(event(i))) for i in range(4)]
    driver = opened(*batch, pbrt=token(70_000))
    for i in range(3):
        document = driver.machine.next_buffered() if fast else NOT_BUFFERED
        if document is NOT_BUFFERED:
            result = driver.next()
            assert isinstance(result, Deliver)
            document = result.document
        assert document is batch[i]
        cached = driver.machine.resume_token
        assert type(cached) is RawBSONDocument
        assert cached.raw == bson.encode(token(i))
        assert cached.raw is not batch[i].raw  # a copy: the reply's buffer is not kept alive
        assert driver.machine.resume_token is cached  # sliced once
        assert driver.machine.position.token_time is not None


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("damage", ["size too big", "size too small", "no terminator"])
def test_a_raw_event_with_a_damaged_id_is_refused_when_it_arrives(fast: bool, damage: str) -> None:
    good = bytearray(bson.encode(event(1)))
    size = int.from_bytes(good[9:13], "little")
    if damage == "size too big":
        good[9:13] = (len(good) + 10).to_bytes(4, "little")
    elif damage == "size too small":
        good[9:13] = (3).to_bytes(4, "little")
    else:
        good[9 + size - 1] = 1
    bad = RawBSONDocument(bytes(good))
    driver = opened(bad, RawBSONDocument(bson.encode(event(2))),
                    RawBSONDocument(bson.encode(event(3))))
    if fast:
        assert driver.machine.next_buffered() is NOT_BUFFERED  # left to the operation
    error = raised(driver.next({"ok": 1}))  # the cursor is killed, the stream fails at once
    assert isinstance(error, ChangeStreamError), error
    assert driver.names()[-1] == "killCursors"
    assert not driver.machine.alive
    assert driver.machine.resume_token is None
