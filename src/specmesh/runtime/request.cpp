#include "specmesh/runtime/request.hpp"

#include <set>
#include <stdexcept>

namespace specmesh {

RequestStrategy request_strategy(const Topology& topo, int n_ctx, const GenerationRequest& request) {
  if (request.strategy.empty() && request.params.empty()) return {};
  const StrategyInfo& configured = strategy(topo.run.strategy);
  const StrategyInfo& info = request.strategy.empty() ? configured : strategy(request.strategy);
  const std::set<std::string> roles = topo.roles();
  // A device pair is built for one strategy: the stages of the pair cannot run another's runs.
  if (info.pair_role != configured.pair_role)
    throw std::invalid_argument(
        "strategy \"" + info.name + "\" cannot run here: " +
        (configured.pair_role.empty() ? "it pairs the target with role \"" + info.pair_role + "\", which this setup does not build"
                                      : "this setup pairs the target's devices for strategy \"" + configured.name + "\""));
  // A block drafter's stage is built for the strategy that drafts with it: another strategy's
  // runs cannot use it as a draft model, and a block-drafting strategy needs it built.
  if (!info.drafter_role.empty() && info.drafter_role != configured.drafter_role)
    throw std::invalid_argument("strategy \"" + info.name + "\" cannot run here: it drafts with a block drafter in role \"" +
                                info.drafter_role + "\", which this setup does not build (its strategy is \"" +
                                configured.name + "\")");
  RequestStrategy out;
  out.info = &info;
  out.params = info.resolve_text(&info == &configured ? topo.run.params : std::map<std::string, ParamValue>{}, request.params);
  for (const std::string& role : info.needed_roles(out.params)) {
    if (role == configured.drafter_role && role != info.drafter_role)
      throw std::invalid_argument("strategy \"" + info.name + "\" cannot run here: it needs a model for role \"" + role +
                                  "\", which this setup runs as a block drafter (for strategy \"" + configured.name + "\")");
    if (!roles.count(role)) {
      std::string have;
      for (const std::string& r : roles) have += (have.empty() ? "" : ", ") + r;
      throw std::invalid_argument("strategy \"" + info.name + "\" needs a pipeline for role \"" + role +
                                  "\", which this setup does not have (roles: " + have + ")");
    }
  }
  if (info.check) {
    try {
      info.check(out.params, SetupFacts{n_ctx, roles});
    } catch (const ParamConflict& c) {
      throw std::invalid_argument("parameter " + c.key + ": " + c.what());
    }
  }
  return out;
}

}  // namespace specmesh
