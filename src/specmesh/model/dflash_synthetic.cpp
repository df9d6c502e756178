#include "specmesh/model/dflash_synthetic.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "specmesh/formats/safetensors.hpp"

namespace specmesh {

DFlashConfig dflash_config_for(const Model& target, int n_layer, int n_taps, int block_size) {
  const HParams& hp = target.hparams();
  DFlashConfig c;
  c.hidden_size = hp.n_embd;
  c.intermediate_size = hp.n_ff;
  c.n_layer = n_layer;
  c.n_head = hp.n_head;
  c.n_head_kv = hp.n_head_kv;
  c.head_dim = hp.head_dim;
  c.block_size = block_size;
  c.num_target_layers = hp.n_layer;
  c.target_layer_ids = dflash_default_target_layers(hp.n_layer, n_taps);
  c.mask_token_id = hp.n_vocab - 1;
  c.vocab_size = hp.n_vocab;
  c.rms_eps = hp.rms_eps;
  c.rope_theta = hp.rope_theta;
  return c;
}

void write_random_dflash_drafter(const DFlashConfig& c, const std::string& dir, uint64_t seed) {
  std::filesystem::create_directories(dir);
  const std::string cfg_path = dir + "/config.json";
  {
    std::ofstream f(cfg_path, std::ios::trunc);
    if (!(f << dflash_config_json(c)) || !f.flush()) throw FormatError(cfg_path + ": cannot write");
  }
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> store;
  std::vector<SafetensorsEntry> entries;
  // Matrices ~ N(0, 1/cols), so activations keep their scale; norms ~ 1 + N(0, 0.1).
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols) {
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(cols)));
    std::vector<float>& v = store.emplace_back(size_t(rows * cols));
    for (float& x : v) x = nd(rng);
    entries.push_back({name, {rows, cols}, v, DType::F16});
  };
  auto norm = [&](const std::string& name, int64_t n) {
    std::normal_distribution<float> nd(1.0f, 0.1f);
    std::vector<float>& v = store.emplace_back(size_t(n));
    for (float& x : v) x = nd(rng);
    entries.push_back({name, {n}, v, DType::F16});
  };
  store.reserve(size_t(c.n_layer) * 11 + 3);
  const int64_t H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim(), F = c.intermediate_size;
  matrix("fc.weight", H, H * c.n_taps());
  norm("hidden_norm.weight", H);
  norm("norm.weight", H);
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string p = "layers." + std::to_string(il) + ".";
    norm(p + "input_layernorm.weight", H);
    norm(p + "post_attention_layernorm.weight", H);
    norm(p + "self_attn.q_norm.weight", c.head_dim);
    norm(p + "self_attn.k_norm.weight", c.head_dim);
    matrix(p + "self_attn.q_proj.weight", Q, H);
    matrix(p + "self_attn.k_proj.weight", KV, H);
    matrix(p + "self_attn.v_proj.weight", KV, H);
    matrix(p + "self_attn.o_proj.weight", H, Q);
    matrix(p + "mlp.gate_proj.weight", F, H);
    matrix(p + "mlp.up_proj.weight", F, H);
    matrix(p + "mlp.down_proj.weight", H, F);
  }
  write_safetensors(dir + "/model.safetensors", entries, {{"format", "pt"}});
}

}  // namespace specmesh
