"""The sync side, the twin of :mod:`changestream.aio` (internal: users import ``changestream``).

Generated from the asyncio sources by ``python tools/gen_sync.py`` (never edit
these by hand; each one's first line names its source): ``_stream``,
``_snapshot_watch``, ``_consume``, ``_hub`` and ``_stats_timer``. Written by hand,
each beside its async twin: ``_sync_io`` (``aio/_async_io``: the few steps the
twins do differently), ``_workers`` (``ThreadWorkers``; ``aio/_workers``) and
``_api`` (the ``watch()`` entry points and the ``Client`` wrappers; ``aio/_api``).
The public names are re-exported by :mod:`changestream`.
"""
