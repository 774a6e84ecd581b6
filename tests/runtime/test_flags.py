import subprocess
import sys
from pathlib import Path

import pytest

from dsv4 import flags_table
from hip_kernels import envs as kenvs
from hip_kernels.flags import FlagError, declare
from mem_pool import envs as menvs
from dsv4 import envs as denvs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("raw,expected", [
    ("1", True), ("0", False), ("true", True), ("FALSE", False), ("on", True), ("Off", False),
])
def test_bool_flag_accepts_documented_spellings(flag_env, raw, expected):
    flag_env(DSV4_CACHE_SWA_TRANSLATION=raw)
    assert menvs.CACHE_SWA_TRANSLATION.get() is expected


@pytest.mark.parametrize("raw", ["2", "yesplease", "", "enabled"])
def test_bool_flag_rejects_other_values_naming_the_flag(flag_env, raw):
    flag_env(DSV4_GRAPH=raw)
    with pytest.raises(FlagError, match="DSV4_GRAPH.*0/1/true/false/on/off"):
        denvs.GRAPH.get()


def test_choice_flag_rejects_unknown_value(flag_env):
    flag_env(DSV4_KERNEL_BACKEND="cuda")
    with pytest.raises(FlagError, match="DSV4_KERNEL_BACKEND.*auto\\|hip\\|triton\\|torch"):
        kenvs.KERNEL_BACKEND.get()


def test_defaults_when_unset(flag_env):
    flag_env()
    assert kenvs.FP8_DIALECT.get() == "auto"
    assert kenvs.KERNEL_BACKEND.get() == "auto"
    assert menvs.CACHE_SWA_TRANSLATION.get() is True
    assert denvs.MULTI_STREAM_PREPARE.get() is False
    assert denvs.GRAPH.get() is True
    assert all(f.source == "default" for f in flags_table.flags())


def test_values_are_read_once_and_cached(flag_env, monkeypatch):
    flag_env(DSV4_MULTI_STREAM_PREPARE="1")
    assert denvs.MULTI_STREAM_PREPARE.get() is True
    monkeypatch.setenv("DSV4_MULTI_STREAM_PREPARE", "0")
    assert denvs.MULTI_STREAM_PREPARE.get() is True  # cached
    flag_env(DSV4_MULTI_STREAM_PREPARE="0")  # refresh
    assert denvs.MULTI_STREAM_PREPARE.get() is False


def test_a_choice_flag_declared_with_a_list_reads_and_names_its_choices(flag_env, monkeypatch):
    """declare() runs here, not at import: a choice flag given its choices as a list parses a
    value in any case, rejects another naming the choices, and shows them in the docs table."""
    from hip_kernels import flags

    monkeypatch.setattr(flags, "_REGISTRY", dict(flags._REGISTRY))
    flag = flags.choice_flag("DSV4_TEST_PICK", ["left", "right"], "left", "a test flag", "dsv4")
    flag_env(DSV4_TEST_PICK="RIGHT")
    assert flag.get() == "right"
    flag_env(DSV4_TEST_PICK="up")
    with pytest.raises(FlagError, match=r"DSV4_TEST_PICK='up': expected one of left\|right"):
        flag.get()
    assert "| left \\| right | `left` |" in flags.markdown_table([flag])


def test_flag_names_need_prefix():
    with pytest.raises(ValueError, match="DSV4_"):
        declare("GRAPH", "bool", True, "x", "dsv4")


def test_every_package_declares_its_flags():
    packages = {f.package for f in flags_table.flags()}
    assert packages == {"hip_kernels", "mem_pool", "dsv4"}
    names = {f.name for f in flags_table.flags()}
    assert {"DSV4_FP8_DIALECT", "DSV4_KERNEL_BACKEND", "DSV4_CACHE_SWA_TRANSLATION",
            "DSV4_MULTI_STREAM_PREPARE", "DSV4_GRAPH"} <= names


def test_docs_flag_table_matches_declarations():
    doc = (ROOT / "docs" / "flags.md").read_text()
    begin = doc.index(flags_table.TABLE_BEGIN) + len(flags_table.TABLE_BEGIN)
    end = doc.index(flags_table.TABLE_END)
    assert doc[begin:end].strip() == flags_table.docs_table().strip(), (
        "docs/flags.md is out of date: regenerate it with `python scripts/update_flags_doc.py`")


