// Plain autoregression and standard speculative decoding (draft a chain, verify it in one
// target run), both over whatever pipelines the topology gives the target and the draft.
#include <algorithm>

#include "specmesh/actors/strategy.hpp"
#include "specmesh/speculation/verify.hpp"

namespace specmesh {

namespace {

class Autoregressive final : public Strategy {
 public:
  explicit Autoregressive(HeadCore& c) : c_(c) {}
  void start() override { awaited_ = feed(c_, c_.cfg().target, cached_, c_.prompt(), 1); }
  void on_logits(uint64_t run, const Logits& l) override {
    if (run != awaited_) return;  // an earlier prefill chunk
    auto row = rows_of(l, 1, c_.vocab(), run);
    if (!c_.accept(c_.sampler().sample(row.data(), c_.vocab()))) return;
    awaited_ = feed(c_, c_.cfg().target, cached_, {c_.tokens().back()}, 1);
  }

 private:
  HeadCore& c_;
  std::vector<int32_t> cached_;
  uint64_t awaited_ = 0;
};

// Draft k tokens (fewer when the draft's confidence drops below p_accept), verify them in one
// target batch: greedy matching, or exact stochastic verification at temperature > 0.
class Speculative final : public Strategy {
 public:
  explicit Speculative(HeadCore& c) : c_(c), draft_sampler_(c.sampler().params()) {}

  void start() override { draft_next(); }

  void on_logits(uint64_t run, const Logits& l) override {
    if (l.pipeline == c_.cfg().draft.name) {
      if (run == awaited_draft_) on_draft(run, l);
    } else if (run == awaited_target_) {
      on_verify(run, l);
    }
  }

 private:
  const SpecParams& sp() const { return c_.cfg().spec; }

  void draft_next() {
    std::vector<int32_t> want = c_.tokens();
    want.insert(want.end(), drafts_.begin(), drafts_.end());
    awaited_draft_ = feed(c_, c_.cfg().draft, draft_cached_, sync_cache(c_, c_.cfg().draft, draft_cached_, want), 1);
  }

  void on_draft(uint64_t run, const Logits& l) {
    auto row = rows_of(l, 1, c_.vocab(), run);
    const float conf = top_probability(row.data(), c_.vocab());
    const bool confident = conf >= sp().p_accept;
    if (confident) {
      if (c_.sampler().greedy()) {
        drafts_.push_back(Sampler::argmax(row.data(), c_.vocab()));
      } else {
        q_.push_back(draft_sampler_.distribution(row.data(), c_.vocab()));
        drafts_.push_back(c_.sampler().sample_from(q_.back()));
      }
    }
    if (confident && int(drafts_.size()) < sp().n_draft) return draft_next();
    verify();
  }

  void verify() {
    // The last accepted token and the drafts, with logits for each of them.
    std::vector<int32_t> pending = sync_cache(c_, c_.cfg().target, target_cached_, c_.tokens());
    pending.insert(pending.end(), drafts_.begin(), drafts_.end());
    awaited_target_ = feed(c_, c_.cfg().target, target_cached_, pending, drafts_.size() + 1);
  }

  void on_verify(uint64_t run, const Logits& l) {
    const size_t k = drafts_.size();
    auto rows = rows_of(l, k + 1, c_.vocab(), run);
    Verdict v;
    if (c_.sampler().greedy()) {
      v = verify_greedy(drafts_, rows.data(), c_.vocab());
    } else {
      std::vector<std::vector<float>> p;
      for (size_t i = 0; i <= k; ++i) p.push_back(c_.sampler().distribution(rows.data() + i * c_.vocab(), c_.vocab()));
      v = verify_stochastic(drafts_, p, q_, c_.sampler());
    }
    SpecMetrics& m = c_.metrics();
    m.drafted += k;
    m.accepted += v.accepted;
    ++m.verifications;
    std::vector<int32_t> proposal(drafts_.begin(), drafts_.begin() + v.accepted);
    drafts_.clear();
    q_.clear();
    for (int32_t t : proposal)
      if (!c_.accept(t)) return;
    if (!c_.accept(v.next)) return;
    draft_next();
  }

  HeadCore& c_;
  Sampler draft_sampler_;  // the draft's distribution uses the same transforms as the target's
  std::vector<int32_t> target_cached_, draft_cached_, drafts_;
  std::vector<std::vector<float>> q_;
  uint64_t awaited_target_ = 0, awaited_draft_ = 0;
};

}  // namespace

std::unique_ptr<Strategy> make_pipeinfer(HeadCore& core);

std::unique_ptr<Strategy> make_strategy(HeadCore& core) {
  const std::string& s = core.cfg().strategy;
  if (s == "ar") return std::make_unique<Autoregressive>(core);
  if (s == "spec") return std::make_unique<Speculative>(core);
  if (s == "pipeinfer") return make_pipeinfer(core);
  throw std::invalid_argument("unknown strategy '" + s + "' (ar, spec, pipeinfer)");
}

}  // namespace specmesh
