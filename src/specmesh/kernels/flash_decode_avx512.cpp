// AVX-512 flash-decode partial, for head sizes that are a multiple of 64. Built with AVX-512
// F/DQ and only called when matmul's AVX-512 path is selected (flash_decode.cpp).
//
// Scores: each key's dot product with a head's query is one 16-lane accumulator (head_dim / 16
// fused multiply-adds in d order); sixteen accumulators are then summed across their lanes
// together, by a shuffle-and-add tree that fills one vector with the sixteen scores (45
// instructions for 16 scores, where a horizontal sum per key costs about 10 each). Four heads
// that read one KV head take four keys at a time, each key row loaded once for the four;
// other heads take sixteen keys alone. The weights' maximum and sum are 16 lanes wide. Values:
// up to four heads of one KV head keep their outputs in registers while the keys pass, so each
// value row is loaded once for all of them.
//
// Determinism: a key's score adds its lanes in one fixed tree whatever its place among the
// sixteen (and whichever route, four heads or one, computed it); the weights' sum adds keys
// t, t + 16, ... in each lane, then the lanes by one tree; every output sums its keys in key
// order. So as in the AVX2 kernel a head's result does not depend on which heads share a
// call or which thread runs it.
//
// Helpers live in an anonymous namespace and no standard-library template is instantiated
// here (see matmul_avx512.cpp).
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

// GCC 12 warns that the deliberately undefined vector _mm512_shuffle_f32x4 starts from
// (_mm512_undefined_ps) is used uninitialised once the shuffles are inlined into a loop.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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
[[gnu::always_inline]] inline __m512 sum16(const __m512 (&a)[16]) {
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

// How a stored type is read. Ptr points at a value of a row; at() finds value `value` of cell
// `cell`; load16(p, c) widens values [16c, 16c + 16) from p to floats, as kv_load does (F16
// exactly, Q8_0 as d * q); bytes(n) is what n values take.
struct F32Rows {
  using Ptr = const float*;
  static Ptr at(const void* base, size_t row_bytes, int32_t cell, size_t value) {
    return reinterpret_cast<Ptr>(static_cast<const char*>(base) + size_t(cell) * row_bytes) + value;
  }
  [[gnu::always_inline]] static __m512 load16(Ptr p, int c) { return _mm512_loadu_ps(p + 16 * c); }
  static size_t bytes(size_t n) { return n * sizeof(float); }
};

struct F16Rows {
  using Ptr = const uint16_t*;
  static Ptr at(const void* base, size_t row_bytes, int32_t cell, size_t value) {
    return reinterpret_cast<Ptr>(static_cast<const char*>(base) + size_t(cell) * row_bytes) + value;
  }
  [[gnu::always_inline]] static __m512 load16(Ptr p, int c) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c)));
  }
  static size_t bytes(size_t n) { return n * sizeof(uint16_t); }
};

// Q8_0: `value` must start a block (flash_decode.cpp checks), so 16 values are half a block.
struct Q8Rows {
  using Ptr = const block_q8_0*;
  static Ptr at(const void* base, size_t row_bytes, int32_t cell, size_t value) {
    return reinterpret_cast<Ptr>(static_cast<const char*>(base) + size_t(cell) * row_bytes) + value / QK8_0;
  }
  [[gnu::always_inline]] static __m512 load16(Ptr p, int c) {
    const block_q8_0& b = p[c / 2];
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * (c % 2)));
    return _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b.d)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
  static size_t bytes(size_t n) { return (n + QK8_0 - 1) / QK8_0 * sizeof(block_q8_0); }
};

// How many keys ahead the passes ask for key and value rows: rows a cell list names are not
// where the hardware prefetcher looks (in a large model each row is its own 4 KiB page), and
// without asking the loads wait on memory (about 1.4x slower at 16K keys).
constexpr size_t kAhead = 16;

