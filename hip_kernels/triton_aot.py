"""Ahead-of-time compile of the Triton kernels (set-KV family, mHC split, indexer scores, decode
attention, quantized linears, the attention plan, ...) for AMD targets, without a GPU.

`report()` gives, per kernel variant, the VGPR/SGPR counts, scratch bytes and the hardware fp8
converts used (`v_cvt_pk_fp8_f32` on gfx942; none means software emulation or no fp8
arithmetic); `scripts/triton_aot_report.py` prints it. Must run in a process where the Triton
interpreter is off (TRITON_INTERPRET unset): it compiles the real kernels, not their interpreted
versions. Each target is compiled with its native fp8 dialect (fnuz on gfx942, OCP on gfx950),
the launchers' options, and what the JIT specializes at run time for torch tensors (see
`_variants`).
"""

from __future__ import annotations

import re

from . import kv_layout as L
from . import numerics as N
from .platform import dialect_for_arch, triton_interpreted

ARCHS = ("gfx942", "gfx950")
# fp32 -> fp8 hardware converts: gfx942 (fnuz) and gfx950 (OCP, with a scale operand)
HW_FP8_CONVERT = re.compile(r"\bv_cvt_(scalef32_)?pk_fp8_f32\b")


def _variants(dialect):
    """name -> (kernel, signature, constexprs) for every kernel variant the launchers use.

    Signatures mirror what the JIT specializes for typical arguments: "i32:D" is an int that is
    a multiple of 16 (row strides of 512-wide rows), index strides of contiguous 1-D tensors are
    the constant 1, pointers are 16-byte aligned."""
    from . import set_kv_triton as K
    from .triton_kv_row import fp8_constexprs

    fp8 = fp8_constexprs(dialect)
    swa_page = {"PAGE_SIZE": 256, "PAGE_BYTES": L.page_bytes(256)}
    c4_page = {"PAGE_SIZE": 64, "PAGE_BYTES": L.page_bytes(64)}
    loc = {"loc_ptr": "*i64", "cache_ptr": "*u8", "num_slots": "i64"}
    norm_rope = {"kv_ptr": "*bf16", "kv_stride": "i32:D", "weight_ptr": "*bf16", "eps": "fp32",
                 "freq_ptr": "*fp32", "freq_stride_pos": "i32:D", "freq_stride_pair": "i32",
                 "pos_ptr": "*i64", "full_to_swa_ptr": "*i32", "map_len": "i64",
                 "swa_out_ptr": "*i32",
                 "q_ptr": "*bf16", "q_stride_row": "i32:D", "q_stride_head": "i32:D", **loc}
    unit = {"pos_stride": 1, "loc_stride": 1, "map_stride": 1, "swa_out_stride": 1}

    def numerics(n=N.DEFAULT_NUMERICS):
        return {**fp8_constexprs(dialect, n.fp8_max_for(dialect)),
                "TILE_AMAX_FLOOR": n.amax_floor, "ROUND_BF16": n.round_to_bf16,
                "KV_NORM": True, "Q_MODE": N.Q_MODES.index(n.q_mode),
                "RMS_DEVICE": n.rms == "device"}

    def norm_rope_variant(translate, has_swa_out, has_q, n=N.DEFAULT_NUMERICS, kv_norm=True):
        flags = {"TRANSLATE": translate, "HAS_SWA_OUT": has_swa_out, "HAS_Q": has_q}
        return K.norm_rope_store_kernel, norm_rope, {**unit, **swa_page, **numerics(n), **flags,
                                                     "KV_NORM": kv_norm}

    # A host engine's numerics (fp32 through norm and RoPE, q rotated only; see StoreNumerics).
    host = N.StoreNumerics(round_to_bf16=False, q_mode="rope_only")
    return {
        "fused_k_norm_rope_store": norm_rope_variant(False, False, False),
        "fused_k_norm_rope_store+q": norm_rope_variant(False, False, True),
        "fused_k_norm_rope_store+q (reference)": norm_rope_variant(
            False, False, True, N.REFERENCE_NUMERICS),
        "fused_k_norm_rope_store+q (fp32, q rope only)": norm_rope_variant(
            False, False, True, host),
        "fused_k_norm_rope_store+q (normed kv, q fp32)": norm_rope_variant(
            False, False, True, N.StoreNumerics(q_mode="norm_rope_fp32"), kv_norm=False),
        "fused_translate_norm_rope_store": norm_rope_variant(True, True, False),
        "fused_store_cache": (
            K.store_cache_kernel, {"rows_ptr": "*bf16", "row_stride": "i32:D", **loc},
            {"loc_stride": 1, **c4_page, **fp8, "TILE_AMAX_FLOOR": N.AMAX_FLOOR}),
        "store_kv_pack": (
            K.store_pack_kernel,
            {"nope_ptr": "*u8", "nope_stride": "i32:D", "rope_ptr": "*bf16", "rope_stride": "i32:D",
             "scales_ptr": "*u8", "scales_stride": "i32", **loc},
            {"loc_stride": 1, **c4_page}),
        "indexer_store": (
            K.indexer_store_kernel, {"k_ptr": "*bf16", "k_stride": "i32:D", **loc},
            {"loc_stride": 1, "PAGE_SIZE": 64, **fp8, "POW2_SCALE": False, "KEY_TILE": 0}),
        "indexer_store (pow2 scale, the model's)": (
            K.indexer_store_kernel, {"k_ptr": "*bf16", "k_stride": "i32:D", **loc},
            {"loc_stride": 1, "PAGE_SIZE": 64, **fp8, "POW2_SCALE": True, "KEY_TILE": 0}),
        "indexer_store (pow2 scale, keys in 16 x 16 tiles)": (
            K.indexer_store_kernel, {"k_ptr": "*bf16", "k_stride": "i32:D", **loc},
            {"loc_stride": 1, "PAGE_SIZE": 64, **fp8, "POW2_SCALE": True, "KEY_TILE": 16}),
        "hc_split": _hc_split_variant(),
        **_indexer_scores_variants(dialect),
        **_decode_attention_variants(dialect),
        **_quant_linear_variants(dialect),
        **_mhc_fused_variants(),
        **_moe_fused_variants(),
        **_moe_fused_quant_variants(dialect),
        **_compressor_variants(),
        **_indexer_topk_variants(),
        **_attention_projection_variants(),
        **_attention_plan_variants(),
    }


