// Types shared by the portable, AVX2 and AVX-512 matmul translation units (private to kernels/).
#pragma once

#include <cstddef>
#include <cstdint>

#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh::mm {

// An activation block quantised to 8 bits. The scale stays f32 (ggml rounds it to f16):
// cheaper to use and one rounding fewer.
struct ActQ8 {
  float d;
  int8_t qs[QK8_0];
};
// The same as the packed kernels read it (see PackedWeights and matmul_avx512.cpp): with
// -offset * sum(qs) for a weight type stored with an offset (Q8_0, Q4_0), d * sum(qs) for
// one with a per-block min (Q4_K), and -32 * the sums of each half for Q6_K (whose quants
// are stored unsigned, q + 32, with a scale per 16 elements).
struct ActBlk {
  ActQ8 q;
  int32_t corr;
  float dsum;
  int32_t half_corr[2];
};
struct Problem {
  DType type;
  const uint8_t* w;   // first weight row of the range
  size_t w_stride;    // bytes per weight row
  size_t cols;
  const float* x;     // n_tokens x cols activations
  const ActQ8* xq;    // n_tokens x cols/32 quantised activations (Q4_0 / Q8_0 weights only)
  const uint8_t* xp;  // the same packed for the AVX-512 kernels (packed_act_bytes per token)
  const uint8_t* wp;  // PackedWeights data (whole matrix), or nullptr
  size_t row0;        // the absolute row of `w`, for panels in `wp`
  size_t panel_bytes; // PackedWeights::panel_bytes
  const ActBlk* xb;   // n_tokens x cols/32 activation blocks for `wp`, or for Q4_K rows (AVX2 tiles)
  const uint16_t* xh; // BF16 weights on AVX-512 BF16: the activations rounded to bf16, each
                      // token's padded with zeros to bf16_act_elems(cols); or nullptr
  size_t n_tokens;
  float* y;           // y[t*ldy + r], r relative to w
  size_t ldy;
};

void gemm_rows_avx2(const Problem& p, size_t r0, size_t r1);
void gemm_rows_avx512(const Problem& p, size_t r0, size_t r1);
// Rows [r0, r1) (relative to p.row0) from the packed weights p.wp and activations p.xb.
void gemm_packed_avx512(const Problem& p, size_t r0, size_t r1);
// The same for Q4_0 panels on AVX2 (matmul_packed_avx2.cpp).
void gemm_packed_avx2(const Problem& p, size_t r0, size_t r1);
// The AVX-512 integer kernels read each token's quantised activations in pairs of blocks laid
// out for whole-register loads: packed_act_bytes(cols) bytes per token (a multiple of 64).
size_t packed_act_bytes(size_t cols);
void pack_act_avx512(DType type, const ActQ8* x, size_t cols, uint8_t* out);
// BF16 weights times bf16 activations with vdpbf16ps (two products per lane per step, summed
// in f32): a token's activations rounded to bf16 (to nearest even) once per matmul, into
// bf16_act_elems(cols) elements (zeros past cols). Only for CPUs with AVX-512 BF16.
size_t bf16_act_elems(size_t cols);
void bf16_act_avx512(const float* x, size_t cols, uint16_t* out);
void quantize_act_avx2(const float* x, size_t cols, ActQ8* out);
// The same quantisation into the packed kernels' blocks, with each block's integer sum
// starting at -offset * sum(q), the min's term d * sum(q), and -32 * the sum of each half.
void quantize_act_blocks_avx2(const float* x, size_t cols, int32_t offset, ActBlk* out);

}  // namespace specmesh::mm
