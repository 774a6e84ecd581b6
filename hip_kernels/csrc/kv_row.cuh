// The work on one 512-wide row, split into the per-lane phases between the group reductions:
//
//   load_lane      bf16 -> float, partial sum of squares           -> sum over all lanes
//                  (fp64 for RmsMode::kExact, else fp32: lane_squares_* and rms_inverse_of)
//   finish_lane    RMSNorm (+weight) and RoPE, partial nope amax   -> max over each 64-wide tile
//   store_lane     FP8 + ue8m0 scales + bf16 RoPE into the cache, or the row back into q
//
// A row is processed by LANES lanes (a wavefront of 64 on AMD, a warp of 32 on NVIDIA), lane l
// owning elements [l*EPT, (l+1)*EPT). The phases are __host__ __device__ so the test harness can
// run the very same code on the CPU, doing the reductions in loops instead of shuffles.
#pragma once

#include "fp8.cuh"
#include "set_kv_params.h"

namespace dsv4 {

DSV4_HD int64_t read_index(const IndexArray& a, int64_t i) {
  return a.wide ? static_cast<const int64_t*>(a.data)[i * a.stride]
                : int64_t(static_cast<const int32_t*>(a.data)[i * a.stride]);
}

// What one lane group does for one item of a launch. Item i belongs to row i / (1 + H): item
// i % (1 + H) == 0 is the KV row, the others are its H q heads.
struct RowJob {
  const uint16_t* src = nullptr;
  uint16_t* q_out = nullptr;        // set for a q head: write the row back here
  uint8_t* values = nullptr;        // set for a KV row that is stored: 576 value bytes
  uint8_t* scales = nullptr;        // ... and its 8 scale bytes
  const void* weight = nullptr;     // nullptr: weightless RMSNorm (q)
  const float* freqs = nullptr;     // cos/sin of the row's position; nullptr: no norm, no RoPE
  RmsMode rms = RmsMode::kExact;    // how its 1 / rms is computed (with freqs only)
};

DSV4_HD int64_t items_of(const SetKvParams& p) { return p.num_rows * (1 + p.num_heads); }

// The cache slot of a row: out_loc, or full_to_swa[full_loc] (op 6). Negative: skip the row.
// With translation, 0 is the unmapped dummy slot and is skipped too; a full location outside the
// map translates to -1.
DSV4_HD int64_t translated_slot(const SetKvParams& p, int64_t row) {
  const int64_t loc = read_index(p.loc, row);
  if (p.full_to_swa.data == nullptr) return loc;
  return loc < 0 || loc >= p.full_to_swa_len ? -1 : read_index(p.full_to_swa, loc);
}

// Slots past the cache are masked here too, so nothing is written outside it when the host's
// range checks are off (DSV4_KERNEL_VALUE_CHECKS=0, or inside graph capture).
DSV4_HD bool writes_cache(const SetKvParams& p, int64_t slot) {
  return (p.full_to_swa.data == nullptr ? slot >= 0 : slot > 0) && slot < p.num_slots;
}

// The slot of an item's KV row (-1 for a q head); lane 0 records it for the attention metadata.
DSV4_HD int64_t item_slot(const SetKvParams& p, int64_t item, int lane) {
  if (item % (1 + p.num_heads) != 0) return -1;
  const int64_t row = item / (1 + p.num_heads);
  const int64_t slot = translated_slot(p, row);
  if (lane == 0 && p.swa_loc_out != nullptr) {
    p.swa_loc_out[row * p.swa_loc_out_stride] = int32_t(slot);
  }
  return slot;
}

// The job of an item with the slot from item_slot; false when the item writes nothing.
DSV4_HD bool make_job(const SetKvParams& p, int64_t item, int64_t slot, RowJob& job) {
  const int64_t row = item / (1 + p.num_heads);
  const int64_t head = item % (1 + p.num_heads);
  if (p.normalize) job.freqs = p.freqs + read_index(p.positions, row) * p.freqs_row_stride;
  if (head > 0) {
    job.rms = p.q_rms;
    job.src = job.q_out = p.q + row * p.q_row_stride + (head - 1) * p.q_head_stride;
    return true;
  }
  if (!writes_cache(p, slot)) return false;
  const int64_t page = slot / p.page_size, in_page = slot % p.page_size;
  job.src = p.src + row * p.src_row_stride;
  job.values = p.cache + page * p.page_bytes + in_page * kValueBytes;
  job.scales = p.cache + page * p.page_bytes + p.page_size * kValueBytes + in_page * kScaleBytes;
  job.weight = p.weight;
  job.rms = p.kv_rms;
  return true;
}

template <int LANES>
struct Lane {
  static constexpr int kEpt = kHeadDim / LANES;      // elements per lane
  static constexpr int kTileLanes = kTile / kEpt;    // lanes per 64-wide scale tile
  static constexpr int kRopeLane = kNopeDim / kEpt;  // first lane of the RoPE dims
  static_assert(kHeadDim % LANES == 0 && kEpt % 4 == 0 && kTile % kEpt == 0, "lane split");
};

// Phase 1: the lane's elements as floats.
template <int LANES>
DSV4_HD void load_lane(const RowJob& job, int lane, float* x) {
  constexpr int kEpt = Lane<LANES>::kEpt;
DSV4_UNROLL
  for (int i = 0; i < kEpt; ++i) x[i] = bf16_to_float(job.src[lane * kEpt + i]);
}

// The lane's part of the sum of squares for RmsMode::kExact: exact in fp64 (16-bit squares), so
// the order of the sum over the lanes does not matter.
template <int LANES>
DSV4_HD double lane_squares_exact(const float* x) {
  double sum = 0.0;
DSV4_UNROLL
  for (int i = 0; i < Lane<LANES>::kEpt; ++i) sum += double(x[i]) * double(x[i]);
  return sum;
}

// The lane's part of the sum of squares for the other modes: an fp32 sum in element order, of
// the squares (exact in fp32: bf16 inputs) rounded to bf16 first for RmsMode::kBf16Ops. The
// lane sums are then added in the butterfly order of the wavefront reduction: for
// m = LANES/2, ..., 1 every lane l takes s[l] + s[l ^ m] (commutative, so all lanes agree).
template <int LANES>
DSV4_HD float lane_squares_fp32(const float* x, RmsMode mode) {
  float sum = 0.0f;
DSV4_UNROLL
  for (int i = 0; i < Lane<LANES>::kEpt; ++i) {
    const float sq = mul_rn(x[i], x[i]);
    sum = add_rn(sum, mode == RmsMode::kBf16Ops ? round_bf16(sq) : sq);
  }
  return sum;
}

// 1 / rms of a row whose fp32 sum of squares (lane_squares_fp32, reduced) is `sum`.
DSV4_HD float rms_inverse_of(RmsMode mode, float sum, float eps) {
  return mode == RmsMode::kBf16Ops ? rms_inverse_bf16_ops(sum, kHeadDim, eps)
                                   : rms_inverse_device(sum, kHeadDim, eps);
}

DSV4_HD float weight_at(const void* w, bool bf16, int i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(w)[i]) : static_cast<const float*>(w)[i];
}