def _hc_split_variant():
    from .mhc_split_triton import BLOCK_N, hc_split_kernel

    ptrs = ("mix_ptr", "scale_ptr", "base_ptr", "pre_ptr", "post_ptr", "comb_ptr")
    return hc_split_kernel, {**dict.fromkeys(ptrs, "*fp32"), "n_rows": "i32", "iters": "i32",
                             "eps": "fp32"}, {"HC": 4, "BLOCK_N": BLOCK_N}


def _mhc_fused_variants():
    """mHC pre (+ the block's RMSNorm), post and the head (+ the final RMSNorm) as the model
    runs them: hc 4, bf16 hidden."""
    from . import mhc_fused_triton as M

    pre = {"x_ptr": "*bf16", "fn_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32",
           "w_ptr": "*fp32", "out_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
           "D": "i32:D", "mix_eps": "fp32", "iters": "i32", "hc_eps": "fp32", "norm_eps": "fp32"}
    post = {"out_ptr": "*bf16", "res_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
            "y_ptr": "*bf16", "D": "i32:D"}
    head = {name: pre[name] for name in ("x_ptr", "fn_ptr", "scale_ptr", "base_ptr", "w_ptr",
                                         "out_ptr", "D", "mix_eps", "hc_eps", "norm_eps")}
    return {"hc_pre (+ norm)": (M.hc_pre_kernel, pre, {"HC": 4, "NORM": True,
                                                       "BLOCK_D": M.BLOCK_D}),
            "hc_post": (M.hc_post_kernel, post, {"HC": 4, "BLOCK_D": M.POST_BLOCK_D}),
            "hc_head (+ norm)": (M.hc_head_kernel, head, {"HC": 4, "NORM": True,
                                                         "BLOCK_D": M.HEAD_BLOCK_D})}


