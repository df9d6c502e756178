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
//
// Multi-sequence speculation (n_parallel > 1): while the draft extends a micro-batch, a
// candidate other than its top one whose probability exceeds p_split plus the cutoff's current
// adjustment becomes an alternative branch: a single token beside the chain's token at that
// depth, not drafted on further (keeping the draft pipeline on the one chain later runs
// continue). Alternatives count against max_micro_batch, and a run has at most n_parallel
// branches. The run then carries a small tree (the chain, then the alternatives by decreasing
// depth: DFS pre-order, at positions p + depth), each alternative in a sequence of its own that
// borrows the same cells as the chain's. Verification walks the tree: at each depth it follows
// the node whose token was accepted there (greedy, or PipeInfer's sample-and-match at
// temperature > 0: the target samples from the row it reached and the walk continues only on a
// matching child); the accepted branch's cells become canonical by a range copy.
#include <algorithm>
#include <cmath>
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
  // Alternatives to inputs[alt_depth[j]], each one leaf in its own sequence alt_seq[j]; with
  // any, the batch is a tree whose rows are the chain's first, then alt_row[j].
  std::vector<int32_t> alt_tok, alt_depth;
  std::vector<int> alt_seq, alt_row;
  int32_t end() const { return p + int32_t(inputs.size()); }
};

// A non-speculative run of the token at `pos`, straight into the canonical sequence.
RunInfo plain(uint64_t id, int32_t pos, int32_t token) {
  RunInfo r;
  r.id = id;
  r.p = r.base_from = pos;
  r.inputs = {token};
  return r;
}

class PipeInfer final : public Strategy {
 public:
  explicit PipeInfer(StrategyHost& h) : c_(h), cut_(p_accept_) {
    const int seqs = 2 * max_runs_ + 2 + (n_parallel_ - 1) * (max_runs_ + 1);
    for (int s = 1; s <= std::min(kMaxSeqs - 1, seqs); ++s) free_.push_back(s);
  }

  void start() override {
    // The prompt goes straight into the canonical sequence; its last token is the first
    // non-speculative run.
    const auto& prompt = c_.prompt();
    std::vector<int32_t> cached;
    const uint64_t id = feed(c_, target(), cached, prompt, 1);
    const int32_t last = int32_t(prompt.size()) - 1;
    inflight_.push_back(plain(id, last, prompt[last]));
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

  // Whether the tokens a run's branch assumed (its base and inputs; branch -1 is the chain,
  // j >= 0 alternative j) agree with what is accepted.
  bool consistent(const RunInfo& r, int branch = -1) const {
    const auto& A = c_.tokens();
    for (int32_t pos = r.base_from; pos < branch_end(r, branch) && pos < accepted(); ++pos) {
      const int32_t t = pos < r.p ? r.base[pos - r.base_from] : token_at(r, branch, pos);
      if (A[pos] != t) return false;
    }
    return true;
  }

  static constexpr int kNoBranch = -2;
  static int32_t branch_end(const RunInfo& r, int branch) {
    return branch < 0 ? r.end() : r.p + r.alt_depth[size_t(branch)] + 1;
  }
  static int32_t token_at(const RunInfo& r, int branch, int32_t pos) {
    return pos + 1 == branch_end(r, branch) && branch >= 0 ? r.alt_tok[size_t(branch)] : r.inputs[pos - r.p];
  }
  static int branch_seq(const RunInfo& r, int branch) { return branch < 0 ? r.seq : r.alt_seq[size_t(branch)]; }

  // The branch of a run the chain goes through: the first (the run's own chain first) that
  // is still valid and agrees with the chain so far. When an alternative won, later runs build
  // on it, so its cells must reach their partitions.
  int followed(const RunInfo& r) const {
    for (int j = -1; j < int(r.alt_tok.size()); ++j) {
      if (!consistent(r, j)) continue;
      bool agrees = true;
      for (int32_t pos = r.p; pos < branch_end(r, j) && pos < int32_t(chain_.size()); ++pos)
        agrees = agrees && chain_[pos] == token_at(r, j, pos);
      if (agrees) return j;
    }
    return kNoBranch;
  }

  // One past the last position whose token a valid branch of the run predicts; -1 if none is valid.
  int32_t reach(const RunInfo& r) const {
    int32_t best = -1;
    for (int j = -1; j < int(r.alt_tok.size()); ++j)
      if (consistent(r, j)) best = std::max(best, branch_end(r, j));
    return best;
  }

  void release(const RunInfo& r, std::vector<KvOp>& ops) {
    ops.push_back({KvOpKind::remove, r.seq, -1, -1, -1});
    free_.push_back(r.seq);
    for (int s : r.alt_seq) {
      ops.push_back({KvOpKind::remove, s, -1, -1, -1});
      free_.push_back(s);
    }
  }

  // Uses a run's rows to extend the accepted sequence; false once generation is over.
  bool verify_run(const RunInfo& r, const Logits& l) {
    const int V = c_.vocab();
    const size_t m = r.inputs.size();
    std::vector<float> rows = rows_of(l, m + r.alt_tok.size(), V, r.id);
    int matched = 0, gained = 0, branch = -1;
    bool ok = r.p <= accepted() && reach(r) >= 0;
    for (size_t i = 0; ok && i < m && branch < 0; ++i) {
      const int32_t pos = r.p + int32_t(i);
      if (pos >= accepted()) break;
      size_t row = i;
      if (c_.tokens()[pos] != r.inputs[i]) {
        // Off the chain: an alternative at this depth may carry the accepted token.
        for (size_t j = 0; j < r.alt_tok.size() && branch < 0; ++j)
          if (r.alt_depth[j] == int32_t(i) && r.alt_tok[j] == c_.tokens()[pos]) branch = int(j);
        if (branch < 0) break;
        row = size_t(r.alt_row[size_t(branch)]);
      }
      ++matched;
      if (pos + 1 == accepted()) {
        ++gained;
        if (!c_.accept(c_.sampler().sample(rows.data() + row * V, V))) break;
      }
    }
    SpecMetrics& mt = c_.metrics();
    if (r.speculative) {
      ++mt.verifications;
      mt.accepted += std::max(0, matched);
    }
    if (gained == 0) ++mt.runs_wasted;
    // The verified path of a speculative run becomes canonical (from the sequence of the
    // branch it took); then the run's partition is freed.
    if (r.seq != 0) {
      std::vector<KvOp> ops;
      const int32_t upto = r.p + matched;
      if (ok && upto > canon_len_ && r.p <= canon_len_) {
        ops.push_back({KvOpKind::copy, branch_seq(r, branch), 0, canon_len_, upto});
        canon_len_ = upto;
      }
      release(r, ops);
      if (!c_.done()) c_.kv_ops(target(), std::move(ops));
    }
    return !c_.done();
  }

  // Cancels runs that can no longer contribute.
  void prune() {
    std::vector<uint64_t> dropped;
    std::vector<KvOp> ops;
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      // A run is invalid once no branch agrees with the accepted tokens, superfluous once
      // every valid branch's predictions are known.
      const int32_t reach_to = reach(*it);
      const bool invalid = reach_to < 0;
      const bool superfluous = reach_to < accepted();
      if (it->speculative && (invalid || superfluous) && cancel_) {
        dropped.push_back(it->id);
        release(*it, ops);
        it = inflight_.erase(it);
      } else {
        ++it;
      }
    }
    c_.cancel(target(), dropped);
    if (!ops.empty()) c_.kv_ops(target(), std::move(ops));
  }

