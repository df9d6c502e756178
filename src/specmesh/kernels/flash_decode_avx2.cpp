// AVX2 + FMA flash-decode partial, for head sizes that are a multiple of 8. Built with -mavx2
// -mfma -mf16c and only called after the run-time CPU check that selects matmul's AVX2 path
// (flash_decode.cpp). The AVX-512 kernel's design at half the width and half the registers.
//
// Scores, over blocks of 8 keys. The block's key rows (the part the job reads) are widened once
// into a scratch block laid out four values by eight keys: chunk c (values 4c .. 4c + 4 of a
// row) of keys 0 .. 8 is 32 consecutive floats, keys 2g and 2g + 1 in one register's halves.
// Each head takes one 128-bit broadcast of its query's chunk c per chunk and multiply-adds it
// into four accumulators of two keys each, so one score is four lanes (lane r adds
// q[4c + r] k[4c + r] in chunk order), added by three horizontal adds shared by eight scores.
// Two heads that read one KV head share the block's loads (two heads' eight accumulators and
// the four key registers fill the sixteen); the widening (F16, Q8_0) happens once per key for
// all heads. Against a dot product per key and head, which reduces eight lanes for every score
// and widens every key once per head, this is about half the operations.
// Weights: e^(s - m) eight keys at a time, summed in eight lanes.
// Values: heads of one KV head keep their outputs in eight registers while the keys pass (eight
// heads times one register of values, four times two, ...), so each value row is loaded and
// widened once for all of them.
//
// Memory: as in the AVX-512 kernel (flash_simd_shared.hpp), the rows of the partial this thread
// computes next are asked for between the multiply-adds, half during the scores and the
// softmax, half during the values (at 16K keys from memory, 3.1-3.3 ms per layer with the asks,
// 4.3-4.8 without, on an AMD Zen 3). Unlike the AVX-512 kernel, the values pass does not also
// ask for its own rows 16 keys ahead to L1: on that CPU it made one layer 20-30 % slower, in
// cache and from memory (bench_flash_decode, KV decode ceiling).
//
// Determinism: a score's four lanes and their sum are the same operations whichever heads share
// its call and wherever its key sits in a block; the weights' sum adds keys t, t + 8, ... in
// each lane, then the lanes by one tree; every output sums its keys in key order. So a head's
// result does not depend on which heads share a call or which thread runs it.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cmath>

#include "specmesh/kernels/avx2_reduce.hpp"
#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/kernels/flash_simd_shared.hpp"

namespace specmesh::detail {

namespace {

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

// How a stored type is read. Ptr points at a value of a row; at(row, value) finds value `value`
// of the row that starts at `row`; load8(p, c) widens values [8c, 8c + 8) from p to floats, as
// kv_load does (F16 exactly, Q8_0 as d * q); bytes(n) is what n values take.
struct F32Rows {
  using Ptr = const float*;
  static Ptr at(const char* row, size_t value) { return reinterpret_cast<Ptr>(row) + value; }
  [[gnu::always_inline]] static __m256 load8(Ptr p, int c) { return _mm256_loadu_ps(p + 8 * c); }
  static size_t bytes(size_t n) { return n * sizeof(float); }
  static constexpr bool kInt8Scores = false;
};

struct F16Rows {
  using Ptr = const uint16_t*;
  static Ptr at(const char* row, size_t value) { return reinterpret_cast<Ptr>(row) + value; }
  [[gnu::always_inline]] static __m256 load8(Ptr p, int c) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * c)));
  }
  static size_t bytes(size_t n) { return n * sizeof(uint16_t); }
  static constexpr bool kInt8Scores = false;
};

// Q8_0: `value` must start a quarter block (flash_decode.cpp checks that heads start blocks;
// the values pass reads 8 values at a time), so 8 values are one quarter of a block.
struct Q8Rows {
  struct Ptr {
    const block_q8_0* block;
    int quarter;  // of the first value in `block`
  };
  static Ptr at(const char* row, size_t value) {
    return {reinterpret_cast<const block_q8_0*>(row) + value / QK8_0, int(value % QK8_0 / 8)};
  }
  [[gnu::always_inline]] static __m256 load8(Ptr p, int c) {
    const block_q8_0& b = p.block[(p.quarter + c) / 4];
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * ((p.quarter + c) % 4)));
    return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(b.d)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
  static size_t bytes(size_t n) { return (n + QK8_0 - 1) / QK8_0 * sizeof(block_q8_0); }
  static constexpr bool kInt8Scores = true;  // see scores_q8
};

