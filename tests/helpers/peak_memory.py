"""The most bytes of tensors alive at once on the CPU while a function runs, above what was
alive when it started, read from the torch profiler's allocation records (every allocation
and free of torch's CPU allocator, in order). A measure of what code allocates, not of the
process: the interpreter, libraries and freed-but-kept pages of malloc are not in it."""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """(peak bytes allocated above the start while fn(*args, **kwargs) ran, its result)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result


def recorded_shapes(fn, *args, **kwargs) -> tuple[list[tuple[int, ...]], object]:
    """(the shape of every tensor argument of every op fn(*args, **kwargs) ran, its result)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn(*args, **kwargs)
    shapes = [tuple(s) for e in prof.profiler.kineto_results.events() for s in e.shapes() if s]
    return shapes, result
