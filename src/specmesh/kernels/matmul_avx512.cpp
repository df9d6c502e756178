// AVX-512 matmul kernels: VNNI (vpdpbusd) integer dot products for Q8_0 / Q4_0 weights, and
// 16-lane FMA for F32 / F16 / BF16. Built with AVX-512 F/BW/VL/DQ/VNNI and F16C and only
// called after a run-time CPU check (matmul.cpp). K-quant weights take the AVX2 kernels.
//
// Q8_0 / Q4_0 weights come in two layouts. A loaded model's are packed into 16-row panels
// (PackedWeights; panel_tile below): every lane is one output, so the work per block is
// eight vpdpbusd and one convert / multiply / fused add per 16 outputs. Row-major weights
// (a WeightView without a packed copy) take tile_int, which fills the lanes of one output.
//
// Integer dots: vpdpbusd multiplies unsigned by signed bytes and adds groups of four into
// 32-bit lanes, with no 16-bit intermediate to saturate. The weights are made unsigned by an
// offset (w + 128 for Q8_0, the stored nibble w + 8 for Q4_0), and the offset times the
// activations, computed once per matmul when the activations are packed, is the starting
// value of the accumulation (see ActPair). So the 32-bit lane sums are exact, and a zmm
// covers two 32-element blocks, each half scaled by its own d_w * d_x.
//
// Determinism: as in the AVX2 kernels, every output y[t][r] is one 16-lane accumulator that
// goes through the same intrinsic sequence over the whole row, then a fixed-order reduction.
// Tiles only interleave independent accumulators, so a value does not depend on the tile it
// lands in, the row range, n_tokens or the thread count.
//
// Helpers live in an anonymous namespace and no standard-library template is instantiated
// here: an out-of-line copy compiled with AVX-512 must never be what the linker picks for the
// other translation units.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

// GCC 12 warns that the deliberately undefined vector some intrinsics start from
// (_mm512_undefined_ps and kin) is used uninitialised once they are inlined into loops.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cstring>

#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/matmul_impl.hpp"
#include "specmesh/kernels/packed_layout.hpp"

namespace specmesh::mm {

namespace {

using TileFn = void (*)(const Problem&, size_t r, size_t t);

inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// The sum of the 16 lanes, in a fixed order (halves, quarters, then pairs).
inline float hsum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// f16 -> f32 for per-block scales through a table (a load instead of a conversion on the
// vector ports the dot products keep busy).
const float* f16_table() {
  static const float* table = [] {
    auto* t = new float[65536];  // lives for the process
    for (uint32_t h = 0; h < 65536; ++h) t[h] = _cvtsh_ss(uint16_t(h));
    return t;
  }();
  return table;
}

// See matmul_avx2.cpp (ask_ahead): each step of a tile asks for the same step of every row or
// panel of the tile after it.
template <int N>
inline void ask_ahead(const uint8_t* first, size_t stride, size_t at, size_t bytes) {
  for (int i = 0; i < N; ++i)
    for (size_t k = 0; k < bytes; k += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + size_t(i) * stride + at + k), _MM_HINT_T0);
}

template <int R, int T>
inline void store(const Problem& p, size_t r, size_t t, __m512 (&acc)[R][T]) {
  for (int j = 0; j < T; ++j)
    for (int i = 0; i < R; ++i) p.y[(t + j) * p.ldy + r + i] = hsum16(acc[i][j]);
}

// Two blocks' 32 bytes side by side; the second is zero when there is none (an odd tail).
inline __m512i load_pair(const int8_t* a, const int8_t* b) {
  const __m512i lo = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  if (b == nullptr) return _mm512_inserti64x4(lo, _mm256_setzero_si256(), 1);
  return _mm512_inserti64x4(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// Two scales, each over its block's eight lanes.
inline __m512 scale_pair(float a, float b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}

// A token's activations for a pair of blocks, as the integer tiles load them (an odd tail's
// missing block is zeros):
//   q:    the 64 signed bytes;
//   d:    each block's scale over its 8 lanes;
//   corr: the weight type's offset times q, summed by fours (-128 q for Q8_0, whose weights
//         are read as w + 128; -8 q for Q4_0, whose nibbles are stored as w + 8).
// So dpbusd(corr, w + offset, q) is the exact sum of w * q in each lane.
struct alignas(64) ActPair {
  int8_t q[64];
  float d[16];
  int32_t corr[16];
};

// --- integer tiles: Q8_0 / Q4_0 weights x packed activations -----------------------------
// A weight type supplies, per row and pair of blocks, the unsigned bytes w + offset and the
// two scales.

struct WeightsQ8_0 {
  static constexpr size_t kBlockBytes = sizeof(block_q8_0);
  static constexpr int kOffset = 128;
  static void load(const uint8_t* row, size_t b, bool two, const float* f16, __m512i& wu, __m512& wd) {
    const auto* w = reinterpret_cast<const block_q8_0*>(row);
    wu = _mm512_xor_si512(load_pair(w[b].qs, two ? w[b + 1].qs : nullptr), _mm512_set1_epi8(char(0x80)));
    wd = scale_pair(f16[w[b].d], two ? f16[w[b + 1].d] : 0.0f);
  }
};

struct WeightsQ4_0 {
  static constexpr size_t kBlockBytes = sizeof(block_q4_0);
  static constexpr int kOffset = 8;
  static void load(const uint8_t* row, size_t b, bool two, const float* f16, __m512i& wu, __m512& wd) {
    const auto* w = reinterpret_cast<const block_q4_0*>(row);
    // Per 128-bit lane: low nibbles (elements 0..15), high nibbles (16..31), then the next
    // block's the same way.
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].qs)));
    const __m256i hi = two ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b + 1].qs)))
                           : _mm256_setzero_si256();
    const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    wu = _mm512_and_si512(_mm512_srlv_epi64(raw, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0F));
    wd = scale_pair(f16[w[b].d], two ? f16[w[b + 1].d] : 0.0f);
  }
};

