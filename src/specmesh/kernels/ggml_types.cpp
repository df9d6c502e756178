#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

namespace {

constexpr DTypeTraits kF32{"f32", 1, 4};
constexpr DTypeTraits kF16{"f16", 1, 2};
constexpr DTypeTraits kQ4_0{"q4_0", QK4_0, sizeof(block_q4_0)};
constexpr DTypeTraits kQ8_0{"q8_0", QK8_0, sizeof(block_q8_0)};
constexpr DTypeTraits kQ4_K{"q4_K", QK_K, sizeof(block_q4_K)};
constexpr DTypeTraits kQ6_K{"q6_K", QK_K, sizeof(block_q6_K)};
constexpr DTypeTraits kBF16{"bf16", 1, 2};

}  // namespace

const DTypeTraits* dtype_traits(uint32_t id) {
  switch (static_cast<DType>(id)) {
    case DType::F32: return &kF32;
    case DType::F16: return &kF16;
    case DType::Q4_0: return &kQ4_0;
    case DType::Q8_0: return &kQ8_0;
    case DType::Q4_K: return &kQ4_K;
    case DType::Q6_K: return &kQ6_K;
    case DType::BF16: return &kBF16;
  }
  return nullptr;
}

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) {
    // inf, or a NaN made quiet with its payload kept (what F16C's vcvtph2ps does)
    return fp32_from_bits(sign | 0x7f800000 | (mant != 0 ? 0x400000u : 0u) | (mant << 13));
  }
  if (exp != 0) return fp32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return fp32_from_bits(sign);
  // Subnormal half: normalise so the leading one becomes the implicit bit of a float.
  uint32_t e = 113;
  while ((mant & 0x400) == 0) {
    mant <<= 1;
    --e;
  }
  return fp32_from_bits(sign | (e << 23) | ((mant & 0x3ff) << 13));
}

uint16_t fp32_to_fp16(float f) {
  const uint32_t x = fp32_to_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) {
    // NaN: keep the top payload bits and force the quiet bit so it cannot become inf.
    return uint16_t(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
  }
  if (ax >= 0x47800000) return uint16_t(sign | 0x7c00);  // >= 65536 (or inf) overflows
  if (ax >= 0x38800000) {
    // Normal half. Adding 0xfff plus the kept lsb rounds to nearest-even; a carry into the
    // exponent is the correct result, including the overflow of 65520..65535 to inf.
    const uint32_t r = ax + 0xfff + ((ax >> 13) & 1) - (uint32_t(127 - 15) << 23);
    return uint16_t(sign | (r >> 13));
  }
  // Result is a half subnormal (or zero): value / 2^-24 rounded to nearest-even.
  const uint32_t e = ax >> 23;
  if (e < 102) return sign;  // below 2^-25: rounds to zero (float subnormals included)
  const uint32_t m = (ax & 0x7fffff) | 0x800000;
  const uint32_t shift = 126 - e;  // 14..24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) ++q;  // may carry into the smallest normal: fine
  return uint16_t(sign | q);
}

}  // namespace specmesh
