// AVX2 kernels for Q4_0, Q4_K and Q6_K weights packed in 16-row panels (PackedWeights), the
// layout the AVX-512 integer kernels read. Built with -mavx2 -mfma -mf16c; called only on the
// AVX2 path.
//
// Why a packed layout on AVX2 too: reading rows as stored, every block of 32 weights of a row
// takes its own integer widening, float conversion and fused add (the lanes of an accumulator
// are parts of one output), and Q6_K rows were dequantised to floats first. On a Zen 3 core
// that made decode compute-bound at or below its share of the memory's speed. In a panel, lane
// l of a vector is row l of 8: a block's float work is one conversion, multiply and fused add
// per 8 rows, and the 8-bit products of a block are added up in 16 bits first.
//
// Without VNNI, four products per lane take maddubs (unsigned weight bytes times signed
// activation bytes, adjacent pairs added in 16 bits) and madd by ones (pairs of those into 32
// bits). Each kernel says how many maddubs results it adds in 16 bits before the madd and why
// that stays exact. Every integer sum is exact, and the float steps per output are the AVX-512
// panel kernels' in the same order, so a row's result is the same bits on both paths, whatever
// the tile, row range, batch or thread count (matmul_avx512.cpp).
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>

#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/matmul_impl.hpp"
#include "specmesh/kernels/packed_layout.hpp"

namespace specmesh::mm {

namespace {

constexpr size_t kPanelRows = 16;
constexpr size_t kQuantBytes = 256;  // one block of a Q4_0 panel: 4 groups x 16 rows x 4 bytes

// Not std::min: a standard-library template instantiated here, with AVX2 enabled, could be the
// copy the linker keeps for the whole program (see matmul_avx512.cpp).
inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

inline __m256i broadcast4(const int8_t* at) {
  int32_t v;
  std::memcpy(&v, at, 4);
  return _mm256_set1_epi32(v);
}

// A single token streams each panel once: the next panel's first byte when this thread
// computes it next (as matmul_avx512.cpp's next_tile), else nullptr; batches reuse each panel
// across tokens and are compute-bound.
template <int T>
inline const char* next_panel(const Problem& p, size_t panel, size_t a1) {
  if (T != 1 || (panel + 1) * kPanelRows >= a1) return nullptr;
  return reinterpret_cast<const char*>(p.wp + (panel + 1) * p.panel_bytes);
}

inline void ask(const char* at, size_t bytes) {
  for (size_t k = 0; k < bytes; k += 64) _mm_prefetch(at + k, _MM_HINT_T0);
}

// A tile's start: tokens t .. t + T's activation blocks, and zeroed accumulators.
template <int T>
inline void start_panel(const Problem& p, size_t t, const ActBlk* (&x)[T], __m256 (&acc)[2][T]) {
  const size_t nb = p.cols / QK8_0;
  for (int j = 0; j < T; ++j) x[j] = p.xb + (t + j) * nb;
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
}

// Stores a panel's outputs for tokens [t, t + T), the rows in [a0, a1) only. acc[h] holds rows
// 8h..8h+7 of the panel.
template <int T>
inline void store_panel(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1, __m256 (&acc)[2][T]) {
  for (int h = 0; h < 2; ++h) {
    const size_t first = panel * kPanelRows + 8 * h;  // absolute row of lane 0
    const bool whole = first >= a0 && first + 8 <= a1;
    for (int j = 0; j < T; ++j) {
      float* y = p.y + (t + j) * p.ldy;
      if (whole) {
        _mm256_storeu_ps(y + (first - p.row0), acc[h][j]);
        continue;
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[h][j]);
      for (size_t l = 0; l < 8; ++l)
        if (first + l >= a0 && first + l < a1) y[first + l - p.row0] = lanes[l];
    }
  }
}

// --- Q4_0 ---------------------------------------------------------------------------------
// Per block of 32 (kQuantBytes, then the 16 rows' f16 scales after all blocks): 4 groups of 64
// bytes, row r's 4 bytes at 4r, low nibbles elements 4m.., high ones 16 + 4m... Per block and
// row the sum starts at the activation block's correction (-8 sum x: the nibbles are w + 8) and
// adds the 32 products; a block's eight maddubs results (each pair at most 2 * 15 * 127 = 3810)
// stay below 32767 in 16 bits. Then acc = fma(float(sum) * d_w, d_x, acc).

// Panel `panel` x tokens [t, t + T); stores the rows in [a0, a1) (absolute). Vector h holds
// rows 8h..8h+7 of the panel. One panel at a time measured as fast as two for a single token
// (5632 x 2048, in cache and from memory), and two tokens at a time fastest for batches.
template <int T>
void panel_tile_q4_0(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1) {
  const size_t nb = p.cols / QK8_0;
  const uint8_t* q = p.wp + panel * p.panel_bytes;
  const uint8_t* sc = q + nb * kQuantBytes;
  const ActBlk* x[T];
  __m256 acc[2][T];
  start_panel(p, t, x, acc);
  const char* next = next_panel<T>(p, panel, a1);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (size_t b = 0; b < nb; ++b) {
    if (next != nullptr) {
      ask(next + b * kQuantBytes, kQuantBytes);
      if (b % 2 == 0) ask(next + nb * kQuantBytes + 32 * b, 64);
    }
    __m256i s16[2][T];
    for (auto& a : s16)
      for (auto& v : a) v = _mm256_setzero_si256();
    // Group m: low nibbles are elements 4m..4m+3, high ones 16+4m..16+4m+3.
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + b * kQuantBytes + 64 * m + 32 * h));
        const __m256i lo = _mm256_and_si256(raw, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
        for (int j = 0; j < T; ++j) {
          const int8_t* xq = x[j][b].q.qs;
          s16[h][j] = _mm256_add_epi16(s16[h][j], _mm256_maddubs_epi16(lo, broadcast4(xq + 4 * m)));
          s16[h][j] = _mm256_add_epi16(s16[h][j], _mm256_maddubs_epi16(hi, broadcast4(xq + 16 + 4 * m)));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 wd = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(sc + 32 * b + 16 * h)));
      for (int j = 0; j < T; ++j) {
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(s16[h][j], ones), _mm256_set1_epi32(x[j][b].corr));
        acc[h][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), wd), _mm256_set1_ps(x[j][b].q.d), acc[h][j]);
      }
    }
  }
  store_panel<T>(p, panel, t, a0, a1, acc);
}