// For heads h0 .. h0 + H (one KV head): o_h[o0 .. o0 + 16 N) = the sum over keys t in index
// order of w_h[t] * v_t[off .. off + 16 N).
template <int N, int H, class E>
inline void accumulate(const PartialJob& j, int h0, size_t ld, size_t off, size_t o0 = 0) {
  const size_t row_bytes = E::bytes(j.kv->row_stride);
  __m512 acc[H][N];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const float* w = j.scores + size_t(h0) * ld;
  for (size_t t = 0; t < j.count; ++t) {
    const typename E::Ptr v = E::at(j.kv->v, row_bytes, j.cells[t], off);
    if (t + kAhead < j.count) {
      const typename E::Ptr pv = E::at(j.kv->v, row_bytes, j.cells[t + kAhead], off);
      // One request per cache line of the 16 N values.
      for (size_t b = 0; b < E::bytes(16 * N); b += 64) _mm_prefetch(reinterpret_cast<const char*>(pv) + b, _MM_HINT_T0);
    }
    __m512 vv[N];
    for (int c = 0; c < N; ++c) vv[c] = E::load16(v, c);
    for (int i = 0; i < H; ++i) {
      const __m512 wv = _mm512_set1_ps(w[size_t(i) * ld + t]);
      for (int c = 0; c < N; ++c) acc[i][c] = _mm512_fmadd_ps(wv, vv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < H; ++i)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(j.o + size_t(h0 + i) * j.head_dim + o0 + 16 * c, acc[i][c]);
}

// The largest of v's lanes.
[[gnu::always_inline]] inline float hmax16(__m512 v) {
  const __m256 a = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}

// The sum of v's lanes by one fixed tree.
[[gnu::always_inline]] inline float hsum16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// Head h's part of the key rows of keys t0 .. t0 + U (keys past the last repeat key t0).
template <class E, size_t U>
[[gnu::always_inline]] inline void key_rows(const PartialJob& j, int h, size_t t0, typename E::Ptr (&krow)[U]) {
  const size_t row_bytes = E::bytes(j.kv->row_stride);
  for (size_t u = 0; u < U; ++u) {
    const size_t t = t0 + u < j.count ? t0 + u : t0;
    krow[u] = E::at(j.kv->k, row_bytes, j.cells[t], j.kv_off + j.head_off[h]);
  }
}

// Scores of heads [h, h + 4), which read one KV head, for the keys t0 .. t0 + 4 (keys past the
// last repeat key t0; their lanes are padding): one accumulator per (head, key), each key row
// loaded once for the four heads. sum16's lane 4i + u is (head i, key u), the accumulator in
// input slot 4u + i, so each 128-bit lane of the sums is one head's four scores.
// ND = head_dim / 16 when it is a constant the compiler can unroll (0: read it from the job).
template <int ND, class E>
[[gnu::always_inline]] inline void scores_4x4(const PartialJob& j, int h, size_t t0, size_t ld) {
  const int nd = ND > 0 ? ND : j.head_dim / 16;
  typename E::Ptr krow[4];
  key_rows<E>(j, h, t0, krow);
  const float* q = j.q + size_t(h) * j.head_dim;
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int c = 0; c < nd; ++c) {
    __m512 qv[4];
    for (int i = 0; i < 4; ++i) qv[i] = _mm512_loadu_ps(q + size_t(i) * j.head_dim + 16 * c);
    for (int u = 0; u < 4; ++u) {
      const __m512 kv = E::load16(krow[u], c);
      for (int i = 0; i < 4; ++i) acc[4 * u + i] = _mm512_fmadd_ps(qv[i], kv, acc[4 * u + i]);
    }
  }
  const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(j.scale));
  float* out = j.scores + size_t(h) * ld + t0;
  _mm_storeu_ps(out, _mm512_extractf32x4_ps(s, 0));
  _mm_storeu_ps(out + ld, _mm512_extractf32x4_ps(s, 1));
  _mm_storeu_ps(out + 2 * ld, _mm512_extractf32x4_ps(s, 2));
  _mm_storeu_ps(out + 3 * ld, _mm512_extractf32x4_ps(s, 3));
}

// Scores of head h alone for the keys t0 .. t0 + 16 (keys past the last repeat key t0).
template <class E>
inline void scores_16x1(const PartialJob& j, int h, size_t t0, size_t ld) {
  const int nd = j.head_dim / 16;
  typename E::Ptr krow[16];
  key_rows<E>(j, h, t0, krow);
  const float* q = j.q + size_t(h) * j.head_dim;
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int c = 0; c < nd; ++c) {
    const __m512 qv = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u)
      acc[kSlot[u]] = _mm512_fmadd_ps(qv, E::load16(krow[u], c), acc[kSlot[u]]);
  }
  _mm512_storeu_ps(j.scores + size_t(h) * ld + t0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(j.scale)));
}

// Heads [h, h + 4) read one KV head (so they can share key loads).
inline bool shares_kv4(const PartialJob& j, int h) {
  return h + 4 <= j.n_q && j.head_off[h] == j.head_off[h + 3] && j.head_off[h] == j.head_off[h + 1] &&
         j.head_off[h] == j.head_off[h + 2];
}