// Widens values [first, first + width) of the key rows of keys t0 .. t0 + 8 (keys past the
// last read the last key's row again: PartialJob::row_off's padding) into kt: value x of key u
// at kt[(x / 4) * 32 + 4 u + x % 4]. Two keys at a time, their eight-value pieces swapped by
// 128-bit halves.
template <class E>
inline void key_block(const PartialJob& j, size_t t0, size_t first, size_t width, float* kt) {
  const char* const k_base = static_cast<const char*>(j.kv->k);
  for (size_t g = 0; g < 4; ++g) {
    const typename E::Ptr ra = E::at(k_base + j.row_off[t0 + 2 * g], first);
    const typename E::Ptr rb = E::at(k_base + j.row_off[t0 + 2 * g + 1], first);
    for (size_t c = 0; c < width / 8; ++c) {
      const __m256 x0 = E::load8(ra, int(c)), x1 = E::load8(rb, int(c));
      _mm256_storeu_ps(kt + 64 * c + 8 * g, _mm256_permute2f128_ps(x0, x1, 0x20));
      _mm256_storeu_ps(kt + 64 * c + 32 + 8 * g, _mm256_permute2f128_ps(x0, x1, 0x31));
    }
  }
}

// Scores of heads h .. h + H for the 8 keys of kt, which starts at value `lo` after kv_off.
// Shared: the H heads read one KV head, so they share the block's loads.
template <int H, bool Shared>
[[gnu::always_inline]] inline void scores_block(const PartialJob& j, int h, const float* kt, size_t lo, size_t t0,
                                                size_t ld) {
  const int nc = j.head_dim / 4;
  const float* kh[H];
  const float* q[H];
  for (int i = 0; i < H; ++i) {
    kh[i] = kt + (j.head_off[h + i] - lo) * 8;
    q[i] = j.q + size_t(h + i) * j.head_dim;
  }
  __m256 acc[H][4];
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
  for (int c = 0; c < nc; ++c) {
    __m256 kv[4];
    if (Shared)
      for (int b = 0; b < 4; ++b) kv[b] = _mm256_loadu_ps(kh[0] + c * 32 + 8 * b);
    for (int i = 0; i < H; ++i) {
      const __m256 qv = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(q[i] + 4 * c));
      for (int b = 0; b < 4; ++b)
        acc[i][b] = _mm256_fmadd_ps(qv, Shared ? kv[b] : _mm256_loadu_ps(kh[i] + c * 32 + 8 * b), acc[i][b]);
    }
  }
  // acc[i][b]: key 2b's four lanes, then key 2b + 1's. Three horizontal adds leave keys
  // 0, 2, 4, 6 in the low half and 1, 3, 5, 7 in the high half, each (l0 + l1) + (l2 + l3);
  // the permutation puts key t in lane t.
  const __m256i to_keys = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < H; ++i) {
    const __m256 x = _mm256_hadd_ps(acc[i][0], acc[i][1]), y = _mm256_hadd_ps(acc[i][2], acc[i][3]);
    const __m256 r = _mm256_permutevar8x32_ps(_mm256_hadd_ps(x, y), to_keys);
    _mm256_storeu_ps(j.scores + size_t(h + i) * ld + t0, _mm256_mul_ps(r, _mm256_set1_ps(j.scale)));
  }
}

// Weights e^(s - m) in place for heads h .. h + G and their sums: the maximum over the real
// keys (exact in any order), then eight lanes of partial sums in key order, added by one fixed
// tree. Each head's operations are the same whatever G is.
template <int G>
[[gnu::always_inline]] inline void weights(const PartialJob& j, int h, size_t ld) {
  const size_t full = j.count / 8 * 8;
  const __m256 tail = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(int(j.count - full)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  float* s[G];
  __m256 vm[G], vl[G];
  for (int i = 0; i < G; ++i) {
    s[i] = j.scores + size_t(h + i) * ld;
    vm[i] = _mm256_set1_ps(-INFINITY);
    vl[i] = _mm256_setzero_ps();
  }
  for (size_t t = 0; t < full; t += 8)
    for (int i = 0; i < G; ++i) vm[i] = _mm256_max_ps(vm[i], _mm256_loadu_ps(s[i] + t));
  for (int i = 0; i < G; ++i) {
    if (full < j.count)
      vm[i] = _mm256_max_ps(vm[i], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s[i] + full), tail));
    j.m[h + i] = avx2::hmax(vm[i]);
    vm[i] = _mm256_set1_ps(j.m[h + i]);
  }
  for (size_t t = 0; t < full; t += 8)
    for (int i = 0; i < G; ++i) {
      const __m256 w = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s[i] + t), vm[i]));
      _mm256_storeu_ps(s[i] + t, w);
      vl[i] = _mm256_add_ps(vl[i], w);
    }
  for (int i = 0; i < G; ++i) {
    if (full < j.count) {
      // Padding lanes get weight 0 (they are never summed into an output).
      const __m256 w = _mm256_and_ps(tail, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s[i] + full), vm[i])));
      _mm256_storeu_ps(s[i] + full, w);
      vl[i] = _mm256_add_ps(vl[i], w);
    }
    j.l[h + i] = avx2::hsum(vl[i]);
  }
}

