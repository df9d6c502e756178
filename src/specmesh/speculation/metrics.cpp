#include "specmesh/speculation/metrics.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace specmesh {

namespace {

// Shortest text that reads back to the same double, so CSV values round-trip.
std::string number(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

// RFC 4180: quote fields holding a separator, quote or line break; double inner quotes.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  out += '"';
  return out;
}

std::string csv_line(const std::vector<std::string>& fields) {
  std::string line;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) line += ',';
    line += csv_field(fields[i]);
  }
  line += '\n';
  return line;
}

std::string os_error(const char* what) {
  return errno ? std::string(what) + ": " + std::strerror(errno) : std::string(what);
}

// "12 30 4": counts separated by spaces, one CSV field.
std::string hist_text(const std::vector<int64_t>& h) {
  std::string out;
  for (int64_t n : h) out += (out.empty() ? "" : " ") + std::to_string(n);
  return out;
}

double ms(TokenRecorder::Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

const std::vector<std::string>& SpecMetrics::csv_columns() {
  static const std::vector<std::string> cols = {
      "strategy", "target_model", "draft_model", "prompt_tokens", "generated_tokens", "ttft_ms", "mean_itl_ms",
      "decode_tokens_per_s", "drafted", "accepted", "acceptance_rate", "verifications", "tokens_per_verification",
      "tree_size", "accepted_depth", "max_accepted_depth",
      "runs_launched", "runs_cancelled", "runs_wasted", "attention_checks", "attention_hits", "attention_hit_rate",
      "overlap_saved_ms", "middle_drafted", "middle_accepted", "middle_acceptance_rate", "middle_verifications",
      "middle_tokens_per_verification", "cache_rebuilds", "itl_p50_ms", "itl_p99_ms", "failovers", "accepted_hist", "speculative_drafts", "speculative_drafts_used",
      "prefill_ms", "ttft_after_prefill_ms"};
  return cols;
}

std::vector<std::string> SpecMetrics::csv_values() const {
  return {strategy,
          target,
          draft,
          std::to_string(prompt_tokens),
          std::to_string(generated_tokens),
          number(ttft_ms),
          number(mean_itl_ms),
          number(decode_tokens_per_s),
          std::to_string(drafted),
          std::to_string(accepted),
          number(acceptance_rate()),
          std::to_string(verifications),
          number(tokens_per_verification()),
          number(tree_size()),
          number(accepted_depth()),
          std::to_string(max_accepted_depth),
          std::to_string(runs_launched),
          std::to_string(runs_cancelled),
          std::to_string(runs_wasted),
          std::to_string(attention_checks),
          std::to_string(attention_hits),
          number(attention_hit_rate()),
          number(overlap_saved_ms),
          std::to_string(middle_drafted),
          std::to_string(middle_accepted),
          number(middle_acceptance_rate()),
          std::to_string(middle_verifications),
          number(middle_tokens_per_verification()),
          std::to_string(cache_rebuilds),
          number(itl_p50_ms),
          number(itl_p99_ms),
          std::to_string(failovers),
          hist_text(accepted_hist),
          std::to_string(speculative_drafts),
          std::to_string(speculative_drafts_used),
          number(prefill_ms),
          number(ttft_after_prefill_ms)};
}

nlohmann::json SpecMetrics::to_json() const {
  return {{"strategy", strategy},
          {"target_model", target},
          {"draft_model", draft},
          {"prompt_tokens", prompt_tokens},
          {"generated_tokens", generated_tokens},
          {"ttft_ms", ttft_ms},
          {"prefill_ms", prefill_ms},
          {"ttft_after_prefill_ms", ttft_after_prefill_ms},
          {"mean_itl_ms", mean_itl_ms},
          {"itl_p50_ms", itl_p50_ms},
          {"itl_p99_ms", itl_p99_ms},
          {"decode_tokens_per_s", decode_tokens_per_s},
          {"drafted", drafted},
          {"accepted", accepted},
          {"acceptance_rate", acceptance_rate()},
          {"verifications", verifications},
          {"tokens_per_verification", tokens_per_verification()},
          {"tree_size", tree_size()},
          {"accepted_depth", accepted_depth()},
          {"max_accepted_depth", max_accepted_depth},
          {"accepted_hist", accepted_hist},
          {"runs_launched", runs_launched},
          {"runs_cancelled", runs_cancelled},
          {"runs_wasted", runs_wasted},
          {"failovers", failovers},
          {"attention_checks", attention_checks},
          {"attention_hits", attention_hits},
          {"attention_hit_rate", attention_hit_rate()},
          {"overlap_saved_ms", overlap_saved_ms},
          {"middle_drafted", middle_drafted},
          {"middle_accepted", middle_accepted},
          {"middle_acceptance_rate", middle_acceptance_rate()},
          {"middle_verifications", middle_verifications},
          {"middle_tokens_per_verification", middle_tokens_per_verification()},
          {"cache_rebuilds", cache_rebuilds},
          {"speculative_drafts", speculative_drafts},
          {"speculative_drafts_used", speculative_drafts_used},
          {"layer_hit_rates", layer_hit_rates},
          {"token_hit_rates", token_hit_rates}};
}

void to_json(nlohmann::json& j, const Metrics& m) { j = SpecMetrics(m).to_json(); }

void SpecMetrics::append_csv(const std::string& path) const {
  const std::string header = csv_line(csv_columns());
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);  // an error here means no file yet (or a directory)
  const bool fresh = ec || size == 0;
  if (!fresh) {
    std::ifstream in(path, std::ios::binary);
    std::string first;
    std::getline(in, first);
    if (!first.empty() && first.back() == '\r') first.pop_back();
    if (first + '\n' != header)
      throw std::runtime_error("metrics CSV '" + path + "' starts with a different header: " + first);
  }
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::app);
  if (!out) throw std::runtime_error(os_error(("cannot open metrics CSV '" + path + "' for appending").c_str()));
  // Header and row in one write, so concurrent appenders are less likely to interleave.
  const std::string text = (fresh ? header : std::string()) + csv_line(csv_values());
  out.write(text.data(), std::streamsize(text.size()));
  out.flush();
  if (!out) throw std::runtime_error(os_error(("cannot write metrics CSV '" + path + "'").c_str()));
}

