// Log lines that a peer can make this process write over and over (refused runs, failed runs,
// rejected messages) go through a RateLimitedLog: per kind at most one line per interval (a
// second by default); the lines held back in between are counted, and the next line of that
// kind, or flush(), says how many there were. A flood then costs a line per second per kind,
// not one per message, and nothing goes unreported.
//
// Kinds are fixed strings chosen by the caller ("stage target[0,5) on stage0: run refused"),
// never text a peer controls: the log keeps one counter per kind, at most kMaxKinds of them
// (later kinds share one overflow counter).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include <spdlog/common.h>

namespace specmesh {

class RateLimitedLog {
 public:
  using Clock = std::chrono::steady_clock;
  // Where lines go; the default writes to spdlog's default logger at the given level.
  using Sink = std::function<void(spdlog::level::level_enum, const std::string&)>;
  static constexpr size_t kMaxKinds = 256;

  explicit RateLimitedLog(std::chrono::milliseconds interval = std::chrono::seconds(1), Sink sink = {});

  // Thread-safe. Writes `line`, unless a line of `kind` went out less than the interval ago:
  // then it is only counted. A written line that follows held-back ones ends with
  // " (N more like this in the last S s)". Returns whether the line was written.
  bool log(std::string_view kind, spdlog::level::level_enum level, const std::string& line, Clock::time_point now);
  bool log(std::string_view kind, spdlog::level::level_enum level, const std::string& line) {
    return log(kind, level, line, Clock::now());
  }

  // Thread-safe. For every kind with held-back lines whose interval has passed, writes
  // "<kind>: N more like this in the last S s". Returns the number of lines written.
  int flush(Clock::time_point now);
  int flush() { return flush(Clock::now()); }
  // Whether some kind has held-back lines not yet reported (what a caller's timer waits on).
  bool pending() const;

  // Lines held back over the log's lifetime.
  uint64_t suppressed_total() const;

 private:
  struct Kind {
    Clock::time_point last{};   // when its last line was written
    bool written = false;       // a line of this kind was written at least once
    uint64_t held = 0;          // lines held back since then
    spdlog::level::level_enum level = spdlog::level::info;
  };
  Kind& kind(std::string_view k);
  void write(spdlog::level::level_enum level, const std::string& line);

  const std::chrono::milliseconds interval_;
  Sink sink_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Kind> kinds_;
  uint64_t pending_kinds_ = 0;  // kinds with held > 0
  uint64_t suppressed_ = 0;
};

}  // namespace specmesh
