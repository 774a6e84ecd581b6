"""Environment flags of the model and runtime layer."""

from hip_kernels.flags import bool_flag, choice_flag, int_flag, str_flag

PKG = "dsv4"

MULTI_STREAM_PREPARE = bool_flag(
    "DSV4_MULTI_STREAM_PREPARE", False,
    "run the compressors of the attention prepare step on side streams", PKG)
FUSED_SWA_TRANSLATE = bool_flag(
    "DSV4_FUSED_SWA_TRANSLATE", False,
    "each layer stores its window KV row with fused_translate_norm_rope_store, the kernel mapping "
    "out_cache_loc to SWA slots itself (no translation op in a step); 0 = the pool's cached "
    "translation, once per step in the attention metadata", PKG)
GRAPH = bool_flag(
    "DSV4_GRAPH", True,
    "capture and replay decode steps as graphs (HIP graphs on ROCm, emulated on CPU)", PKG)
GRAPH_BATCH_SIZES = choice_flag(
    "DSV4_GRAPH_BATCH_SIZES", ("pow2", "every"), "every",
    "decode graphs captured: every = each batch size up to max_batch (no padding, so replay "
    "gives eager's bits; more graphs to capture and hold); pow2 = batch 1, 2, 4, ... 64 (and "
    "max_batch), a batch replays the next one up with padded rows, whose GEMM row count can "
    "change the live rows' last bits", PKG)
GRAPH_BACKEND = choice_flag(
    "DSV4_GRAPH_BACKEND", ("auto", "cuda", "emulate"), "auto",
    "graph backend: auto = torch.cuda.CUDAGraph where a GPU exists, else the CPU emulation", PKG)
SGLANG_PLUGIN = bool_flag(
    "DSV4_SGLANG_PLUGIN", True,
    "let SGLang's plugin loader install this backend's SWA KV setters (0 = SGLang's own)", PKG)
SGLANG_MONOKERNEL = bool_flag(
    "DSV4_SGLANG_MONOKERNEL", True,
    "register this backend's monokernel spec for DeepseekV4ForCausalLM with SGLang, so that "
    "`--enable-amd-monokernel` runs its decode steps on this project's model (0 = no spec; "
    "DSV4_SGLANG_PLUGIN=0 turns it off too)", PKG)
VLLM_PLUGIN = bool_flag(
    "DSV4_VLLM_PLUGIN", True,
    "let vLLM's plugin loader install this backend's DeepSeek-V4 KV insert (0 = vLLM's own)", PKG)
CHECK_WEIGHTS = bool_flag(
    "DSV4_CHECK_WEIGHTS", True,
    "scan loaded weights for NaN/inf and tid2eid for experts out of range (0 skips the scan)", PKG)
PREFIX_CACHE = bool_flag(
    "DSV4_PREFIX_CACHE", False,
    "reuse the KV of cached prompt prefixes (host tier, optional file tier; SWA all or nothing)",
    PKG)
PREFIX_CACHE_HOST_PAGES = int_flag(
    "DSV4_PREFIX_CACHE_HOST_PAGES", 0,
    "host tier capacity of the prefix cache in pages (0 = as many pages as the device pool)", PKG)
PREFIX_CACHE_DIR = str_flag(
    "DSV4_PREFIX_CACHE_DIR", "",
    "directory of the prefix cache's file tier (empty = no file tier)", PKG)
PREFILL_CHUNK = int_flag(
    "DSV4_PREFILL_CHUNK", 0,
    "the engine prefills a prompt in chunks of at most this many tokens, and gives each step this "
    "many tokens: the running requests' decodes first, then prompt chunks (0 = sized from the "
    "device's memory, see dsv4/memory_estimate.py)", PKG)
