"""A batch committed on a thread of its own while the stream fetches the next (write-behind).

``consume`` with a :class:`~changestream.delta.DeltaSink` as its store calls
:meth:`~changestream.delta.DeltaSink.save_behind` instead of ``save``: the
batch's conversion, its commit and any compaction after it run here while
the loop fetches and stages the next batch. The sink's next call waits for the
commit, not for a compaction after it: the next batch is converted beside that
compaction and committed after it (``Behind.before_table``), so a rewrite of
base files never holds the stream up at a batch's end. Exactly-once is
unchanged: the token rides in the batch's own
commit, so it is durable exactly when the batch is. A failure is raised by
the sink's next call (``save_behind``, ``save``, ``flush``, ``load``, ...);
the failed batch's changes go back in front of the staged ones (unless its
commit was made and only the compaction after it failed), so a retried save
commits them: nothing is lost, and no token past the failed batch is stored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._delta_recopy import boundary

__all__ = ["Behind", "WriteBehind"]


class Behind:
    """One batch's commit on its own thread (:meth:`start`: once the sink holds it, so the
    commit finds itself as the sink's batch behind)."""

    def __init__(self, staged: Sequence[Mapping[str, Any]],
                 work: Callable[[Behind], None], previous: Behind | None = None) -> None:
        self.staged = list(staged)
        """The batch's changes: staged again if its commit fails."""
        self.committed = False
        """The batch's commit is made (``work`` sets it; a compaction after it may still fail)."""
        self.error: BaseException | None = None
        self.previous = previous
        """The batch before, its compaction still under way: this commit waits for it."""
        self._made = threading.Event()  # the commit is made, or the job is over
        self._thread = threading.Thread(target=self._run, args=(work,),
                                        name="changestream-delta-commit")

    def start(self) -> None:
        self._thread.start()

    def _run(self, work: Callable[[Behind], None]) -> None:
        try:
            work(self)
        except BaseException as exc:  # raised on the caller's thread, by its next call
            self.error = exc
        finally:
            self._made.set()

    def made(self) -> None:
        """The batch's commit is made (its thread goes on with a compaction, maybe)."""
        self.committed = True
        self.staged = []  # (never staged again: not kept while the next batch converts)
        self._made.set()

    def before_table(self) -> None:
        """Before the caller reads the table (:meth:`WriteBehind._wait_behind`): on this
        job's thread, until the batch before is over (its failure, a compaction's, raised
        as this batch's: not committed, staged again); on another, until this job is over."""
        previous = self.previous
        if threading.current_thread() is not self._thread:
            self.wait()
        elif previous is not None:
            previous.wait()
            self.previous = None  # (no chain of batches kept)
            if previous.error is not None:
                raise previous.error

    @property
    def mine(self) -> bool:
        """Is the caller this job's thread or the one before's (a commit or a compaction
        reading the table it writes)?"""
        current = threading.current_thread()
        previous = self.previous
        return current is self._thread or (previous is not None and previous.mine)

    def wait_made(self) -> None:
        """Until the commit is made or the job is over (never on its own thread)."""
        self._made.wait()

    def wait(self) -> None:
        """Until the job and the one before are over (at once on either's thread)."""
        if not self.mine:
            previous = self.previous
            self._thread.join()
            if previous is not None:  # (a job that failed before it waited for it)
                previous.wait()

    @property
    def running(self) -> bool:
        """Is the job's thread still at work (after its commit: a compaction)?"""
        return self._thread.is_alive()


