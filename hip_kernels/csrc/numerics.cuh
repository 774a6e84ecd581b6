// Bit-exact scalar numerics of the set-KV family, shared by the GPU kernels (nvcc, hipcc) and the
// host harness of the tests (plain C++). Every function reproduces one rounding step of the torch
// reference in hip_kernels/set_kv_ref.py; nothing here depends on the math library.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif

// Unrolling matters on the GPU (the per-lane arrays must live in registers); host compilers
// would warn about the device pragma.
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define DSV4_UNROLL _Pragma("unroll")
#else
#define DSV4_UNROLL
#endif

namespace dsv4 {

DSV4_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(uint32_t, f);
#endif
}

DSV4_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}

DSV4_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// Round to nearest even, NaN -> 0x7FC0 (what torch's float -> bfloat16 cast does).
DSV4_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

DSV4_HD float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// Single-rounding products and sums: the reference rounds after every operation, so an FMA
// contraction of a*c - b*d would change RoPE results in the last bit.
DSV4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a * b;
#endif
}

DSV4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a + b;
#endif
}

DSV4_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a - b;
#endif
}

// Correctly rounded division and square root. HIP-Clang emits IEEE fdiv/sqrt for these unless
// built with -fno-hip-fp32-correctly-rounded-divide-sqrt (the compile test checks the ISA).
DSV4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

DSV4_HD float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);
#endif
}

// 1 / sqrt(mean(x^2) + eps) from the exact fp64 sum of squares of a 512-wide bf16 row.
DSV4_HD float rms_inverse(double sum_squares, int width, float eps) {
  const float mean_square = float(sum_squares / double(width));
  return div_rn(1.0f, sqrt_rn(add_rn(mean_square, eps)));
}

// The fp32 1 / sqrt of the "device" modes below: IEEE 1 / sqrt_rn (div_rn of sqrt_rn), not the
// hardware rsqrt (v_rsq_f32, about 1 ulp). The reference's last bits depend on the device's
// summation order and rsqrt anyway, so this picks the variant that gives the same bits on every
// GPU and in the host harness, and equals torch's CPU rsqrt (also 1 / sqrt, both IEEE), so the
// tests can hold the kernel to exact bytes. For bf16 inputs rounded to bf16 (q_mode
// "bf16_norm_rope") the choice does not matter: over every positive bf16 value, any result
// within 1 ulp of the correctly rounded fp32 rsqrt rounds to the same bf16.
DSV4_HD float rsqrt_rn(float x) { return div_rn(1.0f, sqrt_rn(x)); }

// StoreNumerics.rms "device": 1 / sqrt(fp32 mean(x^2) + eps) from the fp32 sum of squares of a
// 512-wide row, in the order the caller summed it. width is a power of two, so the division
// is exact (correctly rounded where the mean is subnormal).
DSV4_HD float rms_inverse_device(float sum_squares, int width, float eps) {
  return rsqrt_rn(add_rn(div_rn(sum_squares, float(width)), eps));
}

// q_mode "bf16_norm_rope": the reference's weightless q norm factor with every op rounded to
// bf16 in turn, from the fp32 sum of the bf16-rounded squares: r = bf16(1 / sqrt(m2)) with
// m2 = bf16(ms + eps), ms = bf16(sum / width). Returned as a bf16 value in a float.
DSV4_HD float rms_inverse_bf16_ops(float sum_bf16_squares, int width, float eps) {
  const float mean_square = round_bf16(div_rn(sum_bf16_squares, float(width)));
  return round_bf16(rsqrt_rn(round_bf16(add_rn(mean_square, eps))));
}

DSV4_HD float abs_f(float x) { return bits_float(float_bits(x) & 0x7fffffffu); }

DSV4_HD float max_f(float a, float b) { return a > b ? a : b; }

constexpr uint32_t kInfBits = 0x7f800000u;

// |x|, with NaN and +-inf as +inf: the amax of a tile is +inf exactly when it must be poisoned.
DSV4_HD float poisoning_abs(float x) {
  return (float_bits(x) & kInfBits) == kInfBits ? bits_float(kInfBits) : abs_f(x);
}

DSV4_HD bool is_inf(float x) { return (float_bits(x) & 0x7fffffffu) == kInfBits; }

// ceil(log2(r)) of a positive normal float, read exactly from its bits.
DSV4_HD int ceil_log2(float r) {
  const uint32_t u = float_bits(r);
  return int((u >> 23) & 0xffu) - 127 + ((u & 0x7fffffu) != 0u);
}

// 2^e as a float, for -126 <= e <= 127.
DSV4_HD float exp2_int(int e) { return bits_float(uint32_t(e + 127) << 23); }

}  // namespace dsv4
