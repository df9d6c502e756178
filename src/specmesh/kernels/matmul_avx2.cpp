// AVX2 + FMA + F16C matmul kernels. Built with -mavx2 -mfma -mf16c and only called after a
// run-time CPU check (matmul.cpp).
//
// Determinism: every output y[t][r] is one accumulator (8 float lanes) updated by the same
// intrinsic sequence over the whole row, then reduced by hsum(). Tiles of R rows x T tokens
// only interleave independent accumulators, so an element's value never depends on the
// tile it lands in, the row range, n_tokens or the thread count. Accumulators change only
// through explicit FMA intrinsics and no multiply result feeds an add, so -ffp-contract has
// nothing to fuse differently between tile shapes.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "specmesh/kernels/avx2_reduce.hpp"
#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/matmul_impl.hpp"

namespace specmesh::mm {

void gemm_rows_avx2(const Problem& p, size_t r0, size_t r1);

namespace {

using avx2::hsum;

using TileFn = void (*)(const Problem&, size_t r, size_t t);

inline float half(uint16_t h) { return _cvtsh_ss(h); }

// f16 -> f32 table for per-block scales: a table load plus a broadcast load keeps the
// conversion off the vector ALU ports the integer dot products saturate.
const float* f16_table() {
  static const float* table = [] {
    auto* t = new float[65536];  // lives for the process
    for (uint32_t h = 0; h < 65536; ++h) t[h] = fp16_to_fp32(uint16_t(h));
    return t;
  }();
  return table;
}

// Asks for `bytes` from `at` of each of N units (weight rows, or packed panels) `stride` apart
// from `first`. A tile calls it at each step for the same step of every row of the tile after
// it, which this thread computes next, so that part of the weights is on its way while the tile
// runs: a gemv has no other work to hide DRAM latency behind, and the hardware prefetchers keep
// too few of the tile's streams going (they stop at every 4 KiB page) to fill the memory's
// bandwidth from one core. Asking row by row, rather than for the next tile's bytes in address
// order at the same pace, keeps every row of it arriving ahead of its use: F16 decode of 5632 x
// 2048 from memory 24-27 -> 28-29 GB/s (AVX-512 path, two threads).
template <int N>
inline void ask_ahead(const uint8_t* first, size_t stride, size_t at, size_t bytes) {
  for (int i = 0; i < N; ++i)
    for (size_t k = 0; k < bytes; k += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + size_t(i) * stride + at + k), _MM_HINT_T0);
}

template <int R, int T>
inline void store(const Problem& p, size_t r, size_t t, __m256 (&acc)[R][T]) {
  for (int j = 0; j < T; ++j)
    for (int i = 0; i < R; ++i) p.y[(t + j) * p.ldy + r + i] = hsum(acc[i][j]);
}

// --- Q8_0 weights x Q8 activations -------------------------------------------------------

template <int R, int T>
void tile_q8_0(const Problem& p, size_t r, size_t t) {
  const size_t nb = p.cols / QK8_0;
  const float* f16 = f16_table();
  const block_q8_0* w[R];
  const ActQ8* x[T];
  for (int i = 0; i < R; ++i) w[i] = reinterpret_cast<const block_q8_0*>(p.w + (r + i) * p.w_stride);
  for (int j = 0; j < T; ++j) x[j] = p.xq + (t + j) * nb;
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  __m256 acc[R][T];
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (size_t b = 0; b < nb; ++b) {
    ask_ahead<R>(next, p.w_stride, b * sizeof(block_q8_0), sizeof(block_q8_0));
    __m256i wv[R], wa[R];
    __m256 wd[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i][b].qs));
      wa[i] = _mm256_abs_epi8(wv[i]);  // maddubs wants one unsigned operand: move the sign to x
      wd[i] = _mm256_broadcast_ss(f16 + w[i][b].d);
    }
