// AVX-512 flash-decode partial, for head sizes that are a multiple of 64. Built with AVX-512
// F/DQ and only called when matmul's AVX-512 path is selected (flash_decode.cpp).
//
// Scores, over blocks of 16 keys. The block's key rows (the part the job reads) are widened
// once into a scratch block laid out four values by sixteen keys: chunk c (values 4c .. 4c + 4
// of a row) of keys 0 .. 16 is 64 consecutive floats. Each head then takes one 128-bit
// broadcast of its query's chunk c per chunk and multiply-adds it into four accumulators of
// four keys each, so one score is four lanes (lane r adds q[4c + r] k[4c + r] in chunk order)
// and its lanes are added by two shuffle-and-add steps shared by sixteen scores: 0.7 operations
// per score, where a 16-lane dot product costs about 3. Heads that read one KV head share the
// block's loads; the widening (F16, Q8_0) happens once per key for all of them.
// Values: up to eight heads of one KV head keep their outputs in registers while the keys pass,
// so each value row is loaded and widened once for all of them.
//
// BF16 products (F16 rows where flash_bf16_products says so): the key block holds bf16 values,
// the queries and the softmax weights are rounded to bf16 too, and vdpbf16ps adds two products
// per lane where a multiply-add adds one: the scores and the values take half the instructions
// (one thread in cache, 32 / 4 heads of 64: 33-35 -> 26 TSC ticks per key and KV head). The file
// is built with AVX-512 BF16 for them (CMakeLists.txt); the other row types never reach them.
//
// Memory: every pass asks, a few cache lines at a time between the multiply-adds, for the rows
// of the partial this thread computes next (PartialJob::next, to L2, on AMD to L1): half of them
// during the scores and the softmax, half during the values, so the memory stays busy for the
// whole partial (asking for all of them before the values pass left it idle through that
// pass, and decode at 16K keys 4-5 % slower). The values pass also asks for its own rows 16
// keys ahead (to L1).
//
// Determinism: a score's four lanes and their sum are the same operations whichever heads share
// its call and wherever its key sits in a block; the weights' sum adds keys t, t + 16, ... in
// each lane, then the lanes by one tree; every output sums its keys in key order. So as in the
// AVX2 kernel a head's result does not depend on which heads share a call or which thread runs
// it.
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
#include "specmesh/kernels/flash_simd_shared.hpp"

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
  // p * 2^k by one scalef: k is an integer in [-126, 126], so this is the product by the
  // normal number 2^k, rounded once as the AVX2 kernel's multiply rounds it.
  return _mm512_scalef_ps(p, k);
}

// How a stored type is read. Ptr points at a value of a row (value x of a row is bytes(x) into
// it); load16(p, c) widens values [16c, 16c + 16) from p to floats, as kv_load does (F16
// exactly, Q8_0 as d * q); bytes(n) is what n values take.
struct F32Rows {
  using Ptr = const float*;
  [[gnu::always_inline]] static __m512 load16(Ptr p, int c) { return _mm512_loadu_ps(p + 16 * c); }
  static size_t bytes(size_t n) { return n * sizeof(float); }
  static constexpr bool kInt8Scores = false;
  static constexpr bool kBf16 = false;
};

struct F16Rows {
  using Ptr = const uint16_t*;
  [[gnu::always_inline]] static __m512 load16(Ptr p, int c) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c)));
  }
  static size_t bytes(size_t n) { return n * sizeof(uint16_t); }
  static constexpr bool kInt8Scores = false;
  static constexpr bool kBf16 = false;
};

// F16 rows multiplied in bf16 (see "BF16 products" below).
struct F16RowsBf16 : F16Rows {
  static constexpr bool kBf16 = true;
};

// Q8_0: `value` must start a block (flash_decode.cpp checks), so 16 values are half a block.
struct Q8Rows {
  using Ptr = const block_q8_0*;
  [[gnu::always_inline]] static __m512 load16(Ptr p, int c) {
    const block_q8_0& b = p[c / 2];
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * (c % 2)));
    return _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b.d)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
  static size_t bytes(size_t n) { return (n + QK8_0 - 1) / QK8_0 * sizeof(block_q8_0); }
  static constexpr bool kInt8Scores = true;  // see scores_q8
  static constexpr bool kBf16 = false;
};

