"""The ``changestream`` command line: ``watch``, ``serve`` the simulator, ``demo``, ``mirror``.

One module per subcommand (``watch``, ``serve``, ``demo``, ``mirror``), what
``watch`` and ``mirror`` share in ``common``, the status line in ``progress``.
This module only dispatches. It imports nothing heavy itself (nor does
``import changestream``): PyMongo and the subcommand are imported when ``main``
runs, so a Ctrl-C before the subcommand is ready for it (while it is imported,
its arguments are read or its client is made) ends the program quietly,
interrupted (130).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

__all__ = ["main"]

INTERRUPTED = 130
"""The exit status of a command interrupted by Ctrl-C before it began (128 + SIGINT)."""


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    exits = argv is None  # the program itself (not a test calling main()): exiting after this
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv), exits=exits)
    except KeyboardInterrupt:
        # Before a subcommand installed its own handling (each one that runs until
        # stopped turns a Ctrl-C into a clean stop, exit 0): nothing began, nothing to say.
        if exits:
            _die_of_sigint()
        return INTERRUPTED
    finally:
        if exits:
            _quiet_exit()


def _dispatch(arguments: list[str], *, exits: bool) -> int:
    command = arguments[:1]
    if command == ["serve"]:
        from . import serve

        return serve.main(arguments[1:])
    if command == ["demo"]:
        from . import demo

        return demo.main(arguments[1:])
    if command == ["mirror"]:
        from . import mirror

        return mirror.main(arguments[1:])
    from . import watch

    parser = _parser(watch.add_parser)
    args = parser.parse_args(arguments)
    return watch.run(parser, args, exits=exits)


def _parser(add_watch: Callable[[Any], None]) -> argparse.ArgumentParser:
    """The top level: ``--version`` and the subcommands (``watch`` adds its own options)."""
    from .common import Parser, version

    parser = Parser(
        prog="changestream", description="MongoDB change streams from the command line."
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_watch(sub)
    sub.add_parser(
        "serve", add_help=False,
        help="run the replica-set simulator (see 'changestream serve --help')",
    )
    sub.add_parser("demo", add_help=False, help="a failover demo on the simulator, in seconds")
    sub.add_parser(
        "mirror", add_help=False,
        help="keep a Delta Lake table equal to a collection (see 'changestream mirror --help')",
    )
    return parser


def _die_of_sigint() -> None:
    """End as a program killed by SIGINT ends (the shell shows 130), without a traceback."""
    with contextlib.suppress(ValueError, OSError):  # not the main thread
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)


def _quiet_exit() -> None:
    """A Ctrl-C or SIGTERM while the interpreter shuts down ends it without a traceback."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            signal.signal(signum, signal.SIG_DFL)