#pragma GCC unroll 4
    for (int j = 0; j < T; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[j][b].qs));
      const __m256 xd = _mm256_broadcast_ss(&x[j][b].d);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256i prod = _mm256_maddubs_epi16(wa[i], _mm256_sign_epi8(xv, wv[i]));
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
        acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(wd[i], xd), s, acc[i][j]);
      }
    }
  }
  store<R, T>(p, r, t, acc);
}

// --- Q4_0 weights x Q8 activations -------------------------------------------------------

template <int R, int T>
void tile_q4_0(const Problem& p, size_t r, size_t t) {
  const size_t nb = p.cols / QK4_0;
  const float* f16 = f16_table();
  const block_q4_0* w[R];
  const ActQ8* x[T];
  for (int i = 0; i < R; ++i) w[i] = reinterpret_cast<const block_q4_0*>(p.w + (r + i) * p.w_stride);
  for (int j = 0; j < T; ++j) x[j] = p.xq + (t + j) * nb;
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  __m256 acc[R][T];
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi8(8);
  const __m256i nibble_shift = _mm256_setr_epi64x(0, 0, 4, 4);
  for (size_t b = 0; b < nb; ++b) {
    // The next tile's rows as one span in address order (fewer asks per block): this kernel
    // computes more per byte than the others, and asking row by row made it 3-6 % slower.
    ask_ahead<1>(next, 0, b * R * sizeof(block_q4_0), R * sizeof(block_q4_0));
    __m256i wq[R];
    __m256 wd[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      // The 16 bytes in both lanes; low nibbles (elements 0..15) from the first lane,
      // high nibbles (16..31) from the second.
      const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[i][b].qs)));
      wq[i] = _mm256_and_si256(_mm256_srlv_epi64(raw, nibble_shift), low4);
      wd[i] = _mm256_broadcast_ss(f16 + w[i][b].d);
    }
#pragma GCC unroll 4
    for (int j = 0; j < T; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[j][b].qs));
      // sum((q-8)*x) = sum(q*x) - sum(8*x); the second term is shared by all rows.
      const __m256i x8 = _mm256_maddubs_epi16(eight, xv);
      const __m256 xd = _mm256_broadcast_ss(&x[j][b].d);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256i prod = _mm256_sub_epi16(_mm256_maddubs_epi16(wq[i], xv), x8);
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
        acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(wd[i], xd), s, acc[i][j]);
      }
    }
  }
  store<R, T>(p, r, t, acc);
}

// --- Q4_K weights x Q8 activation blocks -------------------------------------------------
// A super-block's sub-block k of 32 meets activation block 8 sb + k. Its nibbles q (unsigned,
// so maddubs needs no sign trick) give sum q * x_q exact in 32 bits, scaled once:
//   acc += float(sum q x_q) * ((d sc_k) * d_x)
// and the mins' term, lane k of a second accumulator (ActBlk::dsum = d_x sum x_q):
//   macc += (dmin m_k) * dsum_k;   y = hsum(acc) - hsum(macc).
// Against dequantising to floats and multiplying by float activations, this is about a third
// of the operations per weight. The eight 6-bit scales and mins come out of their 12 bytes by
// word masks and shifts (as ggml unpacks them), not one at a time.

