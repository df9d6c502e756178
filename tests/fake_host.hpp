// A StrategyHost with no actors, sockets or threads, for message-level tests of the decoding
// strategies. Every launch, cache operation, cancel, accept and finish is logged in order.
// Each role's pipeline is one simulated stage: runs and cache operations are processed in the
// order they were sent (llama.cpp seq_rm/seq_cp/seq_keep semantics, as KvCache), a run
// cancelled before it is processed is skipped (a run with inputs, a block drafter's, keeps only
// the rows that took taps), and a run's logits come from the role's
// script (an oracle over the tokens the row attends to). The test decides when each run's
// result arrives, so several runs can be in flight.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "specmesh/speculation/strategy.hpp"

namespace specmesh::test {

// The logits for the token after `seen` (the tokens at positions 0..n-1 a batch row attends
// to, its own token last).
using Oracle = std::function<std::vector<float>(const std::vector<int32_t>& seen)>;
using NextToken = std::function<int32_t(const std::vector<int32_t>& seen)>;

// Logits whose softmax gives `token` probability `confidence` and spreads the rest evenly.
std::vector<float> peaked(int n_vocab, int32_t token, float confidence);
// An oracle that always predicts next(seen) with the given confidence.
Oracle greedy_oracle(int n_vocab, NextToken next, float confidence = 0.99f);
// A target whose next token depends on the whole history, so a stale or missing cache cell
// changes what it predicts; it never predicts `avoid`.
NextToken history_hash(int n_vocab, int32_t avoid = -1);
// A draft that predicts what `target` does except for the tokens at `positions` (the
// position of the predicted token: seen.size()).
NextToken disagree_at(NextToken target, std::vector<int32_t> positions, int n_vocab);
// What plain greedy decoding with `next` emits after the prompt: up to n tokens, ending
// before `stop`.
std::vector<int32_t> greedy_continuation(std::vector<int32_t> prompt, const NextToken& next, int n, int32_t stop = -1);
// The same with llama.cpp's context shift: once the tokens exceed n_ctx, the first n_keep stay
// and half of the rest after them go.
std::vector<int32_t> greedy_shifting(std::vector<int32_t> prompt, const NextToken& next, int n, int n_ctx, int n_keep);

struct LaunchRecord {
  uint64_t run = 0;
  std::string role;
  Batch batch;
  bool speculative = false;
  std::vector<TapRow> inputs;  // per row, the tapped row it takes as input (launch's inputs)
  bool cancelled = false;  // host.cancel named it
  bool processed = false;  // the stage ran it (cells placed, logits computed)
  bool delivered = false;  // its logits reached the strategy
  bool dropped = false;    // the stage skipped it: nothing will arrive
  std::vector<std::vector<int32_t>> seen;  // per logits row, what the oracle was given
  std::vector<float> logits;               // rows x vocab
  bool pending() const { return !delivered && !dropped; }
  bool in_flight() const { return pending() && !cancelled; }
};

enum class EventKind { launch, kv_ops, cancel, accept, finish };
struct Event {
  EventKind kind;
  std::string role;             // launch, kv_ops, cancel
  uint64_t run = 0;             // launch
  std::vector<KvOp> ops;        // kv_ops
  std::vector<uint64_t> runs;   // cancel
  int32_t token = -1;           // accept
  std::string error;            // finish
};

struct FakeHostOptions {
  int vocab = 32;
  int n_batch = 512;
  int n_predict = 16;
  int32_t stop_token = -1;  // accepting it ends generation without appending it
  SamplerParams sampling{};
  // Cancels reach the stage only after it ran the run, so its logits arrive all the same.
  bool cancel_too_late = false;
  // Positions a session may use (a run past them is an error). When an accepted token fills
  // them, the host shifts as the head does (keeping n_keep tokens, dropping half the rest)
  // with context_shift, and ends the session (no error) without it.
  int n_ctx = 1 << 30;
  bool context_shift = false;
  int n_keep = 0;
};

class FakeHost final : public StrategyHost {
 public:
  FakeHost(std::vector<int32_t> prompt, FakeHostOptions o = {});

  void script(const std::string& role, Oracle o) { oracles_[role] = std::move(o); }
  // Makes the registered strategy through its factory, parameters resolved by its schema, and
  // starts it.
  void start(const std::string& name, const std::map<std::string, ParamValue>& params = {});

  // Processes the role's queue up to `run` and hands its logits to the strategy, even when it
  // was cancelled (the cancel arrived too late).
  void deliver(uint64_t run);
  // The stage skipped `run`: nothing arrives for it.
  void drop(uint64_t run);
  // The oldest pending run of a role.
  std::optional<uint64_t> oldest(const std::string& role) const;
  // Settles the oldest pending run of a role the way a stage would: a cancelled run is
  // dropped, any other delivered. False when the role has nothing pending.
  bool settle_next(const std::string& role);
  // Settles runs until generation is over, choosing among the roles' oldest pending runs
  // with `pick` (index into the candidates), calling `after` after each. Records an error
  // when nothing is pending before the end or `max_steps` pass.
  using Pick = std::function<size_t(const std::vector<const LaunchRecord*>& candidates)>;
  void run_to_end(const Pick& pick, const std::function<void()>& after = {}, int max_steps = 10000);
  static Pick oldest_first();
  static Pick prefer(const std::string& role);
  static Pick shuffled(uint64_t seed);
  // The role's oldest run with probability `share` (a pipeline that much faster), else
  // another role's.
  static Pick favour(const std::string& role, double share, uint64_t seed);

