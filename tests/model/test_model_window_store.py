"""The window KV store is called like the other stores: the layer calls the hip_kernels op on the
pool's SWA buffer, and the op's overload of the backend that runs it is that backend's function
itself. So a window store reaches its kernel in at most six of our Python frames (files under
hip_kernels/, mem_pool/ and dsv4/) below the model's forward: the decoder layer's forward,
PagedAttention's __call__, prepare and store method, the public set-KV function, and the
backend's function (the torch reference, or the Triton launcher); two of them in hip_kernels,
none in mem_pool (no pool method in between)."""

import inspect
import os
import sys
from pathlib import Path

import pytest

from dsv4.engine import Engine
from dsv4.model import DeepseekV4Model
from dsv4.options import Options
from hip_kernels import set_kv, set_kv_ref
from hip_kernels.options import KernelOptions
from tiny_model import tiny_model

ROOT = Path(__file__).resolve().parents[2]
OURS = tuple(f"{ROOT / package}{os.sep}" for package in ("hip_kernels", "mem_pool", "dsv4"))
MAX_FRAMES = 6
MAX_KERNEL_FRAMES = 2        # the public function and the backend's
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["slots", "fused-translate"])


def store_name(fused: bool) -> str:
    return "fused_translate_norm_rope_store" if fused else "fused_k_norm_rope_store"


def frames_below_forward(frame) -> list[str] | None:
    """"file:function" of each of our frames from `frame` up to the model's forward (not
    included), innermost first; None when the model's forward is not on the stack."""
    forward = inspect.unwrap(DeepseekV4Model.forward).__code__
    ours = []
    while frame is not None and frame.f_code is not forward:
        code = frame.f_code
        if code.co_filename.startswith(OURS):
            ours.append(f"{Path(code.co_filename).relative_to(ROOT)}:{code.co_name}")
        frame = frame.f_back
    return ours if frame is not None else None


def generate(fused: bool, backend: str) -> int:
    """Two steps of one request (a prefill, a decode); the number of layers."""
    model = tiny_model(max_seq_len=64, seed=1)
    options = Options(kernel=KernelOptions(backend=backend), fused_swa_translate=fused)
    engine = Engine(model, max_batch=1, max_context_len=64, graph=False, options=options)
    engine.generate([[3, 1, 4, 1, 5]], 2)
    return model.config.n_layers


def assert_within_the_frames(stacks: list, n_layers: int) -> None:
    assert len(stacks) == 2 * n_layers                       # one store per layer per step
    assert None not in stacks, "a window store did not come from the model's forward"
    deepest = max(stacks, key=len)
    assert len(deepest) <= MAX_FRAMES, f"{len(deepest)} frames: {deepest}"
    kernels = [f for f in deepest if f.startswith("hip_kernels")]
    assert len(kernels) <= MAX_KERNEL_FRAMES, f"{len(kernels)} frames in hip_kernels: {kernels}"
    assert not [f for f in deepest if f.startswith("mem_pool")], deepest


@FUSED
def test_the_window_store_reaches_the_torch_reference_in_six_frames(fused):
    target = getattr(set_kv_ref, store_name(fused)).__code__
    stacks = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is target:
            stacks.append(frames_below_forward(frame))

    sys.setprofile(profile)
    try:
        n_layers = generate(fused, "torch")
    finally:
        sys.setprofile(None)
    assert_within_the_frames(stacks, n_layers)
    assert stacks[0][:2] == [f"hip_kernels/set_kv_ref.py:{store_name(fused)}",
                             f"hip_kernels/set_kv.py:{store_name(fused)}"]


@FUSED
def test_the_window_store_reaches_its_triton_launcher_in_six_frames(monkeypatch, fused):
    """The launch is recorded where the launcher launches the kernel (then the kernel runs).
    Only the set-KV family is sent to Triton (its resolve says so; every other op stays on the
    torch reference), so that only its kernels run in the interpreter."""
    pytest.importorskip("triton")
    from hip_kernels import set_kv_triton

    kernel, stacks = set_kv_triton.norm_rope_store_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                stacks.append(frames_below_forward(sys._getframe(1)))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(set_kv_triton, "norm_rope_store_kernel", Recorder())
    monkeypatch.setattr(set_kv, "resolve", lambda op, device, backend, **kw: "triton")
    n_layers = generate(fused, "torch")
    assert_within_the_frames(stacks, n_layers)
    assert stacks[0][:2] == [f"hip_kernels/set_kv_triton.py:{store_name(fused)}",
                             f"hip_kernels/set_kv.py:{store_name(fused)}"]
