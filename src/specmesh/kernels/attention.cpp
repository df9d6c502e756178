#include "specmesh/kernels/attention.hpp"

namespace specmesh {

void attention(const float* q, const KvRows& kv, size_t kv_off, int head_dim, float scale,
               const int32_t* cells, size_t n, float* out, const FlashLayout& layout) {
  flash_decode_head(q, kv, kv_off, head_dim, scale, cells, n, out, layout);
}

}  // namespace specmesh
