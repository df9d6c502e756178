// The example topologies and apps in examples/ as a user runs them: every topology loads and
// generates the same tokens as `specmesh generate`, the chat example talks over a pipe, and
// an app builds against an installed specmesh.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>

#include "specmesh/model/model.hpp"
#include "processes.hpp"
#include "refdata.hpp"
#include "specmesh/topology.hpp"

using namespace specmesh;
namespace fs = std::filesystem;

namespace {

const std::string kExamples = std::string(SPECMESH_SOURCE_DIR) + "/examples/";
const std::string kPrompt = "Once upon a time";

using Run = test::ShellRun;
using test::shell;

// The model every example names (relative to examples/, as ../../shared/refdata/...), but the
// DFlash one, whose drafter was trained for stories-target-1M.
std::string refdata_path() { return specmesh::test::refdata("gguf-models/stories260K.gguf"); }
const std::string kDFlashExample = "dflash-stages.toml";
const std::string kDFlashMesh = "dflash-mesh.toml";
std::string dflash_target_path() { return specmesh::test::refdata("gguf-models/stories-target-1M.gguf"); }

std::string cli(const std::string& args) { return std::string(SPECMESH_CLI_PATH) + " " + args; }

std::string tmpdir() {
  static std::string dir = [] {
    auto d = fs::temp_directory_path() / ("specmesh-examples-" + std::to_string(::getpid()));
    fs::create_directories(d);
    fs::permissions(d, fs::perms::owner_all);  // ipc sockets need a private directory
    return d.string();
  }();
  return dir;
}

// The install prefix and the app's build tree are large; remove them when the program ends.
struct TmpCleanup : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(fs::temp_directory_path() / ("specmesh-examples-" + std::to_string(::getpid())), ec);
  }
};
[[maybe_unused]] auto* const tmp_cleanup = ::testing::AddGlobalTestEnvironment(new TmpCleanup);


nlohmann::json generate_reference(int n) {
  auto r = shell(cli("generate -m " + refdata_path() + " -p '" + kPrompt + "' -n " + std::to_string(n) + " --temp 0 --json"));
  EXPECT_EQ(r.status, 0) << r.out;
  return nlohmann::json::parse(r.out);
}

}  // namespace

TEST(Examples, EveryTopologyParsesAndItsLayersResolve) {
  SPECMESH_REQUIRE_REFDATA();
  const std::map<std::string, size_t> nodes = {{"single-process.toml", 1},
                                               {"pipeline-2stage-ipc.toml", 3},
                                               {"pipeline-3stage-tcp.toml", 4},
                                               {"pipeline-3stage-standby.toml", 5},
                                               {"emulated-cluster.toml", 4},
                                               {"alspec-pair.toml", 3},
                                               {"alspec-n300.toml", 3},
                                               {"alspec-sp-tp4.toml", 3},
                                               {"pipeinfer-artifact.toml", 4},
                                               {kDFlashExample, 3},
                                               {kDFlashMesh, 2}};
  std::set<std::string> found;
  for (const auto& e : fs::directory_iterator(kExamples))
    if (e.path().extension() == ".toml") found.insert(e.path().filename().string());
  for (const auto& [name, n] : nodes) EXPECT_TRUE(found.count(name)) << name << " is missing";

  for (const std::string& name : found) {
    SCOPED_TRACE(name);
    Topology t = Topology::load(kExamples + name);
    const ModelSpec& m = t.models.at(t.run.model);
    ASSERT_TRUE(fs::exists(m.path)) << m.path;
    const bool dflash = name == kDFlashExample || name == kDFlashMesh;
    EXPECT_EQ(fs::canonical(m.path), fs::canonical(dflash ? dflash_target_path() : refdata_path()));
    const int n_layer = Model::load(m.path, m.tokenizer)->hparams().n_layer;
    t.resolve_layers("target", n_layer);
    int next = 0;
    for (const StageSpec* s : t.stages_of("target")) {
      EXPECT_EQ(s->layer_begin, next);
      next = s->layer_end;
    }
    EXPECT_EQ(next, n_layer);
    if (nodes.count(name)) EXPECT_EQ(t.nodes.size(), nodes.at(name));
    EXPECT_EQ(t.run.temperature, 0.0f) << "examples are greedy so their output can be checked";
  }

  // The PipeInfer preset is the artifact's command line (-pa 0.001 -pr 0.4 -pd 0.01 -ps 0.8
  // --draft 4 -np 3) with the artifact's decay rule.
  const Topology artifact = Topology::load(kExamples + "pipeinfer-artifact.toml");
  EXPECT_EQ(artifact.run.strategy, "pipeinfer");
  const std::map<std::string, ParamValue> want = {{"p_accept", 0.001}, {"p_recovery", 0.4},  {"p_decay", 0.01},
                                                  {"p_split", 0.8},    {"max_micro_batch", 4}, {"n_parallel", 3},
                                                  {"decay_reset", 1},  {"cancel", 1}};
  EXPECT_EQ(artifact.run.params, want);

  Topology cluster = Topology::load(kExamples + "emulated-cluster.toml");
  EXPECT_EQ(cluster.stages.size(), 4u);
  for (const auto& [name, d] : cluster.devices) {
    ASSERT_TRUE(d.profile) << name;
    EXPECT_EQ(d.profile->name, "slow-node");
  }
  EXPECT_DOUBLE_EQ(cluster.link.latency_s, link_profile("gigabit")->latency_s);
  EXPECT_DOUBLE_EQ(cluster.link.bytes_per_s, link_profile("gigabit")->bytes_per_s);
}