template <class W, int R, int T>
void tile_int(const Problem& p, size_t r, size_t t) {
  const size_t nb = p.cols / QK8_0, np = (nb + 1) / 2;
  const float* f16 = f16_table();
  const uint8_t* w[R];
  const ActPair* x[T];
  for (int i = 0; i < R; ++i) w[i] = p.w + (r + i) * p.w_stride;
  for (int j = 0; j < T; ++j) x[j] = reinterpret_cast<const ActPair*>(p.xp) + (t + j) * np;
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  __m512 acc[R][T];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (size_t b = 0, k = 0; b < nb; b += 2, ++k) {
    const bool two = b + 1 < nb;
    ask_ahead<R>(next, p.w_stride, b * W::kBlockBytes, 2 * W::kBlockBytes);
    __m512i wu[R];
    __m512 wd[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) W::load(w[i], b, two, f16, wu[i], wd[i]);
#pragma GCC unroll 8
    for (int j = 0; j < T; ++j) {
      const ActPair& xa = x[j][k];
      const __m512i xq = _mm512_load_si512(xa.q);
      const __m512 xd = _mm512_load_ps(xa.d);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_load_si512(xa.corr), wu[i], xq);
        acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(wd[i], xd), _mm512_cvtepi32_ps(s), acc[i][j]);
      }
    }
  }
  store<R, T>(p, r, t, acc);
}

template <int R, int T> void tile_q8_0(const Problem& p, size_t r, size_t t) { tile_int<WeightsQ8_0, R, T>(p, r, t); }
template <int R, int T> void tile_q4_0(const Problem& p, size_t r, size_t t) { tile_int<WeightsQ4_0, R, T>(p, r, t); }

// --- float-like weights (F32, F16, BF16) x F32 activations -------------------------------
// The same loop as matmul_avx2.cpp's tile_float at twice the width. It is not one shared
// template: instantiations are merged by name at link time, so a copy built with AVX-512
// flags could end up serving the AVX2 path on a CPU without AVX-512.

