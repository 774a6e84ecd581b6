"""DeepSeek-V4 decode on AMD Instinct GPUs: model, engine, graphs, CLI, serving entry points."""

import logging

from . import envs

logging.getLogger(__name__).addHandler(logging.NullHandler())

# Public names imported on first use, so `import dsv4` stays cheap: name -> submodule.
_LAZY = {
    "load_model": "checkpoint",
    "save_random_checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "ModelConfig": "config",
    "DeepseekV4Model": "model",
    "init_random_weights": "random_init",
    "Engine": "engine",
    "Options": "options",
    "SamplingParams": "sampling",
}

__all__ = ["envs", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
