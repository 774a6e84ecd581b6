"""KV memory for DeepSeek-V4: paged allocators, the SWA and compressed pools, the full->SWA
slot mapping and its identity-keyed per-step translation cache, host copies."""

import logging

from . import envs

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["envs"]