TEST(Examples, RunJsonMatchesGenerateJson) {
  SPECMESH_REQUIRE_REFDATA();
  const nlohmann::json want = generate_reference(32);
  auto r = shell(cli("run " + kExamples + "single-process.toml -p '" + kPrompt + "' -n 32 --json"));
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json got = test::last_json(r.out);
  ASSERT_TRUE(got.is_object()) << r.out;
  for (const char* k : {"prompt_ids", "ids", "text", "stats"}) {
    EXPECT_TRUE(want.contains(k)) << "generate: " << k;
    EXPECT_TRUE(got.contains(k)) << "run: " << k;
  }
  for (const char* k : {"prompt_tokens", "generated_tokens", "ttft_ms", "decode_tokens_per_s"}) {
    EXPECT_TRUE(want["stats"].contains(k)) << "generate: stats." << k;
    EXPECT_TRUE(got["stats"].contains(k)) << "run: stats." << k;
  }
  EXPECT_EQ(got["prompt_ids"], want["prompt_ids"]);
  EXPECT_EQ(got["ids"], want["ids"]);
  EXPECT_EQ(got["text"], want["text"]);
  EXPECT_EQ(got["stats"]["prompt_tokens"], want["stats"]["prompt_tokens"]);
  EXPECT_EQ(got["stats"]["generated_tokens"], want["stats"]["generated_tokens"]);
  EXPECT_EQ(want["ids"].size(), 32u);
}

TEST(Examples, RunJsonIsTheOnlyThingOnStdout) {
  SPECMESH_REQUIRE_REFDATA();
  // `specmesh run ... --json | jq` must work: logs belong on stderr.
  auto r = shell(cli("run " + kExamples + "single-process.toml -p '" + kPrompt + "' -n 4 --json 2>/dev/null"));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NO_THROW(nlohmann::json::parse(r.out)) << "stdout is not one JSON document:\n" << r.out;
}

TEST(Examples, EveryTopologyGeneratesTheTokensOfGenerate) {
  SPECMESH_REQUIRE_REFDATA();
  const nlohmann::json want = generate_reference(32);
  // alspec-pair, -n300, -sp-tp4: with these contexts under 2 x window keys every speculation is
  // exact.
  for (const char* name : {"pipeline-2stage-ipc.toml", "pipeline-3stage-tcp.toml", "pipeline-3stage-standby.toml",
                           "emulated-cluster.toml", "single-process.toml", "alspec-pair.toml", "pipeinfer-artifact.toml",
                           "alspec-n300.toml", "alspec-sp-tp4.toml"}) {
    SCOPED_TRACE(name);
    // On endpoints of its own (free ports, ipc paths with -pN): the tests below run
    // alspec-pair.toml, dflash-stages.toml and (the embed app) pipeline-2stage-ipc.toml as they
    // are, and ctest -j runs them in other processes beside this one.
    auto r = shell(cli("run " + kExamples + name + " --spawn --port-base 0 -p '" + kPrompt + "' -n 32 --json"));
    ASSERT_EQ(r.status, 0) << r.out;
    const nlohmann::json got = test::last_json(r.out);
    ASSERT_TRUE(got.is_object()) << r.out;
    EXPECT_EQ(got["prompt_ids"], want["prompt_ids"]);
    EXPECT_EQ(got["ids"], want["ids"]);
  }
}

