"""The AOT reports' reading of compiler output, in-process: what hip_aot and triton_aot make of
an amdgcn listing or an nvcc log, the Triton variants they feed the compiler, and the lines the
two report scripts print. The compiles themselves run in tests/kernels/test_hip_compile.py and
test_triton_aot.py (a subprocess: the compiler needs the interpreter off); the texts here are
written by hand in the compilers' formats, so these run with no toolchain."""

import inspect
import re

import pytest
from bench_runner import SCRIPTS  # noqa: F401  (puts scripts/ on the import path)

import hip_aot_report  # noqa: E402
import triton_aot_report  # noqa: E402
from hip_kernels import hip_aot, triton_aot  # noqa: E402
from hip_kernels import kv_layout as L  # noqa: E402
from hip_kernels.platform import dialect_for_arch  # noqa: E402

FNUZ_SYM = "_Z13set_kv_kernelIL11Fp8DialectE0EEvPKvPh"
OCP_SYM = "_Z13set_kv_kernelIL11Fp8DialectE1EEvPKvPh"


def kernel_metadata(sym, vgpr, sgpr, vspill, sspill, scratch):
    return (f"\n  - .agpr_count:     0\n    .name:           {sym}\n"
            f"    .private_segment_fixed_size: {scratch}\n    .sgpr_count:     {sgpr}\n"
            f"    .sgpr_spill_count: {sspill}\n    .vgpr_count:     {vgpr}\n"
            f"    .vgpr_spill_count: {vspill}\n")


AMDGCN = (
    f"\t.text\n{FNUZ_SYM}:\n\tv_cvt_pk_fp8_f32 v1, v2, v3\n\tv_cvt_pk_fp8_f32 v4, v5, v6\n"
    f"\ts_swappc_b64 s[30:31], s[16:17]\n\ts_endpgm\n.Lfunc_end0:\n"
    f"{OCP_SYM}:\n\tv_div_fixup_f32 v1, v2, v3, v4\n\ts_endpgm\n.Lfunc_end1:\n"
    "helper_kernel:\n\ts_endpgm\n.Lfunc_end2:\n"
    "\t.amdgpu_metadata\n---\namdhsa.kernels:"
    + kernel_metadata(FNUZ_SYM, 40, 18, 0, 0, 0)
    + kernel_metadata(OCP_SYM, 52, 20, 3, 1, 64)
    + kernel_metadata("helper_kernel", 4, 4, 0, 0, 0)
    + "amdhsa.version:\n  - 1\n  - 2\n...\n")

NVCC_LOG = "".join(
    f"ptxas info    : Compiling entry function '{sym}' for 'sm_90'\n"
    f"ptxas info    : Function properties for {sym}\n"
    f"    {stack} bytes stack frame, {st} bytes spill stores, {ld} bytes spill loads\n"
    f"ptxas info    : Used {regs} registers, 380 bytes cmem[0]\n"
    "ptxas info    : Compile time = 10.500 ms\n"
    for sym, regs, stack, st, ld in ((FNUZ_SYM, 38, 0, 0, 0), (OCP_SYM, 72, 16, 8, 4)))


def test_amdgcn_stats_per_dialect_from_the_listing():
    assert hip_aot.amdgcn_kernel_stats(AMDGCN) == {
        "fnuz": {"vgpr": 40, "sgpr": 18, "spills": 0, "scratch_bytes": 0, "hw_fp8_converts": 2,
                 "calls": 1, "ieee_div": False},
        "ocp": {"vgpr": 52, "sgpr": 20, "spills": 4, "scratch_bytes": 64, "hw_fp8_converts": 0,
                "calls": 0, "ieee_div": True},
    }