struct LoadF32 {
  using elem = float;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load_tail(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};
struct LoadF16 {
  using elem = uint16_t;
  static __m512 load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m512 load_tail(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
};
struct LoadBF16 {
  static __m512 widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
  using elem = uint16_t;
  static __m512 load(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m512 load_tail(const uint16_t* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
};

template <class L, int R, int T>
void tile_float(const Problem& p, size_t r, size_t t) {
  using E = typename L::elem;
  const E* w[R];
  const float* x[T];
  for (int i = 0; i < R; ++i) w[i] = reinterpret_cast<const E*>(p.w + (r + i) * p.w_stride);
  for (int j = 0; j < T; ++j) x[j] = p.x + (t + j) * p.cols;
  __m512 acc[R][T];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  const size_t n16 = p.cols & ~size_t(15);
  for (size_t c = 0; c < n16; c += 16) {
    ask_ahead<R>(next, p.w_stride, c * sizeof(E), 16 * sizeof(E));
    __m512 wv[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) wv[i] = L::load(w[i] + c);
#pragma GCC unroll 6
    for (int j = 0; j < T; ++j) {
      const __m512 xv = _mm512_loadu_ps(x[j] + c);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (n16 < p.cols) {
    // Ragged end: masked loads give zeros past the row (0*0 adds +0).
    const __mmask16 m = __mmask16((1u << (p.cols - n16)) - 1);
    __m512 wv[R];
    for (int i = 0; i < R; ++i) wv[i] = L::load_tail(w[i] + n16, m);
    for (int j = 0; j < T; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x[j] + n16);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  store<R, T>(p, r, t, acc);
}

// BF16 weights x bf16 activations (p.xh): per 32 elements one vdpbf16ps per output, which
// adds its two bf16 products per lane to the lane in f32. The ragged end loads the weights
// masked; the activations are zero-padded past the row.
template <int R, int T>
[[gnu::target("avx512bf16")]] void tile_bf16_dot(const Problem& p, size_t r, size_t t) {
  const uint16_t* w[R];
  const uint16_t* x[T];
  const size_t xn = bf16_act_elems(p.cols);
  for (int i = 0; i < R; ++i) w[i] = reinterpret_cast<const uint16_t*>(p.w + (r + i) * p.w_stride);
  for (int j = 0; j < T; ++j) x[j] = p.xh + (t + j) * xn;
  __m512 acc[R][T];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  const size_t n32 = p.cols & ~size_t(31);
  for (size_t c = 0; c < n32; c += 32) {
    ask_ahead<R>(next, p.w_stride, c * 2, 64);
    __m512bh wv[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) wv[i] = (__m512bh)_mm512_loadu_si512(w[i] + c);
#pragma GCC unroll 6
    for (int j = 0; j < T; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[j] + c);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
    }
  }
  if (n32 < p.cols) {
    const __mmask32 m = __mmask32((uint64_t(1) << (p.cols - n32)) - 1);
    __m512bh wv[R];
    for (int i = 0; i < R; ++i) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, w[i] + n32);
    for (int j = 0; j < T; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[j] + n32);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
    }
  }
  store<R, T>(p, r, t, acc);
}

template <int R, int T> void tile_f32(const Problem& p, size_t r, size_t t) { tile_float<LoadF32, R, T>(p, r, t); }
template <int R, int T> void tile_f16(const Problem& p, size_t r, size_t t) { tile_float<LoadF16, R, T>(p, r, t); }
template <int R, int T> void tile_bf16(const Problem& p, size_t r, size_t t) { tile_float<LoadBF16, R, T>(p, r, t); }

constexpr int kMaxR = 4, kMaxT = 6;
using TileTable = TileFn[kMaxR][kMaxT];

#define SPECMESH_TILE_ROW(f, R) {f<R, 1>, f<R, 2>, f<R, 3>, f<R, 4>, f<R, 5>, f<R, 6>}
#define SPECMESH_TILE_TABLE(f) \
  {SPECMESH_TILE_ROW(f, 1), SPECMESH_TILE_ROW(f, 2), SPECMESH_TILE_ROW(f, 3), SPECMESH_TILE_ROW(f, 4)}

constexpr TileTable kF32 = SPECMESH_TILE_TABLE(tile_f32);
constexpr TileTable kF16 = SPECMESH_TILE_TABLE(tile_f16);
constexpr TileTable kBF16 = SPECMESH_TILE_TABLE(tile_bf16);
constexpr TileTable kBF16Dot = SPECMESH_TILE_TABLE(tile_bf16_dot);
constexpr TileTable kQ8_0 = SPECMESH_TILE_TABLE(tile_q8_0);
constexpr TileTable kQ4_0 = SPECMESH_TILE_TABLE(tile_q4_0);

#undef SPECMESH_TILE_TABLE
#undef SPECMESH_TILE_ROW

struct Shape {
  const TileTable* table;
  size_t rows, tokens;  // the largest tile
};

// Batches: 4 rows x 4 tokens for the integer dots (16 accumulators plus each row's weights
// and scales; the activations are memory operands), 4 x 6 for the float types (24
// accumulators, 4 weight vectors); measured best of 2..4 x 4..8 on a 5632 x 2048 matrix.
// A single token streams 4 rows at a time.
Shape shape_for(DType t, size_t n_tokens, bool bf16_dot) {
  const bool single = n_tokens == 1;
  if (t == DType::BF16 && bf16_dot) return {&kBF16Dot, 4, single ? 1u : 6u};
  switch (t) {
    case DType::F32: return {&kF32, 4, single ? 1u : 6u};
    case DType::F16: return {&kF16, 4, single ? 1u : 6u};
    case DType::BF16: return {&kBF16, 4, single ? 1u : 6u};
    case DType::Q8_0: return {&kQ8_0, 4, single ? 1u : 4u};
    case DType::Q4_0: return {&kQ4_0, 4, single ? 1u : 4u};
    default: return {nullptr, 0, 0};
  }
}

// --- packed integer panels (PackedWeights) x activation blocks --------------------------
// Lane l of every vector is row l of its panel. Per block, each output's 32-bit sum starts
// at the activation block's correction (-offset * sum q) and takes eight vpdpbusd of a
// 64-byte group of weight bytes with four broadcast activation bytes, so it is exact; then
//   acc = fma(float(sum) * d_w, d_x, acc)
// one rounding chain per output in block order, whatever the tile (P panels x T tokens).

// Adds a group of four weight bytes per lane of each panel, w[i], times every token's four
// activation bytes at `at` of its block xb (broadcast), into the sums s.
template <int P, int T>
inline void dot_group(const __m512i (&w)[P], const ActBlk* const (&x)[T], size_t xb, int at, __m512i (&s)[P][T]) {
#pragma GCC unroll 8
  for (int j = 0; j < T; ++j) {
    int32_t xv;
    std::memcpy(&xv, x[j][xb].q.qs + at, 4);
    const __m512i xq = _mm512_set1_epi32(xv);
    for (int i = 0; i < P; ++i) s[i][j] = _mm512_dpbusd_epi32(s[i][j], w[i], xq);
  }
}

struct PanelQ8_0 {
  static constexpr size_t kQuantBytes = 512;
  // The eight groups of block b (elements 4g..4g+3) into each panel's sums.
  template <int P, int T>
  static void dot(const uint8_t* const (&q)[P], size_t b, const ActBlk* const (&x)[T], __m512i (&s)[P][T]) {
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m512i w[P];
      for (int i = 0; i < P; ++i) w[i] = _mm512_load_si512(q[i] + b * kQuantBytes + 64 * g);
      dot_group(w, x, b, 4 * g, s);
    }
  }
};

struct PanelQ4_0 {
  static constexpr size_t kQuantBytes = 256;
  // Each 64-byte load holds group m in its low nibbles and group m + 4 (elements 16 + 4m..)
  // in its high ones.
  template <int P, int T>
  static void dot(const uint8_t* const (&q)[P], size_t b, const ActBlk* const (&x)[T], __m512i (&s)[P][T]) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
      __m512i lo[P], hi[P];
      for (int i = 0; i < P; ++i) {
        const __m512i raw = _mm512_load_si512(q[i] + b * kQuantBytes + 64 * m);
        lo[i] = _mm512_and_si512(raw, nib);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
      }
      dot_group(lo, x, b, 4 * m, s);
      dot_group(hi, x, b, 16 + 4 * m, s);
    }
  }
};

// Stores panels [panel, panel + P) x tokens [t, t + T), the rows in [a0, a1) only.
template <int P, int T>
inline void store_panels(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1, __m512 (&acc)[P][T]) {
  constexpr size_t kRows = 16;
  for (int i = 0; i < P; ++i) {
    const size_t first = (panel + i) * kRows;  // absolute row of lane 0
    const bool whole = first >= a0 && first + kRows <= a1;
    for (int j = 0; j < T; ++j) {
      float* y = p.y + (t + j) * p.ldy;
      if (whole) {
        _mm512_storeu_ps(y + (first - p.row0), acc[i][j]);
        continue;
      }
      alignas(64) float lanes[kRows];
      _mm512_store_ps(lanes, acc[i][j]);
      for (size_t l = 0; l < kRows; ++l)
        if (first + l >= a0 && first + l < a1) y[first + l - p.row0] = lanes[l];
    }
  }
}

// A panel tile's start: tokens t .. t + T's activation blocks, and zeroed accumulators.
template <int P, int T>
inline void start_panels(const Problem& p, size_t t, const ActBlk* (&x)[T], __m512 (&acc)[P][T]) {
  const size_t nb = p.cols / QK8_0;
  for (int j = 0; j < T; ++j) x[j] = p.xb + (t + j) * nb;
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
}

using PanelFn = void (*)(const Problem&, size_t panel, size_t t, size_t a0, size_t a1);

// A single token's tile streams each of its panels once (ask_ahead); the tile after it is the
// next P panels when this thread computes them: their first byte, else nullptr, as for
// batches, which reuse each panel across tokens and are compute-bound. Q4_0 and Q4_K 5632 x
// 2048 from memory: 24-28 -> 28-32 GB/s (Q8_0 unchanged at 30-32).
template <int P, int T>
inline const uint8_t* next_tile(const Problem& p, size_t panel, size_t a1) {
  constexpr size_t kRows = 16;
  if (T != 1 || (panel + 2 * P - 1) * kRows >= a1) return nullptr;
  return p.wp + (panel + P) * p.panel_bytes;
}

// Panels [panel, panel + P) x tokens [t, t + T); stores the rows in [a0, a1) (absolute).
template <class W, int P, int T>
void panel_tile(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1) {
  constexpr size_t kRows = 16;
  const size_t nb = p.cols / QK8_0;
  const uint8_t* q[P];
  const uint16_t* sc[P];
  for (int i = 0; i < P; ++i) {
    q[i] = p.wp + (panel + i) * p.panel_bytes;
    sc[i] = reinterpret_cast<const uint16_t*>(q[i] + nb * W::kQuantBytes);
  }
  const ActBlk* x[T];
  __m512 acc[P][T];
  start_panels(p, t, x, acc);
  const uint8_t* next = next_tile<P, T>(p, panel, a1);
  // A block of more than four lines per panel (Q8_0's eight) is asked for half before the dot
  // products and half after them, fewer at once on the miss buffers (as Q4_K's): Q8_0 decode on
  // a Zen 5 2-7 % faster than all before. Q4_0's four lines are asked for at once.
  constexpr size_t kFirstAsk = W::kQuantBytes > 4 * 64 ? W::kQuantBytes / 2 : W::kQuantBytes;
  for (size_t b = 0; b < nb; ++b) {
    if (next != nullptr) {
      ask_ahead<P>(next, p.panel_bytes, b * W::kQuantBytes, kFirstAsk);
      if (b % 2 == 0) ask_ahead<P>(next, p.panel_bytes, nb * W::kQuantBytes + kRows * sizeof(uint16_t) * b, 64);
    }
    __m512i s[P][T];
    for (int j = 0; j < T; ++j) {
      const __m512i c = _mm512_set1_epi32(x[j][b].corr);
      for (int i = 0; i < P; ++i) s[i][j] = c;
    }
    W::template dot<P, T>(q, b, x, s);
    if (kFirstAsk < W::kQuantBytes && next != nullptr)
      ask_ahead<P>(next, p.panel_bytes, b * W::kQuantBytes + kFirstAsk, W::kQuantBytes - kFirstAsk);
    for (int i = 0; i < P; ++i) {
      const __m512 wd = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc[i] + kRows * b)));
      for (int j = 0; j < T; ++j)
        acc[i][j] =
            _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[i][j]), wd), _mm512_set1_ps(x[j][b].q.d), acc[i][j]);
    }
  }
  store_panels<P, T>(p, panel, t, a0, a1, acc);
}

