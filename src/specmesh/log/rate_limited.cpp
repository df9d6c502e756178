#include "specmesh/log/rate_limited.hpp"

#include <cstdio>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

namespace specmesh {

namespace {

constexpr const char* kOverflowKind = "(other kinds)";

std::string held_text(uint64_t n, RateLimitedLog::Clock::duration over) {
  char text[96];
  std::snprintf(text, sizeof text, "%llu more like this in the last %.1f s", static_cast<unsigned long long>(n),
                std::chrono::duration<double>(over).count());
  return text;
}

}  // namespace

RateLimitedLog::RateLimitedLog(std::chrono::milliseconds interval, Sink sink)
    : interval_(interval), sink_(std::move(sink)) {}

RateLimitedLog::Kind& RateLimitedLog::kind(std::string_view k) {
  auto it = kinds_.find(std::string(k));
  if (it != kinds_.end()) return it->second;
  if (kinds_.size() >= kMaxKinds - 1) return kinds_[kOverflowKind];  // the overflow kind is the last
  return kinds_[std::string(k)];
}

void RateLimitedLog::write(spdlog::level::level_enum level, const std::string& line) {
  if (sink_) sink_(level, line);
  else spdlog::log(level, "{}", line);
}

bool RateLimitedLog::log(std::string_view k, spdlog::level::level_enum level, const std::string& line,
                         Clock::time_point now) {
  std::string out;
  {
    std::lock_guard<std::mutex> g(mu_);
    Kind& c = kind(k);
    if (c.written && now - c.last < interval_) {
      if (c.held++ == 0) ++pending_kinds_;
      c.level = level;
      ++suppressed_;
      return false;
    }
    out = line;
    if (c.held > 0) {
      out += " (" + held_text(c.held, now - c.last) + ")";
      c.held = 0;
      --pending_kinds_;
    }
    c.written = true;
    c.last = now;
  }
  // Written outside the lock: a slow sink does not serialise the threads that only count.
  write(level, out);
  return true;
}

int RateLimitedLog::flush(Clock::time_point now) {
  std::vector<std::pair<spdlog::level::level_enum, std::string>> lines;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (pending_kinds_ == 0) return 0;
    for (auto& [name, c] : kinds_) {
      if (c.held == 0 || now - c.last < interval_) continue;
      lines.emplace_back(c.level, name + ": " + held_text(c.held, now - c.last));
      c.held = 0;
      c.last = now;
      --pending_kinds_;
    }
  }
  for (const auto& [level, line] : lines) write(level, line);
  return int(lines.size());
}

bool RateLimitedLog::pending() const {
  std::lock_guard<std::mutex> g(mu_);
  return pending_kinds_ > 0;
}

uint64_t RateLimitedLog::suppressed_total() const {
  std::lock_guard<std::mutex> g(mu_);
  return suppressed_;
}

}  // namespace specmesh
