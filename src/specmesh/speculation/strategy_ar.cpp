// Plain autoregression through the target pipeline: one run per token. The reference every
// other strategy must reproduce token for token.
#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {

class Autoregressive final : public Strategy {
 public:
  explicit Autoregressive(StrategyHost& h) : h_(h) {}
  void start() override { awaited_ = feed(h_, kTargetRole, cached_, h_.prompt(), 1); }
  void on_logits(uint64_t run, const Logits& l) override {
    if (run != awaited_) return;  // an earlier prefill chunk
    auto row = rows_of(l, 1, h_.vocab(), run);
    if (!h_.accept(h_.sampler().sample(row.data(), h_.vocab()))) return;
    awaited_ = feed(h_, kTargetRole, cached_, {h_.tokens().back()}, 1);
  }

 private:
  StrategyHost& h_;
  std::vector<int32_t> cached_;
  uint64_t awaited_ = 0;
};

}  // namespace

StrategyInfo strategy_info_ar() {
  StrategyInfo s;
  s.name = "ar";
  s.summary = "one target run per token";
  s.roles = {kTargetRole};
  s.default_for_roles = true;
  s.make = [](StrategyHost& h) { return std::make_unique<Autoregressive>(h); };
  return s;
}

}  // namespace specmesh
