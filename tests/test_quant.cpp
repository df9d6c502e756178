// Type table, fp16 conversion, and the dequantisers / reference quantisers of every weight type.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/quant.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace specmesh {
namespace {

constexpr DType kAllTypes[] = {DType::F32, DType::F16, DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::BF16};

std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<float> round_trip(DType t, const std::vector<float>& x) {
  std::vector<uint8_t> q(row_bytes(t, x.size()));
  quantize_row(t, x.data(), q.data(), x.size());
  std::vector<float> y(x.size());
  dequantize_row(t, q.data(), y.data(), x.size());
  return y;
}

double rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * x;
  return std::sqrt(s / double(v.size()));
}

double rms_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return std::sqrt(s / double(a.size()));
}

// --- type table ----------------------------------------------------------------------------

TEST(DTypeTraits, TableMatchesGgml) {
  struct Row { uint32_t id; const char* name; size_t elems, bytes; };
  const Row rows[] = {{0, "f32", 1, 4},       {1, "f16", 1, 2},         {2, "q4_0", 32, 18}, {8, "q8_0", 32, 34},
                      {12, "q4_K", 256, 144}, {14, "q6_K", 256, 210}, {30, "bf16", 1, 2}};
  for (const auto& r : rows) {
    const DTypeTraits* t = dtype_traits(r.id);
    ASSERT_NE(t, nullptr) << r.id;
    EXPECT_EQ(t->name, r.name);
    EXPECT_EQ(t->block_elems, r.elems);
    EXPECT_EQ(t->block_bytes, r.bytes);
  }
  for (uint32_t id : {3u, 4u, 6u, 7u, 9u, 10u, 11u, 13u, 15u, 16u, 28u, 29u, 31u, 39u, 1000u})
    EXPECT_EQ(dtype_traits(id), nullptr) << id;
  EXPECT_EQ(row_bytes(DType::Q4_K, 512), 288u);
  EXPECT_EQ(dtype_name(DType::Q6_K), "q6_K");
}

// --- fp16 ----------------------------------------------------------------------------------

TEST(Fp16, KnownValues) {
  EXPECT_EQ(fp16_to_fp32(0x3c00), 1.0f);
  EXPECT_EQ(fp16_to_fp32(0xc000), -2.0f);
  EXPECT_EQ(fp16_to_fp32(0x7bff), 65504.0f);
  EXPECT_EQ(fp16_to_fp32(0x0400), std::ldexp(1.0f, -14));           // smallest normal
  EXPECT_EQ(fp16_to_fp32(0x0001), std::ldexp(1.0f, -24));           // smallest subnormal
  EXPECT_EQ(fp16_to_fp32(0x03ff), std::ldexp(1023.0f, -24));        // largest subnormal
  EXPECT_EQ(fp16_to_fp32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(fp16_to_fp32(0x3555), 0x155 * std::ldexp(1.0f, -12) + 0.25f);
  EXPECT_EQ(fp16_to_fp32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp16_to_fp32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(fp16_to_fp32(0x7e00)));
  EXPECT_TRUE(std::isnan(fp16_to_fp32(0x7c01)));  // signalling-pattern NaN stays NaN
  EXPECT_EQ(fp32_to_bits(fp16_to_fp32(0x8000)), 0x80000000u);

  EXPECT_EQ(fp32_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(fp32_to_fp16(1e10f), 0x7c00);
  EXPECT_EQ(fp32_to_fp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  const uint16_t nan = fp32_to_fp16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_EQ(fp32_to_fp16(fp32_from_bits(0x7f800001)) & 0x7fff, 0x7e00);  // payload lost below bit 13: stays NaN
}

TEST(Fp16, RoundsToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -10);  // spacing of halves in [1, 2)
  EXPECT_EQ(fp32_to_fp16(1.0f + ulp1 / 2), 0x3c00);                        // tie -> even (down)
  EXPECT_EQ(fp32_to_fp16(1.0f + 3 * ulp1 / 2), 0x3c02);                    // tie -> even (up)
  EXPECT_EQ(fp32_to_fp16(std::nextafter(1.0f + ulp1 / 2, 2.0f)), 0x3c01);  // just above the tie
  EXPECT_EQ(fp32_to_fp16(65519.0f), 0x7bff);                               // below the overflow tie
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7c00);                               // the tie rounds to inf
  // Subnormal results.
  const float sub = std::ldexp(1.0f, -24);
  EXPECT_EQ(fp32_to_fp16(sub / 2), 0x0000);                                // tie -> 0
  EXPECT_EQ(fp32_to_fp16(std::nextafter(sub / 2, 1.0f)), 0x0001);
  EXPECT_EQ(fp32_to_fp16(3 * sub / 2), 0x0002);                            // tie -> even
  EXPECT_EQ(fp32_to_fp16(5 * sub / 2), 0x0002);
  EXPECT_EQ(fp32_to_fp16(-7 * sub / 2), 0x8004);
  EXPECT_EQ(fp32_to_fp16(1023.5f * sub), 0x0400);                          // carries into the smallest normal
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(fp32_to_fp16(fp32_from_bits(0x00000001)), 0x0000);             // float subnormal
  EXPECT_EQ(fp32_to_fp16(-fp32_from_bits(0x007fffff)), 0x8000);
}

TEST(Fp16, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(uint16_t(h));
    if (std::isnan(f)) {
      EXPECT_EQ((h & 0x7c00), 0x7c00u);
      EXPECT_EQ(fp32_to_fp16(f), h | 0x0200) << std::hex << h;  // quiet bit set, payload kept
      continue;
    }
    ASSERT_EQ(fp32_to_fp16(f), h) << std::hex << h;
  }
}

