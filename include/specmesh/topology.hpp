// The configuration of a specmesh deployment: which models, devices, nodes (processes) and
// pipeline stages it has, and how it generates. Plain data: fill it in code
// (Topology::single_process is the usual start), or load it from a TOML topology file, whose
// errors name the file, the line and the key.
//
// The head generates through pipelines, one per role: "target" (run.model), "draft"
// (run.draft) and whatever else a strategy needs ([run.roles], e.g. draft2 = "small").
#pragma once

#include <map>
#include <set>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "specmesh/profiles.hpp"

namespace specmesh {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ModelSpec {
  std::string name;
  std::string path;       // relative paths are resolved against the config file's folder
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
  // A standby runs no stage until a stage's node stops answering; the head then moves that
  // node's stages onto it and the generation goes on (failover). Stages never name it.
  bool standby = false;
};

struct StageSpec {
  std::string model;
  std::string role;       // the pipeline it belongs to; empty: every role whose model is `model`
                          // and that has no stages tagged with its name
  std::string device;
  // Further devices of a tensor-parallel stage, ranks 1.. (`device` is rank 0), on the same
  // node: each computes its share of every layer (so far, the groups of strategy alspec).
  std::vector<std::string> tensor_parallel;
  int layer_begin = -1;   // explicit range, or
  int layer_end = -1;
  double fraction = 0;    // a share of the model's layers, resolved by resolve_layers()
  int line = 0;           // for error messages
};

// A strategy parameter's value: a number (ints and bools as numbers, true = 1) or a list of
// integers (a tree's children per depth, "1,1,3"). `params["n_draft"] = 8` and
// `params["tree"] = std::vector<int>{1, 1, 3}` both work.
struct ParamValue {
  double number = 0;
  std::vector<int> list;
  bool is_list = false;
  ParamValue(double v = 0) : number(v) {}
  ParamValue(std::vector<int> l) : list(std::move(l)), is_list(true) {}
  friend bool operator==(const ParamValue&, const ParamValue&) = default;
};

struct RunSpec {
  std::string model;             // the target the head generates with (role "target")
  std::string strategy;          // a registered strategy; empty: the default for the roles present
  std::string draft;             // the draft model (role "draft"), if any
  std::map<std::string, std::string> roles;  // further roles -> model (draft2, retrieval, ...)
  int n_predict = 128;
  int n_ctx = 0;
  std::string kv_type = "f16";   // how KV caches store keys and values: "f16", "q8_0" or "f32"
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  std::map<std::string, ParamValue> params;  // strategy parameters, checked against its schema
  std::string metrics_csv;               // append one row of metrics per generation
};

// [security]: keys for tcp:// nodes, and whether they may listen beyond loopback.
//   keys = "keys"         a directory (relative to the file's folder) holding NODE.key (public)
//                         and NODE.key_secret (mode 0600) for every node: `specmesh keygen
//                         --topology FILE` writes them. tcp:// always runs CURVE, so a topology
//                         with tcp:// nodes needs keys, except under `specmesh run --spawn`,
//                         which makes throwaway ones.
//   allow_remote = true   tcp:// nodes may bind addresses other than loopback (needs keys).
struct SecuritySpec {
  std::string keys;
  bool allow_remote = false;
};

struct Topology {
  std::string path;
  RunSpec run;
  std::map<std::string, ModelSpec> models;
  std::map<std::string, NodeSpec> nodes;
  std::map<std::string, DeviceSpec> devices;
  std::vector<StageSpec> stages;  // pipeline order
  LinkProfile link;               // applied to every inter-node hop (zero: unshaped)
  SecuritySpec security;
  std::string head_node;

  std::map<std::string, int> lines;  // key -> line in the file, for errors found after parsing

  static Topology load(const std::string& path);   // throws ConfigError
  static Topology parse(const std::string& text, const std::string& path_for_errors,
                        const std::string& base_dir);
  // Everything in one process: the target on a device with `threads` threads, and each other
  // role's model (e.g. {"draft", ...}) on a single-thread device of its own.
  static Topology single_process(const ModelSpec& target, const std::map<std::string, ModelSpec>& roles = {},
                                 int threads = 1);

  // Checks what parsing cannot see alone: the strategy is registered, it has a pipeline for
  // every role it needs, its parameters fit its schema, every role has stages. Fills in the
  // default strategy and stages. Throws ConfigError ("file:line: key: what").
  void check();

  // Every role and its model: "target", "draft" when set, then run.roles.
  std::map<std::string, std::string> role_models() const;
  // The roles of role_models().
  std::set<std::string> roles() const;
  // The key that names a role's model: run.model, run.draft or run.roles.NAME.
  static std::string role_key(const std::string& role);
  // Throws ConfigError "file:line: key: what", with the line of `key` (or of its table) when
  // the file gave one; for checks made after parsing, once the models are known.
  [[noreturn]] void fail(const std::string& key, const std::string& what) const;

  // Turns fractions into explicit layer ranges for a role's model of n_layer layers and checks
  // that the role's stages cover [0, n_layer) in order; throws ConfigError.
  void resolve_layers(const std::string& role, int n_layer);

  std::vector<const StageSpec*> stages_of(const std::string& role) const;
  const NodeSpec& node_of_device(const std::string& device) const;
};

}  // namespace specmesh
