"""``python -m changestream ...``: the ``changestream`` command line (the ``changestream`` script runs the same)."""

from __future__ import annotations

from ._cli import main

raise SystemExit(main())
