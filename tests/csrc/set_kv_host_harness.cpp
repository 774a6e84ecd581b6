// Runs the HIP/CUDA set-KV kernel logic on the CPU: the same argument code (set_kv_args.h) and
// the same per-lane phases (kv_row.cuh) as the GPU kernel, with the wavefront's shuffle
// reductions done as loops over the lanes. Lets the tests compare its bytes with the torch
// reference on a machine without a GPU. `lanes` picks the AMD (64) or NVIDIA (32) row split.
// Registered as torch.ops.dsv4_set_kv_host (torch/library.h compiles much faster than pybind).
#include <torch/library.h>

#include "kv_row.cuh"
#include "set_kv_args.h"

namespace dsv4 {

template <Fp8Dialect D, int LANES>
void run_rows(const SetKvParams& p) {
  using L = Lane<LANES>;
  for (int64_t item = 0; item < items_of(p); ++item) {
    RowJob job;
    if (!make_job(p, item, item_slot(p, item, 0), job)) continue;
    float x[LANES][L::kEpt];
    double sum_squares = 0.0;
    for (int lane = 0; lane < LANES; ++lane) sum_squares += load_lane<LANES>(job, lane, x[lane]);
    const float inv_rms = job.freqs != nullptr ? rms_inverse(sum_squares, kHeadDim, p.eps) : 0.0f;
    float amax[LANES];
    for (int lane = 0; lane < LANES; ++lane) {
      amax[lane] = finish_lane<LANES>(job, p, lane, inv_rms, x[lane]);
    }
    for (int lane = 0; lane < LANES; ++lane) {
      const int tile_start = lane - lane % L::kTileLanes;
      float tile_amax = 0.0f;
      for (int l = tile_start; l < tile_start + L::kTileLanes; ++l) tile_amax = max_f(tile_amax, amax[l]);
      store_lane<D, LANES>(job, lane, tile_amax, x[lane]);
    }
  }
}

void run(const SetKvParams& p, bool fnuz, int64_t lanes) {
  TORCH_CHECK(lanes == 32 || lanes == 64, "lanes must be 32 or 64, got ", lanes);
  if (fnuz) {
    lanes == 64 ? run_rows<Fp8Dialect::Fnuz, 64>(p) : run_rows<Fp8Dialect::Fnuz, 32>(p);
  } else {
    lanes == 64 ? run_rows<Fp8Dialect::Ocp, 64>(p) : run_rows<Fp8Dialect::Ocp, 32>(p);
  }
}

}  // namespace dsv4

namespace {
using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

void k_norm_rope_store(const Tensor& kv, const Tensor& weight, double eps, const Tensor& freqs,
                       const Tensor& positions, const Tensor& out_loc, const Tensor& cache,
                       int64_t page_size, const OptTensor& q, bool fnuz, int64_t lanes) {
  dsv4::run(dsv4::k_norm_rope_store_params(kv, weight, eps, freqs, positions, out_loc, cache,
                                           page_size, q),
            fnuz, lanes);
}

void store_cache(const Tensor& rows, const Tensor& cache, const Tensor& out_loc,
                 int64_t page_size, bool fnuz, int64_t lanes) {
  dsv4::run(dsv4::store_cache_params(rows, cache, out_loc, page_size), fnuz, lanes);
}

void translate_norm_rope_store(const Tensor& kv, const Tensor& weight, double eps,
                               const Tensor& freqs, const Tensor& positions,
                               const Tensor& full_loc, const Tensor& full_to_swa,
                               const Tensor& cache, int64_t page_size,
                               const OptTensor& swa_loc_out, bool fnuz, int64_t lanes) {
  dsv4::run(dsv4::translate_norm_rope_store_params(kv, weight, eps, freqs, positions, full_loc,
                                                   full_to_swa, cache, page_size, swa_loc_out),
            fnuz, lanes);
}
}  // namespace

TORCH_LIBRARY(dsv4_set_kv_host, m) {
  m.def("k_norm_rope_store", &k_norm_rope_store);
  m.def("store_cache", &store_cache);
  m.def("translate_norm_rope_store", &translate_norm_rope_store);
}
