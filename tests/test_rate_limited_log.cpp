// The rate-limited log: per kind one line per interval, the lines held back in between counted
// and reported by the next line of the kind or by flush(); kinds apart; bounded kinds; safe
// from many threads.
#include "specmesh/log/rate_limited.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace specmesh {
namespace {

using namespace std::chrono_literals;
using Clock = RateLimitedLog::Clock;

struct Lines {
  std::mutex mu;
  std::vector<std::string> text;
  RateLimitedLog::Sink sink() {
    return [this](spdlog::level::level_enum, const std::string& line) {
      std::lock_guard<std::mutex> g(mu);
      text.push_back(line);
    };
  }
};

TEST(RateLimitedLog, OneLinePerIntervalThenTheCountOfTheHeldBackOnes) {
  Lines out;
  RateLimitedLog log(1000ms, out.sink());
  const Clock::time_point t0{};
  EXPECT_TRUE(log.log("refused", spdlog::level::warn, "run 1 refused", t0 + 5s));
  for (int i = 2; i <= 100; ++i)
    EXPECT_FALSE(log.log("refused", spdlog::level::warn, "run " + std::to_string(i) + " refused", t0 + 5s + i * 1ms));
  EXPECT_TRUE(log.pending());
  EXPECT_TRUE(log.log("refused", spdlog::level::warn, "run 101 refused", t0 + 6s));
  ASSERT_EQ(out.text.size(), 2u);
  EXPECT_EQ(out.text[0], "run 1 refused");
  EXPECT_EQ(out.text[1], "run 101 refused (99 more like this in the last 1.0 s)");
  EXPECT_FALSE(log.pending());
  EXPECT_EQ(log.suppressed_total(), 99u);
}

TEST(RateLimitedLog, FlushReportsHeldBackLinesOnceTheirIntervalHasPassed) {
  Lines out;
  RateLimitedLog log(1000ms, out.sink());
  const Clock::time_point t0{};
  EXPECT_EQ(log.flush(t0), 0);  // nothing logged yet
  log.log("failed", spdlog::level::err, "run 1: KV cache full", t0);
  log.log("failed", spdlog::level::err, "run 2: KV cache full", t0 + 100ms);
  log.log("failed", spdlog::level::err, "run 3: KV cache full", t0 + 200ms);
  EXPECT_EQ(log.flush(t0 + 500ms), 0) << "too early: the interval since the last line has not passed";
  EXPECT_EQ(log.flush(t0 + 1500ms), 1);
  ASSERT_EQ(out.text.size(), 2u);
  EXPECT_EQ(out.text[1], "failed: 2 more like this in the last 1.5 s");
  EXPECT_FALSE(log.pending());
  EXPECT_EQ(log.flush(t0 + 5s), 0) << "reported once";
  // The flushed summary counts as the kind's line: the next one within the interval is held.
  EXPECT_TRUE(log.log("failed", spdlog::level::err, "run 4", t0 + 5s));
}

TEST(RateLimitedLog, KindsAreLimitedApart) {
  Lines out;
  RateLimitedLog log(1000ms, out.sink());
  const Clock::time_point t0{};
  EXPECT_TRUE(log.log("a", spdlog::level::warn, "a1", t0));
  EXPECT_TRUE(log.log("b", spdlog::level::warn, "b1", t0));
  EXPECT_FALSE(log.log("a", spdlog::level::warn, "a2", t0 + 1ms));
  EXPECT_FALSE(log.log("b", spdlog::level::warn, "b2", t0 + 1ms));
  EXPECT_EQ(log.flush(t0 + 2s), 2);
  EXPECT_EQ(out.text.size(), 4u);
}

TEST(RateLimitedLog, KindsBeyondTheBoundShareOneCounter) {
  Lines out;
  RateLimitedLog log(1000ms, out.sink());
  const Clock::time_point t0{};
  size_t written = 0;
  for (size_t i = 0; i < RateLimitedLog::kMaxKinds + 1000; ++i)
    written += log.log("kind " + std::to_string(i), spdlog::level::warn, "line", t0);
  // kMaxKinds - 1 kinds of their own, then everything else shares the overflow kind.
  EXPECT_EQ(written, RateLimitedLog::kMaxKinds);
  EXPECT_EQ(log.suppressed_total(), 1000u);
}

TEST(RateLimitedLog, ManyThreadsLoseNoCount) {
  Lines out;
  RateLimitedLog log(1h, out.sink());
  constexpr int kThreads = 4, kEach = 20000;
  std::atomic<int> written{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) written += log.log("flood", spdlog::level::warn, "line");
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(written.load(), 1);
  EXPECT_EQ(out.text.size(), 1u);
  EXPECT_EQ(log.suppressed_total(), uint64_t(kThreads * kEach - 1));
}

TEST(RateLimitedLog, WritesToSpdlogWithoutASink) {
  RateLimitedLog log(1000ms);
  EXPECT_TRUE(log.log("x", spdlog::level::debug, "a debug line nobody sees"));
  EXPECT_FALSE(log.log("x", spdlog::level::debug, "held back"));
}

}  // namespace
}  // namespace specmesh
