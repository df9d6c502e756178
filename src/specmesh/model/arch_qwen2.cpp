// Qwen2: biases on the Q, K and V projections; RoPE rotates the two halves of a head (NeoX).
#include "specmesh/kernels/ops.hpp"
#include "specmesh/model/arch.hpp"
#include "specmesh/model/model.hpp"

namespace specmesh {

const ArchSpec kQwen2Arch{
    Arch::Qwen2, "qwen2", RopeStyle::Neox,
    [](const VectorLoader& vec, const std::string& p, const HParams& hp, LayerWeights& w) {
      w.bq = vec(p + "attn_q.bias", hp.q_dim());
      w.bk = vec(p + "attn_k.bias", hp.kv_dim());
      w.bv = vec(p + "attn_v.bias", hp.kv_dim());
    },
    [](const HParams& hp, const LayerWeights& w, int kv_begin, int kv_end, float* q, float* k, float* v) {
      const size_t D = size_t(hp.head_dim), group = size_t(hp.n_head / hp.n_head_kv);
      const size_t n_kv = size_t(kv_end - kv_begin) * D, off_kv = size_t(kv_begin) * D;
      add(q, w.bq + off_kv * group, n_kv * group);
      add(k, w.bk + off_kv, n_kv);
      add(v, w.bv + off_kv, n_kv);
    },
};

}  // namespace specmesh
