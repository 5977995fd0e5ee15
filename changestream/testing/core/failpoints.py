"""mongod's test failpoints: ``failCommand``, ``failGetMoreAfterCursorCheckout`` and
``onPrimaryTransactionalWrite``.

One :class:`FailPointRegistry` per member holds each failpoint's mode, data
and ``timesEntered`` counter with mongod's semantics (``fail_point.cpp``):
the activation predicate is evaluated first, and only a pass where it matched
consumes ``{times: n}`` / ``{skip: n}`` and counts as entered.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from .errors import CommandError

FAIL_COMMAND = "failCommand"
FAIL_GET_MORE_AFTER_CHECKOUT = "failGetMoreAfterCursorCheckout"
ON_PRIMARY_TRANSACTIONAL_WRITE = "onPrimaryTransactionalWrite"
MAX_TIME_ALWAYS_TIME_OUT = "maxTimeAlwaysTimeOut"
KNOWN_FAILPOINTS = (
    FAIL_COMMAND,
    FAIL_GET_MORE_AFTER_CHECKOUT,
    ON_PRIMARY_TRANSACTIONAL_WRITE,
    MAX_TIME_ALWAYS_TIME_OUT,
)

_MODE_SHAPES = "'mode' must be one of 'off', 'alwaysOn', '{times:n}', '{skip:n}' or '{activationProbability:p}'"


@dataclass(slots=True)
class _FailPoint:
    mode: str = "off"
    """``off``, ``alwaysOn``, ``times``, ``skip`` or ``activationProbability``."""
    value: float = 0
    """Remaining times / skips, or the probability."""
    data: dict[str, Any] = field(default_factory=dict)
    times_entered: int = 0


@dataclass(frozen=True, slots=True)
class CommandTarget:
    """What failCommand's filters look at for one command invocation."""

    names: Collection[str]
    """The command's canonical name and aliases."""
    ns: str
    app_name: str | None


@dataclass(frozen=True, slots=True)
class FailCommandAction:
    """What a fired failCommand asks the dispatcher to do, in this order."""

    close_connection: bool
    block_ms: float | None
    error: CommandError | None


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_mode(mode: Any) -> tuple[str, float]:
    """mongod's ``FailPoint::parseBSON`` for the ``mode`` field."""
    if mode is None:
        raise CommandError(20, "When setting a failpoint, you must supply a 'mode'")
    if isinstance(mode, str):
        if mode in ("off", "alwaysOn"):
            return mode, 0
        raise CommandError(2, f"unknown mode: {mode}")
    if not isinstance(mode, dict):
        raise CommandError(14, "'mode' must be a string or JSON object")
    if "times" in mode or "skip" in mode:
        key = "times" if "times" in mode else "skip"
        n = mode[key]
        if not _is_number(n):
            raise CommandError(2, f"'{key}' option to 'mode' must be a number")
        if n < 0:
            raise CommandError(2, f"'{key}' option to 'mode' must be positive")
        return key, int(n)
    if "activationProbability" in mode:
        p = mode["activationProbability"]
        if not _is_number(p):
            raise CommandError(14, "'activationProbability' option to 'mode' must be a double")
        if not 0 <= p <= 1:
            raise CommandError(
                2, "'activationProbability' option to 'mode' must be between 0 and 1"
            )
        return "activationProbability", float(p)
    raise CommandError(2, _MODE_SHAPES)


def _matches(
    data: dict[str, Any], target: CommandTarget, implied_commands: Collection[str] | None
) -> bool:
    """``CommandHelpers::shouldActivateFailCommandFailPoint``."""
    if "configureFailPoint" in target.names:
        return False
    wanted = implied_commands if implied_commands is not None else data.get("failCommands", [])
    if not isinstance(wanted, list | tuple) or not any(n in target.names for n in wanted):
        return False
    if "appName" in data and data["appName"] != target.app_name:
        return False
    return not ("namespace" in data and data["namespace"] != target.ns)