  // The speculative chain: accepted tokens, then the inputs of valid runs beyond them.
  void rebuild_chain() {
    chain_ = c_.tokens();
    for (const RunInfo& r : inflight_) {
      if (!r.speculative || r.p > int32_t(chain_.size())) continue;
      const int j = followed(r);
      if (j == kNoBranch) continue;
      for (int32_t pos = int32_t(chain_.size()); pos < branch_end(r, j); ++pos) chain_.push_back(token_at(r, j, pos));
    }
    // A draft micro-batch built on a chain that changed is stale.
    const bool fresh = draft_ctx_.size() == chain_.size() + mb_.size() &&
                       std::equal(chain_.begin(), chain_.end(), draft_ctx_.begin());
    if (!fresh) drafting_ = false;
  }

  bool covered(int32_t pos) const {
    for (const RunInfo& r : inflight_) {
      if (pos >= r.p && pos < r.end() && consistent(r)) return true;
      for (int j = 0; j < int(r.alt_tok.size()); ++j)
        if (pos + 1 == branch_end(r, j) && consistent(r, j)) return true;
    }
    return false;
  }

  void pump() {
    if (c_.done()) return;
    // The newest accepted token must be in flight: a non-speculative run if nothing covers it.
    const int32_t last = accepted() - 1;
    if (!covered(last) && canon_len_ <= last) {
      Batch b;
      b.add(c_.tokens()[last], last, seq_bit(0), true);
      inflight_.push_back(plain(c_.launch(target(), b, false), last, c_.tokens()[last]));
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
    alt_tok_.clear();
    alt_depth_.clear();
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
      split(row, d);
      if (int(mb_.size() + alt_tok_.size()) < max_micro_batch_) return feed_draft();
    }
    drafting_ = false;
    launch_speculative();
    pump();
  }

