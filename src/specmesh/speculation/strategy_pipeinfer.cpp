// PipeInfer: asynchronous, continuous speculation over a pipelined target.
//
// The newest accepted token is always in a target run in flight: a non-speculative run of
// it (which writes straight into the canonical sequence 0 and always completes), unless a
// valid speculative run already carries it, whose logits then serve just as well. Whenever
// fewer than max_runs target runs are in flight, the head asks the draft pipeline for a
// micro-batch of 1-4 tokens (as many as clear the confidence cutoff, at least one: an idle
// pipeline is the worst use of it) continuing the speculative chain (accepted tokens followed by
// the inputs of the valid runs in flight) and launches it as a speculative run in its own
// KV sequence partition, which first borrows the canonical cells and the cells of the runs
// it builds on (metadata copies, no data moves). Logits come back in launch order; each
// run's rows are checked against the accepted sequence and extend it where its inputs
// match. Runs that became invalid (an input or a token they build on was rejected) or
// superfluous (everything they could predict is already known) are cancelled on the
// priority path; their partitions are released by cache operations that travel in order
// with the runs, so every stage's cache stays consistent.
#include <algorithm>
#include <deque>

#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {

const char* const kDraftRole = "draft";

struct RunInfo {
  uint64_t id = 0;
  int32_t p = 0;                // position of inputs[0]
  std::vector<int32_t> inputs;
  std::vector<int32_t> base;    // speculative tokens it builds on, positions [base_from, p)
  int32_t base_from = 0;
  int seq = 0;                  // 0: canonical (non-speculative run)
  bool speculative = false;
  int32_t end() const { return p + int32_t(inputs.size()); }
};

class PipeInfer final : public Strategy {
 public:
  explicit PipeInfer(StrategyHost& h) : c_(h), cut_(p_accept_) {
    for (int s = 1; s <= std::min(kMaxSeqs - 1, 2 * max_runs_ + 2); ++s) free_.push_back(s);
  }

  void start() override {
    // The prompt goes straight into the canonical sequence; its last token is the first
    // non-speculative run.
    const auto& prompt = c_.prompt();
    std::vector<int32_t> cached;
    const uint64_t id = feed(c_, target(), cached, prompt, 1);
    const int32_t last = int32_t(prompt.size()) - 1;
    inflight_.push_back({id, last, {prompt[last]}, {}, last, 0, false});
    canon_len_ = int32_t(prompt.size());
    rebuild_chain();
    pump();
  }

  void abandon() override {
    std::vector<uint64_t> runs;
    for (const RunInfo& r : inflight_) runs.push_back(r.id);
    c_.cancel(target(), runs);
    inflight_.clear();
  }

  void on_logits(uint64_t run, const Logits& l) override {
    if (l.pipeline == kDraftRole) return on_draft(run, l);
    auto it = std::find_if(inflight_.begin(), inflight_.end(), [&](const RunInfo& r) { return r.id == run; });
    if (it == inflight_.end()) {
      // Not ours any more: a prefill chunk, or a run cancelled too late to stop.
      if (!l.rows.empty()) ++c_.metrics().runs_wasted;
      return;
    }
    RunInfo r = std::move(*it);
    inflight_.erase(it);
    burst_ = 0;
    if (!verify_run(r, l)) return;  // generation over
    if (c_.done()) return;
    prune();
    rebuild_chain();
    pump();
  }

 private:
  static const char* target() { return kTargetRole; }
  static const char* draft() { return kDraftRole; }
  int32_t accepted() const { return int32_t(c_.tokens().size()); }

  // Whether the tokens a run assumed (its base and inputs) agree with what is accepted.
  bool consistent(const RunInfo& r) const {
    const auto& A = c_.tokens();
    for (int32_t pos = r.base_from; pos < r.end() && pos < accepted(); ++pos) {
      const int32_t t = pos < r.p ? r.base[pos - r.base_from] : r.inputs[pos - r.p];
      if (A[pos] != t) return false;
    }
    return true;
  }

