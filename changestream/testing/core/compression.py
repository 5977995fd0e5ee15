"""Wire compression (OP_COMPRESSED) as mongod's ``MessageCompressorManager`` does it.

A member enables a list of compressors (mongod's ``--networkMessageCompressors``,
default ``snappy,zstd,zlib``; the simulator drops those whose Python module is
missing: zlib always works, snappy and zstd need python-snappy / ``zstd``).
``hello`` negotiates from the client's offer; a compressed request is answered
with the same compressor; anything malformed closes the connection. The
per-compressor byte counters are what ``serverStatus().network.compression``
reports.
"""

from __future__ import annotations

import importlib
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bson.int64 import Int64

MONGOD_DEFAULT = ("snappy", "zstd", "zlib")
"""mongod's default ``networkMessageCompressors``."""


class CompressionError(Exception):
    """A compressed message cannot be decompressed (mongod closes the connection)."""


@dataclass(frozen=True, slots=True)
class Codec:
    """One compressor: its wire id and its byte transforms."""

    name: str
    id: int
    compress: Callable[[bytes], bytes]
    decompress: Callable[[bytes, int], bytes]
    """``decompress(data, expected_size)``; may return more or fewer bytes than expected."""


def _zlib_decompress(data: bytes, size: int) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, size + 1)  # one byte more reveals an oversized payload
    except zlib.error as exc:
        raise CompressionError(f"zlib: {exc}") from None
    if not inflater.eof:
        raise CompressionError("zlib: truncated or oversized compressed data")
    return out


def _noop_decompress(data: bytes, size: int) -> bytes:
    return data


def _optional_codec(name: str, ident: int, modules: tuple[str, ...]) -> Codec | None:
    """A codec backed by the first importable module of ``modules`` (pymongo's choices)."""
    for module_name in modules:
        try:
            module: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        inflate = module.uncompress if hasattr(module, "uncompress") else module.decompress

        def decompress(data: bytes, size: int, inflate: Any = inflate) -> bytes:
            try:
                return bytes(inflate(data))
            except Exception as exc:  # each library raises its own error type
                raise CompressionError(f"{name}: {exc}") from None

        def compress(data: bytes, deflate: Any = module.compress) -> bytes:
            return bytes(deflate(data))

        return Codec(name, ident, compress, decompress)
    return None


def _codecs() -> dict[str, Codec]:
    found = [
        Codec("noop", 0, bytes, _noop_decompress),
        Codec("zlib", 2, lambda data: zlib.compress(data, 6), _zlib_decompress),
        _optional_codec("snappy", 1, ("snappy",)),
        _optional_codec("zstd", 3, ("compression.zstd", "backports.zstd")),
    ]
    return {codec.name: codec for codec in found if codec is not None}


CODECS: dict[str, Codec] = _codecs()
"""Every compressor this Python can run, by name."""


def resolve(names: Iterable[str] | str | None) -> tuple[str, ...]:
    """The enabled compressor list: mongod's default (those available), or exactly ``names``.

    ``"disabled"`` (or an empty list) enables none. A named compressor this
    Python cannot run is an error, as an unknown name is for mongod.
    """
    if names is None:
        return tuple(name for name in MONGOD_DEFAULT if name in CODECS)
    if isinstance(names, str):
        names = [] if names == "disabled" else [n for n in names.replace(" ", ",").split(",") if n]
    chosen = tuple(names)
    for name in chosen:
        if name not in CODECS:
            raise ValueError(
                f"Invalid network message compressor specified in configuration: {name} "
                f"(available here: {', '.join(CODECS)})"
            )
    return chosen


class CompressorSet:
    """The compressors one member has enabled, with their byte counters."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self._by_id = {CODECS[name].id: CODECS[name] for name in self.names}
        self._lock = threading.Lock()
        self._counters = {name: [0, 0, 0, 0] for name in self.names}
        """compressor bytesIn/bytesOut, decompressor bytesIn/bytesOut."""

    def negotiate(self, offered: list[str]) -> list[str]:
        """``serverNegotiate``: the offered names this member has enabled, in the client's order."""
        return [name for name in offered if name in self.names]

    def codec(self, ident: int) -> Codec | None:
        return self._by_id.get(ident)

    def compress(self, codec: Codec, data: bytes) -> bytes:
        out = codec.compress(data)
        self._count(codec.name, 0, len(data), len(out))
        return out

    def decompress(self, ident: int, data: bytes, size: int) -> tuple[Codec, bytes]:
        """Decompress a message body; CompressionError if the id or the data is bad."""
        codec = self._by_id.get(ident)
        if codec is None:
            raise CompressionError("Compression algorithm specified in message is not available")
        out = codec.decompress(data, size)
        if len(out) != size:
            raise CompressionError("Decompressing message returned less data than expected")
        self._count(codec.name, 2, len(data), len(out))
        return codec, out

    def _count(self, name: str, slot: int, bytes_in: int, bytes_out: int) -> None:
        with self._lock:
            counters = self._counters[name]
            counters[slot] += bytes_in
            counters[slot + 1] += bytes_out

    def stats(self) -> dict[str, Any]:
        """``serverStatus().network.compression``."""
        with self._lock:
            return {
                name: {
                    "compressor": {"bytesIn": Int64(c[0]), "bytesOut": Int64(c[1])},
                    "decompressor": {"bytesIn": Int64(c[2]), "bytesOut": Int64(c[3])},
                }
                for name, c in self._counters.items()
            }
