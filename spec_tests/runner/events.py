"""Command monitoring for client entities, and the ``expectEvents`` check.

Each observed client gets its own :class:`EventRecorder` (a PyMongo
``CommandListener``). It keeps only the event types the client observes and
drops ``configureFailPoint``, ``ignoreCommandMonitoringEvents`` and
sensitive commands, as the unified format requires.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

from pymongo import monitoring

from . import RunnerError, SpecFailure
from .matcher import EntityLookup, MatchError, match

COMMAND_EVENTS = {
    "commandStartedEvent": monitoring.CommandStartedEvent,
    "commandSucceededEvent": monitoring.CommandSucceededEvent,
    "commandFailedEvent": monitoring.CommandFailedEvent,
}

_SENSITIVE = frozenset(
    {
        "authenticate",
        "saslstart",
        "saslcontinue",
        "getnonce",
        "createuser",
        "updateuser",
        "copydbgetnonce",
        "copydbsaslstart",
        "copydb",
    }
)
_HELLO = frozenset({"hello", "ismaster"})


@dataclass(frozen=True)
class Observed:
    """One recorded event; ``command`` is a copy taken when it was published."""

    kind: str
    event: Any
    command: dict[str, Any] | None


class EventRecorder(monitoring.CommandListener):
    """Collects one client's command events while enabled."""

    def __init__(
        self, observe: list[str], ignore: list[str], observe_sensitive: bool = False
    ) -> None:
        unsupported = [name for name in observe if name not in COMMAND_EVENTS]
        if unsupported:
            raise RunnerError(
                f"observeEvents {unsupported} are not supported (command events only)"
            )
        self._types: tuple[type[Any], ...] = tuple(COMMAND_EVENTS[name] for name in observe)
        self._ignore = set(ignore) | {"configureFailPoint"}
        self._observe_sensitive = observe_sensitive
        self._lock = threading.Lock()
        self.enabled = True
        self.events: list[Observed] = []
        """In the order PyMongo published them."""

    def _keep(self, event: Any) -> bool:
        if not self.enabled or not isinstance(event, self._types):
            return False
        name: str = event.command_name
        if name in self._ignore:
            return False
        if self._observe_sensitive:
            return True
        lowered = name.lower()
        if lowered in _SENSITIVE:
            return False
        if lowered in _HELLO:
            # hello is sensitive when it carries speculativeAuthenticate; PyMongo
            # then redacts it to an empty document.
            body = getattr(event, "command", None) or getattr(event, "reply", None)
            return bool(body)
        return True

    def _record(self, kind: str, event: Any, command: dict[str, Any] | None = None) -> None:
        if self._keep(event):
            with self._lock:
                self.events.append(Observed(kind, event, command))

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        # Copy: the driver may reuse the command document after publishing it.
        self._record("commandStartedEvent", event, copy.deepcopy(dict(event.command)))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self._record("commandSucceededEvent", event)

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._record("commandFailedEvent", event)

    def snapshot(self) -> list[Observed]:
        with self._lock:
            return list(self.events)


def describe(observed: Observed) -> str:
    """One line per event for failure messages."""
    event = observed.event
    text = f"{observed.kind}({event.command_name} on {event.database_name})"
    if observed.command is not None:
        hidden = ("lsid", "$clusterTime", "$db")
        text += f" { ({k: v for k, v in observed.command.items() if k not in hidden}) }"
    return text


def check_expected_events(
    spec: dict[str, Any],
    recorder: EventRecorder,
    entities: EntityLookup,
) -> None:
    """Assert one ``expectedEventsForClient`` entry against what was recorded."""
    unknown = set(spec) - {"client", "eventType", "events", "ignoreExtraEvents"}
    if unknown:
        raise RunnerError(f"unsupported expectEvents keys {sorted(unknown)}")
    event_type = spec.get("eventType", "command")
    if event_type != "command":
        raise RunnerError(f"expectEvents eventType {event_type!r} is not supported (command only)")
    expected = spec["events"]
    actual = recorder.snapshot()
    listing = "\n    ".join(describe(o) for o in actual) or "(none)"
    if spec.get("ignoreExtraEvents", False):
        if len(actual) < len(expected):
            raise SpecFailure(
                f"client {spec['client']}: expected at least {len(expected)} events, "
                f"observed {len(actual)}:\n    {listing}"
            )
        actual = actual[: len(expected)]
    elif len(actual) != len(expected):
        raise SpecFailure(
            f"client {spec['client']}: expected {len(expected)} events, observed {len(actual)}:"
            f"\n    {listing}"
        )
    for index, (exp, observed) in enumerate(zip(expected, actual, strict=True)):
        try:
            _match_event(exp, observed, entities)
        except MatchError as exc:
            raise SpecFailure(
                f"client {spec['client']} event {index}: {exc}\n  observed:\n    {listing}"
            ) from None


def _match_event(expected: dict[str, Any], observed: Observed, entities: EntityLookup) -> None:
    kind, event = observed.kind, observed.event
    if len(expected) != 1:
        raise RunnerError(f"an expected event must have exactly one key, got {sorted(expected)}")
    exp_kind, fields = next(iter(expected.items()))
    if exp_kind not in COMMAND_EVENTS:
        raise RunnerError(f"unsupported expected event {exp_kind}")
    if exp_kind != kind:
        raise MatchError(f"expected {exp_kind}, observed {kind} ({event.command_name})")
    allowed = {"commandName", "databaseName", "hasServiceId", "hasServerConnectionId"}
    allowed |= {"command"} if kind == "commandStartedEvent" else set()
    allowed |= {"reply"} if kind == "commandSucceededEvent" else set()
    unknown = set(fields) - allowed
    if unknown:
        raise RunnerError(f"unsupported {exp_kind} fields {sorted(unknown)}")
    if "commandName" in fields and fields["commandName"] != event.command_name:
        raise MatchError(f"commandName: expected {fields['commandName']}, got {event.command_name}")
    if "databaseName" in fields and fields["databaseName"] != event.database_name:
        raise MatchError(
            f"databaseName: expected {fields['databaseName']}, got {event.database_name} "
            f"({event.command_name})"
        )
    if "command" in fields:
        match(fields["command"], observed.command, root=True, entities=entities, path="command")
    if "reply" in fields:
        match(fields["reply"], event.reply, root=True, entities=entities, path="reply")
    if "hasServiceId" in fields and fields["hasServiceId"] != (event.service_id is not None):
        raise MatchError(f"hasServiceId: expected {fields['hasServiceId']}")
    if "hasServerConnectionId" in fields and fields["hasServerConnectionId"] != (
        event.server_connection_id is not None
    ):
        raise MatchError(f"hasServerConnectionId: expected {fields['hasServerConnectionId']}")