// Q8_0 keys: the scores as 8-bit dot products, with the AVX-512 kernel's numerics. Each query
// head is quantised once per partial, per 32-value block, exactly as that kernel does (d = amax
// / 127, q = x * (127 / amax) rounded to nearest even), so a score is scale * sum over blocks of
// d_q d_k (q . k), with q . k exact in 32 bits. Without VNNI the products go through maddubs,
// which multiplies unsigned by signed bytes and saturates its pair sums at 16 bits: the unsigned
// side is |q| and the signed side k with q's sign (vpsignb), so each pair sum is at most
// 2 * 127 * 127 and exact. (A stored key byte of -128 would flip wrongly; Q8_0 rows hold
// -127 .. 127, as kv_store quantises them.) The float steps are the AVX-512 kernel's, in
// its order, so both give the same scores (their softmax sums differ in order). Against widening
// the keys to floats this halves the multiplier-port operations per score and drops the
// widening.

// The quantised queries of a job, in PartialJob::q8 as the AVX-512 kernel lays them out (its
// bias part unused here).
struct Q8Query {
  const int8_t* q;  // n_q * head_dim
  const float* d;   // n_q * (head_dim / 32)
};

inline Q8Query quantize_queries(const PartialJob& j) {
  const int D = j.head_dim, nb = D / 32;
  auto* q8 = reinterpret_cast<int8_t*>(j.q8);
  float* d = j.q8 + size_t(j.n_q) * size_t(D) / 4;
  if (j.q8_ready) return {q8, d};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // packs_epi32 then packs_epi16 leave the four registers' values interleaved by 32-bit groups
  // within each half; this puts them back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int h = 0; h < j.n_q; ++h)
    for (int b = 0; b < nb; ++b) {
      const float* x = j.q + size_t(h) * size_t(D) + 32 * size_t(b);
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
      const float amax = avx2::hmax(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
      const size_t at = size_t(h) * size_t(nb) + size_t(b);
      d[at] = amax / 127.0f;
      const __m256 id = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      __m256i n[4];
      for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8 + size_t(h) * size_t(D) + 32 * size_t(b)),
                          _mm256_permutevar8x32_epi32(bytes, order));
    }
  return {q8, d};
}

