// The JSON every generating command prints with --json.
#pragma once

#include <nlohmann/json.hpp>

#include "specmesh/generation.hpp"
#include "specmesh/speculation/metrics.hpp"

namespace specmesh {

inline nlohmann::json result_json(const GenerationResult& r) {
  nlohmann::json j;
  j["prompt_ids"] = r.prompt_ids;
  j["ids"] = r.ids;
  j["text"] = r.text;
  nlohmann::json stats = r.metrics;
  stats["prompt_tokens"] = r.stats.prompt_tokens;
  stats["generated_tokens"] = r.stats.generated_tokens;
  stats["ttft_ms"] = r.stats.ttft_ms;
  stats["decode_tokens_per_s"] = r.stats.decode_tokens_per_s;
  stats["total_ms"] = r.stats.total_ms;
  stats["context_shifts"] = r.context_shifts;
  stats["context"] = r.context;
  j["stats"] = stats;
  if (!r.ok()) {
    j["error"] = r.error;
    j["error_kind"] = to_string(r.error_kind);
  }
  return j;
}

inline std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace specmesh