// Nearest-even against an exact reference: the candidates are the two halves around f.
TEST(Fp16, MatchesExactRoundingOnSampledFloats) {
  std::mt19937 rng(7);
  for (int it = 0; it < 300000; ++it) {
    // Exponents concentrated on the half range, including subnormals and overflow.
    const uint32_t sign = (rng() & 1) << 31;
    const uint32_t exp = 95 + rng() % 50;
    const uint32_t bits = sign | (exp << 23) | (rng() & 0x7fffff);
    const float f = fp32_from_bits(bits);
    const uint16_t h = fp32_to_fp16(f);
    const double v = std::fabs(double(f));
    if (v >= 65520.0) {
      ASSERT_EQ(h & 0x7fff, 0x7c00) << f;
      continue;
    }
    const double got = std::fabs(double(fp16_to_fp32(h)));
    ASSERT_EQ(h >> 15, sign >> 31);
    // Spacing of halves at this magnitude.
    const double spacing = v < std::ldexp(1.0, -14) ? std::ldexp(1.0, -24) : std::ldexp(1.0, std::ilogb(v) - 10);
    const double err = std::fabs(got - v);
    ASSERT_LE(err, spacing / 2) << f;
    if (err == spacing / 2) {  // a tie must pick the even mantissa
      ASSERT_EQ(h & 1, 0) << f;
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("f16c"))) uint16_t hw_fp32_to_fp16(float f) {
  return uint16_t(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
}
__attribute__((target("f16c"))) float hw_fp16_to_fp32(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }

TEST(Fp16, AgreesWithF16cHardware) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C on this CPU";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = fp16_to_fp32(uint16_t(h)), b = hw_fp16_to_fp32(uint16_t(h));
    ASSERT_EQ(fp32_to_bits(a), fp32_to_bits(b)) << std::hex << h;
  }
  // A strided walk over all float bit patterns, plus every pattern near the half range.
  for (uint64_t bits = 0; bits < (uint64_t(1) << 32); bits += 4099) {
    const float f = fp32_from_bits(uint32_t(bits));
    if (std::isnan(f)) continue;  // payload handling is implementation-defined
    ASSERT_EQ(fp32_to_fp16(f), hw_fp32_to_fp16(f)) << std::hex << bits;
  }
  for (uint32_t bits = 0x33000000 - 4096; bits < 0x38800000 + 4096; bits += 7) {
    const float f = fp32_from_bits(bits);
    ASSERT_EQ(fp32_to_fp16(f), hw_fp32_to_fp16(f)) << std::hex << bits;
  }
  for (uint32_t bits = 0x477fe000; bits < 0x47801000; ++bits) {
    const float f = fp32_from_bits(bits);
    ASSERT_EQ(fp32_to_fp16(f), hw_fp32_to_fp16(f)) << std::hex << bits;
  }
}
#endif

// --- dequantisation of hand-built blocks ----------------------------------------------------

