// Strategy parameters on a command line: `--param key=value` (repeatable) for any registered
// parameter, and each parameter's classic flags (`--n-draft 4`, `--pa 0.3`, `--no-cancel`) as
// aliases, all taken from the strategy registry's schemas.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "specmesh/topology.hpp"

namespace specmesh {

// A CLI11 check for a finite number in [lo, hi]. CLI11's own Range and NonNegativeNumber let
// nan through (every comparison with it is false).
CLI::Validator finite_in(double lo, double hi);

// Adds --kv-type (f16, q8_0 or f32: how the KV cache stores keys and values) to `cmd`; the
// value is written to `kv_type` in lower case. `default_text` says what applies without it.
void add_kv_type_option(CLI::App& cmd, std::string& kv_type, const std::string& default_text);

class ParamOptions {
 public:
  // Adds --param and every parameter's flags to `cmd`.
  void add_to(CLI::App& cmd);
  // The parameters given, checked against their specs; throws std::invalid_argument naming a malformed or
  // unknown one (unknown to every strategy; the chosen strategy checks its own set later).
  std::map<std::string, ParamValue> values(const CLI::App& cmd) const;

 private:
  std::vector<std::string> pairs_;                                   // --param key=value
  std::map<std::string, std::shared_ptr<std::string>> aliased_;     // parameter -> flag value
  std::map<std::string, std::shared_ptr<bool>> switched_;           // boolean parameter -> flag seen
  std::map<std::string, std::string> first_flag_;                   // parameter -> its first flag
};

// Command-line choices over a topology file's [run]: a strategy other than the file's starts
// from its defaults (the file's parameters are another strategy's), then `params` override.
void override_run(Topology& topo, const std::string& strategy, const std::map<std::string, ParamValue>& params);
// The same for the KV cache: n_ctx >= 0 and a non-empty kv_type replace the file's.
void override_cache(Topology& topo, int n_ctx, const std::string& kv_type);

}  // namespace specmesh
