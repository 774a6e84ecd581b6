"""A stand-in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the call instead of
compiling and running it, so a test can see what a wrapper launches with (tensors on a device
the machine does not have, launch options the interpreter ignores)."""


class LaunchRecorder:
    def __init__(self):
        self.launches = []                               # (args, kwargs) per launch

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))