  // Uses a run's rows to extend the accepted sequence; false once generation is over.
  bool verify_run(const RunInfo& r, const Logits& l) {
    const int V = c_.vocab();
    const size_t m = r.inputs.size();
    std::vector<float> rows = rows_of(l, m, V, r.id);
    int matched = 0, gained = 0;
    bool ok = r.p <= accepted() && consistent(r);
    for (size_t i = 0; ok && i < m; ++i) {
      const int32_t pos = r.p + int32_t(i);
      if (pos >= accepted() || c_.tokens()[pos] != r.inputs[i]) break;
      ++matched;
      if (pos + 1 == accepted()) {
        ++gained;
        if (!c_.accept(c_.sampler().sample(rows.data() + i * V, V))) break;
      }
    }
    SpecMetrics& mt = c_.metrics();
    if (r.speculative) {
      ++mt.verifications;
      mt.accepted += std::max(0, matched);
    }
    if (gained == 0) ++mt.runs_wasted;
    // Verified inputs of a speculative run become canonical; then its partition is freed.
    if (r.seq != 0) {
      std::vector<KvOp> ops;
      const int32_t upto = r.p + matched;
      if (ok && upto > canon_len_ && r.p <= canon_len_) {
        ops.push_back({KvOpKind::copy, r.seq, 0, canon_len_, upto});
        canon_len_ = upto;
      }
      ops.push_back({KvOpKind::remove, r.seq, -1, -1, -1});
      if (!c_.done()) c_.kv_ops(target(), std::move(ops));
      free_.push_back(r.seq);
    }
    return !c_.done();
  }

  // Cancels runs that can no longer contribute.
  void prune() {
    std::vector<uint64_t> dropped;
    std::vector<KvOp> release;
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      const bool invalid = !consistent(*it);
      const bool superfluous = it->end() < accepted();
      if (it->speculative && (invalid || superfluous) && cancel_) {
        dropped.push_back(it->id);
        release.push_back({KvOpKind::remove, it->seq, -1, -1, -1});
        free_.push_back(it->seq);
        it = inflight_.erase(it);
      } else {
        ++it;
      }
    }
    c_.cancel(target(), dropped);
    if (!release.empty()) c_.kv_ops(target(), std::move(release));
  }

  // The speculative chain: accepted tokens, then the inputs of valid runs beyond them.
  void rebuild_chain() {
    chain_ = c_.tokens();
    for (const RunInfo& r : inflight_) {
      if (!r.speculative || !consistent(r) || r.p > int32_t(chain_.size())) continue;
      bool agrees = true;
      for (int32_t pos = r.p; pos < r.end() && pos < int32_t(chain_.size()); ++pos)
        agrees = agrees && chain_[pos] == r.inputs[pos - r.p];
      if (!agrees) continue;
      for (int32_t pos = int32_t(chain_.size()); pos < r.end(); ++pos) chain_.push_back(r.inputs[pos - r.p]);
    }
    // A draft micro-batch built on a chain that changed is stale.
    const bool fresh = draft_ctx_.size() == chain_.size() + mb_.size() &&
                       std::equal(chain_.begin(), chain_.end(), draft_ctx_.begin());
    if (!fresh) drafting_ = false;
  }

  bool covered(int32_t pos) const {
    for (const RunInfo& r : inflight_)
      if (pos >= r.p && pos < r.end() && consistent(r)) return true;
    return false;
  }

  void pump() {
    if (c_.done()) return;
    // The newest accepted token must be in flight: a non-speculative run if nothing covers it.
    const int32_t last = accepted() - 1;
    if (!covered(last) && canon_len_ <= last) {
      Batch b;
      b.add(c_.tokens()[last], last, seq_bit(0), true);
      inflight_.push_back({c_.launch(target(), b, false), last, {c_.tokens()[last]}, {}, last, 0, false});
      canon_len_ = last + 1;
      rebuild_chain();
    }
    if (!drafting_ && int(inflight_.size()) < max_runs_ && !free_.empty() &&
        int(chain_.size()) - accepted() < max_runs_ * max_micro_batch_)
      start_draft();
  }

  void start_draft() {
    drafting_ = true;
    draft_ctx_ = chain_;
    mb_.clear();
    feed_draft();
  }

  void feed_draft() {
    awaited_draft_ = feed(c_, draft(), draft_cached_, sync_cache(c_, draft(), draft_cached_, draft_ctx_), 1);
  }

  void on_draft(uint64_t run, const Logits& l) {
    if (run != awaited_draft_) return;
    if (!drafting_) return pump();  // the chain moved on while the draft worked
    const int V = c_.vocab();
    std::vector<float> row = rows_of(l, 1, V, run);
    const float conf = top_probability(row.data(), V);
    if (conf < cutoff() && mb_.empty()) {
      // Speculation would yield nothing and the head would idle: loosen the cutoff and
      // launch this one token anyway.
      cut_ = std::max(0.0f, cut_ - p_decay_);
    }
    if (conf >= cutoff() || mb_.empty()) {
      const int32_t d = Sampler::argmax(row.data(), V);
      mb_.push_back(d);
      draft_ctx_.push_back(d);
      if (int(mb_.size()) < max_micro_batch_) return feed_draft();
    }
    drafting_ = false;
    launch_speculative();
    pump();
  }

  // The draft confidence a token needs: the base cutoff plus the recovery factor for every
  // speculative run already launched since the last target result.
  float cutoff() const { return std::min(0.99f, cut_ + p_recovery_ * burst_); }

  void launch_speculative() {
    if (free_.empty() || draft_ctx_.size() != chain_.size() + mb_.size()) return;
    RunInfo r;
    r.p = int32_t(chain_.size());
    r.inputs = mb_;
    r.base_from = accepted();
    r.base.assign(chain_.begin() + r.base_from, chain_.end());
    r.speculative = true;
    r.seq = free_.front();
    free_.pop_front();
    // The partition sees the canonical cells and those of the runs it builds on.
    std::vector<KvOp> ops{{KvOpKind::copy, 0, r.seq, -1, -1}};
    for (const RunInfo& dep : inflight_)
      if (dep.speculative && dep.end() > canon_len_ && dep.p < r.p && consistent(dep))
        ops.push_back({KvOpKind::copy, dep.seq, r.seq, -1, -1});
    c_.kv_ops(target(), std::move(ops));
    Batch b;
    for (size_t i = 0; i < mb_.size(); ++i) b.add(mb_[i], r.p + int32_t(i), seq_bit(r.seq), true);
    r.id = c_.launch(target(), b, true);
    c_.metrics().drafted += mb_.size();
    inflight_.push_back(std::move(r));
    ++burst_;  // each further run in this burst needs more confidence (cutoff())
    rebuild_chain();
  }

  StrategyHost& c_;
  const int max_micro_batch_ = c_.params().integer("max_micro_batch");
  const int max_runs_ = c_.params().integer("max_runs");
  const float p_accept_ = c_.params().real("p_accept");
  const float p_recovery_ = c_.params().real("p_recovery");
  const float p_decay_ = c_.params().real("p_decay");
  const bool cancel_ = c_.params().flag("cancel");
  std::deque<RunInfo> inflight_;
  std::deque<int> free_;
  std::vector<int32_t> chain_, draft_cached_, draft_ctx_, mb_;
  int32_t canon_len_ = 0;
  bool drafting_ = false;
  uint64_t awaited_draft_ = 0;
  float cut_;
  int burst_ = 0;
};

}  // namespace

