"""The one rule for which of a request's pages have left the sliding window."""

from __future__ import annotations


def pages_out_of_window(seq_len: int, window: int, page_size: int) -> int:
    """How many of a request's pages lie wholly before its sliding window: pages 0..n-1.

    A request of `seq_len` tokens attends, from its next token on, to positions at or after
    `seq_len - window` only. Its pages 0..n-1, n = max(0, seq_len - window) // page_size,
    hold positions 0..n * page_size - 1, all before that: their SWA rows are never read again,
    so their SWA pages are freed (and never loaded or preallocated). Page n, partly in the
    window or not, keeps its SWA page. n never shrinks as seq_len grows.
    """
    for name, value, low in (("seq_len", seq_len, 0), ("window", window, 1),
                             ("page_size", page_size, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    return max(0, seq_len - window) // page_size
