"""The memory estimate counts the weights in the format the model holds them: the published
FP8/FP4 formats ("native") or dequantized to bf16; a Flash run fits a 192 GB device natively."""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.memory_estimate import GIB, estimate, shortfall, weight_bytes
from dsv4.model import DeepseekV4Model
from dsv4.weights import quant
from dsv4.weights.formats import FP4, FP8, native_problem, quantized_bytes

GB = 10 ** 9


def test_quantized_bytes_are_the_quantizers_bytes():
    w = torch.randn(200, 384)
    for fmt, quantize in ((FP8, quant.quant_fp8), (FP4, quant.quant_fp4)):
        q, scale = quantize(w)
        assert quantized_bytes(fmt, (200, 384)) == q.nbytes + scale.nbytes, fmt
    assert quantized_bytes(FP4, (3, 200, 384)) == 3 * quantized_bytes(FP4, (200, 384))


@pytest.mark.parametrize("preset", ["small", "flash"])
def test_native_count_equals_the_native_models_bytes(preset):
    """Counted from the bf16 model's shapes, the figure is what a native model holds."""
    config = ModelConfig.preset(preset)
    model = DeepseekV4Model(config, device="meta", weights="native")
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes(config, "native") == held


def test_flash_and_pro_sizes():
    flash, pro = ModelConfig.preset("flash"), ModelConfig.preset("pro")
    assert 150 * GB < weight_bytes(flash, "native") <= 160 * GB
    assert round(weight_bytes(flash, "bf16") / GIB) == 531     # what the bf16 path holds
    assert 800 * GB < weight_bytes(pro, "native") <= 870 * GB
    assert weight_bytes(pro, "bf16") > 3.3 * weight_bytes(pro, "native")


def test_flash_fits_a_192_gb_device_natively_and_not_80_gb():
    need = estimate(ModelConfig.preset("flash"), 4, 48, prefill_tokens=128)
    assert shortfall(need, 192 * GB, "a 192 GB device") is None
    problem = shortfall(need, 80 * GB, "an 80 GB device")
    assert problem.startswith("this run needs about 148.") and "an 80 GB device has 74.5 GiB" \
        in problem
    bf16 = estimate(ModelConfig.preset("flash"), 4, 48, prefill_tokens=128, weights="bf16")
    assert shortfall(bf16, 192 * GB, "a 192 GB device").startswith("this run needs about 531.")


def test_bad_weights_value_is_named():
    with pytest.raises(ValueError, match="weights must be one of"):
        weight_bytes(ModelConfig.preset("tiny"), "fp8")


def test_native_problem_names_the_dims():
    assert native_problem(ModelConfig.preset("small")) is None
    problem = native_problem(ModelConfig.preset("tiny"))
    assert "dim=64, q_lora_rank=32, o_groups*o_lora_rank=64, moe_inter_dim=32" in problem


def test_available_bytes_is_the_gpus_total_or_the_machines_memory(monkeypatch):
    import os

    from dsv4.memory_estimate import available_bytes

    cpu = available_bytes(torch.device("cpu"))
    assert cpu == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and cpu >= GIB
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device: seen.append(device) or (3 * GIB, 80 * GIB))   # (free, total)
    gpu = torch.device("cuda", 1)
    assert available_bytes(gpu) == 80 * GIB and seen == [gpu]


def test_the_estimate_line_a_user_reads():
    from dsv4.memory_estimate import MemoryEstimate

    need = MemoryEstimate(weight_bytes=3 * GIB, kv_bytes=GIB // 2, prefill_bytes=GIB // 4)
    assert need.describe() == ("3.8 GiB (3.0 GiB of weights, 0.50 GiB of KV cache, 0.25 GiB for "
                               "the prefill step)")
    assert shortfall(need, need.total_bytes, "cpu") is None
    assert shortfall(need, need.total_bytes - 1, "cpu") == (
        "this run needs about 3.8 GiB (3.0 GiB of weights, 0.50 GiB of KV cache, 0.25 GiB for the "
        "prefill step) but cpu has 3.7 GiB; use a smaller model, shorter or fewer prompts, a "
        "smaller --prefill-chunk, or pass --force")


def test_the_kv_estimate_holds_whole_pages_for_each_requests_context():
    """Each request's context is rounded up to whole 256-token pages of the pool: one token
    costs a page, 257 tokens a second page for each request, both in the full and the SWA pool."""
    from mem_pool.kv_cache_spec import KVCacheSpec, footprint

    tiny = ModelConfig.preset("tiny")
    pages = footprint(KVCacheSpec(compress_ratios=tiny.compress_ratios[:tiny.n_layers],
                                  window_size=tiny.window_size), 256)
    kv = {n: estimate(tiny, 3, n).kv_bytes for n in (1, 256, 257, 512)}
    assert kv[1] == kv[256] > 0 and kv[257] == kv[512]
    assert kv[257] - kv[256] == 3 * (pages.full_page_bytes + pages.swa_page_bytes)
