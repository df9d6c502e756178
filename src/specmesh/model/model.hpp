// A loaded transformer: hyper-parameters, weight views into the mapped file, tokenizer.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "specmesh/formats/mapped_file.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/ops.hpp"
#include "specmesh/kernels/packed_weights.hpp"
#include "specmesh/model/arch.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

class GgufFile;

struct HParams {
  Arch arch = Arch::Llama;
  int n_vocab = 0;
  int n_embd = 0;
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  int n_ff = 0;
  int n_ctx_train = 0;
  int n_rot = 0;
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeStyle rope = RopeStyle::Interleaved;

  int q_dim() const { return n_head * head_dim; }
  int kv_dim() const { return n_head_kv * head_dim; }
};

// A 1-D tensor (norm weights, biases) is always F32 after loading. The architecture-specific
// ones are loaded and applied by the layer's ArchSpec (model/arch_*.cpp).
struct LayerWeights {
  const float* attn_norm = nullptr;
  WeightView wq{}, wk{}, wv{}, wo{};
  const float* bq = nullptr;      // qwen2
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* q_norm = nullptr;  // qwen3, per head
  const float* k_norm = nullptr;
  const float* ffn_norm = nullptr;
  WeightView w_gate{}, w_up{}, w_down{};
};

class Model {
 public:
  // Loads a GGUF file, or a llama2.c checkpoint (then tokenizer_path names its tok*.bin).
  static std::unique_ptr<Model> load(const std::string& path, const std::string& tokenizer_path = "");
  // The same from a file's bytes (mapped, or MappedFile::copy_of bytes in memory); a llama2.c
  // checkpoint needs its tokenizer file's bytes too, a GGUF file ignores `tokenizer`.
  static std::unique_ptr<Model> load(MappedFile file, const MappedFile* tokenizer = nullptr);

  const HParams& hparams() const { return hp_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::string& path() const { return path_; }
  const std::string& format() const { return format_; }  // "gguf" or "llama2c"

  WeightView tok_embd{};
  const float* output_norm = nullptr;
  WeightView output{};
  std::vector<LayerWeights> layers;

  // Bytes of weights one decode step reads (all matrices, the classifier, one embedding row).
  size_t weight_bytes_per_token() const;

  // Llama2.c models stop at BOS (as run.c does); GGUF models at the vocabulary's EOG tokens.
  bool stops_at(int32_t token) const;

 private:
  Model() = default;
  void load_gguf(MappedFile file);
  void load_llama2c(MappedFile file, const MappedFile* tokenizer);
  void pack_for_kernels();

  HParams hp_;
  std::string path_;
  std::string format_;
  std::shared_ptr<GgufFile> gguf_;
  MappedFile map_;                       // llama2.c checkpoints
  std::vector<std::vector<float>> owned_;  // 1-D tensors converted to F32
  std::vector<PackedWeights> packed_;      // matrices as the matmul kernels read them
  std::unique_ptr<Tokenizer> tokenizer_;
};

}  // namespace specmesh
