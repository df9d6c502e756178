// The JSON the completion routes answer with: whole responses, stream chunks, usage, the
// per-reply "specmesh" statistics, and the status of a generation that failed.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "specmesh/generation.hpp"
#include "specmesh/serve/api_error.hpp"

namespace specmesh::serve {

// What every response and chunk of one reply repeats.
struct ReplyHeader {
  std::string id;       // "chatcmpl-..." or "cmpl-..."
  std::string model;
  int64_t created = 0;  // unix seconds
  bool chat = false;    // chat.completion(.chunk) rather than text_completion
};

// {"prompt_tokens", "completion_tokens", "total_tokens"}.
nlohmann::json usage_json(const GenerationResult& r);
// The "specmesh" extension of a reply: strategy, tokens_per_second, acceptance (null when
// nothing was drafted), ttft_ms, drafted, accepted, generated tokens.
nlohmann::json stats_json(const GenerationResult& r);
// "length" (max tokens or the context reached) or "stop" (EOS, a stop string, a cancel).
std::string finish_reason(const GenerationResult& r);

// A whole (not streamed) response; it carries the reply's ids in "specmesh".
nlohmann::json response_json(const ReplyHeader& h, const std::string& text, const std::string& finish,
                             const GenerationResult& r);
// A stream chunk with `text`; a chat stream's first chunk says the role (`first`). With
// `finish` set it is the last choice chunk: finish_reason, usage and the statistics.
nlohmann::json chunk_json(const ReplyHeader& h, const std::string& text, bool first, const std::string& finish = {},
                          const GenerationResult* r = nullptr);
// The chunk stream_options.include_usage asks for after the last: no choices, the usage.
nlohmann::json usage_chunk_json(const ReplyHeader& h, const GenerationResult& r);

// JSON text; text that is not valid UTF-8 (a reply cut inside a character) becomes U+FFFD.
std::string json_text(const nlohmann::json& j);
// One server-sent event: "data: JSON\n\n".
std::string sse_event(const nlohmann::json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

// The HTTP status and error of a generation that failed: invalid_request 400, context_full
// 413, busy 429, unavailable 503, anything else 500.
ApiError generation_error(const GenerationResult& r);

}  // namespace specmesh::serve
