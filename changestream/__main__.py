"""``python -m changestream ...``: the ``changestream`` command line (:mod:`changestream._cli`)."""

from __future__ import annotations

from ._cli import main

raise SystemExit(main())