// A packed K-quant super-block: d (and dmin), then scales (and mins) at packed::kKQuantScales,
// then quants at packed::kKQuantQuants (packed_weights.hpp).
using packed::kKQuantQuants;
using packed::kKQuantScales;

// Q4_K panels (PackedWeights::kQ4KBytes per super-block): per sub-block s of 32, the
// 16 rows' scale a = d * sc_s and min b = dmin * m_s (both exact in f32), and
//   acc = fma(float(sum q * x) * a, d_x, acc);  acc = acc - b * (d_x * sum x)
// where the nibbles q are unsigned, so the integer sums need no correction.
// A single token's tile also asks for bytes [ask_from, ask_to) of the next tile's panels from
// `ask` (nullptr: none), one line of each panel per group between the dot products.
template <int Shift, int P, int T>
inline void q4_K_sub(const uint8_t* const (&q)[P], const ActBlk* const (&x)[T], size_t xb, size_t sub,
                     const __m512 (&d)[P], const __m512 (&dmin)[P], __m512 (&acc)[P][T], const uint8_t* ask,
                     size_t ask_stride, size_t ask_from, size_t ask_to) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i s[P][T];
  for (auto& a : s)
    for (auto& v : a) v = _mm512_setzero_si512();
  const size_t chunk = sub / 2;
