// Tensors -> SetKvParams for the three set-KV ops, with the checks that keep the kernel's memory
// accesses valid (dtypes, shapes, strides, devices, page stride, alignment). Location ranges are
// checked in Python (hip_kernels/set_kv.py): that needs a host sync, which C++ avoids.
// Host-only and free of GPU headers: shared by the torch binding and the CPU test harness.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <string_view>

#include "set_kv_params.h"

namespace dsv4 {

inline int64_t page_bytes(int64_t page_size) {
  constexpr int64_t token_bytes = kValueBytes + kScaleBytes;
  return (page_size * token_bytes + kValueBytes - 1) / kValueBytes * kValueBytes;
}

inline void check_device(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on ", ref.device(), ", got ",
              t.device());
}

// [N, 512] bf16 rows with unit inner stride.
inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(1) == kHeadDim, name, " must have shape [N, ", kHeadDim,
              "], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, name, " must have unit inner stride, got strides ", t.strides());
}

// A 1-D int32/int64 tensor on ref's device; n >= 0 also fixes its length.
inline IndexArray index_array(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              int64_t n) {
  check_device(t, name, ref);
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
              " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(n < 0 || t.size(0) == n, name, " must have shape [", n, "], got ", t.sizes());
  return IndexArray{t.data_ptr(), t.stride(0), t.scalar_type() == at::kLong};
}

inline void set_cache(SetKvParams& p, const at::Tensor& cache, int64_t page_size,
                      const at::Tensor& ref) {
  check_device(cache, "cache", ref);
  TORCH_CHECK(page_size >= 1, "page_size must be >= 1, got ", page_size);
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 2 && cache.is_contiguous(),
              "cache must be a contiguous 2-D uint8 tensor, got ", cache.scalar_type(), " ",
              cache.sizes());
  TORCH_CHECK(cache.size(1) == page_bytes(page_size), "cache page stride is ", cache.size(1),
              " bytes but page_size=", page_size, " needs ", page_bytes(page_size));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 4 == 0,
              "cache must be 4-byte aligned (the kernel stores 32-bit words)");
  p.cache = static_cast<uint8_t*>(cache.data_ptr());
  p.page_size = page_size;
  p.page_bytes = page_bytes(page_size);
  p.num_slots = cache.size(0) * page_size;
}

// Source rows, weight, eps, freqs = view_as_real(freqs_cis) [max_pos, 32, 2] fp32, positions.
inline void set_norm_rope(SetKvParams& p, const at::Tensor& kv, const at::Tensor& weight,
                          double eps, const at::Tensor& freqs, const at::Tensor& positions) {
  check_rows(kv, "kv");
  check_device(weight, "weight", kv);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "weight must be bfloat16 or float32, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == kHeadDim && weight.is_contiguous(),
              "weight must be contiguous [", kHeadDim, "], got ", weight.sizes());
  check_device(freqs, "freqs", kv);
  TORCH_CHECK(freqs.scalar_type() == at::kFloat && freqs.dim() == 3 &&
                  freqs.size(1) == kRopeDim / 2 && freqs.size(2) == 2 && freqs.stride(1) == 2 &&
                  freqs.stride(2) == 1,
              "freqs must be view_as_real(freqs_cis): float32 [max_pos, ", kRopeDim / 2,
              ", 2] with contiguous rows, got ", freqs.sizes(), " strides ", freqs.strides());
  p.num_rows = kv.size(0);
  p.src = static_cast<const uint16_t*>(kv.data_ptr());
  p.src_row_stride = kv.stride(0);
  p.normalize = true;
  p.weight = weight.data_ptr();
  p.weight_bf16 = weight.scalar_type() == at::kBFloat16;
  p.eps = static_cast<float>(eps);
  p.freqs = static_cast<const float*>(freqs.data_ptr());
  p.freqs_row_stride = freqs.stride(0);
  p.positions = index_array(positions, "positions", kv, p.num_rows);
}