  // Adds the draft's best candidate other than `top` (just appended to the chain) as an
  // alternative branch when it is likely enough and the run has room for it.
  void split(const std::vector<float>& row, int32_t top) {
    const size_t alts = alt_tok_.size();
    if (int(alts) + 1 >= n_parallel_ || int(mb_.size() + alts) >= max_micro_batch_ || free_.size() < alts + 2) return;
    const int V = c_.vocab();
    int32_t alt = -1;
    for (int t = 0; t < V; ++t)
      if (t != top && (alt < 0 || row[size_t(t)] > row[size_t(alt)])) alt = t;
    const float mx = row[size_t(top)];
    double z = 0;
    for (float x : row) z += std::exp(double(x - mx));
    const double p_alt = std::exp(double(row[size_t(alt)] - mx)) / z;
    // The same adjustment the confidence cutoff carries: stricter deep in a burst, looser after decay.
    if (p_alt <= p_split_ + (cutoff() - p_accept_)) return;
    alt_tok_.push_back(alt);
    alt_depth_.push_back(int32_t(mb_.size()) - 1);
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
    // At most one alternative per depth, drafted shallow to deep; deepest first after the
    // chain is DFS pre-order. split() kept enough sequences free for them.
    for (size_t j = alt_tok_.size(); j-- > 0;) {
      r.alt_tok.push_back(alt_tok_[j]);
      r.alt_depth.push_back(alt_depth_[j]);
      r.alt_seq.push_back(free_.front());
      r.alt_row.push_back(int(mb_.size() + r.alt_row.size()));
      free_.pop_front();
    }
    // Every branch's partition sees the canonical cells and those of the runs it builds on.
    std::vector<int> seqs = r.alt_seq;
    seqs.insert(seqs.begin(), r.seq);
    std::vector<KvOp> ops;
    for (int s : seqs) ops.push_back({KvOpKind::copy, 0, s, -1, -1});
    for (const RunInfo& dep : inflight_) {
      if (!dep.speculative || dep.p >= r.p) continue;
      const int j = consistent(dep) ? -1 : followed(dep);
      if (j != kNoBranch && branch_end(dep, j) > canon_len_)
        for (int s : seqs) ops.push_back({KvOpKind::copy, branch_seq(dep, j), s, -1, -1});
    }
    c_.kv_ops(target(), std::move(ops));
    Batch b;
    for (size_t i = 0; i < mb_.size(); ++i) {
      // A chain token is on the chain and on every alternative that branches off deeper.
      SeqSet s = seq_bit(r.seq);
      for (size_t j = 0; j < r.alt_tok.size(); ++j)
        if (r.alt_depth[j] > int32_t(i)) s |= seq_bit(r.alt_seq[j]);
      b.add(mb_[i], r.p + int32_t(i), s, true);
    }
    if (!r.alt_tok.empty()) {
      for (size_t i = 0; i < mb_.size(); ++i) b.parent.push_back(int32_t(i) - 1);
      for (size_t j = 0; j < r.alt_tok.size(); ++j) {
        b.add(r.alt_tok[j], r.p + r.alt_depth[j], seq_bit(r.alt_seq[j]), true);
        b.parent.push_back(r.alt_depth[j] - 1);
      }
    }
    r.id = c_.launch(target(), b, true);
    c_.metrics().drafted += b.size();
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
  const int n_parallel_ = c_.params().integer("n_parallel");
  const float p_split_ = c_.params().real("p_split");
  std::deque<RunInfo> inflight_;
  std::deque<int> free_;
  std::vector<int32_t> chain_, draft_cached_, draft_ctx_, mb_, alt_tok_, alt_depth_;
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
              "stages drop them, between layers if they have started; with `n_parallel` > 1 a non-top draft candidate "
              "above `p_split` becomes a one-token alternative branch, so a run carries a small token tree verified "
              "along whichever branch matches";
  s.roles = {kTargetRole, kDraftRole};
  s.params = {
      {"max_micro_batch", ParamType::Int, 1, 4, 4, "draft tokens per speculative run", {"--micro-batch"}},
      {"max_runs", ParamType::Int, 1, 30, 4, "target runs in flight", {"--max-runs", "--np"}},
      {"p_accept", ParamType::Float, 0, 1, 0.5, "base draft confidence cutoff", {"--p-accept", "--pa"}},
      {"p_recovery", ParamType::Float, 0, 1, 0.05, "cutoff increase per speculative run in a burst", {"--p-recovery", "--pr"}},
      {"p_decay", ParamType::Float, 0, 1, 0.05, "cutoff decrease when speculation yields nothing", {"--p-decay", "--pd"}},
      {"cancel", ParamType::Bool, 0, 1, 1, "cancel invalid and superfluous runs early", {"--no-cancel"}},
      {"n_parallel", ParamType::Int, 1, 8, 1, "most branches of one speculative run (1: chains)", {"--n-parallel"}},
      {"p_split", ParamType::Float, 0, 1, 0.8, "draft probability (plus the cutoff's adjustment) a non-top candidate needs to become a branch", {"--p-split", "--ps"}},
  };
  s.make = [](StrategyHost& h) { return std::make_unique<PipeInfer>(h); };
  return s;
}

}  // namespace specmesh
