// The specmesh binary as users and scripts call it.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "refdata.hpp"

using specmesh::test::refdata;

namespace {

struct Run {
  int status;
  std::string out;
};

Run run(const std::string& args) {
  std::string cmd = std::string(SPECMESH_CLI_PATH) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int st = pclose(p);
  return {WEXITSTATUS(st), out};
}

}  // namespace

TEST(Cli, GenerateJsonMatchesGolden) {
  SPECMESH_REQUIRE_REFDATA();
  auto r = run("generate -m " + refdata("llama2c/stories260K.bin") + " -z " + refdata("llama2c/tok512.bin") +
               " -p 'Once upon a time' -n 60 --temp 0 --json -t 1");
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["prompt_ids"], nlohmann::json({1, 403, 407, 261, 378}));
  ASSERT_EQ(j["ids"].size(), 60u);
  EXPECT_EQ(j["ids"][0], 432);
  EXPECT_EQ(j["text"].get<std::string>().substr(0, 30), ", there was a little girl name");
  for (const char* k : {"prompt_tokens", "generated_tokens", "ttft_ms", "decode_tokens_per_s"})
    EXPECT_TRUE(j["stats"].contains(k)) << k;
  EXPECT_EQ(j["stats"]["generated_tokens"], 60);
}

TEST(Cli, TriForceWithoutItsDraftNeedsOnlyTheTarget) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string base = "generate -m " + refdata("gguf-models/stories-target-1M.gguf") +
                           " -p 'Once upon a time' -n 40 --temp 0 --json -t 1";
  auto ar = run(base + " --strategy ar");
  ASSERT_EQ(ar.status, 0) << ar.out;
  // The middle level over the retrieval cache drafts for itself: no draft model is given.
  auto tf = run(base + " --strategy triforce --param use_draft=false --param budget=32");
  ASSERT_EQ(tf.status, 0) << tf.out;
  EXPECT_EQ(nlohmann::json::parse(tf.out)["ids"], nlohmann::json::parse(ar.out)["ids"]);
  auto missing = run(base + " --strategy triforce");
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.out.find("\"triforce\" needs a pipeline for role \"draft\""), std::string::npos) << missing.out;
}

TEST(Cli, GenerateSplitOverDevicesGivesTheSameTokens) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string base = "generate -m " + refdata("gguf-models/stories-target-1M.gguf") +
                           " -p 'Once upon a time' -n 40 --temp 0 --json -t 2";
  auto one = run(base);
  ASSERT_EQ(one.status, 0) << one.out;
  for (const std::string extra : {" --tp 2", " --tp 4", " --tp 2 --strategy alspec --param lambda=0 --param window=8"}) {
    auto split = run(base + extra);
    ASSERT_EQ(split.status, 0) << extra << ": " << split.out;
    EXPECT_EQ(nlohmann::json::parse(split.out)["ids"], nlohmann::json::parse(one.out)["ids"]) << extra;
  }
  auto too_many = run(base + " --tp 5");  // 4 KV heads
  EXPECT_NE(too_many.status, 0);
  EXPECT_NE(too_many.out.find("generate: stages: tensor parallelism: 5 devices for 4 KV heads"), std::string::npos)
      << too_many.out;
}

TEST(Cli, GenerateStopsAtBosForLlama2c) {
  SPECMESH_REQUIRE_REFDATA();
  // target-1M ends a story (emits BOS) within 400 tokens of "Once upon a time" (MODELS.md).
  auto r = run("generate -m " + refdata("llama2c/stories-target-1M.bin") + " -z " + refdata("llama2c/tok512.bin") +
               " -p 'Once upon a time' -n 400 --temp 0 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_LT(j["ids"].size(), 400u);
  auto r2 = run("generate -m " + refdata("llama2c/stories-target-1M.bin") + " -z " + refdata("llama2c/tok512.bin") +
                " -p 'Once upon a time' -n 400 --temp 0 --json --ignore-eos");
  EXPECT_EQ(nlohmann::json::parse(r2.out)["ids"].size(), 400u);
}

TEST(Cli, TokenizePrintsIds) {
  SPECMESH_REQUIRE_REFDATA();
  auto r = run("tokenize -m " + refdata("gguf-vocab/ggml-vocab-llama-spm.gguf") + " 'I believe the meaning of life is'");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out), nlohmann::json({1, 306, 4658, 278, 6593, 310, 2834, 338}));
  auto nb = run("tokenize --no-bos -m " + refdata("gguf-models/stories260K.gguf") + " 'Zoo'");
  EXPECT_EQ(nlohmann::json::parse(nb.out), nlohmann::json({410, 469, 347}));
}