// The DFlash example: the target over two stage processes, the drafter on the head node.
TEST(Examples, DFlashTopologyGeneratesTheTokensOfGenerate) {
  SPECMESH_REQUIRE_REFDATA();
  auto want = shell(cli("generate -m " + dflash_target_path() + " -p '" + kPrompt + "' -n 48 --temp 0 --json"));
  ASSERT_EQ(want.status, 0) << want.out;
  // The emulated mesh: the target tensor-parallel over four chips, paced.
  auto mesh = shell(cli("run " + kExamples + kDFlashMesh + " --spawn --port-base 0 -p '" + kPrompt + "' -n 48 --json"));
  ASSERT_EQ(mesh.status, 0) << mesh.out;
  EXPECT_EQ(test::last_json(mesh.out)["ids"], nlohmann::json::parse(want.out)["ids"]);
  for (const std::string params : {"", " --param async=true"}) {
    auto r = shell(cli("run " + kExamples + kDFlashExample + " --spawn -p '" + kPrompt + "' -n 48 --json" + params));
    ASSERT_EQ(r.status, 0) << r.out;
    const nlohmann::json got = test::last_json(r.out);
    ASSERT_TRUE(got.is_object()) << r.out;
    EXPECT_EQ(got["ids"], nlohmann::json::parse(want.out)["ids"]) << params;
    EXPECT_EQ(got["stats"]["strategy"], "dflash");
    EXPECT_GT(got["stats"]["tokens_per_verification"].get<double>(), 1.5) << params;
  }
}

// `run --spawn` hands its strategy parameters to the nodes it starts: the ALSpec groups then
// speculate over a 16-key window with lambda = 0, so every check past 2 x 16 keys misses
// (with the file's window of 128 every check of this short run is exact, and a hit).
TEST(Examples, RunSpawnPassesItsParametersToTheNodes) {
  SPECMESH_REQUIRE_REFDATA();
  const nlohmann::json want = generate_reference(48);
  for (const std::string params : {"", " --param window=16 --param lambda=0"}) {
    SCOPED_TRACE(params);
    auto r = shell(cli("run " + kExamples + "alspec-pair.toml --spawn -p '" + kPrompt + "' -n 48 --json" + params));
    ASSERT_EQ(r.status, 0) << r.out;
    const nlohmann::json got = test::last_json(r.out);
    ASSERT_TRUE(got.is_object()) << r.out;
    EXPECT_EQ(got["ids"], want["ids"]);
    const double hit_rate = got["stats"]["attention_hit_rate"].get<double>();
    if (params.empty()) {
      EXPECT_EQ(hit_rate, 1.0);
    } else {
      EXPECT_GT(hit_rate, 0.0);  // the exact checks of the first 32 keys
      EXPECT_LT(hit_rate, 0.9);
    }
  }
}

// ... and its cache settings: the stage nodes say which KV cache they built, and the tokens
// are those `generate` gives with the same cache.
TEST(Examples, RunSpawnPassesItsCacheSettingsToTheNodes) {
  SPECMESH_REQUIRE_REFDATA();
  auto want = shell(cli("generate -m " + refdata_path() + " -p '" + kPrompt + "' -n 24 --temp 0 --json --kv-type q8_0"));
  ASSERT_EQ(want.status, 0) << want.out;
  auto r = shell("SPECMESH_LOG=info " + cli("run " + kExamples + "pipeline-2stage-ipc.toml --spawn --port-base 0 -p '" +
                                            kPrompt + "' -n 24 --json --kv-type q8_0 -c 200 2>&1"));
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* node : {"stage0", "stage1"})
    EXPECT_NE(r.out.find(std::string("node ") + node + " serving at"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("f16 KV cache"), std::string::npos) << r.out;
  size_t q8 = 0;
  for (size_t at = r.out.find("(1 stages, q8_0 KV cache)"); at != std::string::npos;
       at = r.out.find("(1 stages, q8_0 KV cache)", at + 1))
    ++q8;
  EXPECT_EQ(q8, 2u) << r.out;
  const nlohmann::json got = test::last_json(r.out);
  ASSERT_TRUE(got.is_object()) << r.out;
  EXPECT_EQ(got["ids"], nlohmann::json::parse(want.out)["ids"]);
}