// How many keys ahead the values pass asks for value rows: rows a cell list names are not
// where the hardware prefetcher looks (in a large model each row is its own 4 KiB page).
constexpr size_t kAhead = 16;
// For heads h0 .. h0 + H (one KV head): o_h[o0 .. o0 + 16 N) = the sum over keys t in index
// order of w_h[t] * v_t[off .. off + 16 N).
// LD: the score rows' stride when it is the usual one (kScoreRows), which leaves the eight
// heads' weights one register and constant offsets away; 0: read it from `ld`.
// Every kAskEvery keys it takes `per` of the next partial's asks (NextRows).
template <int N, int H, class E, size_t LD>
inline void accumulate(const PartialJob& j, int h0, size_t ld_, size_t off, size_t o0, NextRows& next, size_t per) {
  static_assert(kAhead <= kRowOffPad);
  const size_t ld = LD > 0 ? LD : ld_;
  __m512 acc[H][N];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const float* w = j.scores + size_t(h0) * ld;
  // Value `off` of every row, and each key's row from it at a precomputed offset: the offsets
  // serve every pass of the partial, and the loop keeps few registers besides its sums.
  const char* vb = static_cast<const char*>(j.kv->v) + E::bytes(off);
  const size_t* ro = j.row_off;
  auto key = [&](size_t t) [[gnu::always_inline]] {
    const auto v = reinterpret_cast<typename E::Ptr>(vb + ro[t]);
    // One request per cache line of the 16 N values (past the last key, the last again).
    const char* pv = vb + ro[t + kAhead];
    for (size_t b = 0; b < E::bytes(16 * N); b += 64) _mm_prefetch(pv + b, _MM_HINT_T0);
    __m512 vv[N];
    for (int c = 0; c < N; ++c) vv[c] = E::load16(v, c);
    const float* wt = w + t;
    // With LD constant, the H weights are wt plus constant offsets; hiding how wt was computed
    // keeps the compiler from giving each head its own pointer (eight live pointers leave too
    // few registers for the loop).
    if (LD > 0) asm("" : "+r"(wt));
    for (int i = 0; i < H; ++i) {
      const __m512 wv = _mm512_set1_ps(wt[size_t(i) * ld]);
      for (int c = 0; c < N; ++c) acc[i][c] = _mm512_fmadd_ps(wv, vv[c], acc[i][c]);
    }
  };
  for_keys_asking(j.count, next, per, key);
  for (int i = 0; i < H; ++i)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(j.o + size_t(h0 + i) * j.head_dim + o0 + 16 * c, acc[i][c]);
}