class WriteBehind:
    """:class:`~changestream.delta.DeltaSink`'s write-behind: :meth:`save_behind`, :meth:`flush`."""

    _behind: Behind | None = None
    """The batch :meth:`save_behind` is committing."""
    _filled = False
    """The first batch of changes was cut (at a quarter: :meth:`_bytes_full`)."""
    _awaiting = False
    """The caller waits for the batch behind (its stream has nothing else to run meanwhile)."""
    _settling: threading.Lock
    """Held by the one caller that takes the batch behind over (the sink makes it)."""
    _staged: list[Mapping[str, Any]]
    _staged_table: Any
    commit_metadata: dict[str, str]

    if TYPE_CHECKING:  # the sink's own steps
        def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...
        def _first_load(self, staged: Sequence[Any]) -> bool: ...
        def _maybe_compact(self, table: Any = None, *, waited: bool = False) -> None: ...
        def _commit_changes(self, changes: Sequence[Mapping[str, Any]],
                            token: Mapping[str, Any], batch_id: int | None = None, *,
                            resnapshot: str | None = None,
                            extra: Mapping[str, str] | None = None) -> Any: ...

    def save_behind(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """:meth:`save`, its commit made on a thread of its own while the caller goes on.

        ``consume``'s save (:class:`changestream.stores.BackgroundTokenStore`): the
        batch's conversion, commit and compaction overlap the fetch of the next batch.
        The next call of this sink waits for that commit (not for a compaction after
        it: the next batch is converted meanwhile, and committed after it); a failure
        is raised there (the batch's changes staged again: a retried save commits
        them), and :meth:`flush` waits for it all. The token is durable with its batch, as with
        :meth:`save`. A first load, a re-snapshot's bounds, an idle position and a
        staged table are committed before this returns, as :meth:`save` does.
        """
        previous = self._made_behind()
        staged: list[Any] = self._staged  # stream events staged as Row tuples: no boundaries
        if not staged or self._staged_table is not None or any(
                type(change) is not tuple and boundary(change) for change in staged) \
                or self._first_load(staged):
            self.save(token, batch_id=batch_id)
            return
        metadata = dict(self.commit_metadata)  # as it is now: the caller may change it next

        def work(job: Behind) -> None:
            written = self._commit_changes(job.staged, token, batch_id, extra=metadata)
            waited = self._awaiting  # (read before a caller waiting for the commit goes on)
            job.made()
            if written is not None:  # put off while the stream waits for this batch
                self._maybe_compact(written, waited=waited)

        self._staged = []
        self._behind = Behind(staged, work, previous)
        self._behind.start()

    def _bytes_full(self, limit: int | None, staged: int, records: int) -> bool:
        """Whether ``staged`` bytes fill a batch of ``limit`` (``None``: no bound). The first
        batch of changes is cut at a quarter, so its commit starts while the stream fills the
        next: its conversion would otherwise wait a whole batch, a core idle meanwhile (the
        stream and its server take turns). ``records``: snapshot records staged (a first
        load's commits hold a base file each, whatever their bytes)."""
        if limit is None:
            return False
        if self._filled or records:
            return staged >= limit
        self._filled = staged >= limit // 4
        return self._filled

    def _made_behind(self) -> Behind | None:
        """Until the commit behind is made; the job if it goes on (a compaction). A job that
        failed before its commit is settled: its failure raised, its changes staged again."""
        job = self._behind
        if job is None or job.mine:
            return None
        with self._settling:
            self._awaiting = True
            try:
                job.wait_made()
            finally:
                self._awaiting = False
        if not job.committed or not job.running:
            self._settle()
            return None
        return job

    def flush(self) -> None:
        """Wait for the commit :meth:`save_behind` left under way; raise its failure."""
        self._settle()

    def _settle(self) -> None:
        """Wait for the batch committed behind; its failure raised here, its changes staged
        again in front of the newer ones (unless only the compaction after it failed)."""
        job = self._behind
        if job is None or job.mine:
            return
        # one caller at a time takes the job over (another thread calling load(), say); the
        # job stays this sink's until it is over, so no second commit starts meanwhile
        with self._settling:
            job = self._behind
            if job is None:
                return
            self._awaiting = True
            try:
                job.wait()
            finally:
                self._awaiting = False
            if self._behind is job:  # (not one the stream started meanwhile)
                self._behind = None
        if job.error is not None:
            if not job.committed:
                self._staged = job.staged + self._staged
            raise job.error

    def _wait_behind(self) -> None:
        """Until the batch committed behind is done, its error left for :meth:`_settle` (on
        its own thread: until the batch before it is done, whose compaction wrote the table)."""
        job = self._behind
        if job is not None:
            job.before_table()

    def _awaited(self) -> bool:
        """Whether the commit under way holds up its caller, so it may use the caller's core:
        a commit on the caller's own thread (:meth:`save`) always does, one behind only while
        a caller waits for it."""
        job = self._behind
        return job is None or not job.mine or self._awaiting