TEST(Cli, InspectShowsArchitectureAndTensors) {
  SPECMESH_REQUIRE_REFDATA();
  auto r = run("inspect " + refdata("gguf-models/stories260K.gguf"));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("blk.4.ffn_norm.weight"), std::string::npos);
  EXPECT_NE(r.out.find("model: llama, n_embd 64, n_layer 5, n_head 8, n_head_kv 4"), std::string::npos);
  EXPECT_NE(r.out.find("tokenizer: spm"), std::string::npos);
}

TEST(Cli, SamplingFlagsOutsideTheirRangeAreRefused) {
  SPECMESH_REQUIRE_REFDATA();
  for (const auto& [flag, what] : std::vector<std::pair<std::string, std::string>>{
           {"--temp nan", "--temp"}, {"--temp inf", "--temp"}, {"--temp -1", "--temp"},
           {"--top-p 7", "--top-p"}, {"--top-p nan", "--top-p"}, {"--min-p -1", "--min-p"},
           {"--top-k -5", "--top-k"}, {"-t -3", "--threads"}, {"-c -5", "--ctx"}}) {
    SCOPED_TRACE(flag);
    auto r = run("generate -m " + refdata("gguf-models/stories260K.gguf") + " -p hi -n 4 " + flag);
    EXPECT_NE(r.status, 0) << r.out;
    EXPECT_NE(r.out.find(what), std::string::npos) << r.out;
  }
}

// --kv-type picks how the KV cache stores rows: every type runs (on this model the greedy ids
// agree), a type it does not know or a Q8_0 cache on rows that are no multiple of 32 values
// is a clear error.
TEST(Cli, KvTypeChoosesTheCacheAndRefusesWhatCannotHoldIt) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string base = "generate -m " + refdata("gguf-models/stories260K.gguf") +
                           " -p 'Once upon a time' -n 40 --temp 0 --json -t 1 --kv-type ";
  auto f32 = run(base + "f32");
  ASSERT_EQ(f32.status, 0) << f32.out;
  for (const char* type : {"f16", "Q8_0"}) {
    auto r = run(base + type);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(nlohmann::json::parse(r.out)["ids"], nlohmann::json::parse(f32.out)["ids"]) << type;
  }
  auto bad = run(base + "q4_0");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--kv-type: unknown KV cache type 'q4_0' (expected f16, q8_0 or f32)"), std::string::npos)
      << bad.out;
  const std::string odd = testing::TempDir() + "/kv24.gguf";
  auto made = run("make-model --arch llama --vocab 300 --dim 48 --layers 2 --heads 4 --kv-heads 2 --head-dim 12 "
                  "--ff 64 -o " + odd);
  ASSERT_EQ(made.status, 0) << made.out;
  auto q8 = run("generate -m " + odd + " -p hi -n 4 --kv-type q8_0");
  EXPECT_NE(q8.status, 0);
  EXPECT_NE(q8.out.find("a q8_0 KV cache needs rows of a multiple of 32 values; this model's have 24 (use f16)"),
            std::string::npos)
      << q8.out;
  EXPECT_EQ(run("generate -m " + odd + " -p hi -n 4 --kv-type f16").status, 0);
  std::remove(odd.c_str());
}