// BF16 values: the pairs of keys (t, t + 1) in index order, each head's two weights (bf16, next
// to each other in its row: weights<G, true>) broadcast as one dword, and the two value rows
// rounded to bf16 and interleaved (lane d of a vector: value d of key t, value d of key t + 1;
// the interleave works within 128-bit lanes, so a vector holds its 16 values permuted, put back
// in order when the outputs are stored). vdpbf16ps then adds both products to the output in
// f32, 16 values x 2 keys per instruction where a multiply-add takes 16 x 1. A count that ends
// on an odd key pairs its last key with the padding row (PartialJob::row_off), whose weight is 0.
// Not inlined: inside partial() GCC kept the sixteen sums on the stack, loading and storing them
// for every pair, and the pass ran no faster than the f32 one.
template <int N, int H, size_t LD>
[[gnu::noinline]] void accumulate_bf16(const PartialJob& j, int h0, size_t ld_, size_t off, size_t o0,
                                       NextRows& next, size_t per) {
  static_assert(N % 2 == 0 && kAhead <= kRowOffPad);
  const size_t ld = LD > 0 ? LD : ld_;
  __m512 acc[H][N];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  // Head i's weights: its score row, read as bf16 values.
  const auto* w = reinterpret_cast<const uint16_t*>(j.scores + size_t(h0) * ld);
  const char* vb = static_cast<const char*>(j.kv->v) + F16Rows::bytes(off);
  const size_t* ro = j.row_off;
  auto pair = [&](size_t t) [[gnu::always_inline]] {
    for (size_t u = t + kAhead - 2; u < t + kAhead; ++u)  // the pair kAhead keys on
      for (size_t b = 0; b < F16Rows::bytes(16 * N); b += 64) _mm_prefetch(vb + ro[u] + b, _MM_HINT_T0);
    const auto* v0 = reinterpret_cast<const uint16_t*>(vb + ro[t]);
    const auto* v1 = reinterpret_cast<const uint16_t*>(vb + ro[t + 1]);
    __m512bh x[N];
    for (int c = 0; c < N; c += 2) {
      const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(F16Rows::load16(v0, c + 1), F16Rows::load16(v0, c));
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(F16Rows::load16(v1, c + 1), F16Rows::load16(v1, c));
      x[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      x[c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    const uint16_t* wt = w + t;
    if (LD > 0) asm("" : "+r"(wt));  // as in accumulate
    for (int i = 0; i < H; ++i) {
      int32_t two;
      __builtin_memcpy(&two, wt + 2 * size_t(i) * ld, sizeof two);
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(two);
      for (int c = 0; c < N; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], x[c], wv);
    }
  };
  for_keys_asking<2>(j.count, next, per, pair);
  // acc[i][c] lane 4L + r holds value 32 (c / 2) + 8L + r (c even) or + 4 + r (c odd).
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < H; ++i) {
    float* o = j.o + size_t(h0 + i) * j.head_dim + o0;
    for (int c = 0; c < N; c += 2) {
      _mm512_storeu_ps(o + 16 * c, _mm512_permutex2var_ps(acc[i][c], lo, acc[i][c + 1]));
      _mm512_storeu_ps(o + 16 * c + 16, _mm512_permutex2var_ps(acc[i][c], hi, acc[i][c + 1]));
    }
  }
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

// Widens values [first, first + width) of the key rows of keys t0 .. t0 + 16 (keys past the
// last read the last key's row again: PartialJob::row_off's padding) into kt: value x of key u
// at kt[(x / 4) * 64 + 4 u + x % 4]. Four keys at a time, their sixteen-value pieces
// transposed by 128-bit lanes in registers.
template <class E>
inline void key_block(const PartialJob& j, size_t t0, size_t first, size_t width, float* kt) {
  const char* kb = static_cast<const char*>(j.kv->k) + E::bytes(first);
  for (size_t g = 0; g < 4; ++g) {
    typename E::Ptr row[4];
    for (size_t u = 0; u < 4; ++u) row[u] = reinterpret_cast<typename E::Ptr>(kb + j.row_off[t0 + 4 * g + u]);
    for (size_t c = 0; c < width / 16; ++c) {
      const __m512 x0 = E::load16(row[0], int(c)), x1 = E::load16(row[1], int(c));
      const __m512 x2 = E::load16(row[2], int(c)), x3 = E::load16(row[3], int(c));
      const __m512 a = _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(1, 0, 1, 0));  // x0 c0 c1, x1 c0 c1
      const __m512 b = _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 2, 3, 2));  // x0 c2 c3, x1 c2 c3
      const __m512 c01 = _mm512_shuffle_f32x4(x2, x3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 c23 = _mm512_shuffle_f32x4(x2, x3, _MM_SHUFFLE(3, 2, 3, 2));
      float* dst = kt + c * 256 + 16 * g;
      _mm512_storeu_ps(dst, _mm512_shuffle_f32x4(a, c01, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_storeu_ps(dst + 64, _mm512_shuffle_f32x4(a, c01, _MM_SHUFFLE(3, 1, 3, 1)));
      _mm512_storeu_ps(dst + 128, _mm512_shuffle_f32x4(b, c23, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_storeu_ps(dst + 192, _mm512_shuffle_f32x4(b, c23, _MM_SHUFFLE(3, 1, 3, 1)));
    }
  }
}

// F16 rows, the same block: four keys' sixteen-value pieces are transposed by 64-bit pieces
// (four values each) while still 16-bit, two two-source permutes where the floats took eight
// shuffles, and then widened. One process alternating both versions (32/4 heads of 64, 128
// keys): 0.93-0.94x the partial's time in cache, 0.97x from memory.
template <>
inline void key_block<F16Rows>(const PartialJob& j, size_t t0, size_t first, size_t width, float* kt) {
  const char* kb = static_cast<const char*>(j.kv->k) + F16Rows::bytes(first);
  const __m512i lo_idx = _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13);
  const __m512i hi_idx = _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15);
  for (size_t g = 0; g < 4; ++g) {
    const uint16_t* row[4];
    for (size_t u = 0; u < 4; ++u) row[u] = reinterpret_cast<const uint16_t*>(kb + j.row_off[t0 + 4 * g + u]);
    for (size_t c = 0; c < width / 16; ++c) {
      auto ld = [&](int u) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[u] + 16 * c)); };
      const __m512i z01 = _mm512_inserti64x4(_mm512_castsi256_si512(ld(0)), ld(1), 1);
      const __m512i z23 = _mm512_inserti64x4(_mm512_castsi256_si512(ld(2)), ld(3), 1);
      const __m512i lo = _mm512_permutex2var_epi64(z01, lo_idx, z23), hi = _mm512_permutex2var_epi64(z01, hi_idx, z23);
      float* dst = kt + c * 256 + 16 * g;
      _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm512_castsi512_si256(lo)));
      _mm512_storeu_ps(dst + 64, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1)));
      _mm512_storeu_ps(dst + 128, _mm512_cvtph_ps(_mm512_castsi512_si256(hi)));
      _mm512_storeu_ps(dst + 192, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1)));
    }
  }
}

