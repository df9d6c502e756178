// The fields of an OpenAI completions or chat completions request, read and checked: every
// malformed or unsupported field is an ApiError (400) naming it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "specmesh/chat/conversation.hpp"
#include "specmesh/generation.hpp"

namespace specmesh::serve {

// What a request leaves out: the server's command-line defaults.
struct RequestDefaults {
  SamplingParams sampling;  // the seed is drawn per request when the request has none
  int max_tokens = -1;      // -1: until the end of sequence or the session's context is full
};

// The part of a request that does not depend on the endpoint.
struct CompletionOptions {
  SamplingParams sampling;
  int max_tokens = 0;
  std::vector<std::string> stop;  // the request's own; a chat format's are added by the server
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage: a last chunk with the usage
  std::string model;              // as requested; empty when not given
  // The "specmesh" extension: {"strategy": NAME, "params": {"n_draft": 6}, "ignore_eos": true};
  // the runtime checks the strategy and its parameters (GenerationRequest::strategy, ::params).
  std::string strategy;           // empty: the server's
  std::vector<std::pair<std::string, std::string>> params;  // as `--param KEY=VALUE` takes them
  bool ignore_eos = false;
};

// Reads the fields both endpoints share. `random_seed` is used when the request has no seed.
CompletionOptions parse_options(const nlohmann::json& body, const RequestDefaults& defaults, uint64_t random_seed);

// POST /v1/completions: "prompt", a string (or a list holding one string).
std::string parse_prompt(const nlohmann::json& body);

// POST /v1/chat/completions: "messages", each {role, content}; content a string, null, or a list
// of {"type": "text", "text": ...} parts. "developer" is taken as "system", as OpenAI does.
std::vector<ChatMessage> parse_messages(const nlohmann::json& body);

// The body as JSON; a body that is not a JSON object is a 400.
nlohmann::json parse_body(const std::string& text);

}  // namespace specmesh::serve
