// float -> FP8 e4m3 in the two dialects of the KV cache, bit-identical to torch's casts:
//   fnuz (MI300 / gfx942 hardware format): exponent bias 8, max 240, no -0 (0x80 is NaN);
//   ocp  (e4m3fn: gfx950, NVIDIA):         exponent bias 7, max 448, signed zero.
// Callers clamp to +-max first (as the reference does), so no input overflows.
#pragma once

#include "numerics.cuh"

namespace dsv4 {

enum class Fp8Dialect : int { Fnuz = 0, Ocp = 1 };

template <Fp8Dialect D> struct Fp8Traits;
template <> struct Fp8Traits<Fp8Dialect::Fnuz> {
  static constexpr int bias = 8;
  static constexpr float max = 240.0f;
  static constexpr bool signed_zero = false;
  static constexpr uint8_t nan = 0x80;
};
template <> struct Fp8Traits<Fp8Dialect::Ocp> {
  static constexpr int bias = 7;
  static constexpr float max = 448.0f;
  static constexpr bool signed_zero = true;
  static constexpr uint8_t nan = 0x7f;
};

// Portable round-to-nearest-even conversion of one value (|x| <= max or NaN).
template <Fp8Dialect D>
DSV4_HD uint8_t fp8_from_float(float x) {
  using T = Fp8Traits<D>;
  const uint32_t u = float_bits(x);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return T::nan;
  const int exp = int(a >> 23) - 127;
  uint32_t mag;
  if (exp >= 1 - T::bias) {
    // Normal in fp8: round the 23-bit mantissa to 3 bits; a carry bumps the exponent.
    const uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
    mag = (rounded >> 20) - uint32_t((127 - T::bias) << 3);
  } else {
    // Subnormal in fp8: count quanta of 2^(-bias-2), rounding the remainder to even.
    const uint32_t sig = (a >> 23) ? (a & 0x7fffffu) | 0x800000u : a;
    const int shift = (a >> 23) ? 21 - T::bias - exp : 32;
    if (shift > 24) {
      mag = 0;
    } else {
      const uint32_t rem = sig & ((1u << shift) - 1u);
      const uint32_t half = 1u << (shift - 1);
      mag = sig >> shift;
      mag += (rem > half || (rem == half && (mag & 1u))) ? 1u : 0u;
    }
  }
  if (mag == 0 && !T::signed_zero) return 0;
  return uint8_t(((u >> 24) & 0x80u) | mag);
}

// Four values -> four fp8 bytes, little-endian in one word. On gfx942 the fnuz dialect is the
// hardware's own format: v_cvt_pk_fp8_f32 converts two values per instruction (RNE).
template <Fp8Dialect D>
DSV4_HD uint32_t fp8x4_from_float(float x0, float x1, float x2, float x3) {
#if defined(__gfx942__)
  if constexpr (D == Fp8Dialect::Fnuz) {
    int word = __builtin_amdgcn_cvt_pk_fp8_f32(x0, x1, 0, false);
    word = __builtin_amdgcn_cvt_pk_fp8_f32(x2, x3, word, true);
    return uint32_t(word);
  }
#endif
  return uint32_t(fp8_from_float<D>(x0)) | uint32_t(fp8_from_float<D>(x1)) << 8 |
         uint32_t(fp8_from_float<D>(x2)) << 16 | uint32_t(fp8_from_float<D>(x3)) << 24;
}

}  // namespace dsv4
