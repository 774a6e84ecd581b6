// torch.ops.dsv4_set_kv: the fused set-KV ops on ROCm/CUDA tensors. Launches on the current
// stream of the tensors' device, so the ops can be captured in HIP/CUDA graphs.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "set_kv_args.h"

namespace dsv4 {
namespace {

void launch(const SetKvParams& p, const at::Tensor& anchor, bool fnuz) {
  TORCH_CHECK(anchor.is_cuda(), "dsv4_set_kv runs on ROCm/CUDA tensors, got ", anchor.device());
  const c10::cuda::CUDAGuard guard(anchor.device());
  const char* err = launch_set_kv(p, fnuz, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "dsv4_set_kv kernel launch failed: ", err);
}

void k_norm_rope_store(const at::Tensor& kv, const at::Tensor& weight, double eps,
                       const at::Tensor& freqs, const at::Tensor& positions,
                       const at::Tensor& out_loc, const at::Tensor& cache, int64_t page_size,
                       const std::optional<at::Tensor>& q, bool fnuz, c10::string_view rms,
                       c10::string_view q_mode) {
  // c10::string_view is std::string_view only in newer torch: convert explicitly
  launch(k_norm_rope_store_params(kv, weight, eps, freqs, positions, out_loc, cache, page_size, q,
                                  std::string_view(rms.data(), rms.size()),
                                  std::string_view(q_mode.data(), q_mode.size())),
         kv, fnuz);
}

void store_cache(const at::Tensor& rows, const at::Tensor& cache, const at::Tensor& out_loc,
                 int64_t page_size, bool fnuz) {
  launch(store_cache_params(rows, cache, out_loc, page_size), rows, fnuz);
}

void translate_norm_rope_store(const at::Tensor& kv, const at::Tensor& weight, double eps,
                               const at::Tensor& freqs, const at::Tensor& positions,
                               const at::Tensor& full_loc, const at::Tensor& full_to_swa,
                               const at::Tensor& cache, int64_t page_size,
                               const std::optional<at::Tensor>& swa_loc_out, bool fnuz,
                               const std::optional<at::Tensor>& q, c10::string_view rms,
                               c10::string_view q_mode) {
  launch(translate_norm_rope_store_params(kv, weight, eps, freqs, positions, full_loc, full_to_swa,
                                          cache, page_size, swa_loc_out, q,
                                          std::string_view(rms.data(), rms.size()),
                                          std::string_view(q_mode.data(), q_mode.size())),
         kv, fnuz);
}

}  // namespace
}  // namespace dsv4

TORCH_LIBRARY(dsv4_set_kv, m) {
  m.def("k_norm_rope_store(Tensor kv, Tensor weight, float eps, Tensor freqs, Tensor positions, "
        "Tensor out_loc, Tensor(a!) cache, int page_size, Tensor(b!)? q, bool fnuz, "
        "str rms=\"exact\", str q_mode=\"norm_rope\") -> ()");
  m.def("store_cache(Tensor rows, Tensor(a!) cache, Tensor out_loc, int page_size, bool fnuz) "
        "-> ()");
  m.def("translate_norm_rope_store(Tensor kv, Tensor weight, float eps, Tensor freqs, "
        "Tensor positions, Tensor full_loc, Tensor full_to_swa, Tensor(a!) cache, int page_size, "
        "Tensor(b!)? swa_loc_out, bool fnuz, Tensor(c!)? q=None, str rms=\"exact\", "
        "str q_mode=\"norm_rope\") -> ()");
}

TORCH_LIBRARY_IMPL(dsv4_set_kv, CUDA, m) {
  m.impl("k_norm_rope_store", &dsv4::k_norm_rope_store);
  m.impl("store_cache", &dsv4::store_cache);
  m.impl("translate_norm_rope_store", &dsv4::translate_norm_rope_store);
}