// --- Q4_K ---------------------------------------------------------------------------------
// Per super-block of 256 (packed::kQ4KBytes): the 16 rows' d and dmin, their 6-bit scales and
// mins, then 4 chunks of 64 elements whose bytes hold sub-block 2c in the low nibbles and 2c + 1
// in the high ones. The nibbles are unsigned, so the sums need no correction (eight pairs of
// at most 2 * 15 * 127 stay exact in 16 bits, as for Q4_0), and per sub-block s, as on AVX-512,
//   acc = fma(float(sum) * (d sc_s), d_x, acc);  acc = acc - (dmin m_s) * (d_x sum x)

// A sub-block's 8 scales (or mins) of rows 8h.. times the super-block's d (or dmin): exact.
inline __m256 sub_scales(const uint8_t* at, __m256 d) {
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)))));
}

template <int T>
void panel_tile_q4_K(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1) {
  constexpr size_t kQuarter = packed::kQ4KBytes / 4;
  const size_t nsb = p.cols / QK_K;
  const ActBlk* x[T];
  __m256 acc[2][T];
  start_panel(p, t, x, acc);
  const char* next = next_panel<T>(p, panel, a1);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (size_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* q = p.wp + panel * p.panel_bytes + sb * packed::kQ4KBytes;
    __m256 d[2], dmin[2];  // rows 8h..
    for (int h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
      dmin[h] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 32 + 16 * h)));
    }
    for (size_t c = 0; c < 4; ++c) {
      if (next != nullptr) ask(next + sb * packed::kQ4KBytes + c * kQuarter, kQuarter);
      const size_t xb = sb * 8 + 2 * c;  // the low nibbles' activation block; xb + 1 the high ones'
      __m256i s16[2][2][T];               // [low / high nibbles][rows 8h..][token]
      for (auto& a : s16)
        for (auto& b : a)
          for (auto& v : b) v = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_load_si256(
              reinterpret_cast<const __m256i*>(q + packed::kKQuantQuants + c * 512 + 64 * g + 32 * h));
          const __m256i lo = _mm256_and_si256(raw, nib);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
          for (int j = 0; j < T; ++j) {
            s16[0][h][j] = _mm256_add_epi16(s16[0][h][j], _mm256_maddubs_epi16(lo, broadcast4(x[j][xb].q.qs + 4 * g)));
            s16[1][h][j] =
                _mm256_add_epi16(s16[1][h][j], _mm256_maddubs_epi16(hi, broadcast4(x[j][xb + 1].q.qs + 4 * g)));
          }
        }
      }
      for (int k = 0; k < 2; ++k) {
        const size_t sub = 2 * c + size_t(k);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* meta = q + packed::kKQuantScales + 16 * sub + 8 * h;
          const __m256 a = sub_scales(meta, d[h]), m = sub_scales(meta + 128, dmin[h]);
          for (int j = 0; j < T; ++j) {
            const ActBlk& xk = x[j][xb + size_t(k)];
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[k][h][j], ones));
            acc[h][j] = _mm256_fmadd_ps(_mm256_mul_ps(s, a), _mm256_set1_ps(xk.q.d), acc[h][j]);
            acc[h][j] = _mm256_fnmadd_ps(m, _mm256_set1_ps(xk.dsum), acc[h][j]);
          }
        }
      }
    }
  }
  store_panel<T>(p, panel, t, a0, a1, acc);
}

