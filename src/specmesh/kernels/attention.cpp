#include "specmesh/kernels/attention.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace specmesh {

void attn_partial(const float* q, const KvRows& kv, size_t kv_off, int head_dim, float scale,
                  const int32_t* cells, size_t n, float* o, AttnPartial& p) {
  if (n == 0) return;
  thread_local std::vector<float> s;
  s.resize(n);
  float m = -INFINITY;
  for (size_t j = 0; j < n; ++j) {
    const float* k = kv.k + size_t(cells[j]) * kv.row_stride + kv_off;
    float dot = 0;
    for (int d = 0; d < head_dim; ++d) dot += q[d] * k[d];
    s[j] = dot * scale;
    m = std::max(m, s[j]);
  }
  // Rescale what is already accumulated to the new maximum, then add this chunk.
  const float m_new = std::max(p.m, m);
  const float old_scale = p.l > 0 ? std::exp(p.m - m_new) : 0.0f;
  for (int d = 0; d < head_dim; ++d) o[d] *= old_scale;
  float l = p.l * old_scale;
  for (size_t j = 0; j < n; ++j) {
    const float w = std::exp(s[j] - m_new);
    l += w;
    const float* v = kv.v + size_t(cells[j]) * kv.row_stride + kv_off;
    for (int d = 0; d < head_dim; ++d) o[d] += w * v[d];
  }
  p.m = m_new;
  p.l = l;
}

void attn_merge(float* o, AttnPartial& p, const float* o2, const AttnPartial& p2, int head_dim) {
  if (p2.l == 0) return;
  const float m = std::max(p.m, p2.m);
  const float a = p.l > 0 ? std::exp(p.m - m) : 0.0f;
  const float b = std::exp(p2.m - m);
  for (int d = 0; d < head_dim; ++d) o[d] = o[d] * a + o2[d] * b;
  p.l = p.l * a + p2.l * b;
  p.m = m;
}

void attention(const float* q, const KvRows& kv, size_t kv_off, int head_dim, float scale,
               const int32_t* cells, size_t n, float* out) {
  thread_local std::vector<float> oc;
  oc.assign(head_dim, 0.0f);
  std::fill(out, out + head_dim, 0.0f);
  AttnPartial acc;
  for (size_t c = 0; c < n; c += kAttnChunk) {
    AttnPartial pc;
    std::fill(oc.begin(), oc.end(), 0.0f);
    attn_partial(q, kv, kv_off, head_dim, scale, cells + c, std::min(kAttnChunk, n - c), oc.data(), pc);
    attn_merge(out, acc, oc.data(), pc, head_dim);
  }
  const float inv = acc.l > 0 ? 1.0f / acc.l : 0.0f;
  for (int d = 0; d < head_dim; ++d) out[d] *= inv;
}

}  // namespace specmesh