TEST(Dequantize, PlainTypes) {
  const float f32[3] = {1.5f, -2.25f, 1e-30f};
  float out[3];
  dequantize_row(DType::F32, f32, out, 3);
  EXPECT_EQ(std::memcmp(f32, out, sizeof out), 0);

  const uint16_t f16[3] = {0x3c00, 0xc500, 0x0001};
  dequantize_row(DType::F16, f16, out, 3);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -5.0f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -24));

  const uint16_t bf16[3] = {0x3f80, 0xc0a0, 0x7f80};
  dequantize_row(DType::BF16, bf16, out, 3);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -5.0f);
  EXPECT_EQ(out[2], std::numeric_limits<float>::infinity());
}

TEST(Dequantize, Q4_0) {
  block_q4_0 b[2];
  b[0].d = fp32_to_fp16(0.5f);
  b[1].d = fp32_to_fp16(-3.0f);
  for (int j = 0; j < 16; ++j) {
    b[0].qs[j] = uint8_t(j | ((15 - j) << 4));
    b[1].qs[j] = uint8_t((j * 7) % 16 | (((j * 5) % 16) << 4));
  }
  float y[64];
  dequantize_row(DType::Q4_0, b, y, 64);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], (j - 8) * 0.5f);                      // low nibbles: first half
    EXPECT_EQ(y[j + 16], (15 - j - 8) * 0.5f);            // high nibbles: second half
    EXPECT_EQ(y[32 + j], ((j * 7) % 16 - 8) * -3.0f);
    EXPECT_EQ(y[48 + j], ((j * 5) % 16 - 8) * -3.0f);
  }
}

TEST(Dequantize, Q8_0) {
  block_q8_0 b;
  b.d = fp32_to_fp16(0.25f);
  for (int j = 0; j < 32; ++j) b.qs[j] = int8_t(j * 8 - 128);
  float y[32];
  dequantize_row(DType::Q8_0, &b, y, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], (j * 8 - 128) * 0.25f);
}

// Packs 6-bit scales and mins so that GGUF-NOTES' get_scale_min_k4 formulas return them.
void pack_k4_scales(const int sc[8], const int m[8], uint8_t out[12]) {
  for (int j = 0; j < 4; ++j) {
    out[j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
    out[j + 4] = uint8_t(m[j] | ((m[j + 4] >> 4) << 6));
    out[j + 8] = uint8_t((sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4));
  }
}

TEST(Dequantize, Q4_K) {
  const int sc[8] = {1, 2, 13, 31, 40, 17, 63, 0};
  const int m[8] = {5, 0, 63, 8, 33, 47, 16, 62};
  block_q4_K b;
  b.d = fp32_to_fp16(0.125f);
  b.dmin = fp32_to_fp16(0.0625f);
  pack_k4_scales(sc, m, b.scales);
  std::mt19937 rng(3);
  for (auto& q : b.qs) q = uint8_t(rng());
  float y[256];
  dequantize_row(DType::Q4_K, &b, y, 256);
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const int lo = b.qs[32 * c + l] & 0x0F, hi = b.qs[32 * c + l] >> 4;
      EXPECT_FLOAT_EQ(y[64 * c + l], 0.125f * sc[2 * c] * lo - 0.0625f * m[2 * c]) << c << " " << l;
      EXPECT_FLOAT_EQ(y[64 * c + 32 + l], 0.125f * sc[2 * c + 1] * hi - 0.0625f * m[2 * c + 1]) << c << " " << l;
    }
  }
}

TEST(Dequantize, Q6_K) {
  block_q6_K b;
  std::mt19937 rng(5);
  for (auto& v : b.ql) v = uint8_t(rng());
  for (auto& v : b.qh) v = uint8_t(rng());
  for (int j = 0; j < 16; ++j) b.scales[j] = int8_t(j % 2 ? -(j * 8) : j * 7 + 3);
  b.scales[5] = -128;
  b.scales[6] = 127;
  b.d = fp32_to_fp16(0.01f);
  const float d = fp16_to_fp32(b.d);
  float y[256];
  dequantize_row(DType::Q6_K, &b, y, 256);
  uint8_t quants[256];
  q6_K_quants(b, quants);
  // Index-by-index restatement of the layout: half n, quarter g, position l.
  for (int i = 0; i < 256; ++i) {
    const int n = i / 128, g = (i % 128) / 32, l = i % 32;
    const uint8_t lbyte = b.ql[64 * n + l + 32 * (g & 1)];
    const int low = g < 2 ? (lbyte & 0x0F) : (lbyte >> 4);
    const int high = (b.qh[32 * n + l] >> (2 * g)) & 3;
    const int q = (low | (high << 4)) - 32;
    const int scale = b.scales[8 * n + l / 16 + 2 * g];
    EXPECT_FLOAT_EQ(y[i], d * scale * q) << i;
    // The packed kernels' accessor: the stored quant (q + 32) and sub-block i / 16's scale.
    EXPECT_EQ(quants[i], q + 32) << i;
    EXPECT_EQ(b.scales[i / 16], scale) << i;
  }
}