def _moe_fused_variants():
    """The MoE's bf16 kernels as the Flash config runs them: 256 experts, top 6, sqrt-softplus."""
    from . import moe_fused_triton as F

    route = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "tid2eid_ptr": "*i64",
             "ids_ptr": "*i64", "weights_ptr": "*fp32", "indices_ptr": "*i64", "D": "i32:D",
             "E": "i32", "route_scale": "fp32"}
    mlp = {"x_ptr": "*bf16", "indices_ptr": "*i64", "weights_ptr": "*fp32", "w1_ptr": "*bf16",
           "w3_ptr": "*bf16", "h_ptr": "*bf16", "D": "i32:D", "INTER": "i32:D", "limit": "fp32"}
    down = {"h_ptr": "*bf16", "indices_ptr": "*i64", "w2_ptr": "*bf16", "routed_ptr": "*fp32",
            "out_ptr": "*fp32", "D": "i32:D", "INTER": "i32:D", "E": "i32"}
    blocks = {"BLOCK_K": F.BLOCK_K, "BLOCK_N": F.BLOCK_N}
    return {
        "moe_route (biased)": (F.moe_route_kernel, route, {
            "K": 6, "K_PAD": 8, "SCORE": F.SCORE_FUNC_IDS["sqrtsoftplus"], "HASH": False,
            "E_PAD": 256, "BLOCK_K": F.ROUTE_BLOCK_K}),
        "moe_routed gate_up": (F.gate_up_kernel, mlp, {"K": 6, "ROUTED": True, **blocks}),
        "moe_routed down": (F.down_kernel, down, {"K": 6, "ROUTED": True, **blocks}),
    }


def _moe_fused_quant_variants(dialect):
    """The MoE's kernels for the published formats as the Flash config runs them (D 4096, inter
    2048, top 6, ue8m0 scales): FP4 routed experts, the FP8 shared expert (fnuz weights from
    ocp_to_fnuz on gfx942)."""
    from . import moe_fused_quant_triton as F
    from .triton_kv_row import fp8_type

    mlp = {"x_ptr": "*bf16", "indices_ptr": "*i64", "weights_ptr": "*fp32", "w1_ptr": "*u8",
           "w3_ptr": "*u8", "s1_ptr": "*u8", "s3_ptr": "*u8", "h_ptr": "*bf16", "D": "i32:D",
           "INTER": "i32:D", "limit": "fp32"}
    down = {"h_ptr": "*bf16", "indices_ptr": "*i64", "w2_ptr": "*u8", "s2_ptr": "*u8",
            "routed_ptr": "*fp32", "out_ptr": "*fp32", "D": "i32:D", "INTER": "i32:D", "E": "i32"}
    shared = {"indices_ptr": "*bf16"}   # the shared launches pass x there (unread)

    def variant(kernel, sig, fp4):
        routed = {"K": 6, "ROUTED": True} if fp4 else {"K": 1, "ROUTED": False}
        return kernel, sig, {**routed, "FP4": fp4, "FP8": fp8_type(dialect),
                             "HALVES": dialect.name == "fnuz", "SCALE_E8M0": True,
                             "BLOCK_N": F.BLOCK_N, "EXACT_DOT": False}, F.LAUNCH_OPTIONS

    return {
        "moe_routed gate_up (fp4)": variant(F.quant_gate_up_kernel, mlp, True),
        "moe_routed down (fp4)": variant(F.quant_down_kernel, down, True),
        "moe_shared gate_up (fp8)": variant(F.quant_gate_up_kernel, {**mlp, **shared}, False),
        "moe_shared down (fp8)": variant(F.quant_down_kernel,
                                         {**down, **shared, "out_ptr": "*bf16"}, False),
    }


