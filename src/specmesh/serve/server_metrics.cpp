#include "specmesh/serve/server_metrics.hpp"

#include "specmesh/serve/heap_bytes.hpp"

#include <cstdio>

namespace specmesh::serve {

namespace {

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// Label values escape backslash, double quote and newline.
std::string label_value(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return out;
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

std::string braces(const std::string& labels) { return labels.empty() ? "" : "{" + labels + "}"; }

}  // namespace

void Histogram::observe(double v) {
  for (size_t i = 0; i < bounds_.size(); ++i)
    if (v <= bounds_[i]) {
      ++counts_[i];
      break;
    }
  ++count_;
  sum_ += v;
}

void Histogram::write(std::string& out, const std::string& name, const std::string& labels) const {
  const std::string sep = labels.empty() ? "" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + "_bucket{" + sep + "le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_bucket{" + sep + "le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum" + braces(labels) + " " + num(sum_) + "\n";
  out += name + "_count" + braces(labels) + " " + std::to_string(count_) + "\n";
}

void ServerMetrics::count_request(const std::string& path, int status) {
  std::lock_guard lk(mu_);
  ++requests_[{path, status}];
}

void ServerMetrics::count_generation(const GenerationResult& r, const std::string& outcome) {
  const Metrics& m = r.metrics;
  std::lock_guard lk(mu_);
  ++outcomes_[{m.strategy, outcome}];
  PerStrategy& s = strategies_[m.strategy];
  ++s.generations;
  s.prompt_tokens += uint64_t(r.stats.prompt_tokens);
  s.generated_tokens += r.ids.size();
  s.drafted += uint64_t(m.drafted);
  s.accepted += uint64_t(m.accepted);
  s.runs_launched += uint64_t(m.runs_launched);
  s.runs_cancelled += uint64_t(m.runs_cancelled);
  s.runs_wasted += uint64_t(m.runs_wasted);
  if (r.ids.empty()) return;  // no token: no latency to speak of
  s.ttft.observe(m.ttft_ms / 1000);
  if (r.ids.size() > 1) {
    s.itl.observe(m.mean_itl_ms / 1000);
    if (m.decode_tokens_per_s > 0) {
      s.tokens_per_s.observe(m.decode_tokens_per_s);
      s.decoded_tokens += r.ids.size() - 1;
      s.decode_seconds += double(r.ids.size() - 1) / m.decode_tokens_per_s;
    }
  }
}

std::string ServerMetrics::exposition() const {
  std::lock_guard lk(mu_);
  std::string out;
  header(out, "specmesh_http_requests_total", "counter", "HTTP requests answered, by route and status");
  for (const auto& [key, n] : requests_)
    out += "specmesh_http_requests_total{path=\"" + label_value(key.first) + "\",status=\"" + std::to_string(key.second) +
           "\"} " + std::to_string(n) + "\n";
  header(out, "specmesh_http_errors_total", "counter", "HTTP requests answered with a status of 400 or more");
  std::map<int, uint64_t> errors;
  for (const auto& [key, n] : requests_)
    if (key.second >= 400) errors[key.second] += n;
  for (const auto& [status, n] : errors)
    out += "specmesh_http_errors_total{status=\"" + std::to_string(status) + "\"} " + std::to_string(n) + "\n";
  header(out, "specmesh_generations_in_flight", "gauge", "generations running or queued now");
  out += "specmesh_generations_in_flight " + std::to_string(in_flight_) + "\n";
  if (auto heap = heap_allocated_bytes()) {
    header(out, "specmesh_heap_allocated_bytes", "gauge", "bytes allocated on the heap and not yet freed");
    out += "specmesh_heap_allocated_bytes " + std::to_string(*heap) + "\n";
  }
  header(out, "specmesh_generations_total", "counter", "generations ended, by strategy and outcome");
  for (const auto& [key, n] : outcomes_)
    out += "specmesh_generations_total{strategy=\"" + label_value(key.first) + "\",outcome=\"" + label_value(key.second) +
           "\"} " + std::to_string(n) + "\n";

  auto counter = [&](const char* name, const char* help, uint64_t PerStrategy::*field) {
    header(out, name, "counter", help);
    for (const auto& [strategy, s] : strategies_)
      out += std::string(name) + "{strategy=\"" + label_value(strategy) + "\"} " + std::to_string(s.*field) + "\n";
  };
  counter("specmesh_prompt_tokens_total", "prompt tokens processed", &PerStrategy::prompt_tokens);
  counter("specmesh_generated_tokens_total", "tokens generated", &PerStrategy::generated_tokens);
  counter("specmesh_draft_tokens_total", "draft tokens that reached a verification", &PerStrategy::drafted);
  counter("specmesh_accepted_tokens_total", "draft tokens the target accepted", &PerStrategy::accepted);
  counter("specmesh_runs_launched_total", "target runs started", &PerStrategy::runs_launched);
  counter("specmesh_runs_cancelled_total", "runs stopped before they finished", &PerStrategy::runs_cancelled);
  counter("specmesh_runs_wasted_total", "runs whose result was discarded", &PerStrategy::runs_wasted);

  header(out, "specmesh_acceptance_ratio", "gauge", "accepted / drafted draft tokens so far (0 without drafts)");
  for (const auto& [strategy, s] : strategies_)
    out += "specmesh_acceptance_ratio{strategy=\"" + label_value(strategy) + "\"} " +
           num(s.drafted ? double(s.accepted) / double(s.drafted) : 0.0) + "\n";
  header(out, "specmesh_decode_tokens_per_second", "gauge",
         "tokens after the first per second of decoding, over all generations so far");
  for (const auto& [strategy, s] : strategies_)
    out += "specmesh_decode_tokens_per_second{strategy=\"" + label_value(strategy) + "\"} " +
           num(s.decode_seconds > 0 ? double(s.decoded_tokens) / s.decode_seconds : 0.0) + "\n";

  auto histogram = [&](const char* name, const char* help, Histogram PerStrategy::*field) {
    header(out, name, "histogram", help);
    for (const auto& [strategy, s] : strategies_) (s.*field).write(out, name, "strategy=\"" + label_value(strategy) + "\"");
  };
  histogram("specmesh_time_to_first_token_seconds", "start of a generation to its first token", &PerStrategy::ttft);
  histogram("specmesh_inter_token_latency_seconds", "mean gap between a generation's tokens after the first",
            &PerStrategy::itl);
  histogram("specmesh_generation_tokens_per_second", "a generation's decode speed", &PerStrategy::tokens_per_s);
  return out;
}

}  // namespace specmesh::serve