def test_sm90_stats_from_the_ptxas_log(monkeypatch, tmp_path):
    commands = []
    monkeypatch.setattr(hip_aot.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setattr(hip_aot, "_run", lambda cmd: commands.append(cmd) or NVCC_LOG)
    assert hip_aot.compile_sm90(tmp_path) == {
        "fnuz": {"registers": 38, "stack_bytes": 0, "spills": 0},
        "ocp": {"registers": 72, "stack_bytes": 16, "spills": 12},
    }
    (cmd,) = commands
    assert cmd[0] == "/opt/bin/nvcc" and "-arch=sm_90" in cmd and cmd[-1].endswith(hip_aot.KERNEL)


def test_sm90_without_nvcc_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(hip_aot.shutil, "which", lambda name: None)
    with pytest.raises(hip_aot.ToolMissing, match="nvcc is not on PATH"):
        hip_aot.compile_sm90(tmp_path)


def test_a_failing_tool_shows_its_command_and_output():
    with pytest.raises(RuntimeError, match=r"(?s)false --flag\nfailed \(1\):\n"):
        hip_aot._run(["false", "--flag"])


def test_hip_report_script_prints_one_line_per_arch_and_dialect(monkeypatch, capsys):
    seen = []
    stats = {"gfx942": {"fnuz": {"vgpr": 40, "spills": 0}},
             "sm_90": {"ocp": {"registers": 72}}}
    monkeypatch.setattr(hip_aot_report, "report", lambda archs: seen.append(archs) or stats)
    hip_aot_report.main([])
    assert seen == [["gfx942", "gfx950", "sm_90"]]
    assert capsys.readouterr().out.splitlines() == [
        "gfx942  fnuz  vgpr=40 spills=0", "sm_90   ocp   registers=72"]
    hip_aot_report.main(["--arch", "gfx950", "--json"])
    assert seen[-1] == ["gfx950"]
    assert capsys.readouterr().out.strip() == (
        '{"gfx942": {"fnuz": {"vgpr": 40, "spills": 0}}, "sm_90": {"ocp": {"registers": 72}}}')


def test_triton_resource_usage_from_the_metadata():
    amdgcn = AMDGCN.replace(FNUZ_SYM, "k").replace("v_cvt_pk_fp8_f32 v4",
                                                   "v_cvt_scalef32_pk_fp8_f32 v4")
    assert triton_aot.resource_usage(amdgcn) == {
        "vgpr": 40, "sgpr": 18, "scratch_bytes": 0, "vgpr_spill": 0,
        "hw_fp8_convert": ["v_cvt_pk_fp8_f32", "v_cvt_scalef32_pk_fp8_f32"]}
    with pytest.raises(ValueError, match=r"amdgcn metadata has no \.vgpr_count"):
        triton_aot.resource_usage("\t.text\n")


@pytest.mark.parametrize("arch", triton_aot.ARCHS)
def test_triton_variants_give_every_kernel_argument_once(arch):
    """What the compiler is handed: each kernel argument either typed or a constexpr, the
    target's own fp8 dialect, and page bytes that match the page size."""
    dialect = dialect_for_arch(arch)
    variants = triton_aot._variants(dialect)
    assert len(variants) >= 10
    for name, (kernel, signature, constexprs, *options) in variants.items():
        assert not set(signature) & set(constexprs), name
        assert set(signature) | set(constexprs) == set(kernel.arg_names), name
        if "FP8_MAX" in constexprs:
            assert constexprs["FP8_NAN"] == dialect.nan_byte, name
        if "PAGE_BYTES" in constexprs:
            assert constexprs["PAGE_BYTES"] == L.page_bytes(constexprs["PAGE_SIZE"]), name
    # the indexer's two variants compile the weight and score types their names say
    scores = {name: v[1] for name, v in variants.items() if name.startswith("indexer_scores")}
    assert {(sig["w_ptr"], sig["out_ptr"]) for name, sig in scores.items()
            if "(bf16" in name} == {("*bf16", "*bf16")}
    assert {(sig["w_ptr"], sig["out_ptr"]) for name, sig in scores.items()
            if "(fp32" in name} == {("*fp32", "*fp32")}


def test_triton_report_rows_name_arch_dialect_kernel_and_use(monkeypatch):
    class Compiled:
        asm = {"amdgcn": AMDGCN.replace(FNUZ_SYM, "k")}

    calls = []
    monkeypatch.setattr(triton_aot, "compile_for",
                        lambda kernel, sig, const, arch, *opt: calls.append(arch) or Compiled)
    rows = triton_aot.report(("gfx942", "gfx950"))
    names = list(triton_aot._variants(dialect_for_arch("gfx942")))
    assert [r["kernel"] for r in rows] == names * 2
    assert calls == ["gfx942"] * len(names) + ["gfx950"] * len(names)
    assert {(r["arch"], r["dialect"]) for r in rows} == {("gfx942", "fnuz"), ("gfx950", "ocp")}
    store = [r for r in rows if r["kernel"] == "fused_store_cache"][0]
    assert store["function"] == "store_cache_kernel" and store["vgpr"] == 40


def test_triton_report_script_prints_a_table(monkeypatch, capsys):
    row = {"arch": "gfx942", "dialect": "fnuz", "kernel": "fused_store_cache", "vgpr": 40,
           "sgpr": 18, "scratch_bytes": 0, "hw_fp8_convert": ["v_cvt_pk_fp8_f32"]}
    calls = []

    def report(archs, jobs):
        calls.append((archs, jobs))
        return [row, {**row, "kernel": "hc_split", "hw_fp8_convert": []}]

    monkeypatch.setattr(triton_aot_report, "report", report)
    triton_aot_report.main(["--jobs", "3"])
    assert calls == [(["gfx942", "gfx950"], 3)]
    header, store, split = capsys.readouterr().out.splitlines()
    assert header.split() == ["arch", "fp8", "kernel", "vgpr", "sgpr", "scratch", "fp8", "convert"]
    assert store.split() == ["gfx942", "fnuz", "fused_store_cache", "40", "18", "0",
                             "v_cvt_pk_fp8_f32"]
    assert split.split()[-1] == "-"


def test_aot_compile_refuses_an_interpreted_process(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel, signature, constexprs = triton_aot._hc_split_variant()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET unset"):
        triton_aot.compile_for(kernel, signature, constexprs, "gfx942")


@pytest.mark.parametrize("arch, target", [("gfx942", ("hip", "gfx942", 64)),
                                          ("gfx950", ("hip", "gfx950", 64)),
                                          ("sm_90", ("cuda", 90, 32))])
def test_aot_compile_hands_triton_plain_types_aligned_arguments_and_the_target(
        monkeypatch, arch, target):
    """What compile_for gives triton.compile (the compile itself needs a process with the
    interpreter off): Triton's own type names (no ":D"), 16-divisibility on every pointer and on
    the ints marked ":D" only, the constexprs by name, the target's backend, arch and wave size,
    the set-KV launch options unless others are given."""
    import triton

    from hip_kernels.triton_kv_row import LAUNCH_OPTIONS

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    handed = []
    monkeypatch.setattr(triton, "compile",
                        lambda src, target, options: handed.append((src, target, options)) or 7)
    kernel, signature, constexprs = triton_aot._mhc_fused_variants()["hc_pre (+ norm)"]
    assert triton_aot.compile_for(kernel, signature, constexprs, arch) == 7
    (src, got_target, options), = handed
    assert (got_target.backend, got_target.arch, got_target.warp_size) == target
    assert options == dict(LAUNCH_OPTIONS)
    assert src.signature["D"] == "i32" and src.signature["iters"] == "i32"
    assert src.signature["x_ptr"] == "*bf16" and src.signature["mix_eps"] == "fp32"
    assert not any(t.endswith(":D") for t in src.signature.values())
    assert {n for n, t in src.signature.items() if t == "constexpr"} == set(constexprs)
    aligned = {kernel.arg_names[i] for (i,) in src.attrs}
    pointers = {n for n, t in signature.items() if t.startswith("*")}
    assert len(pointers) == 8 and aligned == pointers | {"D"}
    assert all(a == [["tt.divisibility", 16]] for a in src.attrs.values())
    handed.clear()
    triton_aot.compile_for(kernel, signature, constexprs, arch, {"num_warps": 8})
    assert handed[0][2] == {"num_warps": 8}


TRITON_DTYPES = "i1 i8 i16 i32 i64 u8 u32 u64 fp16 bf16 fp32 fp64".split()
TRITON_TYPE = re.compile(rf"\*({'|'.join(TRITON_DTYPES)})|(fp16|bf16|fp32|fp64)|"
                         rf"([iu](1|8|16|32|64))(:D)?")


def declared_constexprs(kernel) -> set:
    params = inspect.signature(kernel.fn).parameters.values()
    return {p.name for p in params if str(p.annotation).endswith("constexpr")}


@pytest.mark.parametrize("arch", triton_aot.ARCHS)
def test_triton_variants_type_every_runtime_argument_and_fix_every_constexpr(arch):
    """Every variant gives each runtime argument a Triton type (a pointer to a dtype, a scalar
    dtype; ":D", a multiple of 16, on ints only) and a value to each constexpr the kernel
    declares; the rest of its constants are runtime arguments fixed at 1 (unit strides)."""
    for name, (kernel, signature, constexprs, *_) in triton_aot._variants(
            dialect_for_arch(arch)).items():
        assert set(signature) == set(kernel.arg_names) - set(constexprs), name
        bad = {a: t for a, t in signature.items() if not TRITON_TYPE.fullmatch(t)}
        assert not bad, (name, bad)
        declared = declared_constexprs(kernel)
        assert declared <= set(constexprs), (name, declared - set(constexprs))
        assert all(constexprs[a] == 1 for a in set(constexprs) - declared), name


@pytest.mark.parametrize("arch", triton_aot.ARCHS)
def test_triton_variants_that_claim_the_models_shapes_have_them(arch):
    """The report compiles the kernels at the model's shapes: the Flash config's mHC width,
    head and rope dims, compress ratios, routed and shared experts per token, and the indexer's
    top-k of the variant's config (Flash 512, Pro 1024)."""
    from dsv4.config import ModelConfig
    from hip_kernels.moe_fused_triton import SCORE_FUNC_IDS

    flash, pro = ModelConfig.preset("flash"), ModelConfig.preset("pro")
    variants = triton_aot._variants(dialect_for_arch(arch))
    seen = set()
    for name, (kernel, _, cex, *_) in variants.items():
        if "HC" in cex:
            assert cex["HC"] == flash.hc_mult, name
            seen.add("HC")
        if "ROPE_DIM" in cex:
            assert cex["ROPE_DIM"] == flash.rope_head_dim, name
        if "HEAD_DIM" in cex:
            indexer = "indexer" in name
            assert cex["HEAD_DIM"] == (flash.index_head_dim if indexer else flash.head_dim), name
            seen.add("HEAD_DIM")
        if "RATIO" in cex:
            assert cex["RATIO"] in set(flash.compress_ratios) - {0}, name
            assert cex["OVERLAP"] == (cex["RATIO"] == 4), name
        if "ROUTED" in cex:
            assert cex["K"] == (flash.n_activated_experts if cex["ROUTED"]
                                else flash.n_shared_experts), name
            seen.add("K")
    assert seen == {"HC", "HEAD_DIM", "K"}
    assert sum("HC" in v[2] for v in variants.values()) == 4      # split, pre, post, head
    route = variants["moe_route (biased)"][2]
    assert route["K"] == flash.n_activated_experts
    assert route["E_PAD"] >= flash.n_routed_experts
    assert route["SCORE"] == SCORE_FUNC_IDS[flash.score_func]
    assert variants["indexer_topk (k 512)"][2]["K"] == flash.index_topk
    assert variants["indexer_topk (k 1024)"][2]["K"] == pro.index_topk


def test_triton_report_names_every_compressor_row_for_the_compressor():
    """A reader finds the compressor's rows of the report with `grep compressor`: every variant
    of a compressor_update_triton kernel is named so, and every such kernel has one."""
    from hip_kernels import compressor_update_triton as C

    variants = triton_aot._variants(dialect_for_arch("gfx942"))
    rows = {name: kernel for name, (kernel, *_) in variants.items()
            if kernel.fn.__module__ == C.__name__}
    assert all("compressor" in name for name in rows), sorted(rows)
    assert {k.fn.__name__ for k in rows.values()} == {
        n for n in dir(C) if n.endswith("_kernel")}


@pytest.mark.parametrize("compilers", [("c++", "g++"), ("g++",)])
def test_binding_check_runs_the_host_compiler_syntax_only_against_csrc(monkeypatch, compilers):
    """The torch binding is checked with the host C++ compiler found on PATH (c++, else g++),
    syntax only, with csrc and the CUDA headers that nvcc reports on the include path."""
    commands = []

    def run(cmd):
        commands.append(cmd)
        return ' #$ INCLUDES="-I/opt/cuda/targets/include"  \n' if "--dryrun" in cmd else ""

    monkeypatch.setattr(hip_aot.shutil, "which",
                        lambda name: f"/opt/bin/{name}" if name in compilers + ("nvcc",) else None)
    monkeypatch.setattr(hip_aot, "_run", run)
    hip_aot.check_binding()
    dry, cmd = commands
    assert dry[0] == "/opt/bin/nvcc"
    assert cmd[0] == f"/opt/bin/{compilers[0]}" and "-fsyntax-only" in cmd
    assert cmd[cmd.index("-I") + 1] == str(hip_aot.CSRC)
    assert "/opt/cuda/targets/include" in cmd
    assert cmd[-1] == str(hip_aot.CSRC / hip_aot.BINDING)


def test_binding_check_without_a_host_compiler_says_so(monkeypatch):
    monkeypatch.setattr(hip_aot.shutil, "which", lambda name: None)
    monkeypatch.setattr(hip_aot, "_run", lambda cmd: pytest.fail(f"ran {cmd}"))
    with pytest.raises(hip_aot.ToolMissing, match=r"no host C\+\+ compiler \(c\+\+/g\+\+\)"):
        hip_aot.check_binding()