def run_env(capsys, flag_env, **env):
    """`python -m dsv4 env` in this process with only the given DSV4_* flags set."""
    from dsv4.cli import main

    flag_env(**env)
    rc = main(["env"])
    return rc, capsys.readouterr().out


def test_cli_env_prints_every_flag_with_value_and_source(capsys, flag_env):
    rc, out = run_env(capsys, flag_env, DSV4_GRAPH="off")
    assert rc == 0
    header, *flag_lines = out.split("\n\n")[0].splitlines()
    assert header.split() == ["flag", "value", "source", "meaning"]
    lines = {line.split()[0]: line.split() for line in flag_lines}
    assert set(lines) == {f.name for f in flags_table.flags()}
    assert lines["DSV4_GRAPH"][1:3] == ["0", "env"]
    assert lines["DSV4_KERNEL_BACKEND"][1:3] == ["auto", "default"]
    # the columns line up: every source starts where the header's "source" does
    column = header.index("source")
    assert {line[column - 2:column + 7].strip() for line in flag_lines} == {"default", "env"}


def test_cli_env_reports_bad_value_and_fails(capsys, flag_env):
    rc, out = run_env(capsys, flag_env, DSV4_FP8_DIALECT="e5m2")
    assert rc == 1
    assert "DSV4_FP8_DIALECT='e5m2'" in out
    assert "serving plugins" not in out


def test_cli_env_markdown_is_the_docs_table(capsys, flag_env):
    from dsv4.cli import main

    flag_env()
    assert main(["env", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == flags_table.docs_table().strip()


def test_cli_env_says_what_each_serving_plugin_would_replace(capsys, flag_env):
    from dsv4.plugins.host_signatures import installed_version

    rc, out = run_env(capsys, flag_env)
    assert rc == 0
    plugins = out.split("serving plugins")[1].splitlines()[1:]
    sglang = [line.strip() for line in plugins if line.strip().startswith("sglang")]
    if installed_version("sglang") is None:
        assert sglang == ["sglang: not installed"]
    else:
        assert sglang[0].startswith(f"sglang {installed_version('sglang')}: would replace "
                                    "DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused -> ")
    _, off = run_env(capsys, flag_env, DSV4_SGLANG_PLUGIN="0")
    assert ("plugin off (DSV4_SGLANG_PLUGIN=0)" in off or "sglang: not installed" in off)
    assert any(line.strip().startswith("vllm") for line in plugins)


def test_cli_env_shows_the_monokernel_specs_coverage(capsys, flag_env):
    from dsv4.plugins.host_signatures import installed_version

    version = installed_version("sglang")
    if version is None:
        pytest.skip("SGLang is not installed (see README)")
    _, out = run_env(capsys, flag_env)
    lines = [line.strip() for line in out.split("serving plugins")[1].splitlines()]
    mono = [line for line in lines if line.startswith("monokernel spec dsv4-rocm")]
    assert mono == ["monokernel spec dsv4-rocm (SGLang --enable-amd-monokernel): gfx942/gfx950, "
                    "decode batch sizes 1-64, TP 1/2/4/8; accepts none of the features SGLang "
                    "refuses by default"]
    held = [line.split(",")[0] for line in lines if "weights beside SGLang's" in line]
    assert held == [f"{model} on {isa}" for model in ("flash", "pro")
                    for isa in ("gfx942", "gfx950")]
    for env, why in (({"DSV4_SGLANG_MONOKERNEL": "0"}, "DSV4_SGLANG_MONOKERNEL=0"),
                     ({"DSV4_SGLANG_PLUGIN": "0"}, "DSV4_SGLANG_PLUGIN=0")):
        _, off = run_env(capsys, flag_env, **env)
        assert f"sglang {version} monokernel: off ({why})" in off


def test_update_flags_doc_help_and_check_write_nothing():
    doc = ROOT / "docs" / "flags.md"
    before = doc.read_bytes()
    script = str(ROOT / "scripts" / "update_flags_doc.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout
    check = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert check.returncode == 0 and "up to date" in check.stdout
    assert doc.read_bytes() == before
