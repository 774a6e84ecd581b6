// The fused set-KV kernel: one wavefront (AMD, 64 lanes) or warp (NVIDIA, 32 lanes) per row.
// A launch covers ops 2, 3 and 6 and the q heads of op 2; SetKvParams says which.
// CUDA dialect: on ROCm, torch.utils.cpp_extension hipifies this file before compiling it.
#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>
#endif

#include "kv_row.cuh"

namespace dsv4 {
namespace {

#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
constexpr int kLanes = 64;
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
  return __shfl_xor(v, mask, kLanes);
}
#else
constexpr int kLanes = 32;
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
#endif

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / kLanes;

template <Fp8Dialect D>
__global__ void __launch_bounds__(kThreads) set_kv_kernel(const SetKvParams p) {
  const int lane = threadIdx.x % kLanes;
  const int64_t item = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (item >= items_of(p)) return;
  RowJob job;
  if (!make_job(p, item, item_slot(p, item, lane), job)) return;

  float x[Lane<kLanes>::kEpt];
  load_lane<kLanes>(job, lane, x);
  float inv_rms = 0.0f;
  // job.rms is the same on every lane of the group (one item per group): no divergence.
  if (job.freqs != nullptr && job.rms == RmsMode::kExact) {
    double sum_squares = lane_squares_exact<kLanes>(x);
#pragma unroll
    for (int m = kLanes / 2; m > 0; m /= 2) sum_squares += shfl_xor(sum_squares, m);
    inv_rms = rms_inverse(sum_squares, kHeadDim, p.eps);
  } else if (job.freqs != nullptr) {
    float sum_squares = lane_squares_fp32<kLanes>(x, job.rms);
#pragma unroll
    for (int m = kLanes / 2; m > 0; m /= 2) {
      sum_squares = add_rn(sum_squares, shfl_xor(sum_squares, m));
    }
    inv_rms = rms_inverse_of(job.rms, sum_squares, p.eps);
  }
  float amax = finish_lane<kLanes>(job, p, lane, inv_rms, x);
#pragma unroll
  for (int m = Lane<kLanes>::kTileLanes / 2; m > 0; m /= 2) amax = max_f(amax, shfl_xor(amax, m));
  store_lane<D, kLanes>(job, lane, amax, x);
}

}  // namespace

const char* launch_set_kv(const SetKvParams& p, bool fnuz, void* stream) {
  const int64_t items = items_of(p);
  if (items == 0) return nullptr;
  const dim3 grid(unsigned((items + kRowsPerBlock - 1) / kRowsPerBlock));
  const auto s = static_cast<cudaStream_t>(stream);
  if (fnuz) {
    set_kv_kernel<Fp8Dialect::Fnuz><<<grid, kThreads, 0, s>>>(p);
  } else {
    set_kv_kernel<Fp8Dialect::Ocp><<<grid, kThreads, 0, s>>>(p);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace dsv4
