// `specmesh run --spawn` and the runtime when processes misbehave: a second run of the same
// file, Ctrl-C or SIGTERM, a frozen stage. Each must end with a clear message and leave no
// node process behind; none may hang.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <regex>

#include "ports.hpp"
#include "processes.hpp"
#include "private_dir.hpp"
#include "refdata.hpp"
#include "specmesh/runtime.hpp"

using namespace specmesh;
using namespace std::chrono_literals;
using specmesh::test::ProcessInfo;
using specmesh::test::processes_running;
using specmesh::test::read_file;
using specmesh::test::start_cli;
using specmesh::test::wait_exit;
using specmesh::test::wait_until;

namespace {

namespace fs = std::filesystem;

std::string tmpdir() {
  static const std::string dir = test::private_tmpdir("specmesh-process-faults");
  return dir;
}

// An example topology as a user has it, copied so that this test owns its addresses: the model
// path made absolute, the fixed tcp ports replaced by free ones and the ipc paths moved here.
// Each device gets a timing profile of `layer_ms` per layer, so a long generation lasts seconds.
std::string example_copy(const std::string& name, double layer_ms) {
  static int n = 0;
  std::string text = read_file(std::string(SPECMESH_SOURCE_DIR) + "/examples/" + name);
  text = std::regex_replace(text, std::regex(R"(\.\./\.\./shared/refdata/gguf-models/stories260K\.gguf)"),
                            test::refdata("gguf-models/stories260K.gguf"));
  const std::string dir = tmpdir() + "/" + std::to_string(n++);
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms::owner_all);
  std::string out;
  std::smatch m;
  const std::regex addr(R"(tcp://127\.0\.0\.1:\d+|ipc:///tmp/specmesh-example/[a-z0-9-]+)");
  std::string rest = text;
  while (std::regex_search(rest, m, addr)) {
    out += m.prefix().str();
    const std::string found = m.str();
    out += found.rfind("tcp://", 0) == 0 ? "tcp://127.0.0.1:" + std::to_string(test::free_port_pair())
                                         : "ipc://" + dir + "/" + found.substr(found.rfind('-') + 1);
    rest = m.suffix().str();
  }
  out += rest;
  out = std::regex_replace(out, std::regex(R"((\[devices\.[a-z0-9]+\]\n))"),
                           "$1profile = { layer_ms = " + std::to_string(layer_ms) + " }\n");
  const std::string path = dir + "/" + name;
  std::ofstream(path) << out;
  return path;
}

// The node processes of a topology file, wherever their parent is.
std::vector<ProcessInfo> nodes_of(const std::string& config) { return processes_running("node --config " + config); }

// Kills whatever a failed test left running of `config` (by pid, only processes named with
// this test's own file), so one failure does not leak processes into the next test.
struct Reaper {
  std::string config;
  std::vector<pid_t> own;
  ~Reaper() {
    for (pid_t p : own) ::kill(p, SIGKILL);
    for (pid_t p : own) ::waitpid(p, nullptr, 0);
    for (const ProcessInfo& p : nodes_of(config)) ::kill(p.pid, SIGKILL);
  }
};

// Output of a run that has started generating: the prompt and at least `chars` more.
bool generating(const std::string& output, size_t chars = 40) {
  const std::string text = read_file(output);
  const size_t at = text.find("Once upon a time");
  return at != std::string::npos && text.size() >= at + 16 + chars;
}

}  // namespace

// Two runs of one example at once: the second used to take the first one's ports or socket
// files (a ZeroMQ assertion, exit 134, or both runs broken and nodes left behind).
TEST(ProcessFaults, SecondRunOfOneFileIsRefusedUnlessItMovesItsPorts) {
  SPECMESH_REQUIRE_REFDATA();
  for (const std::string name : {"pipeline-3stage-tcp.toml", "pipeline-2stage-ipc.toml"}) {
    SCOPED_TRACE(name);
    const std::string config = example_copy(name, 1.0);
    Reaper reaper{config, {}};
    const std::string out_a = config + ".a.out", out_b = config + ".b.out", out_c = config + ".c.out";
    const pid_t a = start_cli({"run", config, "--spawn", "-p", "Once upon a time", "-n", "1500", "--ignore-eos"}, out_a);
    reaper.own.push_back(a);
    ASSERT_TRUE(wait_until([&] { return generating(out_a); }, 60s)) << read_file(out_a);

    const pid_t b = start_cli({"run", config, "--spawn", "-p", "Once upon a time", "-n", "4"}, out_b);
    reaper.own.push_back(b);
    const auto status_b = wait_exit(b, 60s);
    ASSERT_TRUE(status_b) << "the second run hangs";
    const std::string text_b = read_file(out_b);
    EXPECT_EQ(*status_b, 1) << text_b;
    const std::string head = Topology::load(config).nodes.at("head").endpoint;
    EXPECT_NE(text_b.find("endpoint " + head + " is in use (node 'head')"), std::string::npos) << text_b;

    // Moved to free ports, a second run works beside the first.
    const pid_t c = start_cli({"run", config, "--spawn", "--port-base", "0", "-p", "Once upon a time", "-n", "8"}, out_c);
    reaper.own.push_back(c);
    const auto status_c = wait_exit(c, 60s);
    ASSERT_TRUE(status_c) << "the moved run hangs";
    EXPECT_EQ(*status_c, 0) << read_file(out_c);
    EXPECT_TRUE(generating(out_c, 10)) << read_file(out_c);

    // The first run was not disturbed.
    const auto status_a = wait_exit(a, 120s);
    ASSERT_TRUE(status_a) << "the first run hangs";
    EXPECT_EQ(*status_a, 0) << read_file(out_a);
    EXPECT_TRUE(wait_until([&] { return nodes_of(config).empty(); }, 5s)) << nodes_of(config).size() << " nodes left";
  }
}

