"""Chained keys of a prompt's full pages, for a prefix KV cache.

The key of page i is the SHA-256 of (key of page i-1, the page's token ids), so a key names the
whole prefix up to the end of its page: two prompts share their first k keys exactly when they
share their first k full pages. Page 0 chains from a root digest of the page size and an
optional namespace (a model or cache-layout name, so that caches of different models never
share keys). A partial last page has no key: only whole pages are cached.

Keys are 64-character lowercase hex strings, safe as file names.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import torch

_ROOT_TAG = b"dsv4-prefix-page-keys-v1"
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _token_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.is_complex():
            raise ValueError(f"token_ids must be a 1-D integer tensor, got shape "
                             f"{tuple(token_ids.shape)} and dtype {token_ids.dtype}")
        return token_ids.detach().cpu().tolist()
    ids = list(token_ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token_ids[{i}] must be an int, got {type(t).__name__}")
        if not _INT64_MIN <= t <= _INT64_MAX:
            raise ValueError(f"token_ids[{i}]={t} does not fit in 64 bits")
    return ids


def root_key(page_size: int, namespace: str = "") -> bytes:
    """The digest page 0 chains from."""
    return hashlib.sha256(_ROOT_TAG + struct.pack("<q", page_size) + namespace.encode()).digest()


def page_keys(token_ids: Sequence[int] | torch.Tensor, page_size: int,
              namespace: str = "") -> list[str]:
    """Keys of the full pages of `token_ids`: len(token_ids) // page_size hex strings."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    ids = _token_list(token_ids)
    keys, prev = [], root_key(page_size, namespace)
    page_format = struct.Struct(f"<{page_size}q")
    for start in range(0, len(ids) - page_size + 1, page_size):
        digest = hashlib.sha256(prev + page_format.pack(*ids[start:start + page_size])).digest()
        keys.append(digest.hex())
        prev = digest
    return keys
