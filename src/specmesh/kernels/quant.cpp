#include "specmesh/kernels/quant.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace specmesh {

namespace {

void check_shape(DType type, size_t n) {
  const DTypeTraits* tr = dtype_traits(static_cast<uint32_t>(type));
  if (tr == nullptr) throw std::invalid_argument("unsupported dtype id " + std::to_string(uint32_t(type)));
  if (n % tr->block_elems != 0)
    throw std::invalid_argument(std::string(tr->name) + ": row length " + std::to_string(n) +
                                " is not a multiple of the block size");
}

// Round half to even, as ggml's nearest_int does.
inline int nearest_int(float v) { return int(std::lrintf(v)); }

// --- dequantisation ----------------------------------------------------------------------

void dequant_q4_0(const block_q4_0* b, float* y, size_t nb) {
  for (size_t i = 0; i < nb; ++i, y += QK4_0) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < QK4_0 / 2; ++j) {
      y[j] = float((b[i].qs[j] & 0x0F) - 8) * d;
      y[j + QK4_0 / 2] = float((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q8_0(const block_q8_0* b, float* y, size_t nb) {
  for (size_t i = 0; i < nb; ++i, y += QK8_0) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < QK8_0; ++j) y[j] = float(b[i].qs[j]) * d;
  }
}

// 6-bit scale and min of sub-block j from the 12 packed bytes (ggml get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void dequant_q4_K(const block_q4_K* b, float* y, size_t nb) {
  for (size_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    const float dmin = fp16_to_fp32(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int c = 0; c < 4; ++c, q += 32) {
      uint8_t sc, m;
      scale_min_k4(2 * c, b[i].scales, sc, m);
      const float d1 = d * float(sc), m1 = dmin * float(m);
      scale_min_k4(2 * c + 1, b[i].scales, sc, m);
      const float d2 = d * float(sc), m2 = dmin * float(m);
      for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] & 0x0F) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * float(q[l] >> 4) - m2;
    }
  }
}

