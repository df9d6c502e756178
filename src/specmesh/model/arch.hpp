// What differs between the supported transformer architectures. Each has a file of its own
// (arch_llama.cpp, arch_qwen2.cpp, arch_qwen3.cpp) that says which extra attention tensors a
// layer loads and what they do to a token's q, k, v between the projections and RoPE; the
// loader and the forward pass ask this table rather than switching on the architecture.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "specmesh/kernels/ops.hpp"

namespace specmesh {

enum class Arch { Llama, Qwen2, Qwen3 };

struct HParams;
struct LayerWeights;

// Reads a 1-D F32 tensor of n values by its GGUF name (throws when missing or misshapen).
using VectorLoader = std::function<const float*(const std::string& name, int64_t n)>;

struct ArchSpec {
  Arch arch;
  const char* name;  // GGUF general.architecture
  RopeStyle rope;
  // Loads the layer's architecture-specific tensors; `prefix` is "blk.N.".
  void (*load_layer)(const VectorLoader& vec, const std::string& prefix, const HParams& hp, LayerWeights& w);
  // Applies them to one token's q, k and v of KV heads [kv_begin, kv_end) (all of them, or a
  // tensor-parallel rank's): k and v hold those heads (head_dim each), q their query heads.
  void (*shape_qkv)(const HParams& hp, const LayerWeights& w, int kv_begin, int kv_end, float* q, float* k, float* v);
};

const ArchSpec& arch_spec(Arch a);
// nullptr for an unknown name.
const ArchSpec* find_arch(std::string_view name);
const char* arch_name(Arch a);
// "llama, qwen2, qwen3"
std::string arch_names();

// The architecture specs, one per file.
extern const ArchSpec kLlamaArch;
extern const ArchSpec kQwen2Arch;
extern const ArchSpec kQwen3Arch;

}  // namespace specmesh