StrategyInfo strategy_info_pipeinfer() {
  StrategyInfo s;
  s.name = "pipeinfer";
  s.summary = "PipeInfer: the newest accepted token is always in a run in flight (a non-speculative run of it, unless a valid speculative run already carries it); whenever fewer than "
              "`max_runs` target runs are in flight the draft pipeline proposes a micro-batch of 1-4 tokens, launched "
              "as a speculative run in its own KV sequence partition (canonical sequence 0 holds accepted tokens); the "
              "draft's confidence cutoff rises by `p_recovery` for every further speculative run in a burst and falls by "
              "`p_decay` when speculation would yield nothing, in which case the head launches the one token anyway "
              "rather than let the pipeline idle; invalid or superfluous runs are cancelled on the priority path and "
              "stages drop them, between layers if they have started";
  s.roles = {kTargetRole, kDraftRole};
  s.params = {
      {"max_micro_batch", ParamType::Int, 1, 4, 4, "draft tokens per speculative run", {"--micro-batch"}},
      {"max_runs", ParamType::Int, 1, 30, 4, "target runs in flight", {"--max-runs", "--np"}},
      {"p_accept", ParamType::Float, 0, 1, 0.5, "base draft confidence cutoff", {"--p-accept", "--pa"}},
      {"p_recovery", ParamType::Float, 0, 1, 0.05, "cutoff increase per speculative run in a burst", {"--p-recovery", "--pr"}},
      {"p_decay", ParamType::Float, 0, 1, 0.05, "cutoff decrease when speculation yields nothing", {"--p-decay", "--pd"}},
      {"cancel", ParamType::Bool, 0, 1, 1, "cancel invalid and superfluous runs early", {"--no-cancel"}},
  };
  s.make = [](StrategyHost& h) { return std::make_unique<PipeInfer>(h); };
  return s;
}

}  // namespace specmesh