TEST(Examples, BrokenTopologyNamesFileLineAndKey) {
  SPECMESH_REQUIRE_REFDATA();
  // The single-process example with one wrong value, kept in the examples folder so the
  // model path still resolves.
  std::ifstream in(kExamples + "single-process.toml");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const size_t at = text.find("threads = 2");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 11, "threads = \"two\"");
  const int line = 1 + int(std::count(text.begin(), text.begin() + at, '\n'));
  const std::string path = tmpdir() + "/broken.toml";
  std::ofstream(path) << text;
  auto r = shell(cli("run " + path + " -p hi -n 4 2>&1"));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find(path + ":" + std::to_string(line) + ": devices.cpu.threads: expected an integer"), std::string::npos)
      << r.out;

  // Layers that do not cover the model are caught once the model is known.
  std::ofstream(path) << "[run]\n[models.m]\npath = \"" << refdata_path()
                      << "\"\n[devices.a]\n[[stages]]\ndevice = \"a\"\nlayers = [0, 3]\n";
  r = shell(cli("run " + path + " -p hi -n 4 2>&1"));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find(path + ":5: stages of role 'target'"), std::string::npos) << r.out;
}

namespace {

// The chat's replies: the lines after each "> " echo of piped input.
std::vector<std::string> replies(const std::string& out) {
  std::vector<std::string> r;
  std::istringstream in(out);
  std::string line;
  bool next = false;
  while (std::getline(in, line)) {
    if (line.rfind("> ", 0) == 0) next = true;
    else if (next) r.push_back(line), next = false;
  }
  return r;
}

}  // namespace

TEST(Examples, ChatContinuesAStoryOverAPipe) {
  SPECMESH_REQUIRE_REFDATA();
  const nlohmann::json want = generate_reference(24);
  const std::string chat = std::string(SPECMESH_CHAT_PATH);
  const std::string input = "printf '" + kPrompt + "\\nThe cat\\n/quit\\nnever read\\n' | ";
  auto direct = shell(input + chat + " -m " + refdata_path() + " -n 24 --temp 0");
  ASSERT_EQ(direct.status, 0) << direct.out;
  auto r = replies(direct.out);
  ASSERT_EQ(r.size(), 2u) << direct.out;
  // The first reply continues the prompt exactly as `generate` does.
  EXPECT_EQ(r[0], want["text"].get<std::string>());
  EXPECT_EQ(direct.out.find("never read"), std::string::npos) << "/quit did not end the chat";

  // Through a topology (specmesh::Runtime) the same conversation gives the same replies.
  auto topo = shell(input + chat + " -c " + kExamples + "single-process.toml -n 24 --temp 0");
  ASSERT_EQ(topo.status, 0) << topo.out;
  EXPECT_EQ(topo.out, direct.out);

  // A conversation longer than the context drops its oldest turns and goes on.
  auto longer = shell("printf 'Once upon a time\\nThe dog ran\\nThen the sun\\nShe was happy\\nThe end\\n' | " + chat +
                      " -m " + refdata_path() + " --ctx 64 -n 24 --temp 0");
  ASSERT_EQ(longer.status, 0) << longer.out;
  EXPECT_EQ(replies(longer.out).size(), 5u) << longer.out;

  // EOF ends it as well; chat framing keeps each reply to the assistant's own turn.
  auto framed = shell("printf 'Hello\\nTell me a story\\n' | " + chat + " -m " + refdata_path() +
                      " --mode chat -n 32 --temp 0");
  ASSERT_EQ(framed.status, 0) << framed.out;
  auto fr = replies(framed.out);
  ASSERT_EQ(fr.size(), 2u) << framed.out;
  for (const auto& reply : fr) EXPECT_EQ(reply.find("User:"), std::string::npos) << reply;
}