// Scales d sc_k and mins dmin m_k (exact in f32) of a super-block, lane k each.
inline void q4_K_scales(const block_q4_K& b, __m256& a, __m256& m) {
  uint32_t u[4];
  std::memcpy(u, b.scales, 12);
  // Bytes 0..7: sc_0..7; bytes 8..15: m_0..7 (q4_K_scale_min's rule, four at a time).
  u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  const uint32_t mins_0_3 = u[1] & 0x3f3f3f3fu;
  u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  u[2] = mins_0_3;
  u[0] &= 0x3f3f3f3fu;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  a = _mm256_mul_ps(_mm256_set1_ps(half(b.d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
  m = _mm256_mul_ps(_mm256_set1_ps(half(b.dmin)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}

template <int R, int T>
void tile_q4_K(const Problem& p, size_t r, size_t t) {
  const size_t nsb = p.cols / QK_K, nb = p.cols / QK8_0;
  const block_q4_K* w[R];
  const ActBlk* x[T];
  for (int i = 0; i < R; ++i) w[i] = reinterpret_cast<const block_q4_K*>(p.w + (r + i) * p.w_stride);
  for (int j = 0; j < T; ++j) x[j] = p.xb + (t + j) * nb;
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  __m256 acc[R][T], macc[R][T];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < T; ++j) acc[i][j] = macc[i][j] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (size_t sb = 0; sb < nsb; ++sb) {
    ask_ahead<R>(next, p.w_stride, sb * sizeof(block_q4_K), sizeof(block_q4_K));
    __m256 dsum[T];
    for (int j = 0; j < T; ++j) {
      const ActBlk* xs = x[j] + sb * 8;
      dsum[j] = _mm256_setr_ps(xs[0].dsum, xs[1].dsum, xs[2].dsum, xs[3].dsum, xs[4].dsum, xs[5].dsum, xs[6].dsum,
                               xs[7].dsum);
    }
    alignas(32) float a[R][8];
    for (int i = 0; i < R; ++i) {
      __m256 av, mv;
      q4_K_scales(w[i][sb], av, mv);
      _mm256_store_ps(a[i], av);
      for (int j = 0; j < T; ++j) macc[i][j] = _mm256_fmadd_ps(mv, dsum[j], macc[i][j]);
    }
    for (int k = 0; k < 8; ++k) {
      const size_t xb = sb * 8 + size_t(k);
      // Sub-block k: the low nibbles of bytes 32 (k / 2) .. + 32 for even k, the high ones for odd.
      __m256i wq[R];
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i][sb].qs + 32 * (k / 2)));
        wq[i] = _mm256_and_si256(k % 2 == 0 ? raw : _mm256_srli_epi16(raw, 4), low4);
      }
#pragma GCC unroll 4
      for (int j = 0; j < T; ++j) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[j][xb].q.qs));
        const float xd = x[j][xb].q.d;
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wq[i], xv), ones));
          acc[i][j] = _mm256_fmadd_ps(s, _mm256_set1_ps(a[i][k] * xd), acc[i][j]);
        }
      }
    }
  }
  for (int j = 0; j < T; ++j)
    for (int i = 0; i < R; ++i) p.y[(t + j) * p.ldy + r + i] = hsum(acc[i][j]) - hsum(macc[i][j]);
}

// --- float-like weights (F32, F16, BF16) x F32 activations -------------------------------