// Keys t0 .. t0 + 8 (past the last, the last again), the Q8_0 block at value `value` of each row:
// k[c] lane l holds bytes 4c .. 4c + 4 of key l; dk lane l its scale.
[[gnu::always_inline]] inline void q8_key_block(const PartialJob& j, size_t t0, size_t value, __m256i k[8], __m256& dk) {
  const char* const k_base = static_cast<const char*>(j.kv->k);
  const block_q8_0* r[8];
  for (size_t u = 0; u < 8; ++u) r[u] = Q8Rows::at(k_base + j.row_off[t0 + u], value).block;
  // Per group of four keys, 4 x 4 dword transposes within each 128-bit half: b[4g + c] holds
  // dword c (low half) and 4 + c (high half) of keys 4g .. 4g + 4.
  __m256i b[8];
  for (int g = 0; g < 2; ++g) {
    __m256i y[4];
    for (int u = 0; u < 4; ++u) y[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[4 * g + u]->qs));
    const __m256i a0 = _mm256_unpacklo_epi32(y[0], y[1]), a1 = _mm256_unpackhi_epi32(y[0], y[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(y[2], y[3]), a3 = _mm256_unpackhi_epi32(y[2], y[3]);
    b[4 * g] = _mm256_unpacklo_epi64(a0, a2);
    b[4 * g + 1] = _mm256_unpackhi_epi64(a0, a2);
    b[4 * g + 2] = _mm256_unpacklo_epi64(a1, a3);
    b[4 * g + 3] = _mm256_unpackhi_epi64(a1, a3);
  }
  for (int c = 0; c < 4; ++c) {
    k[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
    k[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
  }
  alignas(16) uint16_t ds[8];
  for (int l = 0; l < 8; ++l) ds[l] = r[l]->d;
  dk = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(ds)));
}

// Scores of heads h .. h + H, which read one KV head, for keys t0 .. t0 + 8. A head's sum over
// the blocks waits in its score row between blocks (sixteen registers hold one block's keys
// and one head's products, not eight heads' sums as well).
template <int H>
[[gnu::always_inline]] inline void scores_q8(const PartialJob& j, const Q8Query& qq, int h, size_t t0, size_t ld) {
  const int D = j.head_dim, nb = D / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int b = 0; b < nb; ++b) {
    __m256i k[8];
    __m256 dk;
    q8_key_block(j, t0, j.kv_off + j.head_off[h] + 32 * size_t(b), k, dk);
    for (int i = 0; i < H; ++i) {
      const size_t at = size_t(h + i) * size_t(nb) + size_t(b);
      const auto* qd = reinterpret_cast<const int32_t*>(qq.q + size_t(h + i) * size_t(D) + 32 * size_t(b));
      __m256i acc = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i x = _mm256_set1_epi32(qd[c]);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(k[c], x)), ones));
      }
      float* row = j.scores + size_t(h + i) * ld + t0;
      const __m256 w = _mm256_mul_ps(dk, _mm256_set1_ps(qq.d[at]));
      __m256 sum = b == 0 ? _mm256_mul_ps(_mm256_cvtepi32_ps(acc), w) : _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), w, _mm256_loadu_ps(row));
      if (b + 1 == nb) sum = _mm256_mul_ps(sum, _mm256_set1_ps(j.scale));
      _mm256_storeu_ps(row, sum);
    }
  }
}

// For heads h0 .. h0 + H (one KV head): o_h[o0 .. o0 + 8 N) = the sum over keys t in index
// order of w_h[t] * v_t[off .. off + 8 N).
// LD: the score rows' stride when it is the usual one (kScoreRows), which leaves the heads'
// weights one register and constant offsets away; 0: read it from `ld`.
// Every kAskEvery keys it takes `per` of the next partial's asks (NextRows).
template <int N, int H, class E, size_t LD>
inline void accumulate(const PartialJob& j, int h0, size_t ld_, size_t off, size_t o0, NextRows& next, size_t per) {
  const size_t ld = LD > 0 ? LD : ld_;
  __m256 acc[H][N];
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
  const float* w = j.scores + size_t(h0) * ld;
  const char* const v_base = static_cast<const char*>(j.kv->v);
  auto key = [&](size_t t) [[gnu::always_inline]] {
    const typename E::Ptr v = E::at(v_base + j.row_off[t], off);
    __m256 vv[N];
    for (int c = 0; c < N; ++c) vv[c] = E::load8(v, c);
    const float* wt = w + t;
    // With LD constant, the H weights are wt plus constant offsets; hiding how wt was computed
    // keeps the compiler from giving each head its own pointer (eight live pointers leave too
    // few registers for the loop).
    if (LD > 0) asm("" : "+r"(wt));
    for (int i = 0; i < H; ++i) {
      const __m256 wv = _mm256_broadcast_ss(wt + size_t(i) * ld);
      for (int c = 0; c < N; ++c) acc[i][c] = _mm256_fmadd_ps(wv, vv[c], acc[i][c]);
    }
  };
  for_keys_asking(j.count, next, per, key);
  for (int i = 0; i < H; ++i)
    for (int c = 0; c < N; ++c) _mm256_storeu_ps(j.o + size_t(h0 + i) * j.head_dim + o0 + 8 * c, acc[i][c]);
}

// How many registers of 8 values of a row one values pass covers for a run of `heads`: the
// outputs fill eight registers (fewer when the head is shorter), and a pass covers a whole
// number of them.
inline int value_regs(int heads, int nd) {
  for (int n = 8 / heads < 4 ? 8 / heads : 4; n > 1; n /= 2)
    if (nd % n == 0) return n;
  return 1;
}

