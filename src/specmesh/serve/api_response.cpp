#include "specmesh/serve/api_response.hpp"

namespace specmesh::serve {

using nlohmann::json;

namespace {

json base(const ReplyHeader& h, const char* object) {
  return {{"id", h.id}, {"object", object}, {"created", h.created}, {"model", h.model}};
}

}  // namespace

json usage_json(const GenerationResult& r) {
  const int64_t prompt = int64_t(r.prompt_ids.size()), completion = int64_t(r.ids.size());
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

json stats_json(const GenerationResult& r) {
  const Metrics& m = r.metrics;
  return {{"strategy", m.strategy},
          {"tokens_per_second", m.decode_tokens_per_s},
          {"acceptance", m.drafted > 0 ? json(m.acceptance_rate()) : json(nullptr)},
          {"ttft_ms", m.ttft_ms},
          {"drafted", m.drafted},
          {"accepted", m.accepted},
          {"generated_tokens", int64_t(r.ids.size())},
          {"total_ms", r.stats.total_ms}};
}

std::string finish_reason(const GenerationResult& r) { return r.finish_reason == FinishReason::length ? "length" : "stop"; }

json response_json(const ReplyHeader& h, const std::string& text, const std::string& finish, const GenerationResult& r) {
  json choice = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
  if (h.chat)
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  else
    choice["text"] = text;
  json j = base(h, h.chat ? "chat.completion" : "text_completion");
  j["choices"] = json::array({choice});
  j["usage"] = usage_json(r);
  j["specmesh"] = stats_json(r);
  j["specmesh"]["ids"] = r.ids;
  return j;
}

json chunk_json(const ReplyHeader& h, const std::string& text, bool first, const std::string& finish,
                const GenerationResult* r) {
  json choice = {{"index", 0}, {"finish_reason", finish.empty() ? json(nullptr) : json(finish)}, {"logprobs", nullptr}};
  if (h.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  json j = base(h, h.chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = json::array({choice});
  if (r) {
    j["usage"] = usage_json(*r);
    j["specmesh"] = stats_json(*r);
  }
  return j;
}

json usage_chunk_json(const ReplyHeader& h, const GenerationResult& r) {
  json j = base(h, h.chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = json::array();
  j["usage"] = usage_json(r);
  return j;
}

std::string json_text(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& j) { return "data: " + json_text(j) + "\n\n"; }

ApiError generation_error(const GenerationResult& r) {
  switch (r.error_kind) {
    case ErrorKind::invalid_request:
      return ApiError(400, "invalid_request_error", "invalid_value", r.error);
    case ErrorKind::context_full:
      return ApiError(413, "invalid_request_error", "context_length_exceeded", r.error);
    case ErrorKind::busy:
      return ApiError(429, "rate_limit_error", "server_busy", r.error);
    case ErrorKind::unavailable:
      return ApiError(503, "server_error", "unavailable", r.error);
    default:
      return ApiError(500, "server_error", "generation_failed", "generation failed: " + r.error);
  }
}

}  // namespace specmesh::serve