TEST(Install, EmbedExampleBuildsAgainstTheInstalledPackage) {
  SPECMESH_REQUIRE_REFDATA();
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int budget_s = 180;
  auto left = [&] {
    return std::max(1, budget_s - int(std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - t0).count()));
  };
  // `timeout` exits with 124 when the time is up: the machine is too busy for this test.
  auto step = [&](const std::string& what, const std::string& cmd) {
    auto r = shell("timeout " + std::to_string(left()) + " " + cmd + " 2>&1");
    if (r.status == 124) return std::optional<std::string>("timeout");
    EXPECT_EQ(r.status, 0) << what << " failed:\n" << cmd << "\n" << r.out;
    return r.status == 0 ? std::optional<std::string>() : std::optional<std::string>(r.out);
  };
  const std::string prefix = tmpdir() + "/prefix", build = tmpdir() + "/embed-build";
  fs::remove_all(prefix);
  fs::remove_all(build);
  for (auto [what, cmd] : std::vector<std::pair<std::string, std::string>>{
           {"install", "cmake --install " + std::string(SPECMESH_BINARY_DIR) + " --prefix " + prefix},
           {"configure", "cmake -S " + kExamples + "embed -B " + build + " -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCMAKE_PREFIX_PATH=" + prefix},
           {"build", "cmake --build " + build + " -j 2"}}) {
    auto failed = step(what, cmd);
    if (failed && *failed == "timeout")
      GTEST_SKIP() << "\n\n*** INSTALL TEST NOT RUN: '" << what << "' took past the " << budget_s
                   << " s budget (busy machine?); the installed package was NOT checked ***\n";
    ASSERT_FALSE(failed);
  }
  // Only the public face is installed, and it includes nothing but itself and the standard
  // library: an app needs no CAF, ZeroMQ or msgpack include path.
  EXPECT_TRUE(fs::exists(prefix + "/include/specmesh/runtime.hpp"));
  EXPECT_FALSE(fs::exists(prefix + "/include/specmesh/actors"));
  int headers = 0;
  for (const auto& e : fs::directory_iterator(prefix + "/include/specmesh")) {
    ++headers;
    std::ifstream in(e.path());
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("#include", 0) != 0) continue;
      const bool std_header = line.find('<') != std::string::npos && line.find('.') == std::string::npos;
      const bool own = line.find("\"specmesh/") != std::string::npos && line.find('/', line.find("specmesh/") + 9) == std::string::npos;
      EXPECT_TRUE(std_header || own) << e.path() << ": " << line;
    }
  }
  EXPECT_GE(headers, 3);
  // The app was compiled with the installed include directory alone.
  std::ifstream cc(build + "/compile_commands.json");
  std::stringstream ccs;
  ccs << cc.rdbuf();
  for (const std::string bad : {"caf", "zmq", "msgpack", "spdlog"})
    EXPECT_EQ(ccs.str().find(bad), std::string::npos) << "the embed app's compile line mentions " << bad << ":\n" << ccs.str();
  EXPECT_NE(ccs.str().find(prefix + "/include"), std::string::npos) << ccs.str();
  bool has_config = false;
  for (const auto& e : fs::recursive_directory_iterator(prefix))
    has_config |= e.path().filename() == "specmeshConfig.cmake" && fs::exists(e.path().parent_path() / "FindCAF.cmake");
  EXPECT_TRUE(has_config) << "no specmeshConfig.cmake with FindCAF.cmake beside it under " << prefix;

  // The app spawns the stage nodes of the ipc pipeline from the installed `specmesh`.
  auto r = shell(build + "/embed " + kExamples + "pipeline-2stage-ipc.toml '" + kPrompt + "' 8 2>&1");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find(kPrompt + generate_reference(48)["text"].get<std::string>()), std::string::npos) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(\[cancelled: \d+ prompt tokens, (\d+) generated)"))) << r.out;
  const int cut = std::stoi(m[1]);
  EXPECT_GE(cut, 8);
  EXPECT_LE(cut, 10) << "cancel() did not stop the generation promptly";
}
