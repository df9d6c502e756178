// Conversion between F32 and every stored weight type.
#pragma once

#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

// dst[0..n) = values of the n elements at src (n a multiple of the block size).
void dequantize_row(DType type, const void* src, float* dst, size_t n);

// Encode n floats into type's layout at dst (row_bytes(type, n) bytes).
// Reference quantizers, compatible with ggml's decoders; used by the GGUF writer and tests.
void quantize_row(DType type, const float* src, void* dst, size_t n);

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K block's 12 packed scale bytes
// (ggml's get_scale_min_k4).
void q4_K_scale_min(const uint8_t* scales, int j, uint8_t& sc, uint8_t& m);

// The stored 6-bit quants of a Q6_K block's 256 elements into out (0..63; element e's value
// is d * scales[e / 16] * (q - 32)).
void q6_K_quants(const block_q6_K& b, uint8_t* out);

}  // namespace specmesh
