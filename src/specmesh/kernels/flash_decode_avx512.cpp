// AVX-512 flash-decode partial, for head sizes that are a multiple of 64. Built with AVX-512
// F/DQ and only called when matmul's AVX-512 path is selected (flash_decode.cpp).
//
// Scores: each key's dot product with a head's query is one 16-lane accumulator (head_dim / 16
// fused multiply-adds in d order); sixteen keys' accumulators are then summed across their
// lanes together, by a shuffle-and-add tree that fills one vector with the sixteen scores
// (45 instructions for 16 scores, where a horizontal sum per key costs about 10 each). Values:
// up to four heads of one KV head keep their outputs in registers while the keys pass, so each
// value row is loaded once for all of them.
//
// Determinism: a key's score adds its lanes in one fixed tree whatever its place among the
// sixteen, and every sum over keys runs in key order, so as in the AVX2 kernel a head's
// result does not depend on which heads share a call or which thread runs it.
//
// Helpers live in an anonymous namespace and no standard-library template is instantiated
// here (see matmul_avx512.cpp).
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cmath>

#include "specmesh/kernels/flash_decode.hpp"

namespace specmesh::detail {

namespace {

// e^x for x <= 0, as exp_neg in flash_decode_avx2.cpp at 16 lanes (the same steps, so the
// same values).
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// The sixteen lane sums of a[0..16), result lane i = sum of a[kOrder[i]]'s lanes: the tree
// leaves lane 4k + e holding input 4e + k, so inputs are passed in that transposed order.
inline __m512 sum16(const __m512 (&a)[16]) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // halves: lanes 0-7 of a[2i], then of a[2i+1]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: one 128-bit lane per input
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs within 128-bit lanes
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane 4k + e of sum16's result comes from input 4e + k: key u of a block goes in input
// slot kSlot[u] so that lane u holds key u.
constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// For heads h0 .. h0 + H (one KV head): o_h[o0 .. o0 + 16 N) = the sum over keys t in index
// order of w_h[t] * v_t[off .. off + 16 N).
template <int N, int H>
inline void accumulate(const PartialJob& j, int h0, size_t ld, size_t off, size_t o0 = 0) {
  __m512 acc[H][N];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const float* w = j.scores + size_t(h0) * ld;
  for (size_t t = 0; t < j.count; ++t) {
    const float* v = j.kv->v + size_t(j.cells[t]) * j.kv->row_stride + off;
    __m512 vv[N];
    for (int c = 0; c < N; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int i = 0; i < H; ++i) {
      const __m512 wv = _mm512_set1_ps(w[size_t(i) * ld + t]);
      for (int c = 0; c < N; ++c) acc[i][c] = _mm512_fmadd_ps(wv, vv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < H; ++i)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(j.o + size_t(h0 + i) * j.head_dim + o0 + 16 * c, acc[i][c]);
}

}  // namespace

void flash_partial_avx512(const PartialJob& j) {
  const int D = j.head_dim;  // a multiple of 64 (see flash_decode.cpp)
  const int nd = D / 16;
  const size_t ld = (j.count + 15) / 16 * 16;
  const size_t stride = j.kv->row_stride;

  // Scores, sixteen keys at a time: sixteen independent accumulators, each adding its key's
  // products in d order. Past the last key a block repeats key 0 (those lanes are padding).
  for (size_t t0 = 0; t0 < j.count; t0 += 16) {
    const size_t nt = j.count - t0 < 16 ? j.count - t0 : 16;
    const float* krow[16];
    for (size_t u = 0; u < 16; ++u) krow[u] = j.kv->k + size_t(j.cells[t0 + (u < nt ? u : 0)]) * stride + j.kv_off;
    for (int h = 0; h < j.n_q; ++h) {
      const float* q = j.q + size_t(h) * D;
      const size_t off = j.head_off[h];
      __m512 acc[16];
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int c = 0; c < nd; ++c) {
        const __m512 qv = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
        for (int u = 0; u < 16; ++u)
          acc[kSlot[u]] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krow[u] + off + 16 * c), acc[kSlot[u]]);
      }
      _mm512_storeu_ps(j.scores + size_t(h) * ld + t0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(j.scale)));
    }
  }

  for (int h = 0; h < j.n_q; ++h) {
    float* s = j.scores + size_t(h) * ld;
    float m = s[0];
    for (size_t t = 1; t < j.count; ++t) m = s[t] > m ? s[t] : m;
    for (size_t t = j.count; t < ld; ++t) s[t] = m;  // padding: weights that are never summed
    const __m512 vm = _mm512_set1_ps(m);
    for (size_t t = 0; t < ld; t += 16) _mm512_storeu_ps(s + t, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm)));
    float l = 0;
    for (size_t t = 0; t < j.count; ++t) l += s[t];
    j.m[h] = m;
    j.l[h] = l;
  }

  // Values: H heads of one KV head at a time, their outputs in registers while the keys pass
  // in index order (each value row loaded once for the H heads).
  for (int h = 0; h < j.n_q;) {
    const size_t off = j.kv_off + j.head_off[h];
    const int left = j.group - h % j.group;  // heads from h on that read this KV head
    if (nd == 4 && left >= 4) {
      accumulate<4, 4>(j, h, ld, off);
      h += 4;
    } else if (nd == 8 && left >= 2) {
      accumulate<8, 2>(j, h, ld, off);
      h += 2;
    } else {
      for (int c = 0; c < nd; c += 4) accumulate<4, 1>(j, h, ld, off + 16 * size_t(c), 16 * c);
      h += 1;
    }
  }
}

}  // namespace specmesh::detail

#endif
