// The specmesh binary as users and scripts call it.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>
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
