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
    [](const HParams& hp, const LayerWeights& w, float* q, float* k, float* v) {
      add(q, w.bq, hp.q_dim());
      add(k, w.bk, hp.kv_dim());
      add(v, w.bv, hp.kv_dim());
    },
};

}  // namespace specmesh