void dequant_q6_K(const block_q6_K* b, float* y, size_t nb) {
  for (size_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* sc = b[i].scales;
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int s = l / 16;
        const int q1 = int((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = int((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * float(sc[s + 0]) * float(q1);
        y[l + 32] = d * float(sc[s + 2]) * float(q2);
        y[l + 64] = d * float(sc[s + 4]) * float(q3);
        y[l + 96] = d * float(sc[s + 6]) * float(q4);
      }
    }
  }
}

// --- quantisation ------------------------------------------------------------------------

void quant_q8_0(const float* x, block_q8_0* b, size_t nb) {
  for (size_t i = 0; i < nb; ++i, x += QK8_0) {
    float amax = 0;
    for (int j = 0; j < QK8_0; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127;
    const float id = d != 0 ? 1 / d : 0;
    b[i].d = fp32_to_fp16(d);
    for (int j = 0; j < QK8_0; ++j) b[i].qs[j] = int8_t(std::roundf(x[j] * id));
  }
}

void quant_q4_0(const float* x, block_q4_0* b, size_t nb) {
  for (size_t i = 0; i < nb; ++i, x += QK4_0) {
    // The signed extreme maps to -8, the one level that has no positive twin.
    float amax = 0, vmax = 0;
    for (int j = 0; j < QK4_0; ++j) {
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        vmax = x[j];
      }
    }
    const float d = vmax / -8;
    const float id = d != 0 ? 1 / d : 0;
    b[i].d = fp32_to_fp16(d);
    // Truncation of v*id + 8.5 rounds to the nearest level (v*id is in [-8, 8]).
    auto level = [&](float v) { return uint8_t(std::clamp(int(v * id + 8.5f), 0, 15)); };
    for (int j = 0; j < QK4_0 / 2; ++j) b[i].qs[j] = uint8_t(level(x[j]) | (level(x[j + QK4_0 / 2]) << 4));
  }
}

// Fits x[i] ~ scale*L[i] - offset with L in [0, nmax] and offset >= 0, minimising the
// w-weighted squared error. Tries a range of grid spacings around (max-min)/nmax and refits
// scale and offset by weighted least squares for each candidate level assignment.
float fit_affine(int n, int nmax, const float* x, const float* w, uint8_t* L, float* offset) {
  float lo = x[0], hi = x[0];
  float sum_w = 0, sum_x = 0;
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  lo = std::min(lo, 0.0f);  // the offset can only pull values down
  if (hi == lo) {
    std::fill(L, L + n, uint8_t(0));
    *offset = -lo;
    return 0;
  }
  auto assign = [&](float iscale, uint8_t* out) {
    for (int i = 0; i < n; ++i) out[i] = uint8_t(std::clamp(nearest_int(iscale * (x[i] - lo)), 0, nmax));
  };
  auto error = [&](const uint8_t* lv, float scale, float base) {
    float e = 0;
    for (int i = 0; i < n; ++i) {
      const float diff = scale * float(lv[i]) + base - x[i];
      e += w[i] * diff * diff;
    }
    return e;
  };

  float scale = (hi - lo) / float(nmax);
  float base = lo;
  assign(float(nmax) / (hi - lo), L);
  float best = error(L, scale, base);

  uint8_t cand[QK_K];
  for (int step = 0; step <= 20; ++step) {
    assign((float(nmax) - 1.0f + 0.1f * float(step)) / (hi - lo), cand);
    float sl = 0, sl2 = 0, sxl = 0;
    for (int i = 0; i < n; ++i) {
      const float l = float(cand[i]);
      sl += w[i] * l;
      sl2 += w[i] * l * l;
      sxl += w[i] * l * x[i];
    }
    const float det = sum_w * sl2 - sl * sl;
    if (det <= 0) continue;
    float s = (sum_w * sxl - sum_x * sl) / det;
    float b = (sl2 * sum_x - sl * sxl) / det;
    if (b > 0) {  // a positive base is not representable: refit the scale alone
      b = 0;
      s = sxl / sl2;
    }
    const float e = error(cand, s, b);
    if (e < best) {
      best = e;
      scale = s;
      base = b;
      std::copy(cand, cand + n, L);
    }
  }
  *offset = -base;
  return scale;
}

void quant_q4_K(const float* x, block_q4_K* b, size_t nb) {
  for (size_t i = 0; i < nb; ++i, x += QK_K) {
    float sum_x2 = 0;
    for (int j = 0; j < QK_K; ++j) sum_x2 += x[j] * x[j];
    const float av_x = std::sqrt(sum_x2 / QK_K);

    // Weights favour large magnitudes, which dominate dot products.
    uint8_t L[QK_K];
    float scales[8], mins[8], w[32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < 32; ++l) w[l] = av_x + std::fabs(x[32 * j + l]);
      scales[j] = fit_affine(32, 15, x + 32 * j, w, L + 32 * j, &mins[j]);
      max_scale = std::max(max_scale, scales[j]);
      max_min = std::max(max_min, mins[j]);
    }

    const float inv_scale = max_scale > 0 ? 63 / max_scale : 0;
    const float inv_min = max_min > 0 ? 63 / max_min : 0;
    std::fill(std::begin(b[i].scales), std::end(b[i].scales), uint8_t(0));
    for (int j = 0; j < 8; ++j) {
      const uint8_t ls = uint8_t(std::min(63, nearest_int(inv_scale * scales[j])));
      const uint8_t lm = uint8_t(std::min(63, nearest_int(inv_min * mins[j])));
      if (j < 4) {
        b[i].scales[j] = ls;
        b[i].scales[j + 4] = lm;
      } else {
        b[i].scales[j + 4] = uint8_t((ls & 0x0F) | ((lm & 0x0F) << 4));
        b[i].scales[j - 4] |= uint8_t((ls >> 4) << 6);
        b[i].scales[j] |= uint8_t((lm >> 4) << 6);
      }
    }
    b[i].d = fp32_to_fp16(max_scale / 63);
    b[i].dmin = fp32_to_fp16(max_min / 63);

    // Re-pick every level against the scales the decoder will actually see.
    const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      scale_min_k4(j, b[i].scales, sc, m);
      const float dd = d * float(sc);
      if (dd == 0) continue;  // every value decodes to -dm whatever the level: keep the fit's
      const float dm = dmin * float(m);
      for (int l = 0; l < 32; ++l) L[32 * j + l] = uint8_t(std::clamp(nearest_int((x[32 * j + l] + dm) / dd), 0, 15));
    }
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) b[i].qs[32 * c + l] = uint8_t(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
  }
}

// Fits x[i] ~ scale*q[i] with q in [-nmax, nmax-1], weighting by x^2. The extreme value is
// mapped to -nmax (the side with the extra level); nearby grid spacings are also tried.
float fit_symmetric(int n, int nmax, const float* x, int8_t* q) {
  float amax = 0, vmax = 0;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      vmax = x[i];
    }
  }
  if (amax < 1e-15f) {
    std::fill(q, q + n, int8_t(0));
    return 0;
  }
  float best_scale = 0, best = -1;
  for (int step = 0; step <= 18; ++step) {
    const float iscale = -(float(nmax) + 0.1f * float(step - 9)) / vmax;
    float sxl = 0, sl2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1);
      const float w = x[i] * x[i];
      sxl += w * x[i] * float(l);
      sl2 += w * float(l) * float(l);
    }
    // Least-squares scale sxl/sl2 leaves error sum(w x^2) - sxl^2/sl2: maximise sxl^2/sl2.
    if (sl2 > 0 && (best < 0 || sxl * sxl > best * sl2)) {
      best_scale = sxl / sl2;
      best = best_scale * sxl;
      for (int i = 0; i < n; ++i) q[i] = int8_t(std::clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1));
    }
  }
  return best_scale;
}

