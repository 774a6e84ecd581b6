"""dsv4.Options: the DSV4_* flags read once into a frozen value; a model reads them when made,
an engine when made, and each passes its value down."""

import dataclasses

import pytest

from dsv4.options import Options
from hip_kernels import KernelOptions
from hip_kernels.numerics import DEFAULT_NUMERICS, REFERENCE_NUMERICS
from tiny_model import tiny_model


def test_from_env_reads_every_flag(flag_env, tmp_path):
    assert Options.from_env() == Options()
    flag_env(DSV4_NUMERICS="fp32", DSV4_KERNEL_BACKEND="torch", DSV4_AITER="0",
             DSV4_FUSED_SWA_TRANSLATE="1", DSV4_MULTI_STREAM_PREPARE="1", DSV4_GRAPH="0",
             DSV4_GRAPH_BATCH_SIZES="every", DSV4_GRAPH_BACKEND="emulate",
             DSV4_CHECK_WEIGHTS="0", DSV4_PREFIX_CACHE="1", DSV4_PREFIX_CACHE_HOST_PAGES="7",
             DSV4_PREFIX_CACHE_DIR=str(tmp_path))
    assert Options.from_env() == Options(
        numerics="fp32", kernel=KernelOptions(backend="torch", aiter="0"),
        fused_swa_translate=True, multi_stream_prepare=True, graph=False,
        graph_batch_sizes="every", graph_backend="emulate", check_weights=False,
        prefix_cache=True, prefix_cache_host_pages=7, prefix_cache_dir=str(tmp_path))


def test_the_numerics_mode_gives_the_store_numerics():
    assert Options().reference and Options().store_numerics == REFERENCE_NUMERICS
    fp32 = Options(numerics="fp32")
    assert not fp32.reference and fp32.store_numerics == DEFAULT_NUMERICS


@pytest.mark.parametrize("kwargs, match", [
    (dict(numerics="bf16"), r"numerics='bf16': expected one of reference\|fp32"),
    (dict(graph_batch_sizes="all"), r"graph_batch_sizes='all': expected one of pow2\|every"),
    (dict(graph_backend="hip"), r"graph_backend='hip': expected one of auto\|cuda\|emulate"),
])
def test_a_bad_value_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Options(**kwargs)
    with pytest.raises(TypeError, match="kernel must be a hip_kernels.KernelOptions"):
        Options(kernel="torch")


def test_step_differences_name_only_the_fields_a_step_computes_with():
    base = Options()
    assert base.step_differences(dataclasses.replace(base, graph=False, check_weights=False)) == []
    other = dataclasses.replace(base, fused_swa_translate=True, numerics="fp32")
    assert base.step_differences(other) == ["numerics: 'reference' -> 'fp32'",
                                            "fused_swa_translate: False -> True"]


def test_a_model_reads_the_flags_when_made(flag_env):
    flag_env(DSV4_NUMERICS="fp32")
    model = tiny_model(max_seq_len=16, seed=0)
    flag_env(DSV4_NUMERICS="reference")
    assert model.options.numerics == "fp32"