struct LoadF32 {
  using elem = float;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static float scalar(float v) { return v; }
};
struct LoadF16 {
  using elem = uint16_t;
  static __m256 load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static float scalar(uint16_t v) { return half(v); }
};
struct LoadBF16 {
  using elem = uint16_t;
  static __m256 load(const uint16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static float scalar(uint16_t v) { return bf16_to_fp32(v); }
};

template <class L, int R, int T>
void tile_float(const Problem& p, size_t r, size_t t) {
  using E = typename L::elem;
  const E* w[R];
  const float* x[T];
  for (int i = 0; i < R; ++i) w[i] = reinterpret_cast<const E*>(p.w + (r + i) * p.w_stride);
  for (int j = 0; j < T; ++j) x[j] = p.x + (t + j) * p.cols;
  __m256 acc[R][T];
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  const size_t n8 = p.cols & ~size_t(7);
  for (size_t c = 0; c < n8; c += 8) {
    ask_ahead<R>(next, p.w_stride, c * sizeof(E), 8 * sizeof(E));
    __m256 wv[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) wv[i] = L::load(w[i] + c);
#pragma GCC unroll 4
    for (int j = 0; j < T; ++j) {
      const __m256 xv = _mm256_loadu_ps(x[j] + c);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (n8 < p.cols) {
    // Ragged end: one more vector step on zero-padded copies (0*0 adds +0 to every lane).
    const size_t rest = p.cols - n8;
    alignas(32) float wt[R][8] = {};
    alignas(32) float xt[8] = {};
    for (int i = 0; i < R; ++i)
      for (size_t k = 0; k < rest; ++k) wt[i][k] = L::scalar(w[i][n8 + k]);
    for (int j = 0; j < T; ++j) {
      std::memcpy(xt, x[j] + n8, rest * sizeof(float));
      const __m256 xv = _mm256_load_ps(xt);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(wt[i]), xv, acc[i][j]);
    }
  }
  store<R, T>(p, r, t, acc);
}

// --- Q6_K: dequantise a super-block to the stack, then FMA -------------------------------
// Values equal dequantize_row's bit for bit.

inline __m256i load8_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

struct DequantQ6K {
  static void run(const uint8_t* src, float* y) {
    const auto* b = reinterpret_cast<const block_q6_K*>(src);
    const float d = half(b->d);
    const __m256i low4 = _mm256_set1_epi32(0x0F), three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    for (int n = 0; n < 2; ++n, y += 128) {
      const uint8_t* ql = b->ql + 64 * n;
      const uint8_t* qh = b->qh + 32 * n;
      const int8_t* sc = b->scales + 8 * n;
      for (int l = 0; l < 32; l += 8) {
        const int s = l / 16;
        const __m256i a = load8_u8(ql + l), c = load8_u8(ql + l + 32), h = load8_u8(qh + l);
        auto level = [&](__m256i nib, int shift) {
          const __m256i hb = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, shift), three), 4);
          return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(nib, hb), bias));
        };
        const __m256 q1 = level(_mm256_and_si256(a, low4), 0);
        const __m256 q2 = level(_mm256_and_si256(c, low4), 2);
        const __m256 q3 = level(_mm256_srli_epi32(a, 4), 4);
        const __m256 q4 = level(_mm256_srli_epi32(c, 4), 6);
        _mm256_storeu_ps(y + l, _mm256_mul_ps(_mm256_set1_ps(d * float(sc[s + 0])), q1));
        _mm256_storeu_ps(y + l + 32, _mm256_mul_ps(_mm256_set1_ps(d * float(sc[s + 2])), q2));
        _mm256_storeu_ps(y + l + 64, _mm256_mul_ps(_mm256_set1_ps(d * float(sc[s + 4])), q3));
        _mm256_storeu_ps(y + l + 96, _mm256_mul_ps(_mm256_set1_ps(d * float(sc[s + 6])), q4));
      }
    }
  }
};

template <class D, size_t BlockBytes, int R, int T>
void tile_kquant(const Problem& p, size_t r, size_t t) {
  const size_t nsb = p.cols / QK_K;
  const uint8_t* w[R];
  const float* x[T];
  for (int i = 0; i < R; ++i) w[i] = p.w + (r + i) * p.w_stride;
  for (int j = 0; j < T; ++j) x[j] = p.x + (t + j) * p.cols;
  __m256 acc[R][T];
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
  const uint8_t* next = p.w + (r + R) * p.w_stride;
  alignas(32) float buf[R][QK_K];
  for (size_t sb = 0; sb < nsb; ++sb) {
    ask_ahead<R>(next, p.w_stride, sb * BlockBytes, BlockBytes);
    for (int i = 0; i < R; ++i) D::run(w[i] + sb * BlockBytes, buf[i]);
    for (int j = 0; j < T; ++j) {
      const float* xs = x[j] + sb * QK_K;
      for (int c = 0; c < QK_K; c += 8) {
        const __m256 xv = _mm256_loadu_ps(xs + c);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(buf[i] + c), xv, acc[i][j]);
      }
    }
  }
  store<R, T>(p, r, t, acc);
}

