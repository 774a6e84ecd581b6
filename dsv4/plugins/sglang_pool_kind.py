"""Which SGLang DeepSeekV4TokenToKVPool this project writes in place: a plain paged V4 pool.

Shared by the SWA setter hooks (`sglang.py`), which leave any other pool to SGLang's own
setters, and by the monokernel's view of the pool (`sglang_mono_pool.py`), which refuses it.
"""

from __future__ import annotations


def not_plain_v4_pool(pool) -> str | None:
    """Why `pool` is not a plain paged V4 pool, whose SWA rows our kernels write as SGLang
    lays them out (else SGLang's own setters stay, and the monokernel refuses it), or None."""
    if getattr(pool, "request_window", None) is not None:
        return "its SWA KV lives in a request window"
    if getattr(pool, "uniform_fp8", False):
        return "it keeps uniform FP8 pages (--dsv4-attn-backend trtllm)"
    if getattr(pool, "_unified_kv", False) or getattr(pool, "unified_kv_pool", None) is not None:
        return "it uses the unified KV layout"
    layout = getattr(getattr(pool, "kv_layout", None), "value", None)
    if layout != "v4":
        return f"its KV layout is {layout!r}, not 'v4'"
    swa = getattr(pool, "swa_kv_pool", None)
    if swa is None:
        return "it has no paged SWA pool"
    if swa.page_size != pool.swa_page_size:
        return (f"its physical SWA page size {swa.page_size} differs from the logical "
                f"{pool.swa_page_size}")
    return None
