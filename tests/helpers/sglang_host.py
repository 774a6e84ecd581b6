"""Helpers for the tests that run the real SGLang (installed by the README's test command).

SGLang 0.5.23 imports a few torchvision names at module load; the real torchvision wheel would
replace this project's torch, so `tests/stubs/` (a torchvision stub, named as such) goes on the
import path, after the real packages, of this process and of the subprocesses these tests start.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

STUBS = str(Path(__file__).resolve().parents[1] / "stubs")


def _real_torchvision() -> bool:
    spec = importlib.util.find_spec("torchvision")
    return spec is not None and not (spec.origin or "").startswith(STUBS)


def stub_path_env() -> dict:
    """os.environ for a subprocess that imports SGLang, with the stubs on PYTHONPATH."""
    env = dict(os.environ)
    if not _real_torchvision():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), STUBS) if p)
    return env


def use_stubs() -> None:
    if not _real_torchvision() and STUBS not in sys.path:
        sys.path.append(STUBS)


def install_cpu_context() -> None:
    """SGLang's runtime context for a CPU process (its pool reads it at construction)."""
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(device="cpu").install()


def make_pool(swa_pages: int = 2, page_size: int = 256, layers=(0, 4, 128),
              full_tokens: int | None = None, max_num_reqs: int = 4):
    """A real DeepSeekV4TokenToKVPool on the CPU (SGLang reserves one more SWA page). With
    full_tokens, sized as SGLang's pool configurator sizes one for that many full tokens (C4 and
    C128 rows full_tokens // 4 and // 128, a C4 state ring of 8 rows per SWA page, C128 state
    rings per request slot); else a few pages of each."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    if full_tokens is None:
        sizes = dict(c4_size=page_size, c128_size=8, c4_state_pool_size=64,
                     c128_state_pool_size=512)
    else:
        sizes = dict(c4_size=full_tokens // 4, c128_size=full_tokens // 128,
                     c4_state_pool_size=swa_pages * 8, c128_state_pool_size=0)
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=max_num_reqs, swa_size=swa_pages * page_size, **sizes, page_size=page_size,
        swa_page_size=page_size, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=len(layers), device="cpu", enable_memory_saver=False,
        compression_ratios=list(layers))


def tp_ranks(rank: int = 0, size: int = 1):
    """Stand-in for SGLang's tensor-parallel group (it needs launched ranks): `size` ranks, this
    process `rank`, with the sizes SGLang checks it against; a context manager."""
    import types

    from sglang.srt.runtime_context import get_parallel

    group = types.SimpleNamespace(world_size=size, rank_in_group=rank, device_group=None,
                                  cpu_group=None)
    return get_parallel().override(tp_group=group, tp_size=size, tp_rank=rank,
                                   attn_tp_size=size, attn_tp_rank=rank, moe_tp_size=size,
                                   moe_tp_rank=rank)
