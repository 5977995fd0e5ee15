"""``python -m changestream.testing serve ...`` (see :mod:`changestream.testing.cli`)."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