#pragma GCC unroll 8
  for (int g = 0; g < 8; ++g) {
    if (ask != nullptr && ask_from + 64 * g < ask_to) ask_ahead<P>(ask, ask_stride, ask_from + 64 * g, 64);
    __m512i w[P];
    for (int i = 0; i < P; ++i)
      w[i] = _mm512_and_si512(_mm512_srli_epi16(_mm512_load_si512(q[i] + kKQuantQuants + chunk * 512 + 64 * g), Shift), nib);
    dot_group(w, x, xb, 4 * g, s);
  }
  for (int i = 0; i < P; ++i) {
    const uint8_t* meta = q[i] + kKQuantScales;
    const __m512 a = _mm512_mul_ps(d[i], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                             _mm_load_si128(reinterpret_cast<const __m128i*>(meta + 16 * sub)))));
    const __m512 b = _mm512_mul_ps(dmin[i], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(
                                                reinterpret_cast<const __m128i*>(meta + 128 + 16 * sub)))));
    for (int j = 0; j < T; ++j) {
      acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[i][j]), a), _mm512_set1_ps(x[j][xb].q.d), acc[i][j]);
      acc[i][j] = _mm512_fnmadd_ps(b, _mm512_set1_ps(x[j][xb].dsum), acc[i][j]);
    }
  }
}

