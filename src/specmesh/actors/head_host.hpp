// The head's implementation of StrategyHost for one session: runs and cache operations go to a
// role's pipeline through the router (decode steps of mergeable strategies through the
// RunMerger); tokens go to the session's TokenStream.
//
// A session owns a range of the KV cache's sequences (SessionSeqs): the strategy numbers its
// sequences from 0 and the host moves them into the range, so `remove -1` and `keep` touch
// the session's sequences only and sessions share the caches without seeing each other.
#pragma once

#include <memory>
#include <stdexcept>
#include <unordered_set>

#include "specmesh/actors/head.hpp"
#include "specmesh/actors/run_ids.hpp"
#include "specmesh/actors/run_merger.hpp"
#include "specmesh/actors/token_stream.hpp"

namespace specmesh {

// Sequences [base, base + count) of every pipeline's cache.
struct SessionSeqs {
  int base = 0;
  int count = kMaxSeqs;
  bool whole() const { return base == 0 && count == kMaxSeqs; }
  SeqSet mask() const { return count == kMaxSeqs ? ~SeqSet(0) : ((SeqSet(1) << count) - 1) << base; }
};

// A run that would take a session past its context (HeadHost::n_ctx).
struct ContextFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class HeadHost final : public StrategyHost {
 public:
  // Run ids come from `ids`, shared by all sessions of a head. `merger`, when given, takes the
  // session's target runs (the strategy's are plain decode steps).
  HeadHost(const HeadConfig& cfg, SessionPtr session, RunIds& ids, const StrategyInfo& strategy, StrategyParams params,
           SessionSeqs seqs, RunMerger* merger);

  // Throws ContextFull for a token at a position past the session's context.
  using StrategyHost::launch;
  uint64_t launch(const std::string& role, const Batch& batch, bool speculative, const std::vector<TapRow>& inputs) override;
  void kv_ops(const std::string& role, std::vector<KvOp> ops) override;
  void cancel(const std::string& role, const std::vector<uint64_t>& runs) override;
  // Streams the token; when the session's context is then full, shifts it (the request's
  // context_shift) or ends the session with a context_full error.
  bool accept(int32_t token) override;
  void finish(std::string error = {}) override { stream_.finish(std::move(error), ErrorKind::internal); }
  void finish(std::string error, ErrorKind kind) { stream_.finish(std::move(error), kind); }
  bool done() const override { return stream_.done(); }
  // Logits arrived for this session: the first rows from the target's pipeline end its prompt
  // processing (prefill_ms, ttft_after_prefill_ms).
  void logits_arrived(const Logits& l) {
    if (l.pipeline == kTargetRole && !l.rows.empty()) stream_.prompt_processed();
  }
  Sampler& sampler() override { return sampler_; }
  SpecMetrics& metrics() override { return stream_.metrics(); }
  const std::vector<int32_t>& prompt() const override { return stream_.prompt(); }
  const std::vector<int32_t>& tokens() const override { return stream_.tokens(); }
  bool has_role(const std::string& role) const override;
  int vocab() const override { return cfg_.target().model->hparams().n_vocab; }
  int n_batch() const override { return cfg_.n_batch; }
  // The session's share of the cache (HeadConfig::session_ctx) less the cells its strategy's
  // speculation may hold beyond one per position (StrategyInfo::spare_cells).
  int n_ctx() const override { return n_ctx_; }
  const StrategyParams& params() const override { return params_; }
  int sequences() const override { return seqs_.count; }

  const HeadConfig& cfg() const { return cfg_; }
  const StrategyInfo& strategy_info() const { return strategy_; }
  const SessionPtr& session() const { return session_; }
  const SessionSeqs& seqs() const { return seqs_; }
  // The strategy that follows a context shift (set once it exists).
  void set_strategy(Strategy* s) { strategy_instance_ = s; }
  // Runs launched and not yet answered or cancelled, with their deadlines.
  RunDeadlines& deadlines() { return deadlines_; }
  // Whether `run` is one of this session's own (unmerged) runs; answered() forgets it.
  bool launched(uint64_t run) const { return runs_.count(run) != 0; }
  void answered(uint64_t run) { runs_.erase(run); }
  // Cancels every run still outstanding (the session ended or its strategy was dropped).
  void cancel_outstanding();
  // Empties the session's sequences in every pipeline (at its start and its end).
  void clear_caches();

 private:
  const PipelineRef& pipeline(const std::string& role) const;
  SeqSet translate(SeqSet s) const;
  int translate(int seq) const;
  std::vector<KvOp> translate(std::vector<KvOp> ops) const;
  void send_kv_ops(const PipelineRef& p, std::vector<KvOp> ops);
  bool shift_context();

  const HeadConfig& cfg_;
  SessionPtr session_;
  const StrategyInfo& strategy_;
  StrategyParams params_;
  int n_ctx_ = 0;
  SessionSeqs seqs_;
  RunMerger* merger_;
  TokenStream stream_;
  Sampler sampler_;
  RunIds& ids_;
  RunDeadlines deadlines_;
  std::unordered_set<uint64_t> runs_;
  Strategy* strategy_instance_ = nullptr;
};

}  // namespace specmesh
