// Qwen3: RMS norms over each head of Q and K (one weight vector shared by the heads) before
// RoPE, no biases; RoPE rotates the two halves of a head (NeoX).
#include "specmesh/kernels/ops.hpp"
#include "specmesh/model/arch.hpp"
#include "specmesh/model/model.hpp"

namespace specmesh {

const ArchSpec kQwen3Arch{
    Arch::Qwen3, "qwen3", RopeStyle::Neox,
    [](const VectorLoader& vec, const std::string& p, const HParams& hp, LayerWeights& w) {
      w.q_norm = vec(p + "attn_q_norm.weight", hp.head_dim);
      w.k_norm = vec(p + "attn_k_norm.weight", hp.head_dim);
    },
    [](const HParams& hp, const LayerWeights& w, int kv_begin, int kv_end, float* q, float* k, float*) {
      const int D = hp.head_dim, n_kv = kv_end - kv_begin, n_q = n_kv * (hp.n_head / hp.n_head_kv);
      for (int h = 0; h < n_q; ++h) rmsnorm(q + h * D, w.q_norm, q + h * D, D, hp.rms_eps);
      for (int h = 0; h < n_kv; ++h) rmsnorm(k + h * D, w.k_norm, k + h * D, D, hp.rms_eps);
    },
};

}  // namespace specmesh
