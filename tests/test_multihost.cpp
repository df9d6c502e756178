// Nodes started by hand with keys from `specmesh keygen`, the head run without --spawn: on
// loopback, and across two network namespaces (the head on one "host", the stages on the
// other, over a veth pair, bound to non-loopback addresses with allow_remote). The generated
// tokens must be those of a single-process run, and no process may be left behind.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>

#include "private_dir.hpp"
#include "netns.hpp"
#include "ports.hpp"
#include "processes.hpp"
#include "refdata.hpp"

namespace specmesh {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

const std::string kPrompt = "Once upon a time";
constexpr int kTokens = 24;

// A private folder for this test's topology, keys and logs, removed at the end.
struct TestDir : test::ScopedTempDir {
  TestDir() : ScopedTempDir("multihost") {}
};

// Starts argv (the first word found on PATH, or a path) with stdout and stderr to `output`.
// Ends the processes it holds (SIGTERM, then SIGKILL), also when a test fails half-way.
struct Started {
  std::vector<pid_t> pids;
  ~Started() { stop(); }
  void stop() {
    for (pid_t p : pids) ::kill(p, SIGTERM);
    for (pid_t p : pids)
      if (!test::wait_exit(p, 5000ms)) {
        ::kill(p, SIGKILL);
        ::waitpid(p, nullptr, 0);
      }
    pids.clear();
  }
};


// The head on `head_addr`, two stages on `stage_addr`; `wrap_head` / `wrap_stages` prefix the
// commands (ip netns exec NS). Checks the tokens against a single-process run.
void run_hand_started(const std::string& head_addr, const std::string& stage_addr, bool allow_remote,
                      const std::vector<std::string>& wrap_head, const std::vector<std::string>& wrap_stages) {
  TestDir dir;
  const std::string topo = dir.path + "/topology.toml";
  const int base = free_port_range(6);  // three nodes, two ports each
  {
    std::ofstream f(topo);
    f << "[run]\nmodel = \"stories\"\nn_predict = " << kTokens << "\ntemperature = 0.0\n"
      << "[models.stories]\npath = \"" << test::refdata("gguf-models/stories260K.gguf") << "\"\n"
      << "[security]\nkeys = \"keys\"\n" << (allow_remote ? "allow_remote = true\n" : "")
      << "[nodes.head]\nendpoint = \"tcp://" << head_addr << ":" << base << "\"\nhead = true\n"
      << "[nodes.stage0]\nendpoint = \"tcp://" << stage_addr << ":" << base + 2 << "\"\n"
      << "[nodes.stage1]\nendpoint = \"tcp://" << stage_addr << ":" << base + 4 << "\"\n"
      << "[devices.cpu0]\nnode = \"stage0\"\n[devices.cpu1]\nnode = \"stage1\"\n"
      << "[[stages]]\ndevice = \"cpu0\"\nlayers = [0, 3]\n[[stages]]\ndevice = \"cpu1\"\nlayers = [3, 5]\n";
  }
  const std::string cli = SPECMESH_CLI_PATH;

  // Without keys a hand-started node refuses to start, naming what is missing.
  const std::string keyless = dir.path + "/keyless.log";
  const pid_t k = test::start_process({cli, "node", "--config", topo, "--name", "stage0"}, keyless);
  EXPECT_EQ(test::wait_exit(k, 10000ms), std::optional<int>(1));
  EXPECT_NE(test::read_file(keyless).find("cannot read the secret key file"), std::string::npos) << test::read_file(keyless);

  ASSERT_EQ(test::wait_exit(test::start_process({cli, "keygen", "--topology", topo}, dir.path + "/keygen.log"), 10000ms),
            std::optional<int>(0))
      << test::read_file(dir.path + "/keygen.log");

  Started nodes;
  for (const std::string name : {"stage0", "stage1"}) {
    std::vector<std::string> argv = wrap_stages;
    argv.insert(argv.end(), {cli, "node", "--config", topo, "--name", name});
    nodes.pids.push_back(test::start_process(argv, dir.path + "/" + name + ".log"));
  }
  std::vector<std::string> head = wrap_head;
  head.insert(head.end(), {cli, "run", topo, "-p", kPrompt, "-n", std::to_string(kTokens), "--json"});
  const std::string head_log = dir.path + "/head.log";
  const pid_t h = test::start_process(head, head_log);
  const auto status = test::wait_exit(h, 60000ms);
  if (!status) {
    ::kill(h, SIGKILL);
    ::waitpid(h, nullptr, 0);
  }
  ASSERT_EQ(status, std::optional<int>(0)) << test::read_file(head_log) << "\nstage0:\n"
                                           << test::read_file(dir.path + "/stage0.log");
  const nlohmann::json got = test::last_json(test::read_file(head_log));

  const std::string ref_log = dir.path + "/reference.log";
  ASSERT_EQ(test::wait_exit(test::start_process({cli, "generate", "-m", test::refdata("gguf-models/stories260K.gguf"), "-p", kPrompt,
                                   "-n", std::to_string(kTokens), "--temp", "0", "--json"},
                                  ref_log),
                            60000ms),
            std::optional<int>(0));
  const nlohmann::json want = test::last_json(test::read_file(ref_log));
  ASSERT_TRUE(got.is_object() && want.is_object()) << test::read_file(head_log);
  EXPECT_EQ(got["ids"].size(), size_t(kTokens));
  EXPECT_EQ(got["prompt_ids"], want["prompt_ids"]);
  EXPECT_EQ(got["ids"], want["ids"]);

  nodes.stop();
  EXPECT_TRUE(test::processes_running(topo).empty()) << "processes of this test are still running";
}

TEST(MultiHost, HandStartedNodesWithKeygenKeysOnLoopback) {
  SPECMESH_REQUIRE_REFDATA();
  run_hand_started("127.0.0.1", "127.0.0.1", false, {}, {});
}

TEST(MultiHost, HeadAndStagesInTwoNetworkNamespaces) {
  SPECMESH_REQUIRE_REFDATA();
  test::NetnsPair ns;
  if (!ns.unavailable.empty())
    GTEST_SKIP() << "\n\n*** MULTI-HOST TEST NOT RUN: " << ns.unavailable << " ***\n";
  run_hand_started(ns.addr_a, ns.addr_b, true, test::NetnsPair::in(ns.a), test::NetnsPair::in(ns.b));
}

TEST(MultiHost, NonLoopbackNeedsAllowRemote) {
  SPECMESH_REQUIRE_REFDATA();
  test::NetnsPair ns;
  if (!ns.unavailable.empty())
    GTEST_SKIP() << "\n\n*** MULTI-HOST TEST NOT RUN: " << ns.unavailable << " ***\n";
  TestDir dir;
  const std::string topo = dir.path + "/topology.toml";
  std::ofstream(topo) << "[models.stories]\npath = \"" << test::refdata("gguf-models/stories260K.gguf") << "\"\n"
                      << "[run]\n[security]\nkeys = \"keys\"\n"
                      << "[nodes.head]\nendpoint = \"tcp://" << ns.addr_a << ":47310\"\nhead = true\n"
                      << "[nodes.stage0]\nendpoint = \"tcp://" << ns.addr_b << ":47320\"\n"
                      << "[devices.cpu0]\nnode = \"stage0\"\n";
  const std::string cli = SPECMESH_CLI_PATH;
  ASSERT_EQ(test::wait_exit(test::start_process({cli, "keygen", "--topology", topo}, dir.path + "/keygen.log"), 10000ms),
            std::optional<int>(0));
  std::vector<std::string> argv = test::NetnsPair::in(ns.b);
  argv.insert(argv.end(), {cli, "node", "--config", topo, "--name", "stage0"});
  const pid_t p = test::start_process(argv, dir.path + "/node.log");
  const auto status = test::wait_exit(p, 10000ms);
  if (!status) ::kill(p, SIGKILL), ::waitpid(p, nullptr, 0);
  EXPECT_EQ(status, std::optional<int>(1));
  const std::string log = test::read_file(dir.path + "/node.log");
  EXPECT_NE(log.find(topo + ":10: nodes.stage0.endpoint: 'tcp://" + ns.addr_b + ":47320' is not a loopback address"),
            std::string::npos)
      << log;
}

}  // namespace
}  // namespace specmesh