  const std::vector<Event>& events() const { return events_; }
  std::vector<Event> events(EventKind kind, const std::string& role = {}) const;
  const std::deque<LaunchRecord>& launches() const { return launches_; }
  std::vector<const LaunchRecord*> launches(const std::string& role) const;
  const LaunchRecord& launch_of(uint64_t run) const;
  const std::vector<int32_t>& generated() const { return emitted_; }  // every accepted token
  // Everything that went wrong: incoherent caches, accepts after the end, strategy errors.
  const std::vector<std::string>& errors() const { return errors_; }
  bool strategy_alive() const { return bool(strategy_); }

  // StrategyHost
  using StrategyHost::launch;
  // A row with an input must name a target run (not cancelled) that computes its position,
  // with the token the canonical sequence has there once it has one (the hidden states it
  // takes are the right ones; beyond the accepted tokens they are a guess).
  uint64_t launch(const std::string& role, const Batch& batch, bool speculative, const std::vector<TapRow>& inputs) override;
  void kv_ops(const std::string& role, std::vector<KvOp> ops) override;
  void cancel(const std::string& role, const std::vector<uint64_t>& runs) override;
  bool accept(int32_t token) override;
  void finish(std::string error = {}) override;
  bool done() const override { return done_; }
  Sampler& sampler() override { return sampler_; }
  SpecMetrics& metrics() override { return metrics_; }
  const std::vector<int32_t>& prompt() const override { return prompt_; }
  const std::vector<int32_t>& tokens() const override { return tokens_; }
  bool has_role(const std::string& role) const override { return oracles_.count(role) > 0; }
  int vocab() const override { return opt_.vocab; }
  int n_batch() const override { return opt_.n_batch; }
  int n_ctx() const override { return opt_.n_ctx; }
  int context_shifts() const { return shifts_; }
  // The most KV cells a role's stage held at once (right after placing a run's rows).
  int peak_cells(const std::string& role) const { return peak_cells_.count(role) ? peak_cells_.at(role) : 0; }
  const StrategyParams& params() const override { return params_; }

 private:
  struct Cell {
    int32_t pos, token;
    SeqSet seqs;
  };
  struct Stage {
    std::vector<Cell> cells;
    std::vector<std::variant<uint64_t, std::vector<KvOp>>> queue;  // runs and cache operations
    std::array<std::optional<KvOp>, kMaxSeqs> views;                // the view op of each sequence
  };
  // KV views: a row in a sequence with a view (the lowest such) gives its oracle only the
  // tokens the view reads, in position order. A StreamingLLM view reads its sink and window;
  // the retrieval view, lacking keys here, ranks chunk 0 first and then the other chunks
  // latest first, and reads what RetrievalView would of that ranking.
  static const KvOp* view_of(const Stage& st, SeqSet seqs);
  static std::vector<int32_t> through_view(const KvOp& view, const std::vector<int32_t>& seen);
  LaunchRecord& record(uint64_t run);
  void process_until(const std::string& role, uint64_t run);
  void process(Stage& st, LaunchRecord& r, bool skip_if_cancelled);
  void apply(Stage& st, const std::string& role, const KvOp& op);
  void error(std::string what) { errors_.push_back(std::move(what)); }
  void after_message();

  FakeHostOptions opt_;
  std::vector<int32_t> prompt_, tokens_, emitted_;
  Sampler sampler_;
  SpecMetrics metrics_;
  StrategyParams params_;
  std::unique_ptr<Strategy> strategy_;
  std::map<std::string, Oracle> oracles_;
  std::map<std::string, Stage> stages_;
  std::deque<LaunchRecord> launches_;  // references stay valid as runs are added
  std::vector<Event> events_;
  std::vector<std::string> errors_;
  uint64_t next_run_ = 1;
  bool done_ = false;
  int shifts_ = 0;
  std::map<std::string, int> peak_cells_;
};

// Parameters `base` with `more` laid over them.
inline std::map<std::string, ParamValue> with(std::map<std::string, ParamValue> base,
                                              const std::map<std::string, ParamValue>& more) {
  for (const auto& [k, v] : more) base[k] = v;
  return base;
}

// The scripted setup the strategy tests share: a 32-token vocabulary, a short prompt, a target
// whose next token hashes what it has seen, and the draft's role name.
namespace scripted {
constexpr int kVocab = 32;
inline const char* const kDraft = "draft";
inline const std::vector<int32_t> kPrompt = {3, 1, 4, 1, 5};
inline const int32_t L = int32_t(kPrompt.size());
inline const NextToken kTarget = history_hash(kVocab);
}  // namespace scripted

}  // namespace specmesh::test