TEST(Cli, BadModelFileIsAClearError) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string bad = testing::TempDir() + "/truncated.gguf";
  {
    std::ifstream in(refdata("gguf-models/stories260K.gguf"), std::ios::binary);
    std::string data((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(bad, std::ios::binary) << data.substr(0, data.size() / 2);
  }
  auto r = run("generate -m " + bad + " -p hi -n 4");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("truncated.gguf"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("outside the file"), std::string::npos) << r.out;
  auto r2 = run("generate -m " + refdata("llama2c/tok512.bin") + " -p hi -n 4");
  EXPECT_EQ(r2.status, 1);
  EXPECT_NE(r2.out.find("error"), std::string::npos) << r2.out;
}

namespace {

std::string readme() {
  std::ifstream in(std::string(SPECMESH_SOURCE_DIR) + "/README.md");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The README's speculative-decoding command: the `R=...` line and the command it feeds.
std::vector<std::string> readme_speculative_command() {
  const std::string text = readme();
  const size_t a = text.find("\nR=");
  EXPECT_NE(a, std::string::npos) << "the README has no `R=...` speculative command";
  std::vector<std::string> lines;
  std::istringstream in(text.substr(a + 1));
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
    if (lines.size() > 1 && (line.empty() || line.back() != '\\')) break;
  }
  return lines;
}

// Runs the command with `cwd` as working directory, the models at `refdata` (as the command
// should write it from there) and the binary built here.
Run run_readme_command(const std::string& cwd, const std::string& refdata_models) {
  std::vector<std::string> lines = readme_speculative_command();
  std::string script = "cd '" + cwd + "' && R=" + refdata_models + "\n";
  for (size_t i = 1; i < lines.size(); ++i) {
    std::string l = lines[i];
    if (l.rfind("build/specmesh ", 0) == 0) l = std::string(SPECMESH_CLI_PATH) + l.substr(14);
    script += l + "\n";
  }
  FILE* p = popen(("bash -c '" + [&] {
                     std::string q;
                     for (char c : script) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
                     return q;
                   }() + "' 2>/dev/null").c_str(),
                  "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  return {WEXITSTATUS(pclose(p)), out};
}

}  // namespace

// The README's strategy tables are the registry's own listing.
TEST(Cli, ReadmeStrategyTablesComeFromTheRegistry) {
  const std::string text = readme();
  const size_t a = text.find("<!-- strategies:begin -->\n"), b = text.find("<!-- strategies:end -->");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  auto r = run("strategies --markdown");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(text.substr(a + 26, b - a - 26), r.out) << "README out of date: paste `specmesh strategies --markdown`";
}

// Relative paths on the command line are relative to the working directory: the README's
// command works from the checkout, and from anywhere else with paths written from there.
TEST(Cli, ReadmeSpeculativeCommandRunsFromTheCheckoutAndElsewhere) {
  SPECMESH_REQUIRE_REFDATA();
  namespace fs = std::filesystem;
  const fs::path models = fs::path(specmesh::test::refdata("gguf-models"));
  const fs::path checkout = fs::canonical(SPECMESH_SOURCE_DIR);
  if (fs::canonical(checkout / "../shared/refdata/gguf-models") != fs::canonical(models))
    GTEST_SKIP() << "\n\n*** the README's command expects the models at ../shared/refdata; they are elsewhere ***\n";
  const auto here = run_readme_command(checkout.string(), readme_speculative_command()[0].substr(2));
  ASSERT_EQ(here.status, 0) << here.out;
  const fs::path elsewhere = fs::temp_directory_path() / ("specmesh-cwd-" + std::to_string(::getpid())) / "a" / "b";
  fs::create_directories(elsewhere);
  const auto there = run_readme_command(elsewhere.string(), fs::relative(models, elsewhere).string());
  fs::remove_all(elsewhere.parent_path().parent_path());
  ASSERT_EQ(there.status, 0) << there.out;
  const auto a = nlohmann::json::parse(here.out), b = nlohmann::json::parse(there.out);
  EXPECT_EQ(a["ids"], b["ids"]);
  EXPECT_GT(a["ids"].size(), 10u);
  EXPECT_NE(fs::relative(models, elsewhere).string().rfind("../", 0), std::string::npos);  // really relative
}
