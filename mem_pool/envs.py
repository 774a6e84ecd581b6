"""Environment flags of the KV memory layer."""

from hip_kernels.flags import bool_flag

PKG = "mem_pool"

CACHE_SWA_TRANSLATION = bool_flag(
    "DSV4_CACHE_SWA_TRANSLATION", True,
    "cache the full->SWA slot translation per step, keyed by the location tensor's identity", PKG)
SWA_CACHE_VERIFY = bool_flag(
    "DSV4_SWA_CACHE_VERIFY", False,
    "recompute every SWA location cache hit and raise on a stale one (debugging; a host sync per "
    "hit)", PKG)