// Scores of head h for the 16 keys from t0: acc[b] lane 4u + r holds part r of key 4b + u's
// dot product. Two steps add (l0 + l2) + (l1 + l3), leaving key 4b + u in lane 4u + b; the
// permutation puts key t in lane t.
[[gnu::always_inline]] inline void store_scores(const PartialJob& j, const __m512 acc[4], int h, size_t t0,
                                                size_t ld) {
  const __m512i to_keys = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(acc[0], acc[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(acc[0], acc[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(acc[2], acc[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(acc[2], acc[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm512_storeu_ps(j.scores + size_t(h) * ld + t0,
                   _mm512_mul_ps(_mm512_permutexvar_ps(to_keys, r), _mm512_set1_ps(j.scale)));
}

// How a key block meets the queries. F32Block: the block holds floats four values by sixteen
// keys (key_block), a query chunk is four floats, one multiply-add per product. Bf16Block: the
// block holds bf16 values eight by sixteen keys (key_block_bf16), a query chunk is eight bf16
// values (PartialJob::qh), and vdpbf16ps adds two products per lane: lane r of a key then adds
// the pairs 2r and 2r + 1 of each chunk, so a score is four lanes either way, at half the
// instructions. A chunk of 16 keys is 16 kValues elements, four keys' part of it 4 kValues.
struct F32Block {
  using T = float;
  using V = __m512;
  static constexpr int kValues = 4;
  [[gnu::always_inline]] static V keys(const T* p) { return _mm512_loadu_ps(p); }
  [[gnu::always_inline]] static V query(const T* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
  [[gnu::always_inline]] static __m512 add(__m512 acc, V k, V q) { return _mm512_fmadd_ps(q, k, acc); }
};

struct Bf16Block {
  using T = uint16_t;
  using V = __m512i;
  static constexpr int kValues = 8;
  [[gnu::always_inline]] static V keys(const T* p) { return _mm512_loadu_si512(p); }
  [[gnu::always_inline]] static V query(const T* p) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  [[gnu::always_inline]] static __m512 add(__m512 acc, V k, V q) {
    return _mm512_dpbf16_ps(acc, (__m512bh)k, (__m512bh)q);
  }
};

// The block type of rows multiplied in bf16 or not (no <type_traits> here: see the header).
template <bool Bf16> struct BlockOf { using type = F32Block; };
template <> struct BlockOf<true> { using type = Bf16Block; };

// Scores of heads h .. h + H for the 16 keys of kt, which starts at value `lo` after kv_off,
// against the queries at qs (head h at qs + h * head_dim). Shared: the H heads read one KV
// head, so they share the block's loads.
template <class B, int H, bool Shared>
[[gnu::always_inline]] inline void scores_block(const PartialJob& j, int h, const typename B::T* kt,
                                                const typename B::T* qs, size_t lo, size_t t0, size_t ld) {
  constexpr int kChunk = 16 * B::kValues, kFour = 4 * B::kValues;
  const int nc = j.head_dim / B::kValues;
  const typename B::T* kh[H];
  const typename B::T* q[H];
  for (int i = 0; i < H; ++i) {
    kh[i] = kt + (j.head_off[h + i] - lo) * 16;
    q[i] = qs + size_t(h + i) * j.head_dim;
  }
  __m512 acc[H][4];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int c = 0; c < nc; ++c) {
    typename B::V kv[4];
    if (Shared)
      for (int b = 0; b < 4; ++b) kv[b] = B::keys(kh[0] + c * kChunk + kFour * b);
    for (int i = 0; i < H; ++i) {
      const typename B::V qv = B::query(q[i] + B::kValues * c);
      for (int b = 0; b < 4; ++b)
        acc[i][b] = B::add(acc[i][b], Shared ? kv[b] : B::keys(kh[i] + c * kChunk + kFour * b), qv);
    }
  }
  for (int i = 0; i < H; ++i) store_scores(j, acc[i], h + i, t0, ld);
}

// F16 rows for Bf16Block: the block's key rows rounded to bf16 into kt, value x of key u at
// kt[(x / 8) * 128 + 8 u + x % 8], so one 512-bit load holds eight values of four keys.
inline void key_block_bf16(const PartialJob& j, size_t t0, size_t first, size_t width, uint16_t* kt) {
  const char* kb = static_cast<const char*>(j.kv->k) + F16Rows::bytes(first);
  for (size_t g = 0; g < 4; ++g) {
    const uint16_t* row[4];
    for (size_t u = 0; u < 4; ++u) row[u] = reinterpret_cast<const uint16_t*>(kb + j.row_off[t0 + 4 * g + u]);
    for (size_t c = 0; c < width / 16; ++c) {
      // Keys 0 and 1 (a), 2 and 3 (b): eight values per 128-bit lane, key by key.
      const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(F16Rows::load16(row[1], int(c)), F16Rows::load16(row[0], int(c)));
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(F16Rows::load16(row[3], int(c)), F16Rows::load16(row[2], int(c)));
      uint16_t* dst = kt + 2 * c * 128 + 32 * g;
      _mm512_storeu_si512(dst, _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_storeu_si512(dst + 128, _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
  }
}

// Weights e^(s - m) in place for heads h .. h + G and their sums: the maximum over the real
// keys (exact in any order), then sixteen lanes of partial sums in key order, added by one
// fixed tree. Each head's operations are the same whatever G is.
// Bf16: each weight is rounded to bf16 (nearest even) and stored as such from the start of the
// head's score row, weight t at bf16 index t (block t writes bytes [2t, 2t + 32), which its own
// and earlier blocks' floats held), and the sum adds the rounded weights, so l is the sum of
// the weights the outputs use.
template <int G, bool Bf16 = false>
[[gnu::always_inline]] inline void weights(const PartialJob& j, int h, size_t ld) {
  const size_t full = j.count / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (j.count - full)) - 1);
  float* s[G];
  __m512 vm[G], vl[G];
  for (int i = 0; i < G; ++i) {
    s[i] = j.scores + size_t(h + i) * ld;
    vm[i] = _mm512_set1_ps(-INFINITY);
    vl[i] = _mm512_setzero_ps();
  }
  for (size_t t = 0; t < full; t += 16)
    for (int i = 0; i < G; ++i) vm[i] = _mm512_max_ps(vm[i], _mm512_loadu_ps(s[i] + t));
  for (int i = 0; i < G; ++i) {
    if (tail) vm[i] = _mm512_mask_max_ps(vm[i], tail, vm[i], _mm512_loadu_ps(s[i] + full));
    j.m[h + i] = hmax16(vm[i]);
    vm[i] = _mm512_set1_ps(j.m[h + i]);
  }
  // Stores the weights of keys t .. t + 16 of head i and adds them to its sums.
  auto put = [&](int i, size_t t, __m512 w) [[gnu::always_inline]] {
    if constexpr (Bf16) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(w);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(s[i]) + t), b);
      w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));  // exact
    } else {
      _mm512_storeu_ps(s[i] + t, w);
    }
    vl[i] = _mm512_add_ps(vl[i], w);
  };
  for (size_t t = 0; t < full; t += 16)
    for (int i = 0; i < G; ++i) put(i, t, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s[i] + t), vm[i])));
  for (int i = 0; i < G; ++i) {
    // Padding lanes get weight 0 (they are never summed into an output).
    if (tail) put(i, full, _mm512_maskz_mov_ps(tail, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s[i] + full), vm[i]))));
    j.l[h + i] = hsum16(vl[i]);
  }
}