def _indexer_topk_variants():
    """The indexer's top-k at the Flash (k 512) and Pro (k 1024) configs (bf16 scores, a width
    per row, chunks of K columns) and the picked rows' gather (int64 locations)."""
    from . import indexer_topk_triton as X

    topk = {"scores_ptr": "*bf16", "visible_ptr": "*u8", "width_ptr": "*i64", "out_ptr": "*i64",
            "T": "i32", "k": "i32:D"}
    gather = {"loc_ptr": "*i64", "loc_stride_n": "i32", "T": "i32", "pick_ptr": "*i64",
              "rows_ptr": "*i64", "valid_ptr": "*u8", "k": "i32:D", "total": "i32"}

    def variant(k):
        keep, block = X.blocks(k)
        return (X.indexer_topk_kernel, topk, {"HAS_WIDTH": True, "K": keep, "BLOCK": block},
                X.LAUNCH_OPTIONS)

    return {"indexer_topk (k 512)": variant(512), "indexer_topk (k 1024)": variant(1024),
            "picked_rows": (X.picked_rows_kernel, gather,
                            {"loc_stride_t": 1, "BLOCK": X.GATHER_BLOCK}, X.LAUNCH_OPTIONS)}


def _compressor_variants():
    """The KV compressors as the Flash config runs them (dim 4096, rope 64, bf16 rows): the
    projection, the pool + finish of the attention's ratio-4 (head_dim 512, overlap) and ratio-128
    compressors and of the indexer's (head_dim 128, overlap, rotate), the ring write."""
    from . import compressor_update_triton as C

    project = {"x_ptr": "*bf16", "wkv_ptr": "*fp32", "wgate_ptr": "*fp32", "out_ptr": "*fp32",
               "n_rows": "i32", "dim": "i32:D", "width": "i32:D"}
    pool = {"new_ptr": "*fp32", "new_stride": "i32:D", "state_ptr": "*fp32",
            "state_stride": "i32:D", "src_state_ptr": "*i64", "src_new_ptr": "*i64",
            "has_prev_ptr": "*i1", "window_start_ptr": "*i64", "ape_ptr": "*fp32",
            "freq_ptr": "*fp32",
            "w_ptr": "*fp32", "out_ptr": "*bf16", "n_src": "i32", "eps": "fp32"}
    ring = {"new_ptr": "*fp32", "new_stride": "i32:D", "state_ptr": "*fp32",
            "state_stride": "i32:D", "write_ptr": "*i64", "scratch_row": "i64", "n_cols": "i32:D"}

    def pool_variant(head_dim, ratio, rotate):
        return C.pool_finish_kernel, pool, {
            "HEAD_DIM": head_dim, "RATIO": ratio, "OVERLAP": ratio == 4, "ROPE_DIM": 64,
            "ROTATE": rotate, "BLOCK_R": C.BLOCK_R}, C.pool_launch_options(head_dim)

    blocks = {"BLOCK_M": C.PROJECT_BLOCK_M, "BLOCK_N": C.PROJECT_BLOCK_N,
              "BLOCK_K": C.PROJECT_BLOCK_K}
    return {
        "compressor_project": (C.compressor_project_kernel, project, blocks, C.LAUNCH_OPTIONS),
        "compressor pool (c4, d 512)": pool_variant(512, 4, False),
        "compressor pool (c128, d 512)": pool_variant(512, 128, False),
        "compressor pool (indexer, d 128)": pool_variant(128, 4, True),
        "compressor ring write": (C.ring_write_kernel, ring, {"BLOCK": C.RING_BLOCK},
                                  C.LAUNCH_OPTIONS),
    }


