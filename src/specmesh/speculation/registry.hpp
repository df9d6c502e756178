// The strategy registry: every decoding strategy with its name, the pipeline roles it needs
// and its parameter schema. The topology parser, the CLI, `specmesh strategies` and the
// README's table are all derived from it, so a new strategy is one file plus one line in
// strategies.def.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "specmesh/speculation/alspec_device.hpp"
#include "specmesh/speculation/params.hpp"
#include "specmesh/speculation/strategy.hpp"

namespace specmesh {

// What a setup offers a strategy beyond its parameters, for checks across them.
struct SetupFacts {
  int n_ctx = 0;                  // KV cells per pipeline; 0: not known yet
  std::set<std::string> roles;    // pipelines present
};

// A parameter value that does not fit the rest of the setup (another parameter, the context).
struct ParamConflict : std::invalid_argument {
  ParamConflict(std::string param, const std::string& what) : std::invalid_argument(what), key(std::move(param)) {}
  std::string key;
};

struct StrategyInfo {
  std::string name;
  std::string summary;                // one line: what the head does
  std::vector<std::string> roles;     // pipelines it needs, "target" first
  // Optional: the roles a configuration needs when a parameter leaves some of `roles` unused
  // (triforce without its draft). Unset: all of `roles`.
  std::function<std::vector<std::string>(const StrategyParams&)> roles_needed;
  std::vector<ParamSpec> params;
  // Chosen when no strategy is named: the default using the most of the roles present.
  bool default_for_roles = false;
  std::function<std::unique_ptr<Strategy>(StrategyHost&)> make;
  // Optional: throws ParamConflict when resolved parameters do not fit together or the setup.
  std::function<void(const StrategyParams&, const SetupFacts&)> check;
  // Attention-level speculation: the role whose pipeline pairs with the target's. Both run the
  // target's model on devices of their own, one stage each, and the runtime builds them as
  // the two groups of actors/alspec_stage with pair_settings(params). Empty: plain pipelines.
  std::string pair_role;
  std::function<AlspecSettings(const StrategyParams&)> pair_settings;
  // Block drafting on the target's hidden states: this role is a DFlash drafter (a directory in
  // the z-lab layout, not a model file), which the runtime builds as one actors/dflash_stage
  // that the target's stages send the drafter's tapped layers to. Its parameter `block`, when
  // 0, becomes the drafter's block size, `taps` (16 or 32) is the tapped states' precision on
  // the wire, and `window` (when it has one) bounds the draft cache. Empty: plain pipelines.
  std::string drafter_role;
  // KV sequences a session of this strategy uses (StrategyHost::sequences), for setups with
  // these roles. Unset: every sequence of the cache, so its sessions run one at a time.
  std::function<int(const StrategyParams&, const std::set<std::string>& roles)> sequences;
  // KV cells a session of this strategy may hold at once beyond one per position of its
  // context, in any pipeline's cache: cells of speculative branches or levels at positions
  // another of its sequences also holds. The head gives such a session that many positions
  // fewer than its share of the cache, so that no session ever takes another's cells. Unset: 0
  // (one cell per position: a chain).
  std::function<int(const StrategyParams&, const std::set<std::string>& roles)> spare_cells;
  // Its target runs are plain decode steps (one sequence, no speculation), which the head may
  // merge with other sessions' into one run (continuous batching).
  bool mergeable_runs = false;

  const ParamSpec* param(const std::string& key) const;
  // roles_needed(params) when set, else roles.
  std::vector<std::string> needed_roles(const StrategyParams& params) const;
  // sequences() when set, else kMaxSeqs; at least 1, at most kMaxSeqs.
  int sequences_for(const StrategyParams& params, const std::set<std::string>& roles) const;
  // spare_cells() when set, else 0.
  int spare_cells_for(const StrategyParams& params, const std::set<std::string>& roles) const;
  // Defaults for everything not given; throws std::invalid_argument naming an unknown key
  // or a value out of its range.
  StrategyParams resolve(const std::map<std::string, ParamValue>& given) const;
  // resolve() over `base` with `text` laid on top, each value parsed from text against its
  // spec as `--param KEY=VALUE` is; throws std::invalid_argument naming the bad key or value.
  StrategyParams resolve_text(std::map<std::string, ParamValue> base,
                              const std::vector<std::pair<std::string, std::string>>& text) const;
};

// Every registered strategy, in registration order.
const std::vector<StrategyInfo>& strategies();
const StrategyInfo* find_strategy(const std::string& name);
// Throws std::invalid_argument listing the registered names.
const StrategyInfo& strategy(const std::string& name);
// The strategy to use when none is named, for a setup with these pipeline roles, of which
// `drafter_roles` have block drafters (directories) for models: a strategy fits when it drafts
// with exactly those of its roles that are drafters.
const StrategyInfo& default_strategy(const std::set<std::string>& roles, const std::set<std::string>& drafter_roles = {});
// "ar, spec, pipeinfer"
std::string strategy_names();
// Every parameter of every strategy, once per name and meaning (strategies may share one, e.g.
// p_accept; a name two strategies use for different things, e.g. window, is listed twice, the
// first with its flags). same_param: the same name with the same help or the same flags.
std::vector<ParamSpec> all_params();
bool same_param(const ParamSpec& a, const ParamSpec& b);

// The README's table of strategies, roles and parameters (Markdown).
std::string strategies_markdown();
// A plain-text listing for `specmesh strategies`.
std::string strategies_text();

}  // namespace specmesh