// Q8_0 keys: the scores as 8-bit dot products (AVX-512 VNNI). Each query head is quantised once
// per partial, per 32-value block as Q8_0 quantises a row (d = amax / 127, q = x / d rounded to
// nearest even), so a score is scale * sum over blocks of d_q d_k (q . k), with q . k exact in
// 32 bits. A 16-key block of one KV head's 32-value block is transposed in registers into eight
// dwords-by-sixteen-keys vectors whose bytes are flipped to unsigned (k + 128); vpdpbusd then
// adds four products for sixteen keys at once, and the accumulator starts at -128 sum(q), which
// takes the offset back out. Against widening the keys to floats this is about a third of the
// operations per key, which is what decode at depth is bound by (bench_flash_decode). The
// quantised query moves a score by at most scale * sum_b d_q/2 sum_i |k_i| (tests state the
// bound); every step is the same whichever heads share the call, so results stay deterministic.

// The quantised queries of a job, carved from PartialJob::q8.
struct Q8Query {
  const int8_t* q;      // n_q * head_dim
  const float* d;       // n_q * (head_dim / 32)
  const int32_t* bias;  // -128 * the block's sum of q, per head and block
};

// The job's quantised queries, computed into j.q8 unless it holds them already (q8_ready).
inline Q8Query quantize_queries(const PartialJob& j) {
  const int D = j.head_dim, nb = D / 32;
  auto* q8 = reinterpret_cast<int8_t*>(j.q8);
  float* d = j.q8 + size_t(j.n_q) * size_t(D) / 4;
  auto* bias = reinterpret_cast<int32_t*>(d + size_t(j.n_q) * size_t(nb));
  if (j.q8_ready) return {q8, d, bias};
  for (int h = 0; h < j.n_q; ++h)
    for (int b = 0; b < nb; ++b) {
      const float* x = j.q + size_t(h) * size_t(D) + 32 * size_t(b);
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      const float amax = hmax16(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const size_t at = size_t(h) * size_t(nb) + size_t(b);
      d[at] = amax / 127.0f;
      const __m512 id = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
      int8_t* out = q8 + size_t(h) * size_t(D) + 32 * size_t(b);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(i1));
      bias[at] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
  return {q8, d, bias};
}

// Keys t0 .. t0 + 16 (past the last, the last again), the Q8_0 block at value `value` of each
// row: k[c] lane l holds bytes 4c .. 4c + 4 of key kQ8Lanes[l], plus 128; dk lane l its scale.
constexpr int32_t kQ8Lanes[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

[[gnu::always_inline]] inline void q8_key_block(const PartialJob& j, size_t t0, size_t value, __m512i k[8],
                                                __m512& dk) {
  const char* kb = static_cast<const char*>(j.kv->k) + Q8Rows::bytes(value);
  const block_q8_0* r[16];
  for (size_t u = 0; u < 16; ++u) r[u] = reinterpret_cast<const block_q8_0*>(kb + j.row_off[t0 + u]);
  // y[u]: key u's eight dwords, then key u + 8's.
  __m512i y[8];
  for (int u = 0; u < 8; ++u)
    y[u] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[u]->qs))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[u + 8]->qs)), 1);
  // Within each 128-bit lane, 4 x 4 dword transposes of keys 4g .. 4g + 4: t[g][c] lane L holds
  // dword c (L even) or 4 + c (L odd) of keys 4g .. 4g + 4 (L < 2) or 8 + 4g .. (L >= 2).
  __m512i t[2][4];
  for (int g = 0; g < 2; ++g) {
    const __m512i a0 = _mm512_unpacklo_epi32(y[4 * g], y[4 * g + 1]), a1 = _mm512_unpackhi_epi32(y[4 * g], y[4 * g + 1]);
    const __m512i a2 = _mm512_unpacklo_epi32(y[4 * g + 2], y[4 * g + 3]);
    const __m512i a3 = _mm512_unpackhi_epi32(y[4 * g + 2], y[4 * g + 3]);
    t[g][0] = _mm512_unpacklo_epi64(a0, a2);
    t[g][1] = _mm512_unpackhi_epi64(a0, a2);
    t[g][2] = _mm512_unpacklo_epi64(a1, a3);
    t[g][3] = _mm512_unpackhi_epi64(a1, a3);
  }
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int c = 0; c < 4; ++c) {
    k[c] = _mm512_xor_si512(_mm512_shuffle_i32x4(t[0][c], t[1][c], _MM_SHUFFLE(2, 0, 2, 0)), flip);
    k[4 + c] = _mm512_xor_si512(_mm512_shuffle_i32x4(t[0][c], t[1][c], _MM_SHUFFLE(3, 1, 3, 1)), flip);
  }
  alignas(32) uint16_t ds[16];
  for (int l = 0; l < 16; ++l) ds[l] = r[kQ8Lanes[l]]->d;
  dk = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ds)));
}