template <int P, int T>
void panel_tile_q4_K(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1) {
  constexpr size_t kQ4KQuarter = packed::kQ4KBytes / 4, kQ4KHalfAsk = kQ4KQuarter / 2 / 64 * 64;
  static_assert(kQ4KQuarter - kQ4KHalfAsk <= 8 * 64);  // the high nibbles' eight groups ask for the rest
  const size_t nsb = p.cols / QK_K;
  const ActBlk* x[T];
  __m512 acc[P][T];
  start_panels(p, t, x, acc);
  const uint8_t* next = next_tile<P, T>(p, panel, a1);
  for (size_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* q[P];
    __m512 d[P], dmin[P];
    for (int i = 0; i < P; ++i) {
      q[i] = p.wp + (panel + i) * p.panel_bytes + sb * packed::kQ4KBytes;
      d[i] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(q[i])));
      dmin[i] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(q[i] + 32)));
    }
    for (size_t c = 0; c < 4; ++c) {
      // Quarter c of the next tile's super-block, its first four lines of each panel asked for
      // during the low nibbles and the other six during the high ones. All forty asked for at
      // once wait on the core's few miss buffers: on a Zen 5, two threads, a 5632 x 2048 matrix
      // from memory streamed at 44.5-45.5 GB/s that way and 50.9-52.1 GB/s spread (three runs
      // each, alternating), where the AVX2 kernel, one panel at a time, made 45-48.
      const uint8_t* ask = next != nullptr ? next + sb * packed::kQ4KBytes + c * kQ4KQuarter : nullptr;
      q4_K_sub<0, P, T>(q, x, sb * 8 + 2 * c, 2 * c, d, dmin, acc, ask, p.panel_bytes, 0, kQ4KHalfAsk);
      q4_K_sub<4, P, T>(q, x, sb * 8 + 2 * c + 1, 2 * c + 1, d, dmin, acc, ask, p.panel_bytes, kQ4KHalfAsk,
                        kQ4KQuarter);
    }
  }
  store_panels<P, T>(p, panel, t, a0, a1, acc);
}