TEST(Dequantize, RejectsBadShapes) {
  float buf[64] = {};
  EXPECT_THROW(dequantize_row(DType::Q4_0, buf, buf, 33), std::invalid_argument);
  EXPECT_THROW(dequantize_row(DType::Q4_K, buf, buf, 64), std::invalid_argument);
  EXPECT_THROW(quantize_row(DType::Q6_K, buf, buf, 32), std::invalid_argument);
  EXPECT_THROW(quantize_row(static_cast<DType>(3), buf, buf, 32), std::invalid_argument);
}

// --- quantisers ------------------------------------------------------------------------------

TEST(Quantize, Q8_0MatchesGgmlReference) {
  std::vector<float> x(64);
  for (int j = 0; j < 64; ++j) x[j] = float(j - 20) * 0.37f;
  std::vector<block_q8_0> b(2);
  quantize_row(DType::Q8_0, x.data(), b.data(), 64);
  for (int k = 0; k < 2; ++k) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * k + j]));
    // quantize_row_q8_0_ref: d = amax/127, levels roundf(x * (1/d)), d stored as f16.
    const float d = amax / 127, id = 1 / d;
    EXPECT_EQ(b[k].d, fp32_to_fp16(d));
    for (int j = 0; j < 32; ++j) EXPECT_EQ(b[k].qs[j], int8_t(std::roundf(x[32 * k + j] * id))) << j;
  }
}

TEST(Quantize, ExactOnRepresentableValues) {
  // Q8_0: multiples of d with the extreme at 127*d.
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = float((j * 37) % 255 - 127) / 128;
  x[3] = 127.0f / 128;
  EXPECT_EQ(round_trip(DType::Q8_0, x), x);
  // Q4_0: levels -8..7 of d, with -8*d the largest magnitude.
  for (int j = 0; j < 32; ++j) x[j] = float(j % 16 - 8) * 0.5f;
  EXPECT_EQ(round_trip(DType::Q4_0, x), x);
  // Halves and bf16 values survive their own types unchanged.
  for (int j = 0; j < 32; ++j) x[j] = fp16_to_fp32(uint16_t((j * 977) | ((j & 1) << 15)));
  EXPECT_EQ(round_trip(DType::F16, x), x);
  for (int j = 0; j < 32; ++j) x[j] = bf16_to_fp32(uint16_t(j * 1999));
  EXPECT_EQ(round_trip(DType::BF16, x), x);
}

TEST(Quantize, ZerosStayZero) {
  const std::vector<float> zero(512, 0.0f);
  for (DType t : kAllTypes) EXPECT_EQ(round_trip(t, zero), zero) << dtype_name(t);
}

TEST(Quantize, PerElementErrorBounds) {
  const auto x = gaussian(4096, 11);
  // F16 / BF16: half an ulp of an 11- / 8-bit significand (|x| here is far from subnormal).
  const auto h = round_trip(DType::F16, x), bf = round_trip(DType::BF16, x);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_LE(std::fabs(h[i] - x[i]), std::fabs(x[i]) * std::ldexp(1.0f, -11)) << i;
    EXPECT_LE(std::fabs(bf[i] - x[i]), std::fabs(x[i]) * std::ldexp(1.0f, -8)) << i;
  }
  EXPECT_EQ(round_trip(DType::F32, x), x);

  // Q8_0: half a step (amax/254), plus the f16 rounding of d, which scales a level of at
  // most 127 by a relative 2^-11.
  const auto q8 = round_trip(DType::Q8_0, x);
  // Q4_0: the extreme maps to -8, so the opposite side clamps at +7: worst case one step
  // (amax/8) for those values, plus the same f16 term.
  const auto q4 = round_trip(DType::Q4_0, x);
  for (size_t b = 0; b < x.size() / 32; ++b) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * b + j]));
    for (int j = 0; j < 32; ++j) {
      const size_t i = 32 * b + j;
      EXPECT_LE(std::fabs(q8[i] - x[i]), amax / 254 + amax * std::ldexp(1.0f, -11) + 1e-7f) << i;
      EXPECT_LE(std::fabs(q4[i] - x[i]), amax / 8 + amax * std::ldexp(1.0f, -10) + 1e-7f) << i;
    }
  }
}

