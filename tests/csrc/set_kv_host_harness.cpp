// Runs the HIP/CUDA set-KV kernel logic on the CPU: the same argument code (set_kv_args.h) and
// the same per-lane phases (kv_row.cuh) as the GPU kernel, with the wavefront's shuffle
// reductions done as loops over the lanes, in the same butterfly order. Lets the tests compare
// its bytes with the torch reference on a machine without a GPU. `lanes` picks the AMD (64) or
// NVIDIA (32) row split.
// Registered as torch.ops.dsv4_set_kv_host (torch/library.h compiles much faster than pybind).
#include <torch/library.h>

#include <cstring>

#include "kv_row.cuh"
#include "set_kv_args.h"

namespace dsv4 {

// The wavefront's xor-butterfly reduction of one value per lane: for m = LANES/2, ..., 1 lane l
// takes add(v[l], v[l ^ m]), as the kernel's shfl_xor loop; returns lane 0's result (every lane
// ends with the same value since add is commutative, which is checked; NaN payloads aside).
template <int LANES, typename T, typename Add>
T butterfly(T* v, Add add) {
  for (int m = LANES / 2; m > 0; m /= 2) {
    T next[LANES];
    for (int l = 0; l < LANES; ++l) next[l] = add(v[l], v[l ^ m]);
    for (int l = 0; l < LANES; ++l) v[l] = next[l];
  }
  for (int l = 1; l < LANES; ++l) {
    const bool nan = v[l] != v[l] && v[0] != v[0];
    TORCH_CHECK(nan || std::memcmp(&v[l], &v[0], sizeof(T)) == 0,
                "lanes disagree after the reduction");
  }
  return v[0];
}

// The kernel's 1 / rms of a job (set_kv_kernels.cu), with the lanes' x already loaded.
template <int LANES>
float job_rms_inverse(const RowJob& job, const SetKvParams& p, float (*x)[Lane<LANES>::kEpt]) {
  if (job.freqs == nullptr) return 0.0f;
  if (job.rms == RmsMode::kExact) {
    double sums[LANES];
    for (int lane = 0; lane < LANES; ++lane) sums[lane] = lane_squares_exact<LANES>(x[lane]);
    return rms_inverse(butterfly<LANES>(sums, [](double a, double b) { return a + b; }),
                       kHeadDim, p.eps);
  }
  float sums[LANES];
  for (int lane = 0; lane < LANES; ++lane) sums[lane] = lane_squares_fp32<LANES>(x[lane], job.rms);
  return rms_inverse_of(job.rms, butterfly<LANES>(sums, add_rn), p.eps);
}

template <Fp8Dialect D, int LANES>
void run_rows(const SetKvParams& p) {
  using L = Lane<LANES>;
  for (int64_t item = 0; item < items_of(p); ++item) {
    RowJob job;
    if (!make_job(p, item, item_slot(p, item, 0), job)) continue;
    float x[LANES][L::kEpt];
    for (int lane = 0; lane < LANES; ++lane) load_lane<LANES>(job, lane, x[lane]);
    const float inv_rms = job_rms_inverse<LANES>(job, p, x);
    float amax[LANES];
    for (int lane = 0; lane < LANES; ++lane) {
      amax[lane] = finish_lane<LANES>(job, p, lane, inv_rms, x[lane]);
    }
    for (int lane = 0; lane < LANES; ++lane) {
      const int tile_start = lane - lane % L::kTileLanes;
      float tile_amax = 0.0f;
      for (int l = tile_start; l < tile_start + L::kTileLanes; ++l) {
        tile_amax = max_f(tile_amax, amax[l]);
      }
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
                       int64_t page_size, const OptTensor& q, bool fnuz, int64_t lanes,
                       c10::string_view rms, c10::string_view q_mode) {
  dsv4::run(dsv4::k_norm_rope_store_params(kv, weight, eps, freqs, positions, out_loc, cache,
                                           page_size, q, std::string_view(rms.data(), rms.size()),
                                           std::string_view(q_mode.data(), q_mode.size())),
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
                               const OptTensor& swa_loc_out, bool fnuz, int64_t lanes,
                               const OptTensor& q, c10::string_view rms,
                               c10::string_view q_mode) {
  dsv4::run(dsv4::translate_norm_rope_store_params(
                kv, weight, eps, freqs, positions, full_loc, full_to_swa, cache, page_size,
                swa_loc_out, q, std::string_view(rms.data(), rms.size()),
                std::string_view(q_mode.data(), q_mode.size())),
            fnuz, lanes);
}
}  // namespace

TORCH_LIBRARY(dsv4_set_kv_host, m) {
  m.def("k_norm_rope_store(Tensor kv, Tensor weight, float eps, Tensor freqs, Tensor positions, "
        "Tensor out_loc, Tensor cache, int page_size, Tensor? q, bool fnuz, int lanes, "
        "str rms=\"exact\", str q_mode=\"norm_rope\") -> ()",
        &k_norm_rope_store);
  m.def("store_cache", &store_cache);
  m.def("translate_norm_rope_store(Tensor kv, Tensor weight, float eps, Tensor freqs, "
        "Tensor positions, Tensor full_loc, Tensor full_to_swa, Tensor cache, int page_size, "
        "Tensor? swa_loc_out, bool fnuz, int lanes, Tensor? q=None, str rms=\"exact\", "
        "str q_mode=\"norm_rope\") -> ()",
        &translate_norm_rope_store);
}
