// AVX2 + FMA tile steps of the tree-attention kernels. Built with -mavx2 -mfma and only
// called after a run-time CPU check, for head_dim a multiple of 8 (tree_attention.cpp).
//
// Register blocking: scores keep RB query rows x 16 key columns in 2*RB accumulators, so
// each K load serves RB rows; accumulate keeps RB rows x 16 output floats, so each V load
// serves RB rows. With RB = 6 that is 12 accumulators of the 16 ymm registers.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "specmesh/kernels/avx2_reduce.hpp"
#include "specmesh/kernels/tree_attention.hpp"

namespace specmesh::tree_attn_detail {

namespace {

using avx2::hmax;
using avx2::hsum;

constexpr size_t kB = kTreeKeyTile;
constexpr int kRows = 6;

// 2^x for x <= 0, exactly 0 below -126 (so -inf, a masked score, gives 0). 2^x = 2^n * 2^f
// with n = round(x), |f| <= 1/2, and 2^f from its Taylor series to degree 6 (relative error
// about 1e-7, near float rounding).
inline __m256 exp2_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 y = _mm256_set1_ps(1.5403530393381606e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3333558146428443e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.6181291076284772e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.5504108664821580e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.4022650695910071e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.9314718055994531e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Lanes whose bit in `bits` (8 bits, lane 0 lowest) is clear.
inline __m256 cleared_lanes(uint32_t bits) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_and_si256(_mm256_set1_epi32(int(bits)), lane_bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
}

template <int RB>
void scores_block(const float* q, int head_dim, const float* kt, float* s) {
  for (size_t c = 0; c < kB; c += 16) {
    __m256 acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int x = 0; x < head_dim; ++x) {
      const __m256 k0 = _mm256_loadu_ps(kt + x * kB + c);
      const __m256 k1 = _mm256_loadu_ps(kt + x * kB + c + 8);
      for (int r = 0; r < RB; ++r) {
        const __m256 qx = _mm256_broadcast_ss(q + r * head_dim + x);
        acc[r][0] = _mm256_fmadd_ps(qx, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qx, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      _mm256_storeu_ps(s + r * kB + c, acc[r][0]);
      _mm256_storeu_ps(s + r * kB + c + 8, acc[r][1]);
    }
  }
}

void scores(const float* q, size_t rows, int head_dim, const float* kt, float* s) {
  size_t r = 0;
  for (; r + kRows <= rows; r += kRows) scores_block<kRows>(q + r * head_dim, head_dim, kt, s + r * kB);
  const float* qr = q + r * head_dim;
  float* sr = s + r * kB;
  switch (rows - r) {
    case 5: scores_block<5>(qr, head_dim, kt, sr); break;
    case 4: scores_block<4>(qr, head_dim, kt, sr); break;
    case 3: scores_block<3>(qr, head_dim, kt, sr); break;
    case 2: scores_block<2>(qr, head_dim, kt, sr); break;
    case 1: scores_block<1>(qr, head_dim, kt, sr); break;
    default: break;
  }
}

void softmax(float* s, size_t rows, size_t group, const uint32_t* vis, float* m, float* l, float* alpha) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  for (size_t r = 0; r < rows; ++r) {
    float* row = s + r * kB;
    const uint32_t bits = vis[r / group];
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(row + 8 * k);
    if (bits != ~0u)
      for (int k = 0; k < 4; ++k) v[k] = _mm256_blendv_ps(v[k], neg_inf, cleared_lanes(bits >> (8 * k)));
    const float mx = hmax(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
    const float m_new = std::max(m[r], mx);
    if (m_new == -INFINITY) {  // nothing visible yet: keep the empty partial
      alpha[r] = 1.0f;
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(row + 8 * k, _mm256_setzero_ps());
      continue;
    }
    alpha[r] = std::exp2(m[r] - m_new);
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      const __m256 e = exp2_nonpos(_mm256_sub_ps(v[k], mv));
      _mm256_storeu_ps(row + 8 * k, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[r] = l[r] * alpha[r] + hsum(sum);
    m[r] = m_new;
  }
}

// RB rows x W ymm (8 W floats) of the output, starting at float x0 of each row.
template <int RB, int W>
void accumulate_block(const float* p, const float* v, int head_dim, size_t x0, const float* alpha,
                      float* o) {
  __m256 acc[RB][W];
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm256_setzero_ps();
  // A fixed trip count (tail keys are zero) lets GCC keep the accumulators in registers.
  for (size_t c = 0; c < kB; ++c) {
    __m256 vc[W];
    for (int w = 0; w < W; ++w) vc[w] = _mm256_loadu_ps(v + c * head_dim + x0 + 8 * w);
    for (int r = 0; r < RB; ++r) {
      const __m256 pc = _mm256_broadcast_ss(p + r * kB + c);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(pc, vc[w], acc[r][w]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    for (int w = 0; w < W; ++w) {
      float* dst = o + r * head_dim + x0 + 8 * w;
      _mm256_storeu_ps(dst, _mm256_fmadd_ps(a, _mm256_loadu_ps(dst), acc[r][w]));
    }
  }
}

template <int RB>
void accumulate_rows(const float* p, const float* v, int head_dim, const float* alpha,
                     float* o) {
  size_t x = 0;
  for (; x + 16 <= size_t(head_dim); x += 16) accumulate_block<RB, 2>(p, v, head_dim, x, alpha, o);
  if (x < size_t(head_dim)) accumulate_block<RB, 1>(p, v, head_dim, x, alpha, o);
}

void accumulate(const float* p, size_t rows, const float* v, int head_dim,
                const float* alpha, float* o) {
  size_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    accumulate_rows<kRows>(p + r * kB, v, head_dim, alpha + r, o + r * head_dim);
  const float* pr = p + r * kB;
  const float* ar = alpha + r;
  float* orow = o + r * head_dim;
  switch (rows - r) {
    case 5: accumulate_rows<5>(pr, v, head_dim, ar, orow); break;
    case 4: accumulate_rows<4>(pr, v, head_dim, ar, orow); break;
    case 3: accumulate_rows<3>(pr, v, head_dim, ar, orow); break;
    case 2: accumulate_rows<2>(pr, v, head_dim, ar, orow); break;
    case 1: accumulate_rows<1>(pr, v, head_dim, ar, orow); break;
    default: break;
  }
}

}  // namespace

const TileSteps& tile_steps_avx2() {
  static const TileSteps steps{scores, softmax, accumulate};
  return steps;
}

}  // namespace specmesh::tree_attn_detail

#endif
