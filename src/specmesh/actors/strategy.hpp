// What the head does with a request: plain autoregression, standard speculative decoding or
// PipeInfer. A strategy launches runs through HeadCore and reacts to the logits that come
// back; the head actor owns the session, the sockets and the bookkeeping they share.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "specmesh/actors/head.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/model/sampler.hpp"

namespace specmesh {

// The session-side state and the actions every strategy needs.
class HeadCore {
 public:
  // Run ids come from `next_run`, shared by all sessions of a head: stages remember
  // cancelled ids, so an id must never be reused.
  HeadCore(const HeadConfig& cfg, SessionPtr session, uint64_t& next_run);

  const HeadConfig& cfg() const { return cfg_; }
  Sampler& sampler() { return *sampler_; }
  SpecMetrics& metrics() { return result_.metrics; }
  const std::vector<int32_t>& prompt() const { return result_.prompt_ids; }
  // Prompt plus accepted tokens: the canonical sequence.
  const std::vector<int32_t>& tokens() const { return tokens_; }
  bool done() const { return done_; }

  // Sends a batch into a pipeline as a new run; returns its id.
  uint64_t launch(const PipelineRef& p, const Batch& batch, bool speculative);
  // Sends KV-cache operations into a pipeline, ordered with its runs.
  void kv_ops(const PipelineRef& p, std::vector<KvOp> ops);
  // Tells every stage of a pipeline to drop these runs (priority path).
  void cancel(const PipelineRef& p, const std::vector<uint64_t>& runs);

  // Appends an accepted token and streams it; false once generation is over (limit, stop
  // token, client stop), after which the strategy must not accept more.
  bool accept(int32_t token);
  // Ends the session (error empty: success).
  void finish(std::string error = {});

  int vocab() const { return cfg_.target.model->hparams().n_vocab; }

 private:
  const HeadConfig& cfg_;
  SessionPtr session_;
  GenerationResult result_;
  std::unique_ptr<Sampler> sampler_;
  std::unique_ptr<StreamDecoder> decoder_;
  std::vector<int32_t> tokens_;
  int n_predict_ = 0;
  bool done_ = false;
  uint64_t& next_run_;
  std::chrono::steady_clock::time_point t0_, t_last_;
  double itl_sum_ms_ = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual void start() = 0;
  virtual void on_logits(uint64_t run, const Logits& logits) = 0;
  // The session is over: drop whatever is still in flight so the next one does not queue
  // behind it.
  virtual void abandon() {}
};

std::unique_ptr<Strategy> make_strategy(HeadCore& core);

// A pipeline's sequence 0 is tracked by the head as `cached`, the tokens its cache holds.
// sync_cache drops what diverged from `want` (and the last wanted token, whose logits the
// caller needs) with a cache operation, and returns the tokens still to feed.
std::vector<int32_t> sync_cache(HeadCore& core, const PipelineRef& p, std::vector<int32_t>& cached,
                                const std::vector<int32_t>& want);
// Feeds `toks` after `cached` into sequence 0, in chunks of n_batch, with logits for the last
// `tail` of them; returns the id of the last run.
uint64_t feed(HeadCore& core, const PipelineRef& p, std::vector<int32_t>& cached, const std::vector<int32_t>& toks,
              size_t tail);
// The logits of a run, checked to hold `want_rows` rows.
std::vector<float> rows_of(const Logits& l, size_t want_rows, int n_vocab, uint64_t run);

// Softmax probability of the most likely token: the draft's confidence.
float top_probability(const float* logits, int n_vocab);

}  // namespace specmesh
