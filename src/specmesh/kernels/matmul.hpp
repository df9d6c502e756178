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
};

// y[t*rows + r] = sum_i W[r][i] * x[t*cols + i], for t < n_tokens.
// Each output is computed in a fixed reduction order that does not depend on n_tokens
// or the thread count, so a batch gives bit-identical results to single-token calls.
void matmul(const WeightView& w, const float* x, size_t n_tokens, float* y, ThreadPool& pool);

// The same for a subset of rows [row_begin, row_end): y has (row_end-row_begin) columns per token.
void matmul_rows(const WeightView& w, size_t row_begin, size_t row_end, const float* x,
                 size_t n_tokens, float* y, ThreadPool& pool);

// Name of the SIMD path matmul uses on this machine ("avx2" or "scalar").
const char* matmul_isa();

// Overrides the path chosen at start-up (from the CPU and SPECMESH_ISA=scalar): "scalar",
// "avx2", or nullptr / "" / "auto" to restore the default. Returns false, changing nothing,
// for an unknown name or a path this CPU cannot run. For tests and benchmarks; not meant to
// race with running matmuls.
bool matmul_set_isa(const char* isa);

}  // namespace specmesh
