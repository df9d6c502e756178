// The config.json of a DFlash drafter, in the layout z-lab publishes (a Hugging Face Qwen3
// config plus the DFlash fields):
//
//   hidden_size, intermediate_size, num_hidden_layers, num_attention_heads      required
//   num_key_value_heads (default: num_attention_heads), head_dim (default: hidden / heads)
//   block_size, num_target_layers                                               required
//   dflash_config.mask_token_id                                                 required
//   dflash_config.target_layer_ids  (default: z-lab's build_target_layer_ids(num_target_layers,
//                                    num_hidden_layers): [L/2] for one tap, else n ids evenly
//                                    spaced from 1 to L-3, rounded half to even)
//   rms_norm_eps (1e-6), rope_theta (10000), vocab_size (optional; when given it must be the
//   target's), layer_types (every entry "full_attention"), hidden_act ("silu"),
//   attention_bias (false), rope_scaling (null): anything else is refused as unsupported.
//
// Errors name the file, the line of the key when it is present, and the key:
// "DIR/config.json:12: dflash_config.mask_token_id: must be a non-negative integer".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace specmesh {

struct DFlashConfig {
  int hidden_size = 0;
  int intermediate_size = 0;
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  int block_size = 0;
  int num_target_layers = 0;
  std::vector<int> target_layer_ids;
  int64_t mask_token_id = -1;
  int64_t vocab_size = 0;  // 0 when the config does not say
  float rms_eps = 1e-6f;
  float rope_theta = 10000.0f;

  int n_taps() const { return int(target_layer_ids.size()); }
  int q_dim() const { return n_head * head_dim; }
  int kv_dim() const { return n_head_kv * head_dim; }
};

// Parses `text` (the contents of `path`); throws FormatError naming path, line and key.
DFlashConfig parse_dflash_config(const std::string& text, const std::string& path);

// The config as config.json text in the published layout (parse_dflash_config reads it back).
std::string dflash_config_json(const DFlashConfig& c);

// z-lab's default tap layers for a target of n_target layers and n taps.
std::vector<int> dflash_default_target_layers(int n_target, int n);

}  // namespace specmesh
