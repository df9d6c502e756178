#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

#include "specmesh/speculation/metrics.hpp"

using namespace specmesh;
namespace fs = std::filesystem;

namespace {

// A scratch directory per test, removed afterwards.
class MetricsCsv : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("specmesh-metrics-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// RFC 4180 reader: quoted fields may hold separators, doubled quotes and line breaks.
std::vector<std::vector<std::string>> read_csv(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> rec;
  std::string field;
  bool quoted = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') field += text[++i];
      else if (c == '"') quoted = false;
      else field += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      rec.push_back(std::move(field));
      field.clear();
    } else if (c == '\n') {
      rec.push_back(std::move(field));
      field.clear();
      records.push_back(std::move(rec));
      rec.clear();
    } else {
      field += c;
    }
  }
  EXPECT_TRUE(field.empty() && rec.empty()) << "file does not end with a line break";
  return records;
}

SpecMetrics sample_metrics() {
  SpecMetrics m;
  m.strategy = "tree, \"wide\"\nv2";  // separator, quotes and a line break all need quoting
  m.target = "qwen3-1.7b";
  m.draft = "qwen3-0.6b";
  m.prompt_tokens = 17;
  m.generated_tokens = 128;
  m.ttft_ms = 12.345678901234567;
  m.prefill_ms = 10.125;
  m.ttft_after_prefill_ms = 4.0625;
  m.mean_itl_ms = 1.0 / 3.0;
  m.itl_p50_ms = 0.25;
  m.itl_p99_ms = 7.5;
  m.decode_tokens_per_s = 3000.0000000001;
  m.drafted = 400;
  m.accepted = 301;
  m.verifications = 97;
  m.max_accepted_depth = 6;
  m.runs_launched = 110;
  m.runs_cancelled = 9;
  m.runs_wasted = 4;
  m.failovers = 1;
  m.accepted_hist = {0, 2, 0, 1};
  m.speculative_drafts = 12;
  m.speculative_drafts_used = 5;
  m.middle_drafted = 50;
  m.middle_accepted = 41;
  m.middle_verifications = 20;
  m.cache_rebuilds = 3;
  return m;
}

