"""Resume tokens: one internal type, :class:`ResumeToken`, and the public JSON helpers.

A resume token is an opaque document ``{_data: <hex KeyString>[, _typeBits:
BinData(0)]}`` (``_data`` is BinData on 3.6); it must come back to the server
byte-for-byte (including ``_typeBits``). So a :class:`ResumeToken` *is* its
BSON bytes: two tokens are equal when their bytes are, whatever mapping type
(``dict``, ``SON``, ``RawBSONDocument``) carried them. Tokens order by their
``_data`` KeyString bytes, memcmp order, which is the server's order for tokens
of one format version (cluster time first). The cluster time is read from the
KeyString prefix (``0x82`` + 8 bytes of timestamp) without any other knowledge
of the token layout. Stored, a token is Extended JSON, which keeps BSON types.

Users never see a :class:`ResumeToken`: ``stream.resume_token`` and every
token handed to a callback or a store stay the mappings PyMongo gives
(:meth:`ResumeToken.present`), so code written for ``coll.watch()`` keeps
working. Every place that compares, orders, stores or converts tokens goes
through this module (machine, shells, consume, stores, Spark offsets).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from typing import Any

import bson
from bson import json_util
from bson.codec_options import CodecOptions, TypeRegistry
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

from .errors import InvalidResumeTokenError

__all__ = [
    "RAW_ID_PREFIX",
    "ResumeToken",
    "check_resume_token",
    "describe",
    "raw_event_token",
    "raw_token_bytes",
    "raw_token_end",
    "token_cluster_time",
    "token_from_json",
    "token_in_raw_event",
    "token_to_json",
]

_KEYSTRING_TIMESTAMP = 0x82
RAW_ID_PREFIX = b"\x03_id\x00"
"""BSON of an embedded-document field named ``_id``: where a raw event's token starts."""
_RAW_DATA_PREFIX = b"\x02_data\x00"
"""BSON of a string field named ``_data``: how a raw resume token starts (at byte 13)."""
_PLAIN: CodecOptions[dict[str, Any]] = CodecOptions(document_class=dict)
_NO_TYPE_CODECS = TypeRegistry()