// --- Q6_K ---------------------------------------------------------------------------------
// Per super-block of 256 (packed::kQ6KBytes): the 16 rows' d, their signed 8-bit scales per
// sub-block of 16, then 8 blocks of 32 laid out as Q4_0's groups, one unsigned byte q + 32
// (0..63) per quant. A pair is at most 2 * 63 * 127 = 16002, so two pairs are added in 16 bits
// before madd widens them. Per sub-block, from the block half's correction -32 sum x, as on
// AVX-512:
//   acc = fma(float(sum) * (d sc), d_x, acc)
template <int T>
void panel_tile_q6_K(const Problem& p, size_t panel, size_t t, size_t a0, size_t a1) {
  constexpr size_t kSixteenth = packed::kQ6KBytes / 16;
  const size_t nsb = p.cols / QK_K;
  const ActBlk* x[T];
  __m256 acc[2][T];
  start_panel(p, t, x, acc);
  const char* next = next_panel<T>(p, panel, a1);
  const __m256i ones = _mm256_set1_epi16(1);
  for (size_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* q = p.wp + panel * p.panel_bytes + sb * packed::kQ6KBytes;
    __m256 d[2];  // rows 8h..
    for (int h = 0; h < 2; ++h) d[h] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
    for (size_t sub = 0; sub < QK_K / 16; ++sub) {
      if (next != nullptr) ask(next + sb * packed::kQ6KBytes + sub * kSixteenth, kSixteenth);
      const size_t xb = sb * 8 + sub / 2, half = sub % 2;
      for (int h = 0; h < 2; ++h) {
        // The sub-block's 4 groups (elements 4g.. of the block half), rows 8h..
        const uint8_t* at = q + packed::kKQuantQuants + (sub / 2) * 512 + 64 * (4 * half) + 32 * h;
        __m256i w[4];
        for (int g = 0; g < 4; ++g) w[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(at + 64 * g));
        const __m256 a = _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                                 reinterpret_cast<const __m128i*>(q + packed::kKQuantScales + 16 * sub + 8 * h)))));
        for (int j = 0; j < T; ++j) {
          const int8_t* xq = x[j][xb].q.qs + 16 * half;
          __m256i pair[2];
          for (int k = 0; k < 2; ++k)
            pair[k] = _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * k], broadcast4(xq + 8 * k)),
                                       _mm256_maddubs_epi16(w[2 * k + 1], broadcast4(xq + 8 * k + 4)));
          const __m256i s = _mm256_add_epi32(
              _mm256_add_epi32(_mm256_madd_epi16(pair[0], ones), _mm256_madd_epi16(pair[1], ones)),
              _mm256_set1_epi32(x[j][xb].half_corr[half]));
          acc[h][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), a), _mm256_set1_ps(x[j][xb].q.d), acc[h][j]);
        }
      }
    }
  }
  store_panel<T>(p, panel, t, a0, a1, acc);
}

using PanelFn = void (*)(const Problem&, size_t panel, size_t t, size_t a0, size_t a1);

// A type's tiles of one and two tokens.
struct PanelTiles {
  PanelFn one, two;
};
constexpr PanelTiles kQ4_0Tiles{panel_tile_q4_0<1>, panel_tile_q4_0<2>};
constexpr PanelTiles kQ4_KTiles{panel_tile_q4_K<1>, panel_tile_q4_K<2>};
constexpr PanelTiles kQ6_KTiles{panel_tile_q6_K<1>, panel_tile_q6_K<2>};

}  // namespace

void gemm_packed_avx2(const Problem& p, size_t r0, size_t r1) {
  const size_t a0 = p.row0 + r0, a1 = p.row0 + r1;
  const size_t pan0 = a0 / kPanelRows, pan1 = (a1 + kPanelRows - 1) / kPanelRows;
  const PanelTiles& tiles = p.type == DType::Q4_K ? kQ4_KTiles : p.type == DType::Q6_K ? kQ6_KTiles : kQ4_0Tiles;
  if (p.n_tokens == 1) {
    for (size_t pan = pan0; pan < pan1; ++pan) tiles.one(p, pan, 0, a0, a1);
    return;
  }
  // As in gemm_packed_avx512: a panel stays cached while a block of tokens passes over it.
  const size_t act_bytes = p.cols / QK8_0 * sizeof(ActBlk);
  size_t tok_block = (size_t(256) << 10) / act_bytes / 2 * 2;
  if (tok_block < 2) tok_block = 2;
  for (size_t t0 = 0; t0 < p.n_tokens; t0 += tok_block) {
    const size_t t1 = min_size(p.n_tokens, t0 + tok_block);
    for (size_t pan = pan0; pan < pan1; ++pan)
      for (size_t t = t0; t < t1; t += 2) (t + 1 < t1 ? tiles.two : tiles.one)(p, pan, t, a0, a1);
  }
}

}  // namespace specmesh::mm

#endif