// Q6_K panels (PackedWeights::kQ6KBytes per super-block): per sub-block of 16, the 16 rows'
// scale a = d * sc (exact in f32) and, with the unsigned quants q = value + 32,
//   acc = fma(float(sum q * x - 32 * sum x) * a, d_x, acc)
// the integer sum exact, one rounding chain per output in sub-block order.
template <int P, int T>
void panel_tile_q6_K(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1) {
  constexpr size_t kQ6KSixteenth = packed::kQ6KBytes / 16;
  const size_t nsb = p.cols / QK_K;
  const ActBlk* x[T];
  __m512 acc[P][T];
  start_panels(p, t, x, acc);
  const uint8_t* next = next_tile<P, T>(p, panel, a1);
  for (size_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* q[P];
    __m512 d[P];
    for (int i = 0; i < P; ++i) {
      q[i] = p.wp + (panel + i) * p.panel_bytes + sb * packed::kQ6KBytes;
      d[i] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(q[i])));
    }
    for (size_t sub = 0; sub < QK_K / 16; ++sub) {
      if (next != nullptr) ask_ahead<P>(next, p.panel_bytes, sb * packed::kQ6KBytes + sub * kQ6KSixteenth, kQ6KSixteenth);
      const size_t xb = sb * 8 + sub / 2, half = sub % 2;
      __m512i s[P][T];
      for (int j = 0; j < T; ++j) {
        const __m512i c = _mm512_set1_epi32(x[j][xb].half_corr[half]);
        for (int i = 0; i < P; ++i) s[i][j] = c;
      }
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        __m512i w[P];
        for (int i = 0; i < P; ++i) w[i] = _mm512_load_si512(q[i] + kKQuantQuants + (sub / 2) * 512 + 64 * (4 * half + g));
        dot_group(w, x, xb, int(16 * half) + 4 * g, s);
      }
      for (int i = 0; i < P; ++i) {
        const __m512 a = _mm512_mul_ps(d[i], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                 _mm_load_si128(reinterpret_cast<const __m128i*>(q[i] + kKQuantScales + 16 * sub)))));
        for (int j = 0; j < T; ++j)
          acc[i][j] =
              _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[i][j]), a), _mm512_set1_ps(x[j][xb].q.d), acc[i][j]);
      }
    }
  }
  store_panels<P, T>(p, panel, t, a0, a1, acc);
}

constexpr int kPanelsMax = 4, kPanelTokensMax = 6;
using PanelTable = PanelFn[kPanelsMax][kPanelTokensMax];

#define SPECMESH_PANEL_ROW(W, P) \
  {panel_tile<W, P, 1>, panel_tile<W, P, 2>, panel_tile<W, P, 3>, \
   panel_tile<W, P, 4>, panel_tile<W, P, 5>, panel_tile<W, P, 6>}
#define SPECMESH_PANEL_TABLE(W) \
  {SPECMESH_PANEL_ROW(W, 1), SPECMESH_PANEL_ROW(W, 2), SPECMESH_PANEL_ROW(W, 3), SPECMESH_PANEL_ROW(W, 4)}
constexpr PanelTable kPanelQ8_0 = SPECMESH_PANEL_TABLE(PanelQ8_0);
constexpr PanelTable kPanelQ4_0 = SPECMESH_PANEL_TABLE(PanelQ4_0);
#undef SPECMESH_PANEL_ROW
#define SPECMESH_PANEL_ROW(W, P)                                                                               \
  {panel_tile_q4_K<P, 1>, panel_tile_q4_K<P, 2>, panel_tile_q4_K<P, 3>, panel_tile_q4_K<P, 4>, panel_tile_q4_K<P, 5>, \
   panel_tile_q4_K<P, 6>}
constexpr PanelTable kPanelQ4_K = SPECMESH_PANEL_TABLE(-);
#undef SPECMESH_PANEL_ROW
#define SPECMESH_PANEL_ROW(W, P)                                                                               \
  {panel_tile_q6_K<P, 1>, panel_tile_q6_K<P, 2>, panel_tile_q6_K<P, 3>, panel_tile_q6_K<P, 4>, panel_tile_q6_K<P, 5>, \
   panel_tile_q6_K<P, 6>}
constexpr PanelTable kPanelQ6_K = SPECMESH_PANEL_TABLE(-);
#undef SPECMESH_PANEL_TABLE
#undef SPECMESH_PANEL_ROW

}  // namespace