class ResumeToken:
    """A resume token by its exact BSON bytes: equality, hash and order on bytes.

    Build one with :meth:`of` (from any mapping), :meth:`from_json` or
    :meth:`from_raw_event`; get the user's mapping back with :meth:`document`
    or :meth:`present`.
    """

    __slots__ = ("_key", "raw")

    raw: bytes
    """The token document's BSON."""
    _key: bytes | None

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._key = None

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def of(cls, token: Mapping[str, Any] | ResumeToken, *, check: bool = True) -> ResumeToken:
        """The token a mapping holds; ``TypeError``/``ValueError`` if it is not a token.

        ``check=False`` skips the ``_data`` check: for comparing whatever a
        server or a user handed over, which only the server may judge.
        """
        if isinstance(token, ResumeToken):
            return token
        if isinstance(token, RawBSONDocument):
            resume = cls(bytes(token.raw))
        elif isinstance(token, Mapping):
            resume = cls(bson.encode(token))
        else:
            raise TypeError(f"token must be a document (mapping), not {type(token).__name__}")
        if check and "_data" not in token:
            raise ValueError(f"not a resume token (no '_data' field): {dict(token)!r:.200}")
        return resume

    @classmethod
    def maybe(cls, token: Mapping[str, Any] | None) -> ResumeToken | None:
        """:meth:`of` without the ``_data`` check, and ``None`` for ``None``: for comparisons."""
        return None if token is None else cls.of(token, check=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> ResumeToken:
        """Parse :meth:`to_json` output; ``ValueError`` if it is not a token."""
        return cls.of(token_from_json(text))

    @staticmethod
    def from_raw_event(raw: bytes | memoryview) -> RawBSONDocument | None:
        """The token of a raw event (``_id`` first, as the server sends it), bytes copied.

        Slicing the token out avoids inflating the event, and the copy keeps the
        token from pinning the whole reply. ``None``: ``_id`` is not the first field.
        """
        return raw_event_token(raw)

    # -- views ------------------------------------------------------------------------------
    def document(self) -> dict[str, Any]:
        """A plain ``dict`` with the same BSON (``_typeBits`` as ``bytes``)."""
        return bson.decode(self.raw, _PLAIN)

    @property
    def data(self) -> str | bytes:
        """``_data``: the hex KeyString (4.0+) or its bytes (3.6)."""
        value: str | bytes = self.document()["_data"]
        return value

    @property
    def key(self) -> bytes:
        """``_data`` as bytes: the memcmp-ordered KeyString (hex that is not hex: its UTF-8)."""
        if self._key is None:
            data = self.data
            if isinstance(data, str):
                try:
                    self._key = bytes.fromhex(data)
                except ValueError:
                    self._key = data.encode()
            elif isinstance(data, bytes):
                self._key = data
            else:
                raise TypeError(f"resume token '_data' is {type(data).__name__}, not str or bytes")
        return self._key

    @property
    def cluster_time(self) -> Timestamp | None:
        """The cluster time the token points at, or ``None`` if it cannot be decoded."""
        try:
            data = self.data
        except (KeyError, TypeError):
            return None
        return _keystring_time(data)

    def to_json(self, *, canonical: bool = False) -> str:
        """Extended JSON (relaxed by default, or canonical); keeps ``_typeBits`` exact."""
        return token_to_json(RawBSONDocument(self.raw), canonical=canonical)

    @staticmethod
    def present(token: Mapping[str, Any] | None, codec: CodecOptions[Any]) -> Any:
        """A token as the user sees it: their document class, never custom-decoded.

        A ``RawBSONDocument`` token keeps its exact bytes (key order,
        ``_typeBits``); the usual ``{_data[, _typeBits]}`` dict is copied
        (a shallow copy of ``str``/``bytes`` values is a deep one), anything
        else goes through its BSON. Per event, use :meth:`presenter` instead.
        """
        return ResumeToken.presenter(codec)(token)

    @staticmethod
    def presenter(codec: CodecOptions[Any]) -> Callable[[Mapping[str, Any] | None], Any]:
        """:meth:`present` with ``codec`` prepared once: consumers call it per event, and
        deriving the token's codec (``with_options``) costs more than decoding the token."""
        if issubclass(codec.document_class, RawBSONDocument):
            decode_as: CodecOptions[Any] | None = None
        else:
            decode_as = codec.with_options(type_registry=_NO_TYPE_CODECS)
        decode = bson.decode

        def present(token: Mapping[str, Any] | None) -> Any:
            if token is None:
                return None
            if isinstance(token, RawBSONDocument):
                return token if decode_as is None else decode(token.raw, decode_as)
            if type(token) is dict:
                for value in token.values():
                    if type(value) is not str and type(value) is not bytes:
                        break
                else:
                    return dict(token)  # 5x cheaper than deepcopy
            return copy.deepcopy(token)

        return present

    # -- comparison -------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, ResumeToken):
            return self.raw == other.raw
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.raw)

    def __lt__(self, other: ResumeToken) -> bool:
        return (self.key, self.raw) < (other.key, other.raw)

    def __le__(self, other: ResumeToken) -> bool:
        return (self.key, self.raw) <= (other.key, other.raw)

    def __gt__(self, other: ResumeToken) -> bool:
        return (self.key, self.raw) > (other.key, other.raw)

    def __ge__(self, other: ResumeToken) -> bool:
        return (self.key, self.raw) >= (other.key, other.raw)

    def __repr__(self) -> str:
        return f"ResumeToken({self.to_json()})"


def raw_event_token(raw: bytes | memoryview) -> RawBSONDocument | None:
    """See :meth:`ResumeToken.from_raw_event`."""
    token = raw_token_bytes(raw)
    return None if token is None else RawBSONDocument(token)


def raw_token_bytes(raw: bytes | memoryview) -> bytes | None:
    """The BSON of a raw event's ``_id`` when it is the first field (a copy), else ``None``."""
    end = raw_token_end(raw)
    return bytes(raw[9:end]) if end else None