template <int R, int T> void tile_f32(const Problem& p, size_t r, size_t t) { tile_float<LoadF32, R, T>(p, r, t); }
template <int R, int T> void tile_f16(const Problem& p, size_t r, size_t t) { tile_float<LoadF16, R, T>(p, r, t); }
template <int R, int T> void tile_bf16(const Problem& p, size_t r, size_t t) { tile_float<LoadBF16, R, T>(p, r, t); }
template <int R, int T> void tile_q6_K(const Problem& p, size_t r, size_t t) {
  tile_kquant<DequantQ6K, sizeof(block_q6_K), R, T>(p, r, t);
}

constexpr int kMaxR = 4, kMaxT = 4;
using TileTable = TileFn[kMaxR][kMaxT];

#define SPECMESH_TILE_ROW(f, R) {f<R, 1>, f<R, 2>, f<R, 3>, f<R, 4>}
#define SPECMESH_TILE_TABLE(f) \
  {SPECMESH_TILE_ROW(f, 1), SPECMESH_TILE_ROW(f, 2), SPECMESH_TILE_ROW(f, 3), SPECMESH_TILE_ROW(f, 4)}
// Q6_K tiles serve single tokens only: batches dequantise row blocks and use the F32 tiles.
#define SPECMESH_DECODE_TABLE(f) {{f<1, 1>}, {f<2, 1>}, {f<3, 1>}, {f<4, 1>}}

constexpr TileTable kF32 = SPECMESH_TILE_TABLE(tile_f32);
constexpr TileTable kF16 = SPECMESH_TILE_TABLE(tile_f16);
constexpr TileTable kBF16 = SPECMESH_TILE_TABLE(tile_bf16);
constexpr TileTable kQ8_0 = SPECMESH_TILE_TABLE(tile_q8_0);
constexpr TileTable kQ4_0 = SPECMESH_TILE_TABLE(tile_q4_0);
constexpr TileTable kQ4_K = SPECMESH_TILE_TABLE(tile_q4_K);
constexpr TileTable kQ6_K = SPECMESH_DECODE_TABLE(tile_q6_K);

#undef SPECMESH_DECODE_TABLE
#undef SPECMESH_TILE_TABLE
#undef SPECMESH_TILE_ROW

const TileTable& table_for(DType t) {
  switch (t) {
    case DType::F32: return kF32;
    case DType::F16: return kF16;
    case DType::BF16: return kBF16;
    case DType::Q8_0: return kQ8_0;
    case DType::Q4_0: return kQ4_0;
    case DType::Q4_K: return kQ4_K;
    case DType::Q6_K: return kQ6_K;
  }
  return kF32;
}

// Dequantises rows [rb, re) of a Q6_K matrix into buf (row-major f32, cols per row).
void dequant_rows(const Problem& p, size_t rb, size_t re, float* buf) {
  for (size_t r = rb; r < re; ++r) {
    const uint8_t* row = p.w + r * p.w_stride;
    float* out = buf + (r - rb) * p.cols;
    for (size_t sb = 0; sb < p.cols / QK_K; ++sb) DequantQ6K::run(row + sb * sizeof(block_q6_K), out + sb * QK_K);
  }
}

}  // namespace

