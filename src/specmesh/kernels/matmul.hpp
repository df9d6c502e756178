// Matrix products of stored weights with F32 activations.
#pragma once

#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

class ThreadPool;

// A row-major weight matrix: `rows` rows of `cols` values, each row row_bytes(type, cols) long.
// Row r produces output feature r (the GGUF {ne0 = cols, ne1 = rows} convention).
struct WeightView {
  DType type;
  const void* data;
  size_t rows;
  size_t cols;
  // The same matrix as PackedWeights lays it out (kernels/packed_weights.hpp), or nullptr.
  // When set, the AVX-512 path reads this instead of `data`, for one row or many alike.
  const void* packed = nullptr;
};

// y[t*rows + r] = sum_i W[r][i] * x[t*cols + i], for t < n_tokens.
// Each output is computed in a fixed reduction order that does not depend on n_tokens
// or the thread count, so a batch gives bit-identical results to single-token calls.
void matmul(const WeightView& w, const float* x, size_t n_tokens, float* y, ThreadPool& pool);

// The same for a subset of rows [row_begin, row_end): y has (row_end-row_begin) columns per token.
void matmul_rows(const WeightView& w, size_t row_begin, size_t row_end, const float* x,
                 size_t n_tokens, float* y, ThreadPool& pool);

// Name of the SIMD path matmul uses on this machine: "avx512" (AVX-512 F/BW/VL/DQ with
// VNNI), "avx2" (AVX2, FMA, F16C) or "scalar" (portable C++).
const char* matmul_isa();

// True when the current path may use AVX2 code (avx2 or avx512): the attention kernels,
// which have no AVX-512 variant, take their AVX2 code then.
bool matmul_isa_has_avx2();
// True when the current path is avx512 (the AVX-512 attention kernel).
bool matmul_isa_has_avx512();
// Whether the current path reads matrices of this type from their packed copy (PackedWeights)
// when they have one: Q8_0, Q4_0, Q4_K and Q6_K on avx512, Q4_0, Q4_K and Q6_K on avx2.
bool matmul_reads_packed(DType type);
// Whether BF16 weights meet activations rounded to bf16 (vdpbf16ps) on the current path: the
// AVX-512 path on a CPU with AVX-512 BF16. Otherwise they are widened to f32.
bool matmul_bf16_dot();

// Overrides the path chosen at start-up (the best the CPU runs, capped by SPECMESH_ISA=scalar,
// avx2 or avx512): "scalar", "avx2", "avx512", or nullptr / "" / "auto" to restore the
// default. Returns false, changing nothing, for an unknown name or a path this CPU cannot run.
// Every path keeps the batch-invariance rule; different paths may round differently.
// For tests and benchmarks; not meant to race with running matmuls.
bool matmul_set_isa(const char* isa);

}  // namespace specmesh