def _attention_plan_variants():
    """A decode step's plan as the model makes it (window 128, the newest slot given; int64
    positions and slots, int32 req_to_token, int64 full_to_swa): the ratio-4 launch with the
    window folded in (every token a candidate, as captured), also with its ring rows by SWA
    page, and the ratio-128 one (given candidates, as an eager step)."""
    from . import attention_plan_triton as P

    sig = {"pos_ptr": "*i64", "req_ptr": "*i64", "seq_ptr": "*i64", "n_tokens": "i32",
           "r2t_ptr": "*i32", "r2t_stride0": "i32", "r2t_stride1": "i32", "n_slots": "i32",
           "ctx": "i32", "f2s_ptr": "*i64", "f2s_stride": "i32", "n_full": "i32",
           "swa_write_ptr": "*i32", "win_loc_ptr": "*i32", "win_valid_ptr": "*i1",
           "window": "i32", "cand_ptr": "*i64", "n_cand": "i32", "ratio": "i32", "ring": "i32",
           "ring_page": "i32", "n_rows": "i32", "tokens_ptr": "*i64", "src_state_ptr": "*i64",
           "src_new_ptr": "*i64", "has_prev_ptr": "*i1", "window_start_ptr": "*i64",
           "emit_loc_ptr": "*i64", "state_write_ptr": "*i64", "row_loc_ptr": "*i64",
           "row_valid_ptr": "*i1", "row_width_ptr": "*i64"}

    def variant(window, candidates, ring, by_page=False):
        return P.attention_plan_kernel, sig, {
            "WINDOW": window, "SWA_WRITE": True, "PLAN": True, "CANDIDATES": candidates,
            "BY_PAGE": by_page, "BLOCK_W": 128, "BLOCK_RING": ring, "BLOCK_C": P.BLOCK_C}, P.LAUNCH_OPTIONS

    return {"attention_plan (window + c4)": variant(True, False, 8),
            "attention_plan (window + c4, rings by SWA page)": variant(True, False, 8, True),
            "attention_plan (c128, given candidates)": variant(False, True, 128)}


def _attention_projection_variants():
    """The indexer's query (64 index heads, head dim 128, rope 64, bf16; one kernel for both
    numerics) and the grouped wo_a (8 groups of 8 heads of 512, rank 1024 per group, bf16 on the
    matrix cores) as the Flash config runs them."""
    from . import grouped_out_proj_triton as G
    from . import indexer_query_triton as Q

    query = {"q_ptr": "*bf16", "freq_ptr": "*fp32", "freq_stride": "i32:D", "pos_ptr": "*i64",
             "out_ptr": "*bf16", "n_heads": "i32:D"}
    out_proj = {"o_ptr": "*bf16", "freq_ptr": "*fp32", "freq_stride": "i32:D", "pos_ptr": "*i64",
                "w_ptr": "*bf16", "out_ptr": "*bf16", "n_tokens": "i32", "K": "i32:D",
                "R": "i32:D"}

    return {
        "indexer_query": (Q.indexer_query_kernel, query, {
            "HEAD_DIM": 128, "ROPE_DIM": 64, "BLOCK_H": Q.BLOCK_H}, Q.LAUNCH_OPTIONS),
        "grouped_out_proj": (G.grouped_out_proj_kernel, out_proj, {
            "HEAD_DIM": 512, "ROPE_DIM": 64, "BLOCK_N": G.BLOCK_N, "BLOCK_R": G.BLOCK_R,
            "BLOCK_K": G.BLOCK_K, "DOT_NATIVE": True}, G.LAUNCH_OPTIONS),
    }