def token_in_raw_event(raw: bytes | memoryview) -> bool:
    """Whether a raw event's token can be sliced out later, as the server sends it.

    ``_id`` is the first field, a document whose first field is a ``_data``
    string, and its length and terminator are consistent. A stream checks this
    when an event arrives and copies the token (:func:`raw_event_token`) only
    when it is used, so most events never pay for the copy.
    """
    # PyMongo hands large replies' events over as memoryviews: only the head is copied
    head = raw if type(raw) is bytes else bytes(raw[:13 + len(_RAW_DATA_PREFIX)])
    return head.startswith(_RAW_DATA_PREFIX, 13) and raw_token_end(raw) > 0


def raw_token_end(raw: bytes | memoryview) -> int:
    """Where the ``_id`` of a raw event ends when it is the first field and well framed; 0 if not.

    Framed as ``RawBSONDocument`` checks it: at least 5 bytes, inside the event,
    ending with a NUL.
    """
    if raw[4:9] != RAW_ID_PREFIX:
        return 0
    end = 9 + int.from_bytes(raw[9:13], "little")
    return end if 14 <= end < len(raw) and raw[end - 1] == 0 else 0


def token_to_json(token: Mapping[str, Any], *, canonical: bool = False) -> str:
    """Serialise a resume token as Extended JSON (relaxed by default, or canonical).

    Both modes keep ``_typeBits`` as ``{"$binary": ...}`` so
    :func:`token_from_json` restores the exact BSON.
    """
    if isinstance(token, ResumeToken):
        token = RawBSONDocument(token.raw)
    if not isinstance(token, Mapping):
        raise TypeError(f"token must be a document (mapping), not {type(token).__name__}")
    options = json_util.CANONICAL_JSON_OPTIONS if canonical else json_util.RELAXED_JSON_OPTIONS
    return json_util.dumps(token, json_options=options)


def token_from_json(text: str | bytes) -> dict[str, Any]:
    """Parse a token stored with :func:`token_to_json`; raise ``ValueError`` if it is not one."""
    try:
        token = json_util.loads(text)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"not a resume token in Extended JSON: {exc}") from exc
    if not isinstance(token, dict) or "_data" not in token:
        raise ValueError("not a resume token: expected a document with a '_data' field")
    return token


def token_cluster_time(token: Mapping[str, Any]) -> Timestamp | None:
    """The cluster time a token points at, or ``None`` if it cannot be decoded.

    Works for hex-string tokens (4.0+) and BinData tokens (3.6).
    """
    if isinstance(token, ResumeToken):
        return token.cluster_time
    data = token.get("_data") if isinstance(token, Mapping) else None
    return _keystring_time(data)  # read in place: called per batch (lag), no BSON round trip


def _keystring_time(data: Any) -> Timestamp | None:
    """The timestamp a ``_data`` KeyString (hex string or bytes) starts with, if any."""
    try:
        if isinstance(data, str):
            key = bytes.fromhex(data[:18])
        elif isinstance(data, (bytes, bytearray)):
            key = bytes(data[:9])
        else:
            return None
    except ValueError:
        return None
    if len(key) < 9 or key[0] != _KEYSTRING_TIMESTAMP:
        return None
    return Timestamp(int.from_bytes(key[1:5], "big"), int.from_bytes(key[5:9], "big"))


def check_resume_token(value: Any, field: str) -> Mapping[str, Any]:
    """``value`` if it is a resume token (a document whose ``_data`` is a string).

    Otherwise :class:`~changestream.errors.InvalidResumeTokenError` naming
    ``field`` and the value: a token the server could not resume from is
    refused where it arrives, never cached.
    """
    if isinstance(value, Mapping):
        try:
            data = value.get("_data")
        except Exception:  # a RawBSONDocument over invalid bytes
            data = None
        if isinstance(data, str):
            return value
    raise InvalidResumeTokenError(
        f"{field} is not a resume token (a document with a '_data' string): {describe(value)}",
        field=field,
        value=value,
    )


def describe(value: Any, limit: int = 120) -> str:
    """``value`` for an error message: its type and a bounded repr."""
    try:
        text = repr(value)
    except Exception:
        text = "<unprintable>"
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(value).__name__} {text}"
