// The client's side of a session: accepted tokens become streamed text, stop rules end the
// generation, and timings become the result's statistics and metrics.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "specmesh/actors/head.hpp"
#include "specmesh/speculation/metrics.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

class TokenStream {
 public:
  // Encodes the prompt; the decoder sees it first so the continuation's spacing and UTF-8
  // come out right.
  TokenStream(SessionPtr session, const Model& target, int default_n_predict, std::string metrics_csv);

  const std::vector<int32_t>& prompt() const { return result_.prompt_ids; }
  // The context: prompt + accepted, less what context shifts dropped.
  const std::vector<int32_t>& tokens() const { return tokens_; }
  SpecMetrics& metrics() { return metrics_; }
  bool done() const { return done_; }

  // Appends and streams a token; false once generation is over (limit, stop token, client
  // stop), after which nothing more is accepted.
  bool accept(int32_t token);
  // Ends the session and hands the result to the client (error empty: success, with `kind`
  // ignored); appends the metrics row to metrics_csv when set.
  void finish(std::string error = {}, ErrorKind kind = ErrorKind::internal);
  // The target's logits for the prompt reached the head: prompt processing is over.
  void prompt_processed() { clock_.prompt_processed(); }
  // The session's context in tokens, reported in the result.
  void set_context(int n_ctx) { result_.context = n_ctx; }
  // Drops tokens [n_keep, n_keep + n_discard) of the context (a context shift).
  void shift(int n_keep, int n_discard);

 private:
  SessionPtr session_;
  const Model& target_;
  std::string metrics_csv_;
  GenerationResult result_;
  SpecMetrics metrics_;
  std::unique_ptr<StreamDecoder> decoder_;
  std::vector<int32_t> tokens_;
  int n_predict_ = 0;  // < 0: no limit
  FinishReason reason_ = FinishReason::length;
  bool done_ = false;
  TokenRecorder clock_;  // when each token was accepted
  double stop_ms_ = -1;  // when a stop token ended the generation before any token
};

}  // namespace specmesh
