// What one launch of the set-KV kernel needs, as plain data: the torch binding fills it from
// tensors, the device code (and the host test harness) reads it. Free of torch and GPU headers.
#pragma once

#include <stdint.h>

namespace dsv4 {

// The V4 paged FP8 KV layout (hip_kernels/kv_layout.py).
constexpr int kHeadDim = 512;
constexpr int kNopeDim = 448;
constexpr int kRopeDim = 64;
constexpr int kTile = 64;
constexpr int kTiles = kNopeDim / kTile;                // 7 ue8m0 scales per row
constexpr int kValueBytes = kNopeDim + 2 * kRopeDim;    // 576
constexpr int kScaleBytes = 8;                          // 7 scales + 1 pad byte
constexpr int kUe8m0Bias = 127;
constexpr float kAmaxFloor = 1e-4f;
constexpr uint8_t kPoisonScale = 0xff;  // scale byte of a tile with a NaN or inf (ue8m0 NaN)

// How a row's 1 / rms is computed (StoreNumerics.rms and q_mode in hip_kernels/kv_layout.py).
enum class RmsMode : int32_t {
  kExact = 0,    // rms "exact": fp64 sum of squares (exact), correctly rounded 1 / sqrt
  kDevice = 1,   // rms "device": fp32 sum of squares in the kernel's order, fp32 1 / sqrt
  kBf16Ops = 2,  // q_mode "bf16_norm_rope": every op of the weightless norm rounded to bf16
};

// A strided int32 or int64 vector (positions, locations, the full->SWA map).
struct IndexArray {
  const void* data = nullptr;
  int64_t stride = 1;  // in elements
  bool wide = false;   // int64 if true, else int32
};

struct SetKvParams {
  int64_t num_rows = 0;
  // Source rows: kv (ops 2, 6) or already normalized rows (op 3), bf16 with unit inner stride.
  const uint16_t* src = nullptr;
  int64_t src_row_stride = 0;
  bool normalize = false;         // RMSNorm with weight + RoPE (ops 2, 6); false: store as is
  const void* weight = nullptr;   // [512] bf16 or fp32
  bool weight_bf16 = false;
  float eps = 0.0f;
  const float* freqs = nullptr;   // view_as_real(freqs_cis): [max_pos, 32, 2] (cos, sin)
  int64_t freqs_row_stride = 0;   // in floats
  IndexArray positions;
  // Destination slots: out_loc (ops 2, 3) or full_loc translated through full_to_swa (op 6).
  IndexArray loc;
  IndexArray full_to_swa;         // data == nullptr: no translation
  int64_t full_to_swa_len = 0;    // full locations at or past it translate to -1 (skip)
  int32_t* swa_loc_out = nullptr;  // op 6: receives the translated slots
  int64_t swa_loc_out_stride = 1;
  uint8_t* cache = nullptr;
  int64_t page_size = 1;
  int64_t page_bytes = 0;
  int64_t num_slots = 0;          // pages * page_size: slots at or past it write nothing (the
                                  // kernel masks them even when the host range checks are off)
  // Optional q [N, H, 512] bf16, normalized (no weight) and rotated in place (op 2).
  uint16_t* q = nullptr;
  int64_t q_row_stride = 0;
  int64_t q_head_stride = 0;
  int64_t num_heads = 0;
  // The norm of the KV row and of the q heads (REFERENCE_NUMERICS: kDevice and kBf16Ops).
  RmsMode kv_rms = RmsMode::kExact;
  RmsMode q_rms = RmsMode::kExact;
};

// Enqueues the kernel on `stream` (a cudaStream_t / hipStream_t). Returns nullptr, or the
// runtime's error message if the launch failed.
const char* launch_set_kv(const SetKvParams& params, bool fnuz, void* stream);

}  // namespace dsv4
