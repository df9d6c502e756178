// Attention-level speculation (ALSpec) on two device groups: the head decodes one token per
// run as ar does, while the runtime runs the target's pipeline and its partner's ("receiver")
// as a speculative pair (actors/alspec_stage): at each layer the sender hands the receiver a
// speculative attention output over the first and last `window` keys, the receiver goes on
// with it, and the sender's check (||spec - full|| < lambda ||full||) decides who holds the
// right state. With lambda = 0 (or force_miss) the output equals plain decoding with the same
// key split; a larger lambda accepts approximate attention for more overlap. Per-layer hits
// come back in a report before each token's logits.
#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {

constexpr const char* kReceiverRole = "receiver";

class AttentionLevel final : public Strategy {
 public:
  explicit AttentionLevel(StrategyHost& h) : h_(h), loop_(h) {}
  void start() override { loop_.start(); }
  void on_attention_report(uint64_t run, const AttentionSync& r) override {
    if (run != loop_.awaited() || r.kind != SyncKind::report || r.tensors.size() != 1) return;
    const std::vector<uint8_t> hits = r.tensors[0].data.to_vector<uint8_t>();
    if (layer_hits_.empty()) layer_hits_.assign(hits.size(), 0);
    if (hits.size() != layer_hits_.size()) throw std::runtime_error("ALSpec report: the layer count changed");
    SpecMetrics& m = h_.metrics();
    int n = 0;
    for (size_t l = 0; l < hits.size(); ++l) {
      layer_hits_[l] += hits[l] != 0;
      n += hits[l] != 0;
    }
    ++tokens_;
    m.attention_checks += int64_t(hits.size());
    m.attention_hits += n;
    m.overlap_saved_ms += r.saved_ms;
    m.token_hit_rates.push_back(hits.empty() ? 0.0 : double(n) / double(hits.size()));
    m.layer_hit_rates.resize(hits.size());
    for (size_t l = 0; l < hits.size(); ++l) m.layer_hit_rates[l] = double(layer_hits_[l]) / double(tokens_);
  }
  void on_logits(uint64_t run, const Logits& l) override { loop_.on_logits(run, l); }
  // The shift reaches the receiver's cache through the sender's group, in order with the runs.
  bool context_shifted(int n_keep, int n_discard) override { return loop_.context_shifted(n_keep, n_discard); }

 private:
  StrategyHost& h_;
  OneRunPerToken loop_;
  std::vector<int64_t> layer_hits_;
  int64_t tokens_ = 0;
};

}  // namespace

StrategyInfo strategy_info_alspec() {
  StrategyInfo s;
  s.name = "alspec";
  s.summary = "ALSpec: one target run per token, decoded layer by layer on two device groups (roles `target` and "
              "`receiver`, each with all layers and its own KV cache) that speculate on each other's attention: "
              "the sender hands a sink + `window` output to the receiver and keeps it when ||spec - full|| < "
              "`lambda` ||full||";
  s.roles = {kTargetRole, kReceiverRole};
  s.params = {
      {"lambda", ParamType::Float, 0, 1e6, 0.1, "accept a speculation when ||spec - full|| < lambda ||full||", {"--lambda"}},
      {"window", ParamType::Int, 1, 1 << 20, 128, "S: sink and window length of the speculative attention", {"--window"}},
      {"chunk", ParamType::Int, 0, 1 << 20, 0, "length of a middle chunk of the attention (0: the window)", {"--chunk"}},
      {"force_miss", ParamType::Bool, 0, 1, 0, "reject every speculation (plain attention on the pair; a baseline)",
       {"--force-miss"}},
      {"emulate_hit_rate", ParamType::Float, 0, 1, 0,
       "timing emulation: verdicts follow a fixed pattern with round(rate x layers) hits per token instead of "
       "lambda (outputs are then not plain decoding's); 0: off",
       {"--emulate-hit-rate"}},
  };
  s.pair_role = kReceiverRole;
  s.pair_settings = [](const StrategyParams& p) {
    AlspecSettings a;
    a.spec.layout.spec_len = size_t(p.integer("window"));
    a.spec.layout.chunk = size_t(p.integer("chunk") > 0 ? p.integer("chunk") : p.integer("window"));
    a.spec.lambda = p.real("lambda");
    a.force_miss = p.flag("force_miss");
    a.emulate_hit_rate = p.real("emulate_hit_rate");
    return a;
  };
  s.check = [](const StrategyParams& p, const SetupFacts& f) {
    if (f.n_ctx > 0 && p.integer("window") > f.n_ctx)
      throw ParamConflict("window", "window " + std::to_string(p.integer("window")) + " is longer than the context (" +
                                        std::to_string(f.n_ctx) + " tokens)");
  };
  s.make = [](StrategyHost& h) { return std::make_unique<AttentionLevel>(h); };
  return s;
}

}  // namespace specmesh
