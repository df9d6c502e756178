// The topology file: which models, devices, nodes (processes) and pipeline stages make up a
// specmesh deployment, and how it generates. Parsed from TOML; every error names the file,
// the line and the key.
#pragma once

#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "specmesh/devices/profile.hpp"

namespace specmesh {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ModelSpec {
  std::string name;
  std::string path;       // resolved against the config file's folder
  std::string tokenizer;  // llama2.c checkpoints only
};

struct NodeSpec {
  std::string name;
  std::string endpoint;  // inproc:// nodes live in the head's process
  bool head = false;
};

struct DeviceSpec {
  std::string name;
  std::string node;
  int threads = 1;
  std::optional<DeviceProfile> profile;
};

struct StageSpec {
  std::string model;
  std::string device;
  int layer_begin = -1;   // explicit range, or
  int layer_end = -1;
  double fraction = 0;    // a share of the model's layers, resolved by resolve_layers()
  int line = 0;           // for error messages
};

struct RunSpec {
  std::string model;             // the target the head generates with
  std::string strategy = "ar";   // ar | spec | pipeinfer
  std::string draft;             // draft model (spec / pipeinfer)
  int n_predict = 128;
  int n_ctx = 0;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  std::map<std::string, double> params;  // strategy parameters (n_draft, cutoffs, ...)
  std::string metrics_csv;               // append one row of metrics per generation
};

struct Topology {
  std::string path;
  RunSpec run;
  std::map<std::string, ModelSpec> models;
  std::map<std::string, NodeSpec> nodes;
  std::map<std::string, DeviceSpec> devices;
  std::vector<StageSpec> stages;  // pipeline order
  LinkProfile link;               // applied to every inter-node hop (zero: unshaped)
  std::string head_node;

  static Topology load(const std::string& path);   // throws ConfigError
  static Topology parse(const std::string& text, const std::string& path_for_errors,
                        const std::string& base_dir);

  // Turns fractions into explicit layer ranges for a model of n_layer layers and checks that
  // the stages of `model` cover [0, n_layer) in order; throws ConfigError.
  void resolve_layers(const std::string& model, int n_layer);

  std::vector<const StageSpec*> stages_of(const std::string& model) const;
  const NodeSpec& node_of_device(const std::string& device) const;
};

}  // namespace specmesh
