// Synthetic (random-weight) models in GGUF: any size and layout of the llama / qwen2 / qwen3
// families, for tests and benchmarks that need a real file but not a trained model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

struct SyntheticSpec {
  std::string arch = "llama";  // llama | qwen2 | qwen3
  int n_vocab = 512;           // ignored when vocab_from is set: the copied vocabulary decides
  int n_embd = 64;
  int n_layer = 2;
  int n_head = 4;
  int n_head_kv = 2;
  int head_dim = 0;            // 0 = n_embd / n_head
  int n_ff = 128;
  int n_ctx = 512;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  DType weight_type = DType::F32;  // 2-D weights; a row length that is not a multiple of the
                                   // block size falls back to F16, as llama.cpp's quantizer does
  DType embd_type = DType::F32;    // token_embd.weight (same fallback)
  bool tied_output = false;        // no output.weight: the classifier is token_embd
  uint64_t seed = 1;
  std::string vocab_from;  // optional GGUF (its tokenizer.* keys are copied) or llama2.c tok*.bin
  int n_threads = 0;       // 0 = all hardware threads
};

// Named shapes: tinyllama-1.1b, stories260k, tiny-llama, tiny-qwen2, tiny-qwen3, qwen2.5-0.5b,
// qwen3-0.6b. Types, seed and vocab_from keep their defaults.
std::optional<SyntheticSpec> synthetic_preset(std::string_view name);
std::vector<std::string> synthetic_preset_names();

// Throws std::invalid_argument on an impossible spec (e.g. n_head not a multiple of
// n_head_kv, a synthetic vocabulary smaller than 259 tokens), FormatError when vocab_from
// cannot be read, std::runtime_error on I/O failure.
void write_synthetic_model(const SyntheticSpec& spec, const std::string& path);

// The LlamaFileType value (general.file_type) of a model whose matrices are mostly `type`.
uint32_t llama_file_type(DType type);

}  // namespace specmesh
