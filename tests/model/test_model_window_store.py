"""The window KV store is called like the other stores: the layer calls the hip_kernels op on the
pool's SWA buffer, so the store reaches its kernel in at most four Python frames (the layer's
store method -> the public hip_kernels function -> the dispatcher's implementation -> the
backend's kernel), with no pool method in between."""

import sys

import pytest

from dsv4.engine import Engine
from dsv4.options import Options
from dsv4.paged_attention import PagedAttention
from hip_kernels import set_kv_ref
from hip_kernels.options import KernelOptions
from tiny_model import tiny_model

MAX_FRAMES = 4


def frames_to_backend(engine, backend_fn) -> list[int]:
    """For every call of backend_fn (a torch-backend kernel) during one generate(): the Python
    frames from the layer's store method down to it, both included."""
    layer_code, target = PagedAttention.project_q_store_kv.__code__, backend_fn.__code__
    depths = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code is not target:
            return
        n, f = 1, frame.f_back
        while f is not None and f.f_code is not layer_code:
            n, f = n + 1, f.f_back
        depths.append(n if f is not None else None)

    sys.setprofile(profile)
    try:
        engine.generate([[3, 1, 4, 1, 5]], 2)
    finally:
        sys.setprofile(None)
    return depths


@pytest.mark.parametrize("fused", [False, True], ids=["slots", "fused-translate"])
def test_the_window_store_reaches_its_kernel_in_four_frames(fused):
    model = tiny_model(max_seq_len=64, seed=1)
    options = Options(kernel=KernelOptions(backend="torch"), fused_swa_translate=fused)
    engine = Engine(model, max_batch=1, max_context_len=64, graph=False, options=options)
    backend_fn = (set_kv_ref.fused_translate_norm_rope_store if fused
                  else set_kv_ref.fused_k_norm_rope_store)
    depths = frames_to_backend(engine, backend_fn)
    assert len(depths) == 2 * model.config.n_layers          # one store per layer per step
    assert None not in depths, "a window store did not come from the layer's store method"
    assert max(depths) <= MAX_FRAMES, f"frames from the layer to the kernel: {sorted(set(depths))}"