// SIGINT (Ctrl-C, or `kill -INT` to the run alone) and SIGTERM used to kill the run and leave
// its node processes serving forever.
TEST(ProcessFaults, InterruptedRunLeavesNoNodeBehind) {
  SPECMESH_REQUIRE_REFDATA();
  for (int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(strsignal(sig));
    const std::string config = example_copy("pipeline-3stage-tcp.toml", 1.0);
    Reaper reaper{config, {}};
    const std::string out = config + ".out";
    const pid_t run = start_cli({"run", config, "--spawn", "--port-base", "0", "-p", "Once upon a time", "-n", "1500", "--ignore-eos"}, out);
    reaper.own.push_back(run);
    ASSERT_TRUE(wait_until([&] { return generating(out); }, 60s)) << read_file(out);
    ASSERT_EQ(nodes_of(config).size(), 3u);
    ::kill(run, sig);
    const auto status = wait_exit(run, 10s);
    ASSERT_TRUE(status) << "the run did not stop";
    EXPECT_EQ(*status, 128 + sig) << read_file(out);
    EXPECT_TRUE(wait_until([&] { return nodes_of(config).empty(); }, 5s))
        << nodes_of(config).size() << " node processes left running:\n" << read_file(out);
  }
}

// A stage that freezes (SIGSTOP) mid-generation: the run reports it within about two seconds,
// keeps the tokens accepted so far, exits non-zero and leaves no process behind (it used to
// wait forever for the frozen child to exit).
TEST(ProcessFaults, FrozenStageEndsTheRunWithTheTokensSoFar) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string config = example_copy("pipeline-2stage-ipc.toml", 1.0);
  Reaper reaper{config, {}};
  const std::string out = config + ".out";
  const pid_t run = start_cli({"run", config, "--spawn", "--port-base", "0", "-p", "Once upon a time", "-n", "1500", "--ignore-eos"}, out);
  reaper.own.push_back(run);
  ASSERT_TRUE(wait_until([&] { return generating(out); }, 60s)) << read_file(out);
  const auto stage1 = processes_running("node --config " + config + " --name stage1");
  ASSERT_EQ(stage1.size(), 1u);
  ::kill(stage1[0].pid, SIGSTOP);
  const auto stopped_at = std::chrono::steady_clock::now();
  const auto status = wait_exit(run, 10s);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped_at).count();
  ASSERT_TRUE(status) << "the run did not end:\n" << read_file(out);
  EXPECT_LT(waited, 3.0);
  const std::string text = read_file(out);
  EXPECT_EQ(*status, 1) << text;
  EXPECT_NE(text.find("node 'stage1' stopped answering"), std::string::npos) << text;
  EXPECT_TRUE(generating(out)) << "the tokens accepted before the freeze are printed";
  EXPECT_TRUE(wait_until([&] { return nodes_of(config).empty(); }, 5s)) << nodes_of(config).size() << " nodes left";
}

// A request made while a stage is down fails at once, naming the node, instead of waiting
// silently for it; once the stage answers again, requests work again.
TEST(ProcessFaults, RequestWhileAStageIsDownFailsAtOnce) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string config = example_copy("pipeline-2stage-ipc.toml", 0.0);
  Reaper reaper{config, {}};
  RuntimeOptions o = test::node_options(true);
  o.port_base = 0;
  auto rt = Runtime::open(config, o);
  ASSERT_TRUE(rt->generate({.prompt = "Once upon a time", .n_predict = 8}).ok());
  const auto stage1 = processes_running("node --config " + config + " --name stage1");
  ASSERT_EQ(stage1.size(), 1u);
  ::kill(stage1[0].pid, SIGSTOP);
  std::this_thread::sleep_for(1s);  // longer than the peer timeout: the head knows it is down

  auto gen = rt->submit({.prompt = "Once upon a time", .n_predict = 8});
  auto result = std::async(std::launch::async, [&] { return gen->wait(); });
  const bool answered = result.wait_for(2s) == std::future_status::ready;
  ::kill(stage1[0].pid, SIGCONT);
  EXPECT_TRUE(answered) << "the request waited for the frozen stage";
  const GenerationResult r = result.get();
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error.find("node 'stage1' stopped answering"), std::string::npos) << r.error;

  // Back: heard from again within a few heartbeats, and requests go through.
  GenerationResult again;
  EXPECT_TRUE(wait_until([&] {
    again = rt->generate({.prompt = "Once upon a time", .n_predict = 8});
    return again.ok();
  }, 10s)) << again.error;
}