void gemm_rows_avx2(const Problem& p, size_t r0, size_t r1) {
  // Decode streams each weight row once: 4 rows give 4 independent FMA chains (8 rows
  // measured no better). For several tokens, 3 rows x 4 tokens (12 accumulators) reuses
  // each weight vector for 4 tokens within the 16 ymm registers.
  const size_t rm = p.n_tokens == 1 ? 4 : 3;
  const size_t tm = 4;
  // Row blocks stay in L1/L2 while every token of a token block passes over them; the token
  // block bounds the activations that must stay cached meanwhile.
  const size_t row_block = 8 * rm;
  const size_t act_bytes = p.xq != nullptr   ? p.cols / QK8_0 * sizeof(ActQ8)
                           : p.xb != nullptr ? p.cols / QK8_0 * sizeof(ActBlk)
                                             : p.cols * sizeof(float);
  const size_t tok_block = std::max<size_t>(tm, (size_t(256) << 10) / std::max<size_t>(act_bytes, 1) / tm * tm);

  // With several tokens, Q6_K row blocks are dequantised once per token block and run
  // through the F32 tiles. Same values (same dequantiser) and the same FMA sequence over
  // the row as tile_kquant, so results stay bit-identical to single-token calls.
  const bool kq_batch = p.n_tokens > 1 && p.type == DType::Q6_K;
  thread_local std::vector<float> deq;
  Problem fp = p;
  if (kq_batch) {
    deq.resize(row_block * p.cols);
    fp.type = DType::F32;
    fp.w = reinterpret_cast<const uint8_t*>(deq.data());
    fp.w_stride = p.cols * sizeof(float);
  }
  const TileTable& tab = table_for(kq_batch ? DType::F32 : p.type);

  for (size_t t0 = 0; t0 < p.n_tokens; t0 += tok_block) {
    const size_t t1 = std::min(p.n_tokens, t0 + tok_block);
    for (size_t rb = r0; rb < r1; rb += row_block) {
      const size_t re = std::min(r1, rb + row_block);
      if (kq_batch) {
        dequant_rows(p, rb, re, deq.data());
        fp.y = p.y + rb;  // the tiles below index rows relative to the block
      }
      for (size_t t = t0; t < t1; t += tm) {
        const size_t nt = std::min(tm, t1 - t);
        for (size_t r = rb; r < re; r += rm) {
          const size_t nr = std::min(rm, re - r);
          if (kq_batch) {
            tab[nr - 1][nt - 1](fp, r - rb, t);
          } else {
            tab[nr - 1][nt - 1](p, r, t);
          }
        }
      }
    }
  }
}

namespace {

// One block of 32 activations quantised as Q8_0 quantises a row, into out; returns its quants.
inline __m256i quantize_block(const float* x, ActQ8& out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[k], abs_mask));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  // Same scalar steps as the portable quantizer, so both paths produce identical blocks.
  const float d = _mm_cvtss_f32(m) / 127;
  const float id = d != 0 ? 1 / d : 0;
  out.d = d;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], idv));  // nearest-even
  // Packs interleave 128-bit lanes; the permute restores element order.
  const __m256i q01 = _mm256_packs_epi32(q[0], q[1]);
  const __m256i q23 = _mm256_packs_epi32(q[2], q[3]);
  __m256i q8 = _mm256_packs_epi16(q01, q23);
  q8 = _mm256_permutevar8x32_epi32(q8, perm);
  q8 = _mm256_max_epi8(q8, _mm256_set1_epi8(-127));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qs), q8);
  return q8;
}

}  // namespace

void quantize_act_avx2(const float* x, size_t cols, ActQ8* out) {
  for (size_t b = 0; b < cols / QK8_0; ++b) quantize_block(x + b * QK8_0, out[b]);
}

void quantize_act_blocks_avx2(const float* x, size_t cols, int32_t offset, ActBlk* out) {
  for (size_t b = 0; b < cols / QK8_0; ++b) {
    ActBlk& blk = out[b];
    const __m256i q8 = quantize_block(x + b * QK8_0, blk.q);
    // The sums of each 16 quants: sad of the bytes flipped to unsigned (q + 128) against zero
    // sums each 8 of them, 1024 over the signed sum.
    const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(q8, _mm256_set1_epi8(char(0x80))), _mm256_setzero_si256());
    const int32_t half0 = int32_t(_mm256_extract_epi64(sad, 0) + _mm256_extract_epi64(sad, 1)) - 2048;
    const int32_t half1 = int32_t(_mm256_extract_epi64(sad, 2) + _mm256_extract_epi64(sad, 3)) - 2048;
    const int32_t sum = half0 + half1;
    blk.corr = -offset * sum;
    blk.dsum = blk.q.d * float(sum);
    blk.half_corr[0] = -32 * half0;
    blk.half_corr[1] = -32 * half1;
  }
}

}  // namespace specmesh::mm

#endif
