// Tensor element types and block layouts, bit-compatible with ggml / GGUF.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace specmesh {

// Ids are the ggml_type values stored in GGUF tensor infos.
enum class DType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q8_0 = 8,
  Q4_K = 12,
  Q6_K = 14,
  BF16 = 30,
};

struct DTypeTraits {
  std::string_view name;
  size_t block_elems;  // values per block
  size_t block_bytes;  // bytes per block
};

// Traits of a supported type; nullptr for an id this runtime does not handle.
const DTypeTraits* dtype_traits(uint32_t id);
inline const DTypeTraits& traits(DType t) { return *dtype_traits(static_cast<uint32_t>(t)); }
inline std::string_view dtype_name(DType t) { return traits(t).name; }
// Bytes of one row of n values (n must be a multiple of the block size).
inline size_t row_bytes(DType t, size_t n) {
  const auto& tr = traits(t);
  return n / tr.block_elems * tr.block_bytes;
}

// --- half precision -------------------------------------------------------

inline float fp32_from_bits(uint32_t w) { float f; std::memcpy(&f, &w, 4); return f; }
inline uint32_t fp32_to_bits(float f) { uint32_t w; std::memcpy(&w, &f, 4); return w; }

// IEEE binary16 <-> float32, exact for all inputs (round-to-nearest-even on narrowing).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);

inline float bf16_to_fp32(uint16_t h) { return fp32_from_bits(uint32_t(h) << 16); }
inline uint16_t fp32_to_bf16(float f) {
  uint32_t u = fp32_to_bits(f);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 64);  // quiet NaN
  return uint16_t((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

// --- block layouts (ggml-common.h) ------------------------------------------

constexpr int QK4_0 = 32;
constexpr int QK8_0 = 32;
constexpr int QK_K = 256;
constexpr int K_SCALE_SIZE = 12;

struct block_q4_0 { uint16_t d; uint8_t qs[QK4_0 / 2]; };
struct block_q8_0 { uint16_t d; int8_t qs[QK8_0]; };
struct block_q4_K { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };

static_assert(sizeof(block_q4_0) == 18);
static_assert(sizeof(block_q8_0) == 34);
static_assert(sizeof(block_q4_K) == 144);
static_assert(sizeof(block_q6_K) == 210);

}  // namespace specmesh
