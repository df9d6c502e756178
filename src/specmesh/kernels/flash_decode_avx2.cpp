// AVX2 + FMA flash-decode partial. Built with -mavx2 -mfma and only called after the run-time
// CPU check that selects matmul's AVX2 path (flash_decode.cpp).
//
// Determinism: a head's scores, weights and output accumulate in an order fixed by the key
// index and head_dim only, never by how many heads share a call or which thread runs it, so
// per-head attention and the whole-layer kernel agree bit for bit.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "specmesh/kernels/avx2_reduce.hpp"
#include "specmesh/kernels/flash_decode.hpp"

namespace specmesh::detail {

namespace {

using avx2::hsum;

// Eight stored values (F32, or F16 widened exactly by F16C) as floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float widen(float x) { return x; }
inline float widen(uint16_t h) { return _cvtsh_ss(h); }

// Four accumulators over 8-float blocks, then a scalar tail.
template <class E>
inline float dot(const float* a, const E* b, int n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), load8(b + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), load8(b + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s = std::fma(a[i], widen(b[i]), s);
  return s;
}

// e^x for x <= 0: x = k ln2 + r with |r| <= ln2/2, e^r by a degree-7 Taylor polynomial
// (relative error about 1e-8 before rounding), times 2^k built in the exponent bits.
// Inputs below -87.3 give about 1e-38 instead of a denormal or zero.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);  // ln2 split into hi + lo
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// o[0..D) += sum over keys t0..t0+U-1 (in key order) of w[t] * v_t[0..D).
template <int U, class E>
inline void accumulate(float* o, const float* w, const E* const* v, int D) {
  __m256 wv[U];
  for (int u = 0; u < U; ++u) wv[u] = _mm256_set1_ps(w[u]);
  int d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 acc = _mm256_loadu_ps(o + d);
    for (int u = 0; u < U; ++u) acc = _mm256_fmadd_ps(wv[u], load8(v[u] + d), acc);
    _mm256_storeu_ps(o + d, acc);
  }
  for (; d < D; ++d)
    for (int u = 0; u < U; ++u) o[d] = std::fma(w[u], widen(v[u][d]), o[d]);
}

// The partial over rows of element type E (float or F16 bits).
template <class E>
void partial(const PartialJob& j) {
  const int D = j.head_dim;
  const size_t ld = (j.count + 7) / 8 * 8;
  const size_t stride = j.kv->row_stride;
  const E* keys = static_cast<const E*>(j.kv->k);
  const E* values = static_cast<const E*>(j.kv->v);

  for (size_t t = 0; t < j.count; ++t) {
    const E* krow = keys + size_t(j.cells[t]) * stride + j.kv_off;
    for (int h = 0; h < j.n_q; ++h)
      j.scores[h * ld + t] = dot(j.q + size_t(h) * D, krow + j.head_off[h], D) * j.scale;
  }

  for (int h = 0; h < j.n_q; ++h) {
    float* s = j.scores + h * ld;
    const float m = *std::max_element(s, s + j.count);
    std::fill(s + j.count, s + ld, m);  // padding: weights that are never summed
    const __m256 vm = _mm256_set1_ps(m);
    for (size_t t = 0; t < ld; t += 8) _mm256_storeu_ps(s + t, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm)));
    float l = 0;
    for (size_t t = 0; t < j.count; ++t) l += s[t];
    j.m[h] = m;
    j.l[h] = l;
  }

  // Four keys per pass over the accumulators; each element still sums keys in index order.
  std::fill(j.o, j.o + size_t(j.n_q) * D, 0.0f);
  constexpr int U = 4;
  size_t t = 0;
  for (; t + U <= j.count; t += U) {
    const E* vrow[U];
    for (int u = 0; u < U; ++u) vrow[u] = values + size_t(j.cells[t + u]) * stride + j.kv_off;
    for (int h = 0; h < j.n_q; ++h) {
      const size_t off = j.head_off[h];
      const E* v[U];
      float w[U];
      for (int u = 0; u < U; ++u) {
        v[u] = vrow[u] + off;
        w[u] = j.scores[h * ld + t + u];
      }
      accumulate<U>(j.o + size_t(h) * D, w, v, D);
    }
  }
  for (; t < j.count; ++t) {
    const E* vrow = values + size_t(j.cells[t]) * stride + j.kv_off;
    for (int h = 0; h < j.n_q; ++h) {
      const E* v[1] = {vrow + j.head_off[h]};
      const float w[1] = {j.scores[h * ld + t]};
      accumulate<1>(j.o + size_t(h) * D, w, v, D);
    }
  }
}

}  // namespace

void flash_partial_avx2(const PartialJob& j) {
  if (j.kv->type == DType::F16) partial<uint16_t>(j);
  else partial<float>(j);
}

}  // namespace specmesh::detail

#endif
