// What a client asks of specmesh and what it gets back: plain data, no dependencies.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace specmesh {

// How a token is drawn from the target's logits.
struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  uint64_t seed = 0;
};

struct GenerationRequest {
  std::string prompt;
  // Tokens to generate. 0: the configuration's default; -1: until the end-of-sequence token or
  // the session's context is full (with context_shift: until the end-of-sequence token).
  int n_predict = 0;
  std::optional<SamplingParams> sampling; // default: the configuration's
  bool ignore_eos = false;
  // Special-token text in the prompt ("<|im_start|>") becomes those tokens, as a rendered
  // chat template needs (llama.cpp's parse_special); otherwise it is plain text.
  bool parse_special = false;
  // The decoding strategy for this request (a registered name); empty: the configuration's.
  // Its roles must be pipelines of the topology. Strategies that pair two devices (alspec)
  // shape the topology itself: only the configured one may run there, and none elsewhere.
  std::string strategy;
  // Its parameters as text, KEY and VALUE as `--param KEY=VALUE` takes them, checked against the
  // strategy's schema the same way; the configuration's values apply when `strategy` is empty
  // or names the configured strategy, the schema's defaults otherwise, then these.
  std::vector<std::pair<std::string, std::string>> params;
  // When the session's context is full: false ends the generation with ErrorKind::context_full;
  // true shifts the context as llama.cpp does (the first n_keep tokens stay, the oldest half of
  // the rest goes, later positions move down) and generation goes on.
  bool context_shift = false;
  // Tokens at the start of the prompt a context shift keeps (a leading BOS always stays);
  // -1: the whole prompt.
  int n_keep = 0;
};

// Why a generation failed, for callers that map failures to their own codes (HTTP statuses).
enum class ErrorKind {
  none,             // no error
  invalid_request,  // a field of the request is wrong (strategy, parameter, sampling)
  context_full,     // the prompt does not fit the session's context, or the context filled up
                    // without context_shift (the tokens so far are kept)
  busy,             // the admission queue is full (RuntimeOptions::max_queued): try again later
  unavailable,      // a node of a pipeline is down or stopped answering
  internal,         // anything else: a stage's error, a broken invariant
};
inline const char* to_string(ErrorKind k) {
  switch (k) {
    case ErrorKind::none: return "none";
    case ErrorKind::invalid_request: return "invalid_request";
    case ErrorKind::context_full: return "context_full";
    case ErrorKind::busy: return "busy";
    case ErrorKind::unavailable: return "unavailable";
    case ErrorKind::internal: return "internal";
  }
  return "internal";
}

// How a generation ended.
enum class FinishReason {
  length,     // n_predict tokens generated
  stop,       // the end-of-sequence token (or the stream callback returned false)
  cancelled,  // Generation::cancel
  error,      // see GenerationResult::error_kind
};

struct GenerationStats {
  int prompt_tokens = 0;
  int generated_tokens = 0;
  double ttft_ms = 0;              // start to first generated token (prompt processing included)
  double decode_tokens_per_s = 0;  // generated tokens after the first, per second
  double total_ms = 0;
};

