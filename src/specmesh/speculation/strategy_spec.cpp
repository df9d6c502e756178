// Standard speculative decoding: the draft proposes a chain, the target verifies it in one
// run (greedy matching at temperature 0, exact rejection sampling otherwise).
#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/speculation/verify.hpp"

namespace specmesh {

namespace {

const char* const kDraftRole = "draft";

// Draft k tokens (fewer when the draft's confidence drops below p_accept), verify them in one
// target batch: greedy matching, or exact stochastic verification at temperature > 0.
class Speculative final : public Strategy {
 public:
  explicit Speculative(StrategyHost& h) : h_(h), draft_sampler_(h.sampler().params()) {}

  void start() override { draft_next(); }

  void on_logits(uint64_t run, const Logits& l) override {
    if (l.pipeline == kDraftRole) {
      if (run == awaited_draft_) on_draft(run, l);
    } else if (run == awaited_target_) {
      on_verify(run, l);
    }
  }

 private:
  void draft_next() {
    std::vector<int32_t> want = h_.tokens();
    want.insert(want.end(), drafts_.begin(), drafts_.end());
    awaited_draft_ = feed(h_, kDraftRole, draft_cached_, sync_cache(h_, kDraftRole, draft_cached_, want), 1);
  }

  void on_draft(uint64_t run, const Logits& l) {
    auto row = rows_of(l, 1, h_.vocab(), run);
    const float conf = top_probability(row.data(), h_.vocab());
    const bool confident = conf >= p_accept_;
    if (confident) {
      if (h_.sampler().greedy()) {
        drafts_.push_back(Sampler::argmax(row.data(), h_.vocab()));
      } else {
        q_.push_back(draft_sampler_.distribution(row.data(), h_.vocab()));
        drafts_.push_back(h_.sampler().sample_from(q_.back()));
      }
    }
    if (confident && int(drafts_.size()) < n_draft_) return draft_next();
    verify();
  }

  void verify() {
    // The last accepted token and the drafts, with logits for each of them.
    std::vector<int32_t> pending = sync_cache(h_, kTargetRole, target_cached_, h_.tokens());
    pending.insert(pending.end(), drafts_.begin(), drafts_.end());
    awaited_target_ = feed(h_, kTargetRole, target_cached_, pending, drafts_.size() + 1);
  }

  void on_verify(uint64_t run, const Logits& l) {
    const size_t k = drafts_.size();
    auto rows = rows_of(l, k + 1, h_.vocab(), run);
    Verdict v;
    if (h_.sampler().greedy()) {
      v = verify_greedy(drafts_, rows.data(), h_.vocab());
    } else {
      std::vector<std::vector<float>> p;
      for (size_t i = 0; i <= k; ++i) p.push_back(h_.sampler().distribution(rows.data() + i * h_.vocab(), h_.vocab()));
      v = verify_stochastic(drafts_, p, q_, h_.sampler());
    }
    SpecMetrics& m = h_.metrics();
    m.drafted += k;
    m.accepted += v.accepted;
    ++m.verifications;
    std::vector<int32_t> proposal(drafts_.begin(), drafts_.begin() + v.accepted);
    drafts_.clear();
    q_.clear();
    for (int32_t t : proposal)
      if (!h_.accept(t)) return;
    if (!h_.accept(v.next)) return;
    draft_next();
  }

  StrategyHost& h_;
  const int n_draft_ = h_.params().integer("n_draft");
  const float p_accept_ = h_.params().real("p_accept");
  Sampler draft_sampler_;  // the draft's distribution uses the same transforms as the target's
  std::vector<int32_t> target_cached_, draft_cached_, drafts_;
  std::vector<std::vector<float>> q_;
  uint64_t awaited_target_ = 0, awaited_draft_ = 0;
};

}  // namespace

StrategyInfo strategy_info_spec() {
  StrategyInfo s;
  s.name = "spec";
  s.summary = "the draft proposes up to `n_draft` tokens (stopping early when its confidence falls below `p_accept`), "
              "the target verifies them in one batch: greedy matching at temperature 0, exact rejection sampling "
              "otherwise (accept with min(1, p/q), resample from max(0, p - q))";
  s.roles = {kTargetRole, kDraftRole};
  s.default_for_roles = true;
  s.params = {
      {"n_draft", ParamType::Int, 1, 64, 4, "draft tokens per verification", {"--draft-n", "--n-draft"}},
      {"p_accept", ParamType::Float, 0, 1, 0.5, "draft confidence cutoff: drafting stops below it", {"--p-accept", "--pa"}},
  };
  s.make = [](StrategyHost& h) { return std::make_unique<Speculative>(h); };
  return s;
}

}  // namespace specmesh