def _indexer_scores_variants(dialect):
    """The indexer's scores as the model runs them (64 heads, bf16 q, page size 64), in both
    numerics: bf16 on the bf16 matrix cores (as launched on a GPU), fp32 with IEEE fp32 dots;
    bf16 also over keys in 16 x 16 tiles.
    A 4th element: the kernel's own launch options (four waves, one stage)."""
    from . import indexer_scores_triton as S
    from .triton_kv_row import fp8_constexprs

    def variant(bf16, key_tile=0):
        w = "*bf16" if bf16 else "*fp32"
        sig = {"q_ptr": "*bf16", "q_stride_n": "i32:D", "q_stride_h": "i32:D", "w_ptr": w,
               "w_stride_n": "i32:D", "w_scale": "fp32", "cache_ptr": "*u8", "loc_ptr": "*i64",
               "loc_stride_n": "i32", "valid_ptr": "*i1", "valid_stride_n": "i32", "out_ptr": w,
               "n_heads": "i32:D", "n_rows": "i32", "num_slots": "i32"}
        cex = {"PAGE_SIZE": 64, "FP8": fp8_constexprs(dialect)["FP8"], "BF16": bf16,
               "HEAD_BLOCK": S.head_block(64), "BLOCK_C": S.BLOCK_C, "D_CHUNK": S.D_CHUNK,
               "DOT_BF16": bf16, "KEY_TILE": key_tile}
        return S.indexer_scores_kernel, sig, cex, S.LAUNCH_OPTIONS

    return {"indexer_scores (bf16, reference)": variant(True),
            "indexer_scores (fp32)": variant(False),
            "indexer_scores (bf16, keys in 16 x 16 tiles)": variant(True, 16)}


def _decode_attention_variants(dialect):
    """The sparse decode attention as the model runs it on a GPU (bf16 q, bf16 dots; SWA pages
    of 256, C4 pages of 64; a window of 128 rows), in both numerics."""
    from . import decode_attention_triton as A
    from .triton_kv_row import fp8_type

    sig = {"q_ptr": "*bf16", "q_stride_n": "i32:D", "q_stride_h": "i32:D", "out_ptr": "*bf16",
           "o_stride_n": "i32:D", "o_stride_h": "i32:D", "sink_ptr": "*fp32", "scale": "fp32",
           "n_heads": "i32", "swa_ptr": "*u8", "wloc_ptr": "*i32", "wloc_stride": "i32",
           "wvalid_ptr": "*i1", "wvalid_stride": "i32", "n_window": "i32", "swa_slots": "i64",
           "cmp_ptr": "*u8", "cloc_ptr": "*i64", "cloc_stride": "i32", "cvalid_ptr": "*i1",
           "cvalid_stride": "i32", "n_comp": "i32", "cmp_slots": "i64"}

    def variant(reference):
        cex = {"SWA_PAGE": 256, "SWA_PAGE_BYTES": L.page_bytes(256), "CMP_PAGE": 64,
               "CMP_PAGE_BYTES": L.page_bytes(64), "FP8": fp8_type(dialect),
               "REFERENCE": reference, "BLOCK_H": A.BLOCK_H, "BLOCK_R": A.BLOCK_R,
               "BLOCK_W": 128, "DOT_BF16": True}
        return A.sparse_decode_attention_kernel, sig, cex, A.LAUNCH_OPTIONS

    return {"sparse_decode_attention (reference)": variant(True),
            "sparse_decode_attention (fp32)": variant(False)}