// What a speculative generation measured: latency, throughput, acceptance and how much
// speculative work was launched, cancelled or thrown away.
struct Metrics {
  std::string strategy;
  std::string target;              // target model name
  std::string draft;               // draft model name, empty without one
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double ttft_ms = 0;              // start to the first generated token
  double prefill_ms = 0;           // start to the prompt's logits at the head (0: not seen)
  // The PipeInfer paper's time to first token: from the prompt's logits (the end of prompt
  // processing) to the first token after the one sampled from them; 0 with fewer than two.
  double ttft_after_prefill_ms = 0;
  double mean_itl_ms = 0;          // mean gap between consecutive generated tokens after the first
  double itl_p50_ms = 0;           // median of those gaps (0 when most tokens come in bursts)
  double itl_p99_ms = 0;           // their 99th percentile (nearest rank)
  double decode_tokens_per_s = 0;  // generated tokens after the first, per second
  int64_t drafted = 0;             // draft tokens that reached a verification
  int64_t accepted = 0;            // draft tokens the target accepted
  int64_t verifications = 0;       // target runs that verified drafts
  int64_t max_accepted_depth = 0;  // most draft tokens one verification accepted
  // accepted_hist[d]: verifications that accepted d draft tokens (they yielded d + 1 tokens:
  // DFlash's tau histogram, shifted by one).
  std::vector<int64_t> accepted_hist;
  int64_t runs_launched = 0;       // target runs started
  int64_t runs_cancelled = 0;      // runs stopped before they finished
  int64_t runs_wasted = 0;         // runs that finished but whose result was discarded
  int64_t failovers = 0;           // times the generation moved stages to a standby and went on
  // Attention-level speculation, over the decode tokens and their layers:
  int64_t attention_checks = 0;    // layer attentions speculated
  int64_t attention_hits = 0;      // speculations accepted
  double overlap_saved_ms = 0;     // modelled time the accepted ones saved (0 without timing)
  std::vector<double> layer_hit_rates;  // per layer: share of the tokens accepted there
  std::vector<double> token_hit_rates;  // per decode token: share of its layers accepted
  // Hierarchical speculation (TriForce): the lower level, where the middle model (the target's
  // weights over a partial KV cache) verifies the tiny draft's tokens. The fields above count
  // the upper level: the middle level's tokens the target verified with its full cache.
  int64_t middle_drafted = 0;        // tiny-draft tokens that reached a middle-level verification
  int64_t middle_accepted = 0;       // of those, accepted by the middle level
  int64_t middle_verifications = 0;  // middle-level verification runs
  int64_t cache_rebuilds = 0;        // times the partial (retrieval) cache was rebuilt
  // Block drafting (DFlash) with async: drafts launched before the verification they assume
  // (that it accepts the whole block), and those whose guess held and were used.
  int64_t speculative_drafts = 0;
  int64_t speculative_drafts_used = 0;

  // accepted / drafted; 0 when nothing was drafted.
  double acceptance_rate() const { return drafted > 0 ? double(accepted) / double(drafted) : 0.0; }
  // middle_accepted / middle_drafted, and tokens per middle-level verification; 0 without any.
  double middle_acceptance_rate() const {
    return middle_drafted > 0 ? double(middle_accepted) / double(middle_drafted) : 0.0;
  }
  double middle_tokens_per_verification() const {
    return middle_verifications > 0 ? double(middle_accepted + middle_verifications) / double(middle_verifications) : 0.0;
  }
  // attention_hits / attention_checks; 0 without any.
  double attention_hit_rate() const {
    return attention_checks > 0 ? double(attention_hits) / double(attention_checks) : 0.0;
  }
  // Tokens one verification yields: (accepted + verifications) / verifications; 0 without any.
  double tokens_per_verification() const {
    return verifications > 0 ? double(accepted + verifications) / double(verifications) : 0.0;
  }
  // Draft tokens (tree nodes, or a chain's length) per verification: drafted / verifications.
  double tree_size() const { return verifications > 0 ? double(drafted) / double(verifications) : 0.0; }
  // Depth of the accepted path per verification: accepted / verifications.
  double accepted_depth() const { return verifications > 0 ? double(accepted) / double(verifications) : 0.0; }
};

struct GenerationResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> ids;  // accepted tokens, also when generation failed part-way
  std::string text;
  GenerationStats stats;
  Metrics metrics;
  std::string error;         // empty on success
  ErrorKind error_kind = ErrorKind::none;  // set with every error
  FinishReason finish_reason = FinishReason::length;
  int context_shifts = 0;    // times the context was shifted (GenerationRequest::context_shift)
  // Tokens the session's context held (Runtime::session_context for the request); 0 when the
  // request never started.
  int context = 0;
  bool ok() const { return error.empty(); }
};

// Called with each accepted token and its text; returning false stops generation.
using StreamCallback = std::function<bool(int32_t id, const std::string& piece)>;
// Called once with the result when a generation ends.
using DoneCallback = std::function<void(const GenerationResult& result)>;

}  // namespace specmesh
