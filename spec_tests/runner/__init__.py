"""The unified test format runner, scoped to the change-stream spec files.

Modules: :mod:`.loader` (files), :mod:`.requirements` (runOnRequirements),
:mod:`.matcher` (Evaluating Matches), :mod:`.events` (command monitoring),
:mod:`.entities` (entity map), :mod:`.adapter` (the change-stream client
under test), :mod:`.async_bridge` (the event loop and ``AsyncMongoClient``
mirrors of the ``changestream-async`` mode), :mod:`.errors` (expectError),
:mod:`.operations`, :mod:`.executor` (one test), :mod:`.targets` (servers),
:mod:`.matrix` (which test runs where).
"""

from __future__ import annotations


class RunnerError(Exception):
    """The test file needs something this runner lacks or forbids (a loud failure)."""


class SpecFailure(AssertionError):
    """A spec test failed: an assertion did not hold or an operation errored."""


class SpecSkip(Exception):
    """A spec test cannot run here; the message says why."""
