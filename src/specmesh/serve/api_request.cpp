#include "specmesh/serve/api_request.hpp"

#include <cmath>
#include <cstdio>
#include <limits>

#include "specmesh/serve/api_error.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh::serve {

namespace {

using nlohmann::json;

// The field's value when present and not null.
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

double number_in(const json& body, const char* name, double lo, double hi, double fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < lo || v->get<double>() > hi)
    throw bad_field(name, std::string("'") + name + "' must be a number from " + json(lo).dump() + " to " +
                              json(hi).dump() + ", not " + v->dump());
  return v->get<double>();
}

int64_t integer_in(const json& body, const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  const bool integral = v->is_number_integer() ||
                        (v->is_number_float() && std::isfinite(v->get<double>()) && v->get<double>() == std::floor(v->get<double>()));
  if (!integral || v->get<double>() < double(lo) || v->get<double>() > double(hi))
    throw bad_field(name, std::string("'") + name + "' must be an integer from " + std::to_string(lo) + " to " +
                              std::to_string(hi) + ", not " + v->dump());
  return v->is_number_unsigned() ? int64_t(v->get<uint64_t>()) : v->get<int64_t>();
}

bool boolean(const json& body, const char* name, const std::string& path) {
  const json* v = field(body, name);
  if (!v) return false;
  if (!v->is_boolean()) throw bad_field(path, "'" + path + "' must be true or false, not " + v->dump());
  return v->get<bool>();
}

// Fields of the API that ask for what this server does not do: refused rather than ignored,
// so a client never gets an answer it did not ask for.
void refuse_unsupported(const json& body) {
  if (const json* n = field(body, "n"); n && *n != 1)
    throw bad_field("n", "'n' must be 1: one choice per request (got " + n->dump() + ")");
  if (const json* b = field(body, "best_of"); b && *b != 1)
    throw bad_field("best_of", "'best_of' must be 1 (got " + b->dump() + ")");
  for (const char* name : {"logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias"}) {
    const json* v = field(body, name);
    const bool unset = !v || *v == false || *v == 0 || ((v->is_array() || v->is_object() || v->is_string()) && v->empty());
    if (!unset)
      throw bad_field(name, std::string("'") + name + "' is not supported by this server");
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    const json* v = field(body, name);
    if (v && (!v->is_number() || v->get<double>() != 0))
      throw bad_field(name, std::string("'") + name + "' is not supported by this server (only 0)");
  }
  if (const json* rf = field(body, "response_format"); rf && !(rf->is_object() && rf->value("type", "") == "text"))
    throw bad_field("response_format", "'response_format' must be {\"type\": \"text\"}: structured output is not supported");
}

std::vector<std::string> parse_stop(const json& body) {
  const json* v = field(body, "stop");
  if (!v) return {};
  std::vector<std::string> out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array() && v->size() <= 4) {
    for (const json& s : *v) {
      if (!s.is_string()) throw bad_field("stop", "'stop' must be a string or a list of up to 4 strings, not " + v->dump());
      out.push_back(s.get<std::string>());
    }
  } else {
    throw bad_field("stop", "'stop' must be a string or a list of up to 4 strings, not " + v->dump());
  }
  for (const std::string& s : out)
    if (s.empty()) throw bad_field("stop", "'stop' strings must not be empty");
  return out;
}

// The "specmesh" extension object.
void parse_extension(const json& body, CompletionOptions& o) {
  const json* ext = field(body, "specmesh");
  if (!ext) return;
  if (!ext->is_object()) throw bad_field("specmesh", "'specmesh' must be an object such as {\"strategy\": \"spec\"}");
  for (const auto& [key, value] : ext->items())
    if (key != "strategy" && key != "params" && key != "ignore_eos")
      throw bad_field("specmesh." + key, "unknown field 'specmesh." + key + "' (known: strategy, params, ignore_eos)");
  if (const json* s = field(*ext, "strategy")) {
    if (!s->is_string()) throw bad_field("specmesh.strategy", "'specmesh.strategy' must be a string");
    o.strategy = s->get<std::string>();
    if (!find_strategy(o.strategy))
      throw bad_field("specmesh.strategy", "unknown strategy '" + o.strategy + "' (registered: " + strategy_names() + ")");
  }
  if (const json* p = field(*ext, "params")) {
    if (!p->is_object()) throw bad_field("specmesh.params", "'specmesh.params' must be an object of parameter values");
    // Typed JSON values become the text `--param KEY=VALUE` takes: 4, 0.25, true, 1,1,3.
    for (const auto& [key, value] : p->items()) {
      const std::string path = "specmesh.params." + key;
      std::string text;
      if (value.is_boolean()) {
        text = value.get<bool>() ? "true" : "false";
      } else if (value.is_number_integer()) {
        text = std::to_string(value.get<int64_t>());
      } else if (value.is_number() && std::isfinite(value.get<double>())) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.17g", value.get<double>());
        text = buf;
      } else if (value.is_array() && !value.empty()) {
        for (const json& e : value) {
          if (!e.is_number_integer()) throw bad_field(path, "'" + path + "' must be a number, a boolean or a list of integers");
          if (!text.empty()) text += ',';
          text += std::to_string(e.get<int64_t>());
        }
      } else {
        throw bad_field(path, "'" + path + "' must be a number, a boolean or a list of integers, not " + value.dump());
      }
      o.params.emplace_back(key, std::move(text));
    }
  }
  o.ignore_eos = boolean(*ext, "ignore_eos", "specmesh.ignore_eos");
}