// One values pass of H heads over n registers of values (value_regs).
template <int H, class E, size_t LD>
inline void values_pass(const PartialJob& j, int h, int n, size_t ld, size_t off, size_t at, NextRows& next,
                        size_t per) {
  if constexpr (H <= 2)
    if (n == 4) return accumulate<4, H, E, LD>(j, h, ld, off, at, next, per);
  if constexpr (H <= 4)
    if (n == 2) return accumulate<2, H, E, LD>(j, h, ld, off, at, next, per);
  accumulate<1, H, E, LD>(j, h, ld, off, at, next, per);
}

// The partial over rows stored as E (F32Rows, F16Rows or Q8Rows).
template <class E>
void partial(const PartialJob& j) {
  const int D = j.head_dim;  // a multiple of 8 (see flash_decode.cpp)
  const int nd = D / 8;
  const size_t ld = score_stride(j.count);

  // The part of a row this job reads: values [lo, hi) after kv_off.
  const size_t lo = j.span_lo, hi = j.span_hi;

  // The next partial's rows, asked for in shares at each head step of the scores (two heads
  // per step), each head of the softmax and every kAskEvery keys of each values pass.
  NextRows next = next_rows<E>(j);
  // Head steps per block of keys: pairs of heads, or (8-bit scores) runs of one KV head.
  const size_t steps = E::kInt8Scores ? kv_runs(j) : size_t(j.n_q / 2 + j.n_q % 2);
  const AskShares share =
      ask_shares(j, next, (j.count + 7) / 8 * steps + size_t(j.n_q), [&](int H) { return nd / value_regs(H, nd); });
  const size_t quota = share.early, value_quota = share.late;

  // Scores, block by block, each head step asking for its share of the next partial's rows:
  // 8-bit scores a run of heads of one KV head at a time, else two heads at a time (sharing the
  // block's loads when they read one KV head).
  Q8Query qq{};
  if constexpr (E::kInt8Scores) qq = quantize_queries(j);
  fill_row_off(j, E::bytes(j.kv->row_stride));
  for (size_t t0 = 0; t0 < j.count; t0 += 8) {
    if constexpr (E::kInt8Scores) {
      for_kv_runs(j, [&]<int H>(int h) {
        next.ask(quota);
        scores_q8<H>(j, qq, h, t0, ld);
      });
      continue;
    }
    key_block<E>(j, t0, j.kv_off + lo, hi - lo, j.key_block);
    int h = 0;
    for (; h + 2 <= j.n_q; h += 2) {
      next.ask(quota);
      if (j.head_off[h] == j.head_off[h + 1]) scores_block<2, true>(j, h, j.key_block, lo, t0, ld);
      else scores_block<2, false>(j, h, j.key_block, lo, t0, ld);
    }
    if (h < j.n_q) {
      next.ask(quota);
      scores_block<1, false>(j, h, j.key_block, lo, t0, ld);
    }
  }

  // Weights e^(s - m) in place and their sum, four heads at a time (their chains interleave).
  int h = 0;
  for (; h + 4 <= j.n_q; h += 4) {
    weights<4>(j, h, ld);
    next.ask(4 * quota);
  }
  for (; h < j.n_q; ++h) {
    weights<1>(j, h, ld);
    next.ask(quota);
  }

  // Values: up to eight heads of one KV head at a time, their outputs in registers while the
  // keys pass in index order (each value row loaded and widened once for all of them).
  auto values = [&]<size_t LD>() {
    for (int h = 0; h < j.n_q;) {
      const size_t off = j.kv_off + j.head_off[h];
      const int H = kv_run(j, h), n = value_regs(H, nd);
      for (int c = 0; c < nd; c += n) {
        const size_t at = 8 * size_t(c);
        if (H == 8) values_pass<8, E, LD>(j, h, n, ld, off + at, at, next, value_quota);
        else if (H == 4) values_pass<4, E, LD>(j, h, n, ld, off + at, at, next, value_quota);
        else if (H == 2) values_pass<2, E, LD>(j, h, n, ld, off + at, at, next, value_quota);
        else values_pass<1, E, LD>(j, h, n, ld, off + at, at, next, value_quota);
      }
      h += H;
    }
  };
  if (ld == kScoreRows) values.template operator()<kScoreRows>();
  else values.template operator()<0>();
  next.ask(next.total());
}

}  // namespace

void flash_partial_avx2(const PartialJob& j) {
  if (j.kv->type == DType::F16) partial<F16Rows>(j);
  else if (j.kv->type == DType::Q8_0) partial<Q8Rows>(j);
  else partial<F32Rows>(j);
}

}  // namespace specmesh::detail

#endif