// Scores of heads h .. h + H, which read one KV head, for keys t0 .. t0 + 16.
template <int H>
[[gnu::always_inline]] inline void scores_q8(const PartialJob& j, const Q8Query& qq, int h, size_t t0, size_t ld) {
  const int D = j.head_dim, nb = D / 32;
  __m512 s[H];
  for (int b = 0; b < nb; ++b) {
    __m512i k[8];
    __m512 dk;
    q8_key_block(j, t0, j.kv_off + j.head_off[h] + 32 * size_t(b), k, dk);
    for (int i = 0; i < H; ++i) {
      const size_t at = size_t(h + i) * size_t(nb) + size_t(b);
      const auto* qd = reinterpret_cast<const int32_t*>(qq.q + size_t(h + i) * size_t(D) + 32 * size_t(b));
      __m512i acc = _mm512_set1_epi32(qq.bias[at]);
      for (int c = 0; c < 8; ++c) acc = _mm512_dpbusd_epi32(acc, k[c], _mm512_set1_epi32(qd[c]));
      const __m512 w = _mm512_mul_ps(dk, _mm512_set1_ps(qq.d[at]));
      s[i] = b == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(acc), w) : _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), w, s[i]);
    }
  }
  // kQ8Lanes is its own inverse, so as a permutation it puts key t in lane t.
  const __m512i to_keys = _mm512_loadu_si512(kQ8Lanes);
  for (int i = 0; i < H; ++i)
    _mm512_storeu_ps(j.scores + size_t(h + i) * ld + t0,
                     _mm512_mul_ps(_mm512_permutexvar_ps(to_keys, s[i]), _mm512_set1_ps(j.scale)));
}