void expect_row(const std::vector<std::string>& row, const SpecMetrics& m) {
  ASSERT_EQ(row.size(), SpecMetrics::csv_columns().size());
  EXPECT_EQ(row[0], m.strategy);
  EXPECT_EQ(row[1], m.target);
  EXPECT_EQ(row[2], m.draft);
  EXPECT_EQ(std::stoll(row[3]), m.prompt_tokens);
  EXPECT_EQ(std::stoll(row[4]), m.generated_tokens);
  EXPECT_EQ(std::strtod(row[5].c_str(), nullptr), m.ttft_ms);  // exact: shortest round-trip text
  EXPECT_EQ(std::strtod(row[6].c_str(), nullptr), m.mean_itl_ms);
  EXPECT_EQ(std::strtod(row[7].c_str(), nullptr), m.decode_tokens_per_s);
  EXPECT_EQ(std::stoll(row[8]), m.drafted);
  EXPECT_EQ(std::stoll(row[9]), m.accepted);
  EXPECT_EQ(std::strtod(row[10].c_str(), nullptr), m.acceptance_rate());
  EXPECT_EQ(std::stoll(row[11]), m.verifications);
  EXPECT_EQ(std::strtod(row[12].c_str(), nullptr), m.tokens_per_verification());
  EXPECT_EQ(std::strtod(row[13].c_str(), nullptr), m.tree_size());
  EXPECT_EQ(std::strtod(row[14].c_str(), nullptr), m.accepted_depth());
  EXPECT_EQ(std::stoll(row[15]), m.max_accepted_depth);
  EXPECT_EQ(std::stoll(row[16]), m.runs_launched);
  EXPECT_EQ(std::stoll(row[17]), m.runs_cancelled);
  EXPECT_EQ(std::stoll(row[18]), m.runs_wasted);
  EXPECT_EQ(std::strtod(row[row.size() - 8].c_str(), nullptr), m.itl_p50_ms);
  EXPECT_EQ(std::strtod(row[row.size() - 7].c_str(), nullptr), m.itl_p99_ms);
  EXPECT_EQ(std::stoll(row[row.size() - 6]), m.failovers);
  EXPECT_EQ(std::stoll(row[row.size() - 4]), m.speculative_drafts);
  EXPECT_EQ(std::stoll(row[row.size() - 3]), m.speculative_drafts_used);
  EXPECT_EQ(std::strtod(row[row.size() - 2].c_str(), nullptr), m.prefill_ms);
  EXPECT_EQ(std::strtod(row[row.size() - 1].c_str(), nullptr), m.ttft_after_prefill_ms);
  std::string hist;
  for (int64_t c : m.accepted_hist) hist += (hist.empty() ? "" : " ") + std::to_string(c);
  EXPECT_EQ(row[row.size() - 5], hist);  // accepted_hist, one field ("0 2 0 1")
  auto col = [&](const char* name) {
    const auto& cols = SpecMetrics::csv_columns();
    return row[size_t(std::find(cols.begin(), cols.end(), name) - cols.begin())];
  };
  EXPECT_EQ(std::stoll(col("middle_drafted")), m.middle_drafted);
  EXPECT_EQ(std::stoll(col("middle_accepted")), m.middle_accepted);
  EXPECT_EQ(std::strtod(col("middle_acceptance_rate").c_str(), nullptr), m.middle_acceptance_rate());
  EXPECT_EQ(std::stoll(col("middle_verifications")), m.middle_verifications);
  EXPECT_EQ(std::strtod(col("middle_tokens_per_verification").c_str(), nullptr), m.middle_tokens_per_verification());
  EXPECT_EQ(std::stoll(col("cache_rebuilds")), m.cache_rebuilds);
}

TEST(SpecMetrics, DerivedRatios) {
  SpecMetrics m;
  EXPECT_EQ(m.acceptance_rate(), 0.0);
  EXPECT_EQ(m.tokens_per_verification(), 0.0);
  m.drafted = 10;
  m.accepted = 7;
  m.verifications = 4;
  EXPECT_DOUBLE_EQ(m.acceptance_rate(), 0.7);
  EXPECT_DOUBLE_EQ(m.tokens_per_verification(), 11.0 / 4.0);  // 7 accepted + one target token each
  EXPECT_DOUBLE_EQ(m.tree_size(), 10.0 / 4.0);
  EXPECT_DOUBLE_EQ(m.accepted_depth(), 7.0 / 4.0);
}

TEST(SpecMetrics, VerifiedCountsDepthAndKeepsTheDeepest) {
  SpecMetrics m;
  m.verified(3);
  m.verified(0);
  m.verified(5);
  m.verified(2);
  EXPECT_EQ(m.verifications, 4);
  EXPECT_EQ(m.accepted, 10);
  EXPECT_EQ(m.max_accepted_depth, 5);
  EXPECT_EQ(m.drafted, 0);  // the strategy counts its drafts where it makes them
}

TEST_F(MetricsCsv, HeaderOnceThenRowsThatRoundTrip) {
  const fs::path path = dir_ / "runs.csv";
  const SpecMetrics a = sample_metrics();
  SpecMetrics b;
  b.strategy = "autoregressive";
  b.target = "stories260K";
  b.generated_tokens = 5;
  b.ttft_ms = 0.1;
  a.append_csv(path.string());
  b.append_csv(path.string());
  a.append_csv(path.string());

  const auto records = read_csv(path);
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records[0], SpecMetrics::csv_columns());
  expect_row(records[1], a);
  expect_row(records[2], b);
  expect_row(records[3], a);
  EXPECT_EQ(records[2][2], "");  // no draft model

  // The header appears once in the raw text too.
  std::ifstream in(path);
  std::string line;
  int headers = 0;
  while (std::getline(in, line)) headers += line.rfind("strategy,target_model,", 0) == 0;
  EXPECT_EQ(headers, 1);
}

