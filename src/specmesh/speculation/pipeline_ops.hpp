// Helpers every strategy uses on a role's pipeline: keeping its canonical sequence in step
// with the accepted tokens, feeding tokens in batches, and reading a run's logits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "specmesh/speculation/strategy.hpp"

namespace specmesh {

// A pipeline's KV sequence (0 unless given) is tracked by the strategy as `cached`, the tokens
// its cache holds. sync_cache drops what diverged from `want` (and the last wanted token, whose
// logits the caller needs) with a cache operation, and returns the tokens still to feed.
std::vector<int32_t> sync_cache(StrategyHost& host, const std::string& role, std::vector<int32_t>& cached,
                                const std::vector<int32_t>& want, int32_t seq = 0);
// Follows a context shift (Strategy::context_shifted) in `cached`: the tokens at
// [n_keep, n_keep + n_discard) are gone and the later ones moved down, as in the cache.
// (Any per-position record: tokens, or the taps that hold each position.)
template <class T>
void shift_cached(std::vector<T>& cached, int n_keep, int n_discard) {
  const size_t b = std::min(cached.size(), size_t(std::max(0, n_keep)));
  const size_t e = std::min(cached.size(), b + size_t(std::max(0, n_discard)));
  cached.erase(cached.begin() + long(b), cached.begin() + long(e));
}
// Feeds `toks` after `cached` into sequence 0, in chunks of n_batch, with logits for the last
// `tail` of them; returns the id of the last run.
uint64_t feed(StrategyHost& host, const std::string& role, std::vector<int32_t>& cached,
              const std::vector<int32_t>& toks, size_t tail);
// The logits of a run, checked to hold `want_rows` rows of n_vocab.
std::vector<float> rows_of(const Logits& l, size_t want_rows, int n_vocab, uint64_t run);
// Softmax probability of the most likely token: the draft's confidence.
float top_probability(const float* logits, int n_vocab);

// Plain decoding's loop: the prompt into the target's pipeline, then one run per accepted
// token. For strategies whose speculation happens below the head, or none at all.
class OneRunPerToken {
 public:
  explicit OneRunPerToken(StrategyHost& h) : h_(h) {}
  void start();
  // Samples and accepts the token of the awaited run (earlier prefill chunks are ignored)
  // and launches the next run.
  void on_logits(uint64_t run, const Logits& l);
  uint64_t awaited() const { return awaited_; }
  // Follows a context shift (Strategy::context_shifted): drops the tokens the cache lost.
  bool context_shifted(int n_keep, int n_discard);

 private:
  StrategyHost& h_;
  std::vector<int32_t> cached_;
  uint64_t awaited_ = 0;
};

}  // namespace specmesh
