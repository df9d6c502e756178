// What a decoding strategy sees of the head: the StrategyHost. A strategy launches runs into
// the pipelines of named roles ("target", "draft", ...), changes their KV caches, cancels runs,
// samples, and accepts tokens; the head actor implements the host over real pipelines, and the
// tests implement it over scripted logits (no actors, sockets or threads), so every strategy is
// tested deterministically at the message level.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "specmesh/messages/protocol.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/model/sampler.hpp"
#include "specmesh/speculation/metrics.hpp"
#include "specmesh/speculation/params.hpp"

namespace specmesh {

// The pipeline every strategy generates with.
inline constexpr const char* kTargetRole = "target";
// The draft model's pipeline, for strategies that have one; further drafts, whose proposals a
// strategy may merge, are draft2, draft3, ...: draft_role(i) for the i-th, from 0.
inline constexpr const char* kDraftRole = "draft";
inline std::string draft_role(int i) { return i == 0 ? kDraftRole : kDraftRole + std::to_string(i + 1); }

// A row of another run's tapped hidden states: row `row` of run `run`'s batch (run 0: none).
struct TapRow {
  uint64_t run = 0;
  int32_t row = 0;
  friend bool operator==(const TapRow&, const TapRow&) = default;
};

class StrategyHost {
 public:
  virtual ~StrategyHost() = default;

  // Sends a batch into a role's pipeline as a new run; returns its id (never reused). Logits
  // come back through Strategy::on_logits, in launch order per pipeline.
  uint64_t launch(const std::string& role, const Batch& batch, bool speculative) { return launch(role, batch, speculative, {}); }
  // The same for a pipeline conditioned on another's hidden states (a block drafter on the
  // target's taps): inputs[i], when its run is not 0, is the row whose tapped states are row
  // i's input.
  virtual uint64_t launch(const std::string& role, const Batch& batch, bool speculative,
                          const std::vector<TapRow>& inputs) = 0;
  // KV-cache operations on a role's pipeline, applied in order with its runs.
  virtual void kv_ops(const std::string& role, std::vector<KvOp> ops) = 0;
  // Tells every stage of a role's pipeline to drop these runs (priority path).
  virtual void cancel(const std::string& role, const std::vector<uint64_t>& runs) = 0;

  // Appends an accepted token and streams it; false once generation is over (limit, stop
  // token, client stop), after which the strategy must accept nothing more.
  virtual bool accept(int32_t token) = 0;
  // Ends the session (error empty: success).
  virtual void finish(std::string error = {}) = 0;
  virtual bool done() const = 0;

  virtual Sampler& sampler() = 0;
  virtual SpecMetrics& metrics() = 0;
  // The encoded prompt, and the prompt plus the accepted tokens (the canonical sequence).
  virtual const std::vector<int32_t>& prompt() const = 0;
  virtual const std::vector<int32_t>& tokens() const = 0;

  // Whether the setup has a pipeline for this role (strategies with optional roles ask).
  virtual bool has_role(const std::string& role) const = 0;
  virtual int vocab() const = 0;
  virtual int n_batch() const = 0;              // most tokens one run may carry
  // Positions a session may use: every run's positions stay below it. When accepting a token
  // fills it, the host shifts the context (Strategy::context_shifted) or ends the session.
  virtual int n_ctx() const = 0;
  virtual const StrategyParams& params() const = 0;
  // KV sequences the strategy may use, 0 .. sequences() - 1 (the head gives each session a
  // range of the cache's sequences and translates these ids into it).
  virtual int sequences() const { return kMaxSeqs; }
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  // Starts from the host's tokens(): the prompt, or after a failover the prompt and the
  // tokens accepted before it, with every cache empty.
  virtual void start() = 0;
  // The logits of a run (Logits::pipeline names the role it was launched into).
  virtual void on_logits(uint64_t run, const Logits& logits) = 0;
  // Hidden states a stage tapped for this strategy (StageConfig::tap_layers), which arrive
  // before their run's logits when they travel the same link.
  virtual void on_hidden_states(uint64_t run, const HiddenStates& states) {}
  // An attention-level speculation pair's report on a decode token (StrategyInfo::pair_role),
  // which arrives before the run's logits.
  virtual void on_attention_report(uint64_t run, const AttentionSync& report) {}
  // The session is over: drop whatever is still in flight so the next one does not queue
  // behind it.
  virtual void abandon() {}
  // The context was full and the host shifted it (GenerationRequest::context_shift): tokens
  // [n_keep, n_keep + n_discard) of tokens() are gone, later ones moved down by n_discard, in
  // tokens() and in every cache of the session (the cache operation is already on its way).
  // Called from inside accept(), before it returns. False: the strategy cannot follow a shift,
  // and the session ends with a context_full error instead.
  virtual bool context_shifted(int n_keep, int n_discard) { return false; }
};

}  // namespace specmesh