def _quant_linear_variants(dialect):
    """The quantized linears at decode (ue8m0 scales): the FP8 linear at 16 and 64 rows (the
    platform's dialect: fnuz weights from ocp_to_fnuz on gfx942), the routed experts' FP4
    grouped linear at 16 rows per expert; 64 output columns per program."""
    from . import quant_linear_triton as Q
    from .triton_kv_row import fp8_type

    sig = {"x_ptr": "*bf16", "x_stride": "i32:D", "w_ptr": "*u8", "w_stride_e": "i64",
           "w_stride_n": "i32:D", "ws_ptr": "*u8", "ws_stride_e": "i32", "ws_stride_n": "i32",
           "offs_ptr": "*i32", "out_ptr": "*bf16", "out_stride": "i32:D", "n_rows": "i32",
           "n_out": "i32:D", "K": "i32:D"}
    common = {"FP8": fp8_type(dialect), "ROUND_SCALE": True, "BLOCK_N": Q.BLOCK_NS[0],
              "EXACT_DOT": False}

    def fp8(rows):
        return Q.fp8_linear_kernel, sig, {**common, "FNUZ_ACT": dialect.name == "fnuz",
                                          "SCALE_E8M0": True, "GROUPED": False,
                                          "BLOCK_M": rows}, Q.LAUNCH_OPTIONS

    fp4 = (Q.fp4_linear_kernel, sig, {**common, "FP8_HALVES": dialect.name == "fnuz",
                                      "GROUPED": True, "BLOCK_M": 16}, Q.LAUNCH_OPTIONS)
    return {"fp8_linear (16 rows)": fp8(16), "fp8_linear (64 rows)": fp8(64),
            "fp4_grouped_linear (16 rows)": fp4}


def compile_for(kernel, signature, constexprs, arch, options=None):
    """Compile one kernel for hip:<arch> (cuda for an "sm_<cc>" arch); returns the compiled
    kernel (`.asm["amdgcn"]` or `.asm["ptx"]`, `.metadata`). signature: arg name -> Triton
    type, ":D" marking an int divisible by 16; constexprs: the other arguments' values;
    options: launch options (default: the set-KV kernels')."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if triton_interpreted():
        raise RuntimeError("ahead-of-time compile needs a process with TRITON_INTERPRET unset")
    from .triton_kv_row import LAUNCH_OPTIONS

    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        ty = "constexpr" if name in constexprs else signature[name]
        if ty.startswith("*") or ty.endswith(":D"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        sig[name] = ty.removesuffix(":D")
    src = ASTSource(kernel, sig, constexprs, attrs)
    target = (GPUTarget("cuda", int(arch[3:]), 32) if arch.startswith("sm_")
              else GPUTarget("hip", arch, 64))
    return triton.compile(src, target=target,
                          options=dict(LAUNCH_OPTIONS if options is None else options))


def _metadata_int(amdgcn: str, key: str) -> int:
    m = re.search(rf"^\s*\.{key}:\s*(\d+)", amdgcn, re.MULTILINE)
    if m is None:
        raise ValueError(f"amdgcn metadata has no .{key}")
    return int(m.group(1))


def resource_usage(amdgcn: str) -> dict:
    """Registers, scratch and fp8 convert use read from the amdgcn text and its metadata."""
    return {
        "vgpr": _metadata_int(amdgcn, "vgpr_count"),
        "sgpr": _metadata_int(amdgcn, "sgpr_count"),
        "scratch_bytes": _metadata_int(amdgcn, "private_segment_fixed_size"),
        "vgpr_spill": _metadata_int(amdgcn, "vgpr_spill_count"),
        "hw_fp8_convert": sorted({m.group(0) for m in HW_FP8_CONVERT.finditer(amdgcn)}),
    }


def _report_row(arch: str, name: str) -> dict:
    dialect = dialect_for_arch(arch)
    kernel, signature, constexprs, *options = _variants(dialect)[name]
    amdgcn = compile_for(kernel, signature, constexprs, arch, *options).asm["amdgcn"]
    return {"arch": arch, "dialect": dialect.name, "kernel": name, "function": kernel.__name__,
            **resource_usage(amdgcn)}


def report(archs=ARCHS, jobs: int = 1) -> list[dict]:
    """One row per (arch, kernel variant), in that order; jobs > 1 compiles in that many
    processes (each compile is single-threaded)."""
    work = [(arch, name) for arch in archs for name in _variants(dialect_for_arch(arch))]
    if jobs <= 1:
        return [_report_row(*w) for w in work]
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_report_row, *zip(*work)))