void quant_q6_K(const float* x, block_q6_K* b, size_t nb) {
  for (size_t i = 0; i < nb; ++i, x += QK_K) {
    int8_t q[QK_K];
    float scales[16];
    float max_scale = 0, amax_scale = 0;
    for (int j = 0; j < 16; ++j) {
      scales[j] = fit_symmetric(16, 32, x + 16 * j, q + 16 * j);
      if (std::fabs(scales[j]) > amax_scale) {
        amax_scale = std::fabs(scales[j]);
        max_scale = scales[j];
      }
    }
    if (amax_scale < 1e-15f) {
      b[i] = block_q6_K{};  // d = 0 decodes every value to 0
      continue;
    }
    // The largest scale maps to -128 so the int8 sub-scales use their full range.
    const float iscale = -128.0f / max_scale;
    b[i].d = fp32_to_fp16(1 / iscale);
    for (int j = 0; j < 16; ++j) b[i].scales[j] = int8_t(std::min(127, nearest_int(iscale * scales[j])));

    uint8_t L[QK_K];
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < 16; ++j) {
      const float dd = d * float(b[i].scales[j]);
      for (int l = 0; l < 16; ++l) {
        const int v = dd != 0 ? std::clamp(nearest_int(x[16 * j + l] / dd), -32, 31) : 0;
        L[16 * j + l] = uint8_t(v + 32);
      }
    }
    uint8_t* ql = b[i].ql;
    uint8_t* qh = b[i].qh;
    for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t* Ln = L + n;
        ql[l] = uint8_t((Ln[l] & 0x0F) | ((Ln[l + 64] & 0x0F) << 4));
        ql[l + 32] = uint8_t((Ln[l + 32] & 0x0F) | ((Ln[l + 96] & 0x0F) << 4));
        qh[l] = uint8_t((Ln[l] >> 4) | ((Ln[l + 32] >> 4) << 2) | ((Ln[l + 64] >> 4) << 4) | ((Ln[l + 96] >> 4) << 6));
      }
    }
  }
}

}  // namespace

void q4_K_scale_min(const uint8_t* scales, int j, uint8_t& sc, uint8_t& m) { scale_min_k4(j, scales, sc, m); }

void q6_K_quants(const block_q6_K& b, uint8_t* out) {
  // Element 128 n + 32 k + l: low nibble of ql[64 n + l + 32 (k & 1)] (the high one for
  // k >= 2), high bits 2k.. of qh[32 n + l] (as dequant_q6_K reads them).
  for (int n = 0; n < 2; ++n)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo = b.ql[64 * n + l + 32 * (k & 1)];
        const uint8_t hi = b.qh[32 * n + l];
        out[128 * n + 32 * k + l] = uint8_t(((k < 2 ? lo : lo >> 4) & 0x0F) | (((hi >> (2 * k)) & 3) << 4));
      }
}

void dequantize_row(DType type, const void* src, float* dst, size_t n) {
  check_shape(type, n);
  switch (type) {
    case DType::F32:
      std::copy_n(static_cast<const float*>(src), n, dst);
      return;
    case DType::F16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(h[i]);
      return;
    }
    case DType::BF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
      return;
    }
    case DType::Q4_0: return dequant_q4_0(static_cast<const block_q4_0*>(src), dst, n / QK4_0);
    case DType::Q8_0: return dequant_q8_0(static_cast<const block_q8_0*>(src), dst, n / QK8_0);
    case DType::Q4_K: return dequant_q4_K(static_cast<const block_q4_K*>(src), dst, n / QK_K);
    case DType::Q6_K: return dequant_q6_K(static_cast<const block_q6_K*>(src), dst, n / QK_K);
  }
}

void quantize_row(DType type, const float* src, void* dst, size_t n) {
  check_shape(type, n);
  switch (type) {
    case DType::F32:
      std::copy_n(src, n, static_cast<float*>(dst));
      return;
    case DType::F16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(src[i]);
      return;
    }
    case DType::BF16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(src[i]);
      return;
    }
    case DType::Q4_0: return quant_q4_0(src, static_cast<block_q4_0*>(dst), n / QK4_0);
    case DType::Q8_0: return quant_q8_0(src, static_cast<block_q8_0*>(dst), n / QK8_0);
    case DType::Q4_K: return quant_q4_K(src, static_cast<block_q4_K*>(dst), n / QK_K);
    case DType::Q6_K: return quant_q6_K(src, static_cast<block_q6_K*>(dst), n / QK_K);
  }
}

}  // namespace specmesh
