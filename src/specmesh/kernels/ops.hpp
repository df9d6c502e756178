// Element-wise and per-row transformer operations on F32 activations.
#pragma once

#include <cstddef>
#include <cstdint>

namespace specmesh {

// y = x / rms(x) * w over n values (y may alias x).
void rmsnorm(const float* x, const float* w, float* y, size_t n, float eps);

enum class RopeStyle {
  Interleaved,  // pairs (x[2i], x[2i+1]): llama GGUF and llama2.c
  Neox,         // pairs (x[i], x[i + n_rot/2]): qwen2 / qwen3
};
// Rotates n_heads heads of head_dim values in place for position pos; the first n_rot
// dimensions of each head rotate, with frequency theta^(-2i/n_rot).
void rope(float* x, int n_heads, int head_dim, int n_rot, int32_t pos, float theta, RopeStyle style);

// gate[i] = silu(gate[i]) * up[i]
void swiglu(float* gate, const float* up, size_t n);

// x = softmax(x) over n values.
void softmax(float* x, size_t n);

// y[i] += x[i]
void add(float* y, const float* x, size_t n);

}  // namespace specmesh