// RMS error relative to the signal for Gaussian rows. Bounds sit above what a uniform
// quantiser of each type's step gives (step/sqrt(12)) with headroom for scale rounding;
// a broken packer or fitter lands far above them.
TEST(Quantize, RmsErrorBounds) {
  struct Case { DType t; double bound; };
  // Q8_0: step amax/127, amax ~ 2.1 sigma over 32 values -> ~0.5%.
  // Q4_0: step amax/8 -> ~8%.  Q4_K: 15 levels over each 32-value range with fitted
  // scale/offset -> ~7%.  Q6_K: step ~ amax/32 over 16 values -> ~2%.
  const Case cases[] = {{DType::Q8_0, 0.008}, {DType::Q4_0, 0.10}, {DType::Q4_K, 0.085}, {DType::Q6_K, 0.025},
                        {DType::F16, 3e-4},   {DType::BF16, 3e-3}};
  for (uint32_t seed : {1u, 2u, 3u}) {
    for (float sigma : {1.0f, 1e-3f, 40.0f}) {
      const auto x = gaussian(8192, seed, sigma);
      for (const auto& c : cases) {
        const double rel = rms_diff(round_trip(c.t, x), x) / rms(x);
        EXPECT_LT(rel, c.bound) << dtype_name(c.t) << " seed " << seed << " sigma " << sigma;
      }
    }
  }
}

// The K-quant fitters must beat a naive encoding: compare against plain uniform min/max
// quantisation at each type's level count, which a sound fit can only improve on.
TEST(Quantize, KQuantsBeatNaiveMinMax) {
  const auto x = gaussian(4096, 21);
  auto naive = [&](int levels, size_t group, bool symmetric) {
    double s = 0;
    for (size_t g = 0; g < x.size(); g += group) {
      float lo = x[g], hi = x[g];
      for (size_t i = g; i < g + group; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
      }
      if (symmetric) {
        hi = std::max(std::fabs(lo), std::fabs(hi));
        lo = -hi;
      }
      const float step = (hi - lo) / float(levels - 1);
      for (size_t i = g; i < g + group; ++i) {
        const float q = lo + step * std::round((x[i] - lo) / step);
        s += (double(q) - x[i]) * (double(q) - x[i]);
      }
    }
    return std::sqrt(s / double(x.size()));
  };
  EXPECT_LT(rms_diff(round_trip(DType::Q4_K, x), x), naive(16, 32, false));
  EXPECT_LT(rms_diff(round_trip(DType::Q6_K, x), x), naive(64, 16, true));
}

// Shifted and one-signed data exercise the Q4_K offset and the Q6_K sign handling.
TEST(Quantize, KQuantsHandleOffsetsAndSigns) {
  auto x = gaussian(1024, 9);
  std::vector<float> pos(x.size()), neg(x.size()), shifted(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    pos[i] = std::fabs(x[i]);
    neg[i] = -std::fabs(x[i]);
    shifted[i] = x[i] + 5.0f;
  }
  for (const auto* v : {&pos, &neg, &shifted, &x}) {
    EXPECT_LT(rms_diff(round_trip(DType::Q4_K, *v), *v) / rms(*v), 0.085);
    EXPECT_LT(rms_diff(round_trip(DType::Q6_K, *v), *v) / rms(*v), 0.025);
  }
  // A constant sub-block: Q4_K must represent it (offset only or scale*level) closely.
  std::vector<float> c(256, 0.75f);
  for (float v : round_trip(DType::Q4_K, c)) EXPECT_NEAR(v, 0.75f, 0.75f * 0.01f);
}

}  // namespace
}  // namespace specmesh