// How many registers of 16 values of a row one values pass covers for a run of `heads` (their
// outputs stay in registers: 8 x 2 or at most 4 x 4).
constexpr int value_regs(int heads) { return heads == 8 ? 2 : 4; }

// Heads [h, h + 4) read one KV head.
inline bool shares_kv4(const PartialJob& j, int h) {
  return j.head_off[h] == j.head_off[h + 3] && j.head_off[h] == j.head_off[h + 1] && j.head_off[h] == j.head_off[h + 2];
}

// The queries of job j rounded to bf16 (nearest even) into j.qh.
inline void round_queries(const PartialJob& j) {
  for (size_t i = 0; i < size_t(j.n_q) * size_t(j.head_dim); i += 32)
    _mm512_storeu_si512(j.qh + i,
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(j.q + i + 16), _mm512_loadu_ps(j.q + i)));
}

// The partial over rows stored as E (F32Rows, F16Rows, F16RowsBf16 or Q8Rows).
template <class E>
void partial(const PartialJob& j) {
  const int D = j.head_dim;  // a multiple of 64 (see flash_decode.cpp)
  const int nd = D / 16;
  const size_t ld = score_stride(j.count);

  // The part of a row this job reads: values [lo, hi) after kv_off.
  const size_t lo = j.span_lo, hi = j.span_hi;

  // Head steps per score block: runs of heads of one KV head (8-bit scores), else four heads at
  // a time and the rest one by one.
  const size_t steps = E::kInt8Scores ? kv_runs(j) : size_t(j.n_q / 4 + j.n_q % 4);

  // The next partial's rows, asked for in shares at each head step of the scores, each head of
  // the softmax and every kAskEvery keys of each values pass.
  NextRows next = next_rows<E>(j);
  const AskShares share =
      ask_shares(j, next, (j.count + 15) / 16 * steps + size_t(j.n_q), [&](int H) { return nd / value_regs(H); });
  const size_t quota = share.early, value_quota = share.late;

  // Scores, block by block. Each head step asks for its share of the next partial's rows, a few
  // at a time between the multiply-adds, as a burst of them stalls on the cache's miss buffers.
  // (This partial's rows are not asked for again: the partial before on this thread asked for
  // them; asking again for the keys cost 4 % at 16K keys, for the values nothing measurable.)
  Q8Query qq{};
  if constexpr (E::kInt8Scores) qq = quantize_queries(j);
  if constexpr (E::kBf16) round_queries(j);
  fill_row_off(j, E::bytes(j.kv->row_stride));
  for (size_t t0 = 0; t0 < j.count; t0 += 16) {
    if constexpr (E::kInt8Scores) {
      for_kv_runs(j, [&]<int H>(int h) {
        next.ask(quota);
        scores_q8<H>(j, qq, h, t0, ld);
      });
    } else {
      // The key block and the queries as the block type B meets them.
      using B = typename BlockOf<E::kBf16>::type;
      const auto* kt = reinterpret_cast<const typename B::T*>(j.key_block);
      const typename B::T* qs;
      if constexpr (E::kBf16) {
        key_block_bf16(j, t0, j.kv_off + lo, hi - lo, reinterpret_cast<uint16_t*>(j.key_block));
        qs = j.qh;
      } else {
        key_block<E>(j, t0, j.kv_off + lo, hi - lo, j.key_block);
        qs = j.q;
      }
      int h = 0;
      for (; h + 4 <= j.n_q; h += 4) {
        next.ask(quota);
        if (shares_kv4(j, h)) scores_block<B, 4, true>(j, h, kt, qs, lo, t0, ld);
        else scores_block<B, 4, false>(j, h, kt, qs, lo, t0, ld);
      }
      for (; h < j.n_q; ++h) {
        next.ask(quota);
        scores_block<B, 1, false>(j, h, kt, qs, lo, t0, ld);
      }
    }
  }

  // Weights e^(s - m) in place and their sum, four heads at a time (their chains interleave).
  int h = 0;
  for (; h + 4 <= j.n_q; h += 4) {
    weights<4, E::kBf16>(j, h, ld);
    next.ask(4 * quota);
  }
  for (; h < j.n_q; ++h) {
    weights<1, E::kBf16>(j, h, ld);
    next.ask(quota);
  }

  // Values: up to eight heads of one KV head at a time, their outputs in registers while the
  // keys pass in index order (each value row loaded and widened once for all of them).
  auto values = [&]<size_t LD>() {
    for (int h = 0; h < j.n_q;) {
      const size_t off = j.kv_off + j.head_off[h];
      const int H = kv_run(j, h);
      for (int c = 0; c < nd; c += value_regs(H)) {
        const size_t at = 16 * size_t(c);
        if constexpr (E::kBf16) {
          if (H == 8) accumulate_bf16<2, 8, LD>(j, h, ld, off + at, at, next, value_quota);
          else if (H == 4) accumulate_bf16<4, 4, LD>(j, h, ld, off + at, at, next, value_quota);
          else if (H == 2) accumulate_bf16<4, 2, LD>(j, h, ld, off + at, at, next, value_quota);
          else accumulate_bf16<4, 1, LD>(j, h, ld, off + at, at, next, value_quota);
          continue;
        }
        if (H == 8) accumulate<2, 8, E, LD>(j, h, ld, off + at, at, next, value_quota);
        else if (H == 4) accumulate<4, 4, E, LD>(j, h, ld, off + at, at, next, value_quota);
        else if (H == 2) accumulate<4, 2, E, LD>(j, h, ld, off + at, at, next, value_quota);
        else accumulate<4, 1, E, LD>(j, h, ld, off + at, at, next, value_quota);
      }
      h += H;
    }
  };
  if (ld == kScoreRows) values.template operator()<kScoreRows>();
  else values.template operator()<0>();
  next.ask(next.total());
}

}  // namespace

void flash_partial_avx512(const PartialJob& j) {
  if (j.kv->type == DType::F16 && j.qh) partial<F16RowsBf16>(j);
  else if (j.kv->type == DType::F16) partial<F16Rows>(j);
  else if (j.kv->type == DType::Q8_0) partial<Q8Rows>(j);
  else partial<F32Rows>(j);
}

}  // namespace specmesh::detail

#endif
