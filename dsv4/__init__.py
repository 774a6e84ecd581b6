"""DeepSeek-V4 decode on AMD Instinct GPUs: model, engine, graphs, CLI, serving entry points."""

import logging

from . import envs

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["envs"]
