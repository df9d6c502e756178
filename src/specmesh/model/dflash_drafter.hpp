// A DFlash drafter: a stack of Qwen3-style layers with non-causal attention that proposes a
// whole block of tokens from the target's hidden states (z-lab's DFlashDraftModel).
//
// Files: DIR/config.json (dflash_config.hpp) and DIR/model.safetensors with, for layer N,
//   layers.N.input_layernorm.weight [H]        layers.N.post_attention_layernorm.weight [H]
//   layers.N.self_attn.q_proj.weight [q, H]    layers.N.self_attn.k_proj.weight [kv, H]
//   layers.N.self_attn.v_proj.weight [kv, H]   layers.N.self_attn.o_proj.weight [H, q]
//   layers.N.self_attn.q_norm.weight [D]       layers.N.self_attn.k_norm.weight [D]
//   layers.N.mlp.gate_proj.weight [F, H]       layers.N.mlp.up_proj.weight [F, H]
//   layers.N.mlp.down_proj.weight [H, F]
// and fc.weight [H, n_taps * H], hidden_norm.weight [H], norm.weight [H]; F32, F16 or BF16.
//
// The drafter has no embedding or classifier: it borrows the target's. The mask token of the
// block is dflash_config.mask_token_id, a row of the target's embedding table (Qwen3 targets
// keep padded rows for it). Format extension, for a target whose vocabulary has no spare row
// (the stories models' 512 tokens): the file may hold `mask_embedding` [H], the drafter's own
// embedding of the mask token; then mask_token_id must equal the target's vocabulary size, an
// id no real token has. A file without it must name a mask id inside the target's vocabulary.
//
// The forward pass, per step (DFlashState::step):
//   ctx = hidden_norm(fc(taps))   for the new context rows: tap i is the residual stream after
//                                 target layer target_layer_ids[i] (HF hidden_states[i + 1])
//   x = the block's embeddings    [anchor, mask, ..., mask] at positions start .. start+B-1
//   every layer: h = input_layernorm(x); q = RoPE(q_norm(W_q h)) at the block positions;
//     K, V of the new context rows (k = RoPE(k_norm(W_k ctx)), v = W_v ctx) join the cache;
//     K, V of the block rows (from h) are used for this step only; attention of the block's
//     queries over [cached context; block] with no mask; x += W_o att; x += MLP(post_norm(x))
//   out = norm(x): row i predicts the token at position start + i (rows 1..B-1 are proposals).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "specmesh/formats/safetensors.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/model/dflash_config.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/profiles.hpp"

namespace specmesh {

class ThreadPool;

struct DFlashLayer {
  const float* attn_norm = nullptr;  // input_layernorm
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* ffn_norm = nullptr;   // post_attention_layernorm
  WeightView wq{}, wk{}, wv{}, wo{}, w_gate{}, w_up{}, w_down{};
};

class DFlashDrafter {
 public:
  // Loads DIR/config.json and DIR/model.safetensors and checks they agree: every tensor present
  // with its shape, no tensor left over. Throws FormatError naming the file and the defect.
  static std::unique_ptr<DFlashDrafter> load(const std::string& dir);

  // Checks the drafter fits `target`: hidden size, layer count and taps, vocabulary, mask id.
  // Throws FormatError naming the drafter's file and the defect.
  void check_target(const Model& target) const;

  const DFlashConfig& config() const { return cfg_; }
  const std::string& dir() const { return dir_; }
  int n_taps() const { return cfg_.n_taps(); }
  int block_size() const { return cfg_.block_size; }

  // The drafter's own mask embedding (H values), nullptr when the mask is a target row.
  const float* mask_embedding() const { return mask_embd_; }
  // Embeddings of the block [anchor, mask x (n - 1)] into out (n x H), through the target's
  // table (check_target must have accepted it).
  void embed_block(const Model& target, int32_t anchor, int n, float* out) const;
  // What one step costs (DFlashState::step with n_new context rows over a cache of n_ctx rows
  // and an n_block-row block), plus the target's classifier over `outputs` rows, for timing
  // profiles and run deadlines.
  WorkCost cost(const Model& target, size_t n_new, size_t n_block, size_t n_ctx, size_t outputs) const;

  WeightView fc{};
  const float* hidden_norm = nullptr;
  const float* norm = nullptr;
  std::vector<DFlashLayer> layers;

 private:
  DFlashDrafter() = default;

  std::string dir_;
  std::string config_path_;
  DFlashConfig cfg_;
  std::unique_ptr<SafetensorsFile> weights_;
  std::vector<std::vector<float>> owned_;  // 1-D tensors as F32
  const float* mask_embd_ = nullptr;
};

// The draft cache of one sequence and the drafter's scratch. The cache holds the K and V of
// context rows only (K after k_norm and RoPE, V raw), one row per target position whose hidden
// states were given; block rows are never cached. With a window W (0: none) a block attends to
// the latest W context rows and itself, so a step's cost stops growing with the context (keys
// keep their absolute RoPE positions); the cache keeps kCropSlack rows more, so a crop of up to
// that many rows (a rejected block) still finds them.
class DFlashState {
 public:
  static constexpr size_t kCropSlack = 64;
  DFlashState(const DFlashDrafter& drafter, ThreadPool& pool, size_t window = 0);

  // Context rows given so far: the positions [0, n_ctx()); the cache holds [first(), n_ctx()).
  size_t n_ctx() const { return n_ctx_; }
  size_t first() const { return first_; }
  // Drops the context rows from position n on (first() <= n <= n_ctx()).
  void crop(size_t n);
  // A context shift: the rows at positions [n_keep, n_keep + n_discard) go, the later ones move
  // down by n_discard (their keys re-rotated), as the target's cache does it.
  void shift(size_t n_keep, size_t n_discard);

  // Appends n_new context rows, from taps (n_new x n_taps*H: row r holds the taps of position
  // n_ctx() + r in config order), then runs the block `embd` (n_block x H) at positions
  // [n_ctx(), n_ctx() + n_block) and returns its output (n_block x H, after the final norm).
  const std::vector<float>& step(const float* taps, size_t n_new, const float* embd, size_t n_block);

 private:
  const DFlashDrafter& d_;
  ThreadPool& pool_;
  size_t window_ = 0;
  size_t n_ctx_ = 0;
  size_t first_ = 0;
  std::vector<std::vector<float>> k_, v_;  // per layer: context rows, then this step's block rows
  std::vector<float> ctx_, x_, h_, q_, kv_tmp_, att_, proj_, gate_, up_, out_;
  std::vector<int32_t> cells_;
};

}  // namespace specmesh