// The partial over rows stored as E (F32Rows, F16Rows or Q8Rows).
template <class E>
void partial(const PartialJob& j) {
  const int D = j.head_dim;  // a multiple of 64 (see flash_decode.cpp)
  const int nd = D / 16;
  const size_t ld = (j.count + 15) / 16 * 16;

  // Scores. A (head, key) score is the same sum in the same order on both routes: one 16-lane
  // accumulator adding the key's products in d order, its lanes summed by sum16's fixed tree.
  // Each block asks for the next block's key rows (the part this job reads).
  size_t lo = j.head_off[0], hi = j.head_off[0];
  for (int h = 1; h < j.n_q; ++h) {
    lo = j.head_off[h] < lo ? j.head_off[h] : lo;
    hi = j.head_off[h] > hi ? j.head_off[h] : hi;
  }
  // The bytes of a row this job reads.
  lo = E::bytes(lo + j.kv_off);
  hi = E::bytes(hi + j.kv_off + size_t(D));
  const auto* key_bytes = static_cast<const char*>(j.kv->k);
  const size_t row_bytes = E::bytes(j.kv->row_stride);
  int steps = 0;  // head steps per block
  for (int h = 0; h < j.n_q; h += shares_kv4(j, h) ? 4 : 1) ++steps;
  for (size_t t0 = 0; t0 < j.count; t0 += 16) {
    int step = 0;
    for (int h = 0; h < j.n_q; ++step) {
      // This step's share of the next block's rows: asked for a few at a time between the
      // multiply-adds, as a burst of them stalls on the cache's miss buffers (one layer at 16K
      // keys took 1.2x longer with the whole block asked for at once).
      const size_t r0 = t0 + kAhead + 16 * size_t(step) / size_t(steps);
      const size_t r1 = t0 + kAhead + 16 * size_t(step + 1) / size_t(steps);
      for (size_t t = r0; t < r1 && t < j.count; ++t) {
        const char* row = key_bytes + size_t(j.cells[t]) * row_bytes;
        for (size_t x = lo; x < hi; x += 64) _mm_prefetch(row + x, _MM_HINT_T0);
      }
      if (shares_kv4(j, h)) {
        for (size_t u = 0; u < 16 && t0 + u < j.count; u += 4) {
          if (nd == 4) scores_4x4<4, E>(j, h, t0 + u, ld);
          else if (nd == 8) scores_4x4<8, E>(j, h, t0 + u, ld);
          else scores_4x4<0, E>(j, h, t0 + u, ld);
        }
        h += 4;
      } else {
        scores_16x1<E>(j, h, t0, ld);
        h += 1;
      }
    }
  }

  // Weights e^(s - m) in place and their sum: the maximum over the real keys (exact in any
  // order), then sixteen lanes of partial sums in key order, added by one fixed tree.
  const size_t full = j.count / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (j.count - full)) - 1);
  for (int h = 0; h < j.n_q; ++h) {
    float* s = j.scores + size_t(h) * ld;
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (size_t t = 0; t < full; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
    if (tail) vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_loadu_ps(s + full));
    const float m = hmax16(vm);
    vm = _mm512_set1_ps(m);
    __m512 vl = _mm512_setzero_ps();
    for (size_t t = 0; t < full; t += 16) {
      const __m512 w = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
      _mm512_storeu_ps(s + t, w);
      vl = _mm512_add_ps(vl, w);
    }
    if (tail) {
      // Padding lanes get weight 0 (they are never summed into an output).
      const __m512 w = _mm512_maskz_mov_ps(tail, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + full), vm)));
      _mm512_storeu_ps(s + full, w);
      vl = _mm512_add_ps(vl, w);
    }
    j.m[h] = m;
    j.l[h] = hsum16(vl);
  }

  // Values: H heads of one KV head at a time, their outputs in registers while the keys pass
  // in index order (each value row loaded once for the H heads).
  for (int h = 0; h < j.n_q;) {
    const size_t off = j.kv_off + j.head_off[h];
    const int left = j.group - h % j.group;  // heads from h on that read this KV head
    if (nd == 4 && left >= 4) {
      accumulate<4, 4, E>(j, h, ld, off);
      h += 4;
    } else if (nd == 8 && left >= 2) {
      accumulate<8, 2, E>(j, h, ld, off);
      h += 2;
    } else {
      for (int c = 0; c < nd; c += 4) accumulate<4, 1, E>(j, h, ld, off + 16 * size_t(c), 16 * c);
      h += 1;
    }
  }
}

}  // namespace

void flash_partial_avx512(const PartialJob& j) {
  if (j.kv->type == DType::F16) partial<F16Rows>(j);
  else if (j.kv->type == DType::Q8_0) partial<Q8Rows>(j);
  else partial<F32Rows>(j);
}

}  // namespace specmesh::detail

#endif
