#include "specmesh/kernels/ops.hpp"

#include <algorithm>
#include <cmath>

namespace specmesh {

void rmsnorm(const float* x, const float* w, float* y, size_t n, float eps) {
  double ss = 0;  // double: the result must not depend on how long the row is
  for (size_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float scale = 1.0f / std::sqrt(float(ss / n) + eps);
  for (size_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void rope(float* x, int n_heads, int head_dim, int n_rot, int32_t pos, float theta, RopeStyle style) {
  const int half = n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const float freq = std::pow(theta, -2.0f * i / n_rot);
    const float angle = pos * freq;
    const float c = std::cos(angle), s = std::sin(angle);
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + size_t(h) * head_dim;
      float* a = style == RopeStyle::Interleaved ? v + 2 * i : v + i;
      float* b = style == RopeStyle::Interleaved ? v + 2 * i + 1 : v + i + half;
      const float x0 = *a, x1 = *b;
      *a = x0 * c - x1 * s;
      *b = x0 * s + x1 * c;
    }
  }
}

void swiglu(float* gate, const float* up, size_t n) {
  for (size_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void softmax(float* x, size_t n) {
  float m = x[0];
  for (size_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (size_t i = 0; i < n; ++i) x[i] *= inv;
}

void add(float* y, const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace specmesh
