"""BSON codec options and message limits shared by every layer (mongod's values).

The server layer encodes replies with :data:`ENCODE_OPTIONS`; change streams
pre-encode events with the same options so a reply can copy their bytes.
"""

from __future__ import annotations

from typing import Any

from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions, DatetimeConversion

MAX_MESSAGE_SIZE = 48_000_000
"""mongod's MaxMessageSizeBytes: the largest message it reads (``hello.maxMessageSizeBytes``)."""

DECODE_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    document_class=dict,
    tz_aware=True,
    datetime_conversion=DatetimeConversion.DATETIME_AUTO,
)
"""How requests are decoded: binaries (UUIDs too) stay :class:`~bson.binary.Binary`
so client documents round-trip byte for byte and re-encode with default options;
out-of-range dates become ``DatetimeMS`` instead of failing."""

ENCODE_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    tz_aware=True, uuid_representation=UuidRepresentation.STANDARD
)
"""How replies are encoded: server-made :class:`uuid.UUID` values (collection
UUIDs, ``lsid``) become subtype-4 binaries, as mongod sends them."""
