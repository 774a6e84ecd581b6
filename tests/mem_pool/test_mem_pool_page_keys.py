"""Chained page keys: shared full pages give shared keys, and nothing else does."""

import hashlib
import struct

import pytest
import torch

from mem_pool import page_keys
from mem_pool.prefix.page_keys import root_key


def chain_by_hand(ids, page_size, namespace=""):
    """The definition: key_i = sha256(key_{i-1} bytes + page tokens as little-endian int64)."""
    prev, keys = root_key(page_size, namespace), []
    for start in range(0, len(ids) // page_size * page_size, page_size):
        page = b"".join(struct.pack("<q", t) for t in ids[start:start + page_size])
        prev = hashlib.sha256(prev + page).digest()
        keys.append(prev.hex())
    return keys


def test_one_key_per_full_page_and_the_definition():
    ids = list(range(100, 111))                       # 11 tokens: 2 full pages of 4, 3 left
    keys = page_keys(ids, 4)
    assert len(keys) == 2
    assert keys == chain_by_hand(ids, 4)
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in keys)
    assert page_keys(ids[:3], 4) == []


def test_prompts_sharing_k_full_pages_share_exactly_k_keys():
    a = [7] * 8 + [1, 2, 3, 4] + [9] * 8 + [5]
    b = [7] * 8 + [1, 2, 3, 4] + [9] * 7 + [6] + [5, 5]   # differs at token 19 (page 4)
    ka, kb = page_keys(a, 4), page_keys(b, 4)
    assert len(ka) == len(kb) == 5
    assert ka[:4] == kb[:4] and ka[4] != kb[4]


def test_a_change_in_page_zero_changes_every_later_key():
    a = list(range(16))
    b = a.copy()
    b[3] = 999                                        # last token of page 0
    ka, kb = page_keys(a, 4), page_keys(b, 4)
    assert all(x != y for x, y in zip(ka, kb))
    # the pages after page 0 hold the same tokens: only the chaining makes their keys differ
    assert a[4:] == b[4:]


def test_tensor_input_namespace_and_page_size():
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert page_keys(torch.tensor(ids), 4) == page_keys(ids, 4)
    assert page_keys(torch.tensor(ids, dtype=torch.int32), 4) == page_keys(ids, 4)
    assert page_keys(ids, 4, namespace="model-a") != page_keys(ids, 4, namespace="model-b")
    assert page_keys(ids, 4, namespace="m") == chain_by_hand(ids, 4, "m")
    assert page_keys(ids, 8)[0] not in page_keys(ids, 4)
    assert page_keys(ids, 2)[1] != page_keys(ids, 4)[0]   # same tokens, other page size


@pytest.mark.parametrize("ids, page_size, error", [
    ([1, 2], 0, ValueError), ([1, 2], True, ValueError), ([1.0, 2], 1, TypeError),
    ([2 ** 63], 1, ValueError), (torch.ones(2, 2, dtype=torch.int64), 1, ValueError),
    (torch.ones(4), 1, ValueError)])
def test_bad_input_raises(ids, page_size, error):
    with pytest.raises(error):
        page_keys(ids, page_size)
