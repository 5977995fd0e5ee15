"""A first load's small files merged on a worker thread while the load goes on.

A first load commits one small base file per save (``mirror --batch``) and,
once 16 of them sit side by side, rewrites them into one file
(``_delta_layout.merge_small``): every document is written twice. Done in
line, the merge stopped the load for as long as the next 16 saves'
conversion took; here it runs beside it, on its own ``DeltaTable`` object,
so the Rust writer uses the core that the load's Python leaves idle.

The merge changes no logical content and commits on its own (retried when
it conflicts with the load's appends), so a crash at any point loses
nothing: the small files are simply merged by a later run. One merge runs
at a time; :meth:`SmallFileMerger.wait` joins it, and is called before
anything that needs the table's files settled (compaction, a change batch,
:meth:`~changestream.delta.DeltaSink.finish`).

A pass starts only once ``every`` commits landed since the last one (a run needs
that many small files side by side): a pass reads the table's state, whose cost
grows with its log, so one per commit made each commit of a 10M-document load
dearer (1,000 commits) while it found nothing to merge nine times in ten.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from deltalake import DeltaTable

from ._delta_layout import REOPEN_EVERY, Compaction

__all__ = ["SmallFileMerger", "ThreadTable"]

_log = logging.getLogger("changestream.delta")


class SmallFileMerger:
    """Runs ``merge`` (one pass of small-file merging; ``None``: nothing merged) on a thread,
    pass after pass until nothing is due."""

    def __init__(self, merge: Callable[[], Compaction | None],
                 done: Callable[[Compaction], None], every: int = 1) -> None:
        self._merge = merge
        self._done = done
        self._every = every
        self._pending = 0
        """Commits since the last pass started."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: concurrent.futures.Future[list[Compaction]] | None = None

    def after_commit(self) -> None:
        """A first-load commit landed: start a merge once ``every`` did, unless one is running."""
        self._pending += 1
        if self._running is not None:
            if not self._running.done():
                return
            self._collect()
        if self._pending < self._every:
            return
        self._pending = 0
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="changestream-delta-merge")
        self._running = self._pool.submit(self._passes)

    def _passes(self) -> list[Compaction]:
        """Merge passes until nothing is due (files the load committed during a pass are
        merged by the next one, so the merges never fall behind the load)."""
        done: list[Compaction] = []
        while (result := self._merge()) is not None:
            done.append(result)
        return done

    def wait(self) -> None:
        """Join the running merge (its failure is logged: the small files stay, and are
        merged by a later pass)."""
        if self._running is not None:
            concurrent.futures.wait([self._running])
            self._collect()

    def close(self) -> None:
        """Join the running merge and end the thread."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _collect(self) -> None:
        assert self._running is not None
        future, self._running = self._running, None
        error = future.exception()
        if error is not None:
            self._pending = self._every  # the next commit tries again
            _log.warning("merging a first load's small files failed (they stay as they are "
                         "and are merged later): %s", error)
            return
        for result in future.result():
            self._done(result)


class ThreadTable:
    """One thread's own object of the table at ``path``: brought up to date at each :meth:`get`
    (cheaper than opening it, which reads the log's listing) and opened anew past
    ``REOPEN_EVERY`` versions (from the newest checkpoint), as the sink's own."""

    def __init__(self, path: str, storage_options: dict[str, str] | None) -> None:
        self._path, self._options = path, storage_options
        self._table: tuple[DeltaTable, int] | None = None

    def get(self) -> DeltaTable:
        if self._table is not None:
            table, opened_at = self._table
            table.update_incremental()
            if table.version() - opened_at < REOPEN_EVERY:
                return table
        table = DeltaTable(self._path, storage_options=self._options)
        self._table = (table, table.version())
        return table

    def drop(self) -> None:
        """After a failure: the next :meth:`get` opens the table anew."""
        self._table = None
