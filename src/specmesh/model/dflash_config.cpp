#include "specmesh/model/dflash_config.hpp"

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "specmesh/formats/mapped_file.hpp"

namespace specmesh {

namespace {

using nlohmann::json;

// nlohmann-json keeps no source positions, so the line of a key is found in the text: the
// first quoted occurrence of each path component after the previous one. For the flat objects
// of a config this is the key's own line.
int line_of(const std::string& text, const std::vector<std::string>& path) {
  size_t at = 0;
  for (const std::string& part : path) {
    const size_t found = text.find("\"" + part + "\"", at);
    if (found == std::string::npos) return 0;
    at = found;
  }
  int line = 1;
  for (size_t i = 0; i < at; ++i) line += text[i] == '\n';
  return line;
}

class Reader {
 public:
  Reader(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  [[noreturn]] void fail(const std::vector<std::string>& key, const std::string& what) const {
    std::string name;
    for (const std::string& k : key) name += (name.empty() ? "" : ".") + k;
    const int line = line_of(text_, key);
    throw FormatError(path_ + (line ? ":" + std::to_string(line) : "") + ": " + name + ": " + what);
  }

  // The value at `key`, nullptr when absent (or null).
  const json* find(const json& root, const std::vector<std::string>& key) const {
    const json* v = &root;
    for (const std::string& k : key) {
      if (!v->is_object() || !v->contains(k)) return nullptr;
      v = &(*v)[k];
    }
    return v->is_null() ? nullptr : v;
  }

  int64_t integer(const json& root, const std::vector<std::string>& key, int64_t min, int64_t fallback = -1,
                  bool required = true) const {
    const json* v = find(root, key);
    if (!v) {
      if (required) fail(key, "missing");
      return fallback;
    }
    if (!v->is_number_integer()) fail(key, "must be an integer, is " + v->dump());
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      fail(key, "is out of range");
    const int64_t i = v->get<int64_t>();
    if (i < min) fail(key, "must be at least " + std::to_string(min) + ", is " + std::to_string(i));
    return i;
  }

  int small(const json& root, const std::vector<std::string>& key, int64_t fallback = -1, bool required = true) const {
    const int64_t i = integer(root, key, 1, fallback, required);
    if (i > (int64_t(1) << 20)) fail(key, "is implausibly large (" + std::to_string(i) + ")");
    return int(i);
  }

  float positive(const json& root, const std::vector<std::string>& key, float fallback) const {
    const json* v = find(root, key);
    if (!v) return fallback;
    if (!v->is_number()) fail(key, "must be a number, is " + v->dump());
    const double d = v->get<double>();
    if (!(d > 0) || !std::isfinite(d)) fail(key, "must be a positive number, is " + v->dump());
    return float(d);
  }

 private:
  const std::string& text_;
  const std::string& path_;
};

}  // namespace

std::vector<int> dflash_default_target_layers(int n_target, int n) {
  if (n == 1) return {n_target / 2};
  const double start = 1, end = n_target - 3, span = end - start;
  std::vector<int> ids;
  for (int i = 0; i < n; ++i) ids.push_back(int(std::nearbyint(start + i * span / (n - 1))));
  return ids;
}

std::string dflash_config_json(const DFlashConfig& c) {
  json j = {{"architectures", {"DFlashDraftModel"}},
            {"model_type", "qwen3"},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.n_layer},
            {"num_attention_heads", c.n_head},
            {"num_key_value_heads", c.n_head_kv},
            {"head_dim", c.head_dim},
            {"block_size", c.block_size},
            {"num_target_layers", c.num_target_layers},
            {"dflash_config", {{"mask_token_id", c.mask_token_id}, {"target_layer_ids", c.target_layer_ids}}},
            {"rms_norm_eps", c.rms_eps},
            {"rope_theta", c.rope_theta},
            {"rope_scaling", nullptr},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"layer_types", std::vector<std::string>(size_t(c.n_layer), "full_attention")}};
  if (c.vocab_size) j["vocab_size"] = c.vocab_size;
  return j.dump(2) + "\n";
}

DFlashConfig parse_dflash_config(const std::string& text, const std::string& path) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    throw FormatError(path + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) throw FormatError(path + ": not a JSON object");
  const Reader r(text, path);

  DFlashConfig c;
  c.hidden_size = r.small(root, {"hidden_size"});
  c.intermediate_size = r.small(root, {"intermediate_size"});
  c.n_layer = r.small(root, {"num_hidden_layers"});
  c.n_head = r.small(root, {"num_attention_heads"});
  c.n_head_kv = r.small(root, {"num_key_value_heads"}, c.n_head, false);
  if (c.n_head % c.n_head_kv != 0)
    r.fail({"num_key_value_heads"}, std::to_string(c.n_head_kv) + " does not divide num_attention_heads " +
                                        std::to_string(c.n_head));
  if (!r.find(root, {"head_dim"}) && c.hidden_size % c.n_head != 0)
    r.fail({"num_attention_heads"}, "does not divide hidden_size and there is no head_dim");
  c.head_dim = r.small(root, {"head_dim"}, c.hidden_size / c.n_head, false);
  if (c.head_dim % 2 != 0) r.fail({"head_dim"}, "must be even for RoPE, is " + std::to_string(c.head_dim));
  c.block_size = r.small(root, {"block_size"});
  if (c.block_size < 2) r.fail({"block_size"}, "must be at least 2 (an anchor and a proposal)");
  c.num_target_layers = r.small(root, {"num_target_layers"});
  c.mask_token_id = r.integer(root, {"dflash_config", "mask_token_id"}, 0);
  c.vocab_size = r.integer(root, {"vocab_size"}, 1, 0, false);
  c.rms_eps = r.positive(root, {"rms_norm_eps"}, 1e-6f);
  c.rope_theta = r.positive(root, {"rope_theta"}, 10000.0f);

  if (const json* ids = r.find(root, {"dflash_config", "target_layer_ids"})) {
    if (!ids->is_array() || ids->empty()) r.fail({"dflash_config", "target_layer_ids"}, "must be a non-empty array of layer ids");
    for (const json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= c.num_target_layers)
        r.fail({"dflash_config", "target_layer_ids"},
               "entry " + id.dump() + " is not a layer of the " + std::to_string(c.num_target_layers) +
                   "-layer target (num_target_layers)");
      c.target_layer_ids.push_back(int(id.get<int64_t>()));
    }
  } else {
    c.target_layer_ids = dflash_default_target_layers(c.num_target_layers, c.n_layer);
    for (int id : c.target_layer_ids)
      if (id < 0 || id >= c.num_target_layers)
        r.fail({"num_target_layers"}, "too few layers for the default taps; give dflash_config.target_layer_ids");
  }

  if (const json* types = r.find(root, {"layer_types"})) {
    if (!types->is_array() || types->size() != size_t(c.n_layer))
      r.fail({"layer_types"}, "must list one type for each of the " + std::to_string(c.n_layer) + " layers");
    for (const json& t : *types)
      if (t != "full_attention")
        r.fail({"layer_types"}, "layer type " + t.dump() + " is not supported (only full_attention)");
  }
  if (const json* act = r.find(root, {"hidden_act"}); act && *act != "silu")
    r.fail({"hidden_act"}, act->dump() + " is not supported (only silu)");
  if (const json* bias = r.find(root, {"attention_bias"}); bias && *bias != false)
    r.fail({"attention_bias"}, "attention biases are not supported");
  if (r.find(root, {"rope_scaling"})) r.fail({"rope_scaling"}, "RoPE scaling is not supported (must be null)");
  return c;
}

}  // namespace specmesh