void gemm_rows_avx512(const Problem& p, size_t r0, size_t r1) {
  const Shape sh = shape_for(p.type, p.n_tokens, p.xh != nullptr);
  if (sh.table == nullptr) return gemm_rows_avx2(p, r0, r1);  // K-quants
  const size_t rm = sh.rows, tm = sh.tokens;
  // A row block stays in L1/L2 while every token of a token block passes over it; the token
  // block bounds the activations that must stay cached meanwhile (see matmul_avx2.cpp).
  const size_t row_block = 8 * rm;
  const size_t act_bytes = p.xq != nullptr ? p.cols / QK8_0 * sizeof(ActQ8) : p.cols * sizeof(float);
  size_t tok_block = (size_t(256) << 10) / (act_bytes > 0 ? act_bytes : 1) / tm * tm;
  if (tok_block < tm) tok_block = tm;
  const TileTable& tab = *sh.table;
  for (size_t t0 = 0; t0 < p.n_tokens; t0 += tok_block) {
    const size_t t1 = min_size(p.n_tokens, t0 + tok_block);
    for (size_t rb = r0; rb < r1; rb += row_block) {
      const size_t re = min_size(r1, rb + row_block);
      for (size_t t = t0; t < t1; t += tm) {
        const size_t nt = min_size(tm, t1 - t);
        for (size_t r = rb; r < re; r += rm) tab[min_size(rm, re - r) - 1][nt - 1](p, r, t);
      }
    }
  }
}

void gemm_packed_avx512(const Problem& p, size_t r0, size_t r1) {
  constexpr size_t kRows = 16, kDecodePanels = 4, kBatchPanels = 2;
  const PanelTable& tab = p.type == DType::Q8_0   ? kPanelQ8_0
                          : p.type == DType::Q4_0 ? kPanelQ4_0
                          : p.type == DType::Q4_K ? kPanelQ4_K
                                                  : kPanelQ6_K;
  const size_t a0 = p.row0 + r0, a1 = p.row0 + r1;
  const size_t pan0 = a0 / kRows, pan1 = (a1 + kRows - 1) / kRows;
  const size_t pm = p.n_tokens == 1 ? kDecodePanels : kBatchPanels, tm = p.n_tokens == 1 ? 1 : kPanelTokensMax;
  // As in gemm_rows_avx512: a panel pair stays cached while a block of tokens passes over it.
  const size_t act_bytes = p.cols / QK8_0 * sizeof(ActBlk);
  size_t tok_block = (size_t(256) << 10) / act_bytes / tm * tm;
  if (tok_block < tm) tok_block = tm;
  for (size_t t0 = 0; t0 < p.n_tokens; t0 += tok_block) {
    const size_t t1 = min_size(p.n_tokens, t0 + tok_block);
    for (size_t pan = pan0; pan < pan1; pan += pm) {
      const size_t np = min_size(pm, pan1 - pan);
      for (size_t t = t0; t < t1; t += tm) tab[np - 1][min_size(tm, t1 - t) - 1](p, pan, t, a0, a1);
    }
  }
}

size_t bf16_act_elems(size_t cols) { return (cols + 31) / 32 * 32; }

[[gnu::target("avx512bf16")]] void bf16_act_avx512(const float* x, size_t cols, uint16_t* out) {
  size_t c = 0;
  for (; c + 32 <= cols; c += 32)
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c)));
  if (c < cols) {  // masked loads give zeros past the row
    const size_t left = cols - c;
    const __mmask16 lo = __mmask16(left >= 16 ? 0xFFFF : (1u << left) - 1);
    const __mmask16 hi = __mmask16(left > 16 ? (1u << (left - 16)) - 1 : 0);
    const __m512 a = _mm512_maskz_loadu_ps(lo, x + c), b = _mm512_maskz_loadu_ps(hi, x + c + 16);
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

size_t packed_act_bytes(size_t cols) { return (cols / QK8_0 + 1) / 2 * sizeof(ActPair); }

void pack_act_avx512(DType type, const ActQ8* x, size_t cols, uint8_t* out) {
  const size_t nb = cols / QK8_0;
  const __m512i offset = _mm512_set1_epi8(char(type == DType::Q8_0 ? WeightsQ8_0::kOffset : WeightsQ4_0::kOffset));
  auto* dst = reinterpret_cast<ActPair*>(out);
  for (size_t b = 0; b < nb; b += 2, ++dst) {
    const bool two = b + 1 < nb;
    const __m512i q = load_pair(x[b].qs, two ? x[b + 1].qs : nullptr);
    _mm512_store_si512(dst->q, q);
    _mm512_store_ps(dst->d, scale_pair(x[b].d, two ? x[b + 1].d : 0.0f));
    // offset * q by fours (|sum| <= 4 * 128 * 127), negated.
    const __m512i prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, q);
    _mm512_store_si512(dst->corr, _mm512_sub_epi32(_mm512_setzero_si512(), prod));
  }
}

}  // namespace specmesh::mm

#endif
