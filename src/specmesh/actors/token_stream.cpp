#include "specmesh/actors/token_stream.hpp"

#include <spdlog/spdlog.h>

namespace specmesh {

TokenStream::TokenStream(SessionPtr session, const Model& target, int default_n_predict, std::string metrics_csv)
    : session_(std::move(session)), target_(target), metrics_csv_(std::move(metrics_csv)) {
  const Tokenizer& tok = target.tokenizer();
  result_.prompt_ids = tok.encode_prompt(session_->request.prompt, session_->request.parse_special);
  result_.stats.prompt_tokens = int(result_.prompt_ids.size());
  metrics_.prompt_tokens = result_.stats.prompt_tokens;
  tokens_ = result_.prompt_ids;
  n_predict_ = session_->request.n_predict != 0 ? session_->request.n_predict : default_n_predict;
  decoder_ = std::make_unique<StreamDecoder>(tok);
  for (int32_t t : result_.prompt_ids) decoder_->feed(t);
}

bool TokenStream::accept(int32_t token) {
  if (done_) return false;
  const auto now = TokenRecorder::Clock::now();
  if (!session_->request.ignore_eos && target_.stops_at(token)) {
    if (result_.ids.empty()) stop_ms_ = std::chrono::duration<double, std::milli>(now - clock_.start()).count();
    reason_ = FinishReason::stop;
    finish();
    return false;
  }
  clock_.accept(1, now);
  tokens_.push_back(token);
  result_.ids.push_back(token);
  ++result_.stats.generated_tokens;
  std::string piece = decoder_->feed(token);
  result_.text += piece;
  bool more = true;
  if (session_->cancel.load()) {
    reason_ = FinishReason::cancelled;
    more = false;
  } else if (session_->on_token && !session_->on_token(token, piece)) {
    reason_ = FinishReason::stop;
    more = false;
  }
  if (!more || (n_predict_ > 0 && int(result_.ids.size()) >= n_predict_)) {
    finish();
    return false;
  }
  return true;
}

void TokenStream::shift(int n_keep, int n_discard) {
  tokens_.erase(tokens_.begin() + n_keep, tokens_.begin() + n_keep + n_discard);
  ++result_.context_shifts;
}

void TokenStream::finish(std::string error, ErrorKind kind) {
  if (done_) return;
  done_ = true;
  result_.text += decoder_->flush();
  result_.error = std::move(error);
  result_.error_kind = result_.error.empty() ? ErrorKind::none : kind;
  result_.finish_reason = result_.error.empty() ? (session_->cancel.load() ? FinishReason::cancelled : reason_)
                                                : FinishReason::error;
  clock_.fill(metrics_);
  if (stop_ms_ >= 0) metrics_.ttft_ms = stop_ms_;  // the stop token was the first one
  GenerationStats& st = result_.stats;
  st.total_ms = std::chrono::duration<double, std::milli>(TokenRecorder::Clock::now() - clock_.start()).count();
  st.ttft_ms = metrics_.ttft_ms;
  st.decode_tokens_per_s = metrics_.decode_tokens_per_s;
  if (!result_.ok()) spdlog::error("generation failed after {} tokens: {}", result_.ids.size(), result_.error);
  if (!metrics_csv_.empty() && session_->record_metrics) {
    try {
      metrics_.append_csv(metrics_csv_);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
    }
  }
  result_.metrics = metrics_;
  // The session is released first, so a client that sees the result may submit again at once.
  session_->hand_over(std::move(result_));
}

}  // namespace specmesh
