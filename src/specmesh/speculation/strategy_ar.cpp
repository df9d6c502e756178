// Plain autoregression through the target pipeline: one run per token. The reference every
// other strategy must reproduce token for token.
#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {

class Autoregressive final : public Strategy {
 public:
  explicit Autoregressive(StrategyHost& h) : loop_(h) {}
  void start() override { loop_.start(); }
  void on_logits(uint64_t run, const Logits& l) override { loop_.on_logits(run, l); }
  bool context_shifted(int n_keep, int n_discard) override { return loop_.context_shifted(n_keep, n_discard); }

 private:
  OneRunPerToken loop_;
};

}  // namespace

StrategyInfo strategy_info_ar() {
  StrategyInfo s;
  s.name = "ar";
  s.summary = "one target run per token";
  s.roles = {kTargetRole};
  s.default_for_roles = true;
  s.sequences = [](const StrategyParams&, const std::set<std::string>&) { return 1; };
  s.mergeable_runs = true;
  s.make = [](StrategyHost& h) { return std::make_unique<Autoregressive>(h); };
  return s;
}

}  // namespace specmesh