class FailPointRegistry:
    """The failpoints of one member, configured with ``configureFailPoint``."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._cond = threading.Condition()
        self._points = {name: _FailPoint() for name in KNOWN_FAILPOINTS}
        self._rng = rng or random.Random()

    def configure(self, name: str, mode: Any, data: Any = None) -> int:
        """Set a failpoint's mode and data; return ``timesEntered`` before the change."""
        if name not in self._points:
            raise CommandError(266, f"{name} not found")
        parsed_mode, value = _parse_mode(mode)
        if data is not None and not isinstance(data, dict):
            raise CommandError(14, "the 'data' field must be a JSON object")
        with self._cond:
            point = self._points[name]
            count = point.times_entered
            if parsed_mode == "times" and value == 0:
                parsed_mode = "off"
            point.mode, point.value, point.data = parsed_mode, value, dict(data or {})
            return count

    def times_entered(self, name: str) -> int:
        with self._cond:
            return self._points[name].times_entered

    def wait_for(self, name: str, times_entered: int, timeout: float) -> bool:
        """Wait until ``name`` was entered ``times_entered`` times in all; False on timeout."""
        if name not in self._points:
            raise CommandError(266, f"{name} not found")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._points[name].times_entered < times_entered:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def reset(self) -> None:
        """Turn every failpoint off (a restarted mongod starts without them)."""
        with self._cond:
            for point in self._points.values():
                point.mode, point.value, point.data = "off", 0, {}

    def _evaluate(
        self, name: str, predicate: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any] | None:
        """The failpoint's data if it fires now (``FailPoint::shouldFail``), else None."""
        with self._cond:
            point = self._points[name]
            if point.mode == "off" or not predicate(point.data):
                return None
            if point.mode == "times":
                point.value -= 1
                if point.value <= 0:
                    point.mode = "off"
            elif point.mode == "skip":
                if point.value > 0:
                    point.value -= 1
                    return None
            elif point.mode == "activationProbability" and self._rng.random() >= point.value:
                return None
            point.times_entered += 1
            self._cond.notify_all()
            return point.data

    # -- failCommand -------------------------------------------------------------------------
    def fail_command(self, target: CommandTarget) -> FailCommandAction | None:
        """Evaluate failCommand before a command runs (``evaluateFailCommandFailPoint``)."""
        data = self._evaluate(
            FAIL_COMMAND,
            lambda d: (
                _matches(d, target, None)
                and bool(
                    d.get("closeConnection")
                    or d.get("blockConnection")
                    or _is_number(d.get("errorCode"))
                )
            ),
        )
        if data is None:
            return None
        if data.get("closeConnection"):
            return FailCommandAction(True, None, None)
        block_ms: float | None = None
        if data.get("blockConnection"):
            block = data.get("blockTimeMS")
            if not _is_number(block):
                missing = "must specify 'blockTimeMS' when 'blockConnection' is true"
                return FailCommandAction(False, None, CommandError(72, missing))
            if block < 0:
                negative = "'blockTimeMS' must be non-negative"
                return FailCommandAction(False, None, CommandError(72, negative))
            block_ms = float(block)
        error: CommandError | None = None
        if _is_number(data.get("errorCode")):
            extra = data.get("errorExtraInfo")
            error = CommandError(
                int(data["errorCode"]),
                "Failing command via 'failCommand' failpoint",
                labels=_labels(data),
                extra=dict(extra) if isinstance(extra, dict) else None,
            )
        return FailCommandAction(False, block_ms, error)

    def write_concern_error(
        self, target: CommandTarget
    ) -> tuple[dict[str, Any], list[str] | None] | None:
        """failCommand's ``writeConcernError`` (and labels) to append to a successful reply."""
        data = self._evaluate(
            FAIL_COMMAND,
            lambda d: _matches(d, target, None) and isinstance(d.get("writeConcernError"), dict),
        )
        if data is None:
            return None
        return dict(data["writeConcernError"]), _labels(data)

    # -- failGetMoreAfterCursorCheckout ------------------------------------------------------
    def fail_get_more_after_checkout(self, target: CommandTarget) -> None:
        """Raise the failpoint's error inside getMore, after the cursor was pinned."""
        data = self._evaluate(
            FAIL_GET_MORE_AFTER_CHECKOUT, lambda d: _matches(d, target, ("getMore",))
        )
        if data is not None:
            code = data.get("errorCode", 1)
            raise CommandError(
                int(code) if _is_number(code) else 1,
                "Hit the 'failGetMoreAfterCursorCheckout' failpoint",
            )

    # -- onPrimaryTransactionalWrite ---------------------------------------------------------
    def on_primary_transactional_write(self) -> dict[str, Any] | None:
        """The failpoint's data when it fires for a retryable write's commit, else None."""
        return self._evaluate(ON_PRIMARY_TRANSACTIONAL_WRITE, lambda d: True)

    # -- maxTimeAlwaysTimeOut ----------------------------------------------------------------
    def check_max_time(self, has_time_limit: bool) -> None:
        """MaxTimeMSExpired (50) for an operation with a time limit while the failpoint is on.

        mongod's ``OperationContext::checkForInterrupt`` fails every operation that has a
        deadline (``maxTimeMS``, or a cursor's leftover one on getMore) this way.
        """
        if has_time_limit and self._evaluate(MAX_TIME_ALWAYS_TIME_OUT, lambda d: True) is not None:
            raise CommandError(50, "operation exceeded time limit")


def _labels(data: dict[str, Any]) -> list[str] | None:
    """failCommand's ``errorLabels``: exactly these labels (None: let the server compute)."""
    labels = data.get("errorLabels")
    return [str(label) for label in labels] if isinstance(labels, list) else None