void TokenRecorder::restart(Clock::time_point start) {
  start_ = start;
  times_.clear();
  prefill_end_.reset();
}

void TokenRecorder::prompt_processed(Clock::time_point t) {
  if (!prefill_end_) prefill_end_ = std::max(t, start_);
}

void TokenRecorder::accept(int n, Clock::time_point t) {
  if (n < 0) throw std::invalid_argument("TokenRecorder::accept: negative token count");
  if (t < start_ || (!times_.empty() && t < times_.back()))
    throw std::invalid_argument("TokenRecorder::accept: timestamp goes backwards");
  times_.insert(times_.end(), size_t(n), t);
}

void TokenRecorder::fill(SpecMetrics& m) const {
  const size_t n = times_.size();
  m.generated_tokens = int64_t(n);
  m.ttft_ms = n ? ms(times_.front() - start_) : 0.0;
  m.prefill_ms = prefill_end_ ? ms(*prefill_end_ - start_) : 0.0;
  m.ttft_after_prefill_ms = prefill_end_ && n >= 2 ? ms(std::max(times_[1], *prefill_end_) - *prefill_end_) : 0.0;
  m.mean_itl_ms = m.itl_p50_ms = m.itl_p99_ms = 0;
  m.decode_tokens_per_s = 0;
  if (n < 2) return;
  // The gaps telescope: their mean is the span from the first to the last token over n-1.
  const double span = ms(times_.back() - times_.front());
  m.mean_itl_ms = span / double(n - 1);
  if (span > 0) m.decode_tokens_per_s = double(n - 1) / (span / 1000.0);
  std::vector<double> gaps(n - 1);
  for (size_t k = 1; k < n; ++k) gaps[k - 1] = ms(times_[k] - times_[k - 1]);
  std::sort(gaps.begin(), gaps.end());
  // Nearest rank: the smallest gap at least the share p of the gaps do not exceed.
  auto rank = [&](double p) { return gaps[size_t(std::max(1.0, std::ceil(p * double(gaps.size())))) - 1]; };
  m.itl_p50_ms = rank(0.50);
  m.itl_p99_ms = rank(0.99);
}

}  // namespace specmesh