// StoreNumerics.rms and .q_mode -> the norms of the KV row and of the q heads. The kernel runs
// rms "exact" | "device" with q_mode "norm_rope" | "bf16_norm_rope" (its other numerics fields
// are the defaults: hip_kernels/set_kv_hip.py refuses the rest).
inline void set_rms_modes(SetKvParams& p, std::string_view rms, std::string_view q_mode) {
  TORCH_CHECK(rms == "exact" || rms == "device", "rms must be 'exact' or 'device', got '",
              std::string(rms), "'");
  TORCH_CHECK(q_mode == "norm_rope" || q_mode == "bf16_norm_rope",
              "q_mode must be 'norm_rope' or 'bf16_norm_rope' for this kernel, got '",
              std::string(q_mode), "'");
  p.kv_rms = rms == "device" ? RmsMode::kDevice : RmsMode::kExact;
  p.q_rms = q_mode == "bf16_norm_rope" ? RmsMode::kBf16Ops : p.kv_rms;
}

// q [N, H, 512] bf16, normed and rotated in place beside the KV row (absent: no q work).
inline void set_q(SetKvParams& p, const std::optional<at::Tensor>& q, const at::Tensor& kv) {
  if (!q.has_value()) return;
  const at::Tensor& t = *q;
  check_device(t, "q", kv);
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 3 && t.size(0) == p.num_rows &&
                  t.size(2) == kHeadDim && t.stride(2) == 1,
              "q must be bfloat16 [", p.num_rows, ", H, ", kHeadDim,
              "] with unit inner stride, got ", t.scalar_type(), " ", t.sizes(), " strides ",
              t.strides());
  p.q = static_cast<uint16_t*>(t.data_ptr());
  p.q_row_stride = t.stride(0);
  p.q_head_stride = t.stride(1);
  p.num_heads = t.size(1);
}

inline SetKvParams k_norm_rope_store_params(const at::Tensor& kv, const at::Tensor& weight,
                                            double eps, const at::Tensor& freqs,
                                            const at::Tensor& positions, const at::Tensor& out_loc,
                                            const at::Tensor& cache, int64_t page_size,
                                            const std::optional<at::Tensor>& q,
                                            std::string_view rms = "exact",
                                            std::string_view q_mode = "norm_rope") {
  SetKvParams p;
  set_rms_modes(p, rms, q_mode);
  set_norm_rope(p, kv, weight, eps, freqs, positions);
  p.loc = index_array(out_loc, "out_loc", kv, p.num_rows);
  set_cache(p, cache, page_size, kv);
  set_q(p, q, kv);
  return p;
}

inline SetKvParams store_cache_params(const at::Tensor& rows, const at::Tensor& cache,
                                      const at::Tensor& out_loc, int64_t page_size) {
  check_rows(rows, "rows");
  SetKvParams p;
  p.num_rows = rows.size(0);
  p.src = static_cast<const uint16_t*>(rows.data_ptr());
  p.src_row_stride = rows.stride(0);
  p.loc = index_array(out_loc, "out_loc", rows, p.num_rows);
  set_cache(p, cache, page_size, rows);
  return p;
}

inline SetKvParams translate_norm_rope_store_params(
    const at::Tensor& kv, const at::Tensor& weight, double eps, const at::Tensor& freqs,
    const at::Tensor& positions, const at::Tensor& full_loc, const at::Tensor& full_to_swa,
    const at::Tensor& cache, int64_t page_size, const std::optional<at::Tensor>& swa_loc_out,
    const std::optional<at::Tensor>& q = std::nullopt, std::string_view rms = "exact",
    std::string_view q_mode = "norm_rope") {
  SetKvParams p;
  set_rms_modes(p, rms, q_mode);
  set_norm_rope(p, kv, weight, eps, freqs, positions);
  p.loc = index_array(full_loc, "full_loc", kv, p.num_rows);
  p.full_to_swa = index_array(full_to_swa, "full_to_swa", kv, -1);
  p.full_to_swa_len = full_to_swa.size(0);
  set_cache(p, cache, page_size, kv);
  if (swa_loc_out.has_value()) {
    const at::Tensor& t = *swa_loc_out;
    check_device(t, "swa_loc_out", kv);
    TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == p.num_rows,
                "swa_loc_out must be int32 [", p.num_rows, "], got ", t.scalar_type(), " ",
                t.sizes());
    p.swa_loc_out = static_cast<int32_t*>(t.data_ptr());
    p.swa_loc_out_stride = t.stride(0);
  }
  set_q(p, q, kv);
  return p;
}

}  // namespace dsv4
