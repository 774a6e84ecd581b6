"""The file tier of the prefix KV cache: one file per page, named by the page key.

Writes survive a crash at any point: the page goes to a temporary file in the same directory,
is flushed and fsynced, renamed over the final name (os.replace, atomic), and the directory is
fsynced, so a final name holds either nothing or a whole page. Files carry a header with a
checksum (page_file_format.py); a file that fails it (corrupt, truncated, torn by something
other than this writer) is a miss: logged once at WARNING with its name, removed, never
returned. Temporary files (`.<key>.<random>.tmp`) are never read, and those a crashed writer
left are removed when a store opens the directory.

A directory belongs to one store at a time: opening removes every temporary file in it and
indexes the pages there, and a store reads only pages it indexed (at open or by its puts). With
`capacity_pages`, a put into a full store removes the least recently used page first; the
order of the pages already on disk at open is their modification time. Not thread-safe.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path

import safetensors

from .page_file_format import PageFileError, page_file_header, page_file_payload
from .page_record import PageRecord, record_from_bytes, record_to_bytes

logger = logging.getLogger(__name__)

PAGE_SUFFIX = ".page"
TEMP_SUFFIX = ".tmp"
_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")


def check_key(key: str) -> str:
    """Keys become file names: letters, digits, '_' and '-' only (page_keys gives hex)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"page key {key!r} must be 1..128 letters, digits, '_' or '-'")
    return key


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilePageStore:
    def __init__(self, directory: str | os.PathLike, capacity_pages: int | None = None):
        if capacity_pages is not None and (isinstance(capacity_pages, bool) or not isinstance(
                capacity_pages, int) or capacity_pages < 1):
            raise ValueError(f"capacity_pages must be None or a positive int, got "
                             f"{capacity_pages!r}")
        self.directory = Path(directory)
        self.capacity_pages = capacity_pages
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_temporary_files()
        pages = sorted(self.directory.glob("*" + PAGE_SUFFIX), key=lambda p: p.stat().st_mtime)
        self._keys: OrderedDict[str, None] = OrderedDict(
            (p.name[:-len(PAGE_SUFFIX)], None) for p in pages
            if _KEY.fullmatch(p.name[:-len(PAGE_SUFFIX)]))
        while capacity_pages is not None and len(self._keys) > capacity_pages:
            self.evict(next(iter(self._keys)))

    def _remove_temporary_files(self) -> None:
        leftovers = list(self.directory.glob(".*" + TEMP_SUFFIX))
        for path in leftovers:
            path.unlink(missing_ok=True)
        if leftovers:
            logger.info("removed %d temporary page files left by an interrupted writer in %s",
                        len(leftovers), self.directory)

    # ---- sizes ----------------------------------------------------------------------------

    def used_pages(self) -> int:
        return len(self._keys)

    def free_pages(self) -> int | None:
        """Pages that fit before a put evicts; None when the store has no capacity limit."""
        return None if self.capacity_pages is None else self.capacity_pages - len(self._keys)

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._keys)

    def path_of(self, key: str) -> Path:
        return self.directory / (check_key(key) + PAGE_SUFFIX)

    # ---- pages ----------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """Whether a file for the page exists (its contents are checked only by `get`)."""
        return check_key(key) in self._keys

    def put(self, key: str, record: PageRecord) -> None:
        final = self.path_of(key)
        if key not in self._keys and self.capacity_pages is not None:
            while len(self._keys) >= self.capacity_pages:
                self.evict(next(iter(self._keys)))
        payload = record_to_bytes(record)
        fd, temp = tempfile.mkstemp(prefix=f".{key}.", suffix=TEMP_SUFFIX, dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(page_file_header(payload))
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, final)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        _fsync_directory(self.directory)
        self._keys[key] = None
        self._keys.move_to_end(key)

    def get(self, key: str) -> PageRecord | None:
        path = self.path_of(key)
        if key not in self._keys:
            return None
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._keys.pop(key, None)
            return None
        try:
            record = record_from_bytes(page_file_payload(data))
        except (PageFileError, safetensors.SafetensorError) as error:
            self._discard_unusable(key, path, str(error))
            return None
        self._keys[key] = None
        self._keys.move_to_end(key)
        return record

    def _discard_unusable(self, key: str, path: Path, reason: str) -> None:
        logger.warning("prefix cache page file %s is unusable (%s): treated as a miss and "
                       "removed", path, reason)
        self._keys.pop(key, None)
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            logger.warning("could not remove unusable page file %s: %s", path, error)

    def evict(self, key: str) -> bool:
        """Remove a page's file (False when the store holds no such page)."""
        path = self.path_of(key)
        if key not in self._keys:
            return False
        del self._keys[key]
        path.unlink(missing_ok=True)
        return True
