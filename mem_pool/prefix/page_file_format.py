"""The on-disk form of one cached page: a fixed header, then the payload (safetensors bytes).

Header (little-endian, 52 bytes): magic b"DSV4PAGE", format version (u32), payload length
(u64), SHA-256 of the payload (32 bytes). A reader accepts a file only when all four agree
with what it read, so a truncated, torn or bit-flipped file is refused, never half-used.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"DSV4PAGE"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")
HEADER_BYTES = _HEADER.size


class PageFileError(ValueError):
    """A page file that is not a complete, intact page of this format."""


def page_file_header(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())


def page_file_payload(data: bytes) -> bytes:
    """The payload of a whole page file's bytes; raises PageFileError saying what is wrong."""
    if len(data) < HEADER_BYTES:
        raise PageFileError(f"{len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PageFileError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise PageFileError(f"format version {version}, this reader knows {FORMAT_VERSION}")
    payload = data[HEADER_BYTES:]
    if len(payload) != length:
        raise PageFileError(f"the header gives a {length}-byte payload, the file holds "
                            f"{len(payload)}")
    if hashlib.sha256(payload).digest() != digest:
        raise PageFileError("the payload checksum does not match the header")
    return payload