// A message's content: a string, null, or text parts.
std::string message_content(const json& content, size_t index) {
  const std::string path = "messages[" + std::to_string(index) + "].content";
  if (content.is_null()) return {};
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) throw bad_field(path, "'" + path + "' must be a string or a list of text parts");
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
      throw bad_field(path, "'" + path + "' may hold only {\"type\": \"text\", \"text\": ...} parts");
    text += part["text"].get<std::string>();
  }
  return text;
}

}  // namespace

json parse_body(const std::string& text) {
  json body = json::parse(text, nullptr, false);
  if (body.is_discarded())
    throw ApiError(400, "invalid_request_error", "invalid_json", "the request body is not valid JSON");
  if (!body.is_object()) throw ApiError(400, "invalid_request_error", "invalid_json", "the request body must be a JSON object");
  return body;
}

CompletionOptions parse_options(const json& body, const RequestDefaults& defaults, uint64_t random_seed) {
  refuse_unsupported(body);
  CompletionOptions o;
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) throw bad_field("model", "'model' must be a string");
    o.model = m->get<std::string>();
  }
  const SamplingParams& d = defaults.sampling;
  o.sampling.temperature = float(number_in(body, "temperature", 0, 2, d.temperature));
  o.sampling.top_p = float(number_in(body, "top_p", 0, 1, d.top_p));
  o.sampling.min_p = float(number_in(body, "min_p", 0, 1, d.min_p));
  o.sampling.top_k = int(integer_in(body, "top_k", 0, std::numeric_limits<int32_t>::max(), d.top_k));
  o.sampling.seed = uint64_t(integer_in(body, "seed", std::numeric_limits<int64_t>::min(),
                                        std::numeric_limits<int64_t>::max(), int64_t(random_seed)));
  // Chat requests may name the limit max_completion_tokens, as newer OpenAI clients do.
  const char* limit = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  o.max_tokens = int(integer_in(body, limit, 1, std::numeric_limits<int32_t>::max(), defaults.max_tokens));
  o.stop = parse_stop(body);
  o.stream = boolean(body, "stream", "stream");
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) throw bad_field("stream_options", "'stream_options' must be an object");
    o.include_usage = boolean(*so, "include_usage", "stream_options.include_usage");
  }
  parse_extension(body, o);
  return o;
}

std::string parse_prompt(const json& body) {
  const json* p = field(body, "prompt");
  if (!p) throw bad_field("prompt", "'prompt' is required");
  if (p->is_string()) return p->get<std::string>();
  if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) return (*p)[0].get<std::string>();
  throw bad_field("prompt", "'prompt' must be a string (or a list holding one string)");
}

std::vector<ChatMessage> parse_messages(const json& body) {
  const json* list = field(body, "messages");
  if (!list) throw bad_field("messages", "'messages' is required");
  if (!list->is_array() || list->empty()) throw bad_field("messages", "'messages' must be a non-empty list");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < list->size(); ++i) {
    const json& m = (*list)[i];
    const std::string path = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw bad_field(path, "'" + path + "' must be an object with a role and a content");
    const std::string role = m.contains("role") && m["role"].is_string() ? m["role"].get<std::string>() : "";
    auto parsed = parse_role(role == "developer" ? "system" : role);
    if (!parsed)
      throw bad_field(path + ".role", "'" + path + ".role' must be system, user or assistant, not " +
                                          (m.contains("role") ? m["role"].dump() : std::string("missing")));
    out.push_back({*parsed, message_content(m.contains("content") ? m["content"] : json(nullptr), i)});
  }
  return out;
}

}  // namespace specmesh::serve