// Phase 2: normalize and rotate in place (bf16-rounded values); returns the lane's nope amax,
// +inf when one of its values is NaN or +-inf (the tile is then stored poisoned).
template <int LANES>
DSV4_HD float finish_lane(const RowJob& job, const SetKvParams& p, int lane, float inv_rms,
                          float* x) {
  using L = Lane<LANES>;
  if (job.freqs != nullptr) {
DSV4_UNROLL
    for (int i = 0; i < L::kEpt; ++i) {
      float y = mul_rn(x[i], inv_rms);
      if (job.weight != nullptr) {
        y = mul_rn(weight_at(job.weight, p.weight_bf16, lane * L::kEpt + i), y);
      }
      x[i] = round_bf16(y);
    }
    if (lane >= L::kRopeLane) {
      const float* cs = job.freqs + (lane * L::kEpt - kNopeDim);  // (cos, sin) per pair
DSV4_UNROLL
      for (int i = 0; i < L::kEpt; i += 2) {
        const float a = x[i], b = x[i + 1], c = cs[i], s = cs[i + 1];
        x[i] = round_bf16(sub_rn(mul_rn(a, c), mul_rn(b, s)));
        x[i + 1] = round_bf16(add_rn(mul_rn(a, s), mul_rn(b, c)));
      }
    }
  }
  float amax = 0.0f;
  if (lane < L::kRopeLane) {
DSV4_UNROLL
    for (int i = 0; i < L::kEpt; ++i) amax = max_f(amax, poisoning_abs(x[i]));
  }
  return amax;
}

// Phase 3: write the lane's part of the row. tile_amax: the amax of the lane's 64-wide tile;
// +inf poisons the tile (every value byte the dialect's NaN, scale byte 0xff). NaN RoPE values
// leave as the bf16 NaN 0x7FC0 (float_to_bf16).
template <Fp8Dialect D, int LANES>
DSV4_HD void store_lane(const RowJob& job, int lane, float tile_amax, const float* x) {
  using L = Lane<LANES>;
  const int first = lane * L::kEpt;
  if (job.q_out != nullptr) {
DSV4_UNROLL
    for (int i = 0; i < L::kEpt; ++i) job.q_out[first + i] = float_to_bf16(x[i]);
    return;
  }
  if (lane < L::kRopeLane && is_inf(tile_amax)) {
    uint32_t* out = reinterpret_cast<uint32_t*>(job.values + first);
    constexpr uint32_t nan4 = 0x01010101u * Fp8Traits<D>::nan;
DSV4_UNROLL
    for (int i = 0; i < L::kEpt; i += 4) out[i / 4] = nan4;
    if (lane % L::kTileLanes == 0) job.scales[lane / L::kTileLanes] = kPoisonScale;
    return;
  }
  if (lane < L::kRopeLane) {
    constexpr float fmax = Fp8Traits<D>::max;
    const int e = ceil_log2(div_rn(max_f(tile_amax, kAmaxFloor), fmax));
    const float inv_scale = exp2_int(-e);
    float q[L::kEpt];
DSV4_UNROLL
    for (int i = 0; i < L::kEpt; ++i) {
      const float v = x[i] * inv_scale;  // exact: a power-of-two scale
      q[i] = v < -fmax ? -fmax : (v > fmax ? fmax : v);
    }
    uint32_t* out = reinterpret_cast<uint32_t*>(job.values + first);
DSV4_UNROLL
    for (int i = 0; i < L::kEpt; i += 4) {
      out[i / 4] = fp8x4_from_float<D>(q[i], q[i + 1], q[i + 2], q[i + 3]);
    }
    if (lane % L::kTileLanes == 0) job.scales[lane / L::kTileLanes] = uint8_t(e + kUe8m0Bias);
    return;
  }
  uint32_t* out = reinterpret_cast<uint32_t*>(job.values + kNopeDim + 2 * (first - kNopeDim));
DSV4_UNROLL
  for (int i = 0; i < L::kEpt; i += 2) {
    out[i / 2] = uint32_t(float_to_bf16(x[i])) | uint32_t(float_to_bf16(x[i + 1])) << 16;
  }
  if (lane == L::kRopeLane) job.scales[kTiles] = 0;
}

}  // namespace dsv4
