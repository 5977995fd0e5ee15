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
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from ._delta_layout import Compaction

__all__ = ["SmallFileMerger"]

_log = logging.getLogger("changestream.delta")


class SmallFileMerger:
    """Runs ``merge`` (one pass of small-file merging; ``None``: nothing merged) on a thread,
    pass after pass until nothing is due."""

    def __init__(self, merge: Callable[[], Compaction | None],
                 done: Callable[[Compaction], None]) -> None:
        self._merge = merge
        self._done = done
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: concurrent.futures.Future[list[Compaction]] | None = None

    def after_commit(self) -> None:
        """A first-load commit landed: start a merge unless one is running."""
        if self._running is not None:
            if not self._running.done():
                return
            self._collect()
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
            _log.warning("merging a first load's small files failed (they stay as they are "
                         "and are merged later): %s", error)
            return
        for result in future.result():
            self._done(result)