TEST_F(MetricsCsv, EmptyFileGetsTheHeader) {
  const fs::path path = dir_ / "empty.csv";
  std::ofstream(path).close();
  sample_metrics().append_csv(path.string());
  const auto records = read_csv(path);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0], SpecMetrics::csv_columns());
}

TEST_F(MetricsCsv, ForeignHeaderIsRefused) {
  const fs::path path = dir_ / "other.csv";
  std::ofstream(path) << "name,value\nx,1\n";
  try {
    sample_metrics().append_csv(path.string());
    FAIL() << "appended under a different header";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

TEST_F(MetricsCsv, UnwritablePathIsNamed) {
  for (const fs::path& path : {dir_ / "no-such-dir" / "runs.csv", dir_}) {
    try {
      sample_metrics().append_csv(path.string());
      FAIL() << "wrote to " << path;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    }
  }
}

TEST(SpecMetrics, JsonHasEveryColumn) {
  const SpecMetrics m = sample_metrics();
  const nlohmann::json j = m.to_json();
  std::set<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.insert(k);
  const auto& cols = SpecMetrics::csv_columns();
  std::set<std::string> want(cols.begin(), cols.end());
  // Per-layer and per-token lists have no place in a CSV row.
  want.insert({"layer_hit_rates", "token_hit_rates"});
  EXPECT_EQ(keys, want);
  EXPECT_EQ(j["strategy"], m.strategy);
  EXPECT_EQ(j["target_model"], m.target);
  EXPECT_EQ(j["draft_model"], m.draft);
  EXPECT_EQ(j["prompt_tokens"], m.prompt_tokens);
  EXPECT_EQ(j["generated_tokens"], m.generated_tokens);
  EXPECT_EQ(j["ttft_ms"], m.ttft_ms);
  EXPECT_EQ(j["prefill_ms"], m.prefill_ms);
  EXPECT_EQ(j["ttft_after_prefill_ms"], m.ttft_after_prefill_ms);
  EXPECT_EQ(j["mean_itl_ms"], m.mean_itl_ms);
  EXPECT_EQ(j["itl_p50_ms"], m.itl_p50_ms);
  EXPECT_EQ(j["itl_p99_ms"], m.itl_p99_ms);
  EXPECT_EQ(j["decode_tokens_per_s"], m.decode_tokens_per_s);
  EXPECT_EQ(j["drafted"], m.drafted);
  EXPECT_EQ(j["accepted"], m.accepted);
  EXPECT_EQ(j["acceptance_rate"], m.acceptance_rate());
  EXPECT_EQ(j["verifications"], m.verifications);
  EXPECT_EQ(j["tokens_per_verification"], m.tokens_per_verification());
  EXPECT_EQ(j["tree_size"], m.tree_size());
  EXPECT_EQ(j["accepted_depth"], m.accepted_depth());
  EXPECT_EQ(j["max_accepted_depth"], m.max_accepted_depth);
  EXPECT_EQ(j["runs_launched"], m.runs_launched);
  EXPECT_EQ(j["runs_cancelled"], m.runs_cancelled);
  EXPECT_EQ(j["runs_wasted"], m.runs_wasted);
  // Survives text and the conversion hook.
  EXPECT_EQ(nlohmann::json::parse(j.dump()), j);
  const nlohmann::json hook = m;
  EXPECT_EQ(hook, j);
}

TEST(TokenRecorder, LatencyFromAcceptanceTimes) {
  using namespace std::chrono_literals;
  const auto t0 = TokenRecorder::Clock::now();
  TokenRecorder rec(t0);
  rec.accept(1, t0 + 50ms);  // first token: prompt processed
  rec.accept(3, t0 + 80ms);  // one verification accepting three
  rec.accept(1, t0 + 100ms);
  SpecMetrics m;
  rec.fill(m);
  EXPECT_EQ(m.generated_tokens, 5);
  EXPECT_DOUBLE_EQ(m.ttft_ms, 50.0);
  // Gaps 30, 0, 0, 20 ms after the first token.
  EXPECT_DOUBLE_EQ(m.mean_itl_ms, 12.5);
  EXPECT_DOUBLE_EQ(m.itl_p50_ms, 0.0);  // half the tokens came in a burst
  EXPECT_DOUBLE_EQ(m.itl_p99_ms, 30.0);
  EXPECT_DOUBLE_EQ(m.decode_tokens_per_s, 80.0);
  EXPECT_THROW(rec.accept(1, t0 + 90ms), std::invalid_argument);
  EXPECT_THROW(rec.accept(-1, t0 + 200ms), std::invalid_argument);

  rec.restart(t0 + 1s);
  EXPECT_THROW(rec.accept(1, t0), std::invalid_argument);  // before the start
  rec.accept(1, t0 + 1s + 7ms);
  rec.fill(m);
  EXPECT_EQ(m.generated_tokens, 1);
  EXPECT_DOUBLE_EQ(m.ttft_ms, 7.0);
  EXPECT_EQ(m.mean_itl_ms, 0.0);
  EXPECT_EQ(m.itl_p99_ms, 0.0);
  EXPECT_EQ(m.decode_tokens_per_s, 0.0);

  // All at once: no interval to measure a rate over.
  rec.restart(t0);
  rec.accept(4, t0 + 10ms);
  rec.fill(m);
  EXPECT_EQ(m.generated_tokens, 4);
  EXPECT_EQ(m.mean_itl_ms, 0.0);
  EXPECT_EQ(m.decode_tokens_per_s, 0.0);
}

// The prompt's logits at 20 ms; the token sampled from them at 50, the next ones at 80: the
// PipeInfer paper's TTFT is 80 - 20 = 60 ms, ours (request to first token) 50.
TEST(TokenRecorder, PrefillAndThePapersTimeToFirstToken) {
  using namespace std::chrono_literals;
  const auto t0 = TokenRecorder::Clock::now();
  TokenRecorder rec(t0);
  SpecMetrics m;
  rec.fill(m);
  EXPECT_EQ(m.prefill_ms, 0.0);  // not seen yet
  rec.prompt_processed(t0 + 20ms);
  rec.prompt_processed(t0 + 40ms);  // a failover's second prompt processing does not count
  rec.accept(1, t0 + 50ms);
  rec.fill(m);
  EXPECT_DOUBLE_EQ(m.prefill_ms, 20.0);
  EXPECT_EQ(m.ttft_after_prefill_ms, 0.0);  // one token: nothing after the sampled one yet
  rec.accept(2, t0 + 80ms);
  rec.fill(m);
  EXPECT_DOUBLE_EQ(m.ttft_ms, 50.0);
  EXPECT_DOUBLE_EQ(m.ttft_after_prefill_ms, 60.0);
  rec.restart(t0 + 1s);
  rec.accept(2, t0 + 1s + 5ms);
  rec.fill(m);
  EXPECT_EQ(m.prefill_ms, 0.0);
  EXPECT_EQ(m.ttft_after_prefill_ms, 0.0);
}

TEST(TokenRecorder, DefaultsToTheSteadyClock) {
  TokenRecorder rec;
  rec.accept();
  rec.accept(2);
  SpecMetrics m;
  rec.fill(m);
  EXPECT_EQ(m.generated_tokens, 3);
  EXPECT_GE(m.ttft_ms, 0.0);
  EXPECT_LT(m.ttft_ms, 10000.0);
}

}  // namespace
