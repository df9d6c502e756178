// Failover: a stage's node dies mid-generation and a standby takes its stages over. The client
// sees a pause, not an error; every accepted token is kept and none is repeated or lost, so
// the ids equal an undisturbed run's.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "private_dir.hpp"
#include "processes.hpp"
#include "refdata.hpp"
#include "specmesh/actors/failover.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/runtime.hpp"

using namespace specmesh;
namespace fs = std::filesystem;

namespace {

HeadConfig three_stages(std::vector<Standby> standbys) {
  HeadConfig cfg;
  cfg.head_node = "head";
  cfg.nodes = {"head", "n0", "n1", "n2", "spare", "spare2"};
  PipelineRef p;
  p.role = kTargetRole;
  p.nodes = {"n0", "n1", "n2"};
  p.first_node = "n0";
  p.price.stages.resize(3);
  cfg.pipelines[kTargetRole] = p;
  cfg.placement = {{kTargetRole, 0, 2, "cpu0", "n0"}, {kTargetRole, 2, 4, "cpu1", "n1"}, {kTargetRole, 4, 5, "cpu2", "n2"}};
  cfg.standbys = std::move(standbys);
  return cfg;
}

}  // namespace

TEST(FailoverPlan, MovesEveryStageOfTheLostNodeAndRewiresItsNeighbours) {
  DeviceProfile prof;
  prof.layer_s = 0.003;
  HeadConfig cfg = three_stages({{"sb", "spare", prof, 2}, {"sb2", "spare2", std::nullopt, 1}});
  auto alive = [](const std::string& n) { return n != "n1"; };
  auto plan = plan_failover(cfg, "n1", alive, 7);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->down, "n1");
  EXPECT_EQ(plan->standby.device, "sb");
  ASSERT_EQ(plan->replans.size(), 1u);
  const Replan& r = plan->replans[0];
  EXPECT_EQ(r.pipeline, kTargetRole);
  EXPECT_EQ(r.layer_begin, 2);
  EXPECT_EQ(r.layer_end, 4);
  EXPECT_EQ(r.node, "spare");
  EXPECT_EQ(r.upstream, "n0");
  EXPECT_EQ(r.next_node, "n2");
  EXPECT_EQ(r.epoch, 7u);
  EXPECT_FALSE(r.done);
  EXPECT_EQ(plan->notify, (std::vector<std::string>{"head", "n0", "n2", "spare", "spare2"}));
  EXPECT_EQ(plan->awaited, plan->notify);
  const PipelineRef& p = cfg.pipelines.at(kTargetRole);
  EXPECT_EQ(p.nodes, (std::vector<std::string>{"n0", "spare", "n2"}));
  EXPECT_EQ(p.first_node, "n0");
  ASSERT_TRUE(p.price.stages[1].profile);
  EXPECT_EQ(p.price.stages[1].threads, 2);
  ASSERT_EQ(cfg.standbys.size(), 1u);
  EXPECT_EQ(cfg.standbys[0].device, "sb2");

  // The first stage: work now comes from the head to the standby.
  // n2 is unreachable too: it still gets the replans (queued until it is back), but nobody
  // waits for its answer.
  auto first = plan_failover(cfg, "n0", [](const std::string& n) { return n != "n0" && n != "n2"; }, 8);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->notify, (std::vector<std::string>{"head", "n1", "n2", "spare", "spare2"}));
  EXPECT_EQ(first->awaited, (std::vector<std::string>{"head", "n1", "spare", "spare2"}));
  EXPECT_EQ(first->replans[0].upstream, "head");
  EXPECT_EQ(first->replans[0].next_node, "spare");
  EXPECT_EQ(cfg.pipelines.at(kTargetRole).first_node, "spare2");
  // No standby left, a node without stages, a standby that is down itself: no plan.
  EXPECT_FALSE(plan_failover(cfg, "n2", [](const std::string&) { return true; }, 9));
  HeadConfig again = three_stages({{"sb", "spare", std::nullopt, 1}});
  EXPECT_FALSE(plan_failover(again, "head", [](const std::string&) { return true; }, 1));
  EXPECT_FALSE(plan_failover(again, "n2", [](const std::string& n) { return n != "spare" && n != "n2"; }, 1));
  EXPECT_EQ(again.standbys.size(), 1u) << "a failed plan keeps its standby";
}

namespace {

std::string tmpdir() {
  static std::string dir = [] {
    return test::private_tmpdir("specmesh-failover");
  }();
  return dir;
}

// head, stages on n0..n2 (one process each), and `standbys` standby devices (on `spare`, then
// `spare2`): 3 ms per layer, so 64 tokens take about a second.
std::string write_topology(const std::string& model, int standbys, int index) {
  const std::string dir = tmpdir() + "/" + std::to_string(index);
  test::private_dir(dir);
  const std::string path = dir + "/failover.toml";
  std::ofstream f(path);
  f << "[run]\nmodel = \"m\"\nn_predict = 64\ntemperature = 0.0\n";
  f << "[models.m]\npath = \"" << model << "\"\n";
  f << "[nodes.head]\nendpoint = \"ipc://" << dir << "/head\"\nhead = true\n";
  std::vector<std::string> nodes = {"n0", "n1", "n2", "spare"};
  if (standbys >= 2) nodes.push_back("spare2");
  for (const std::string& n : nodes) f << "[nodes." << n << "]\nendpoint = \"ipc://" << dir << "/" << n << "\"\n";
  for (int i = 0; i < 3; ++i) f << "[devices.cpu" << i << "]\nnode = \"n" << i << "\"\nprofile = { layer_ms = 3.0 }\n";
  if (standbys >= 1) f << "[devices.standby]\nnode = \"spare\"\nstandby = true\nprofile = { layer_ms = 3.0 }\n";
  if (standbys >= 2) f << "[devices.standby2]\nnode = \"spare2\"\nstandby = true\nprofile = { layer_ms = 3.0 }\n";
  f << "[[stages]]\ndevice = \"cpu0\"\nlayers = [0, 2]\n";
  f << "[[stages]]\ndevice = \"cpu1\"\nlayers = [2, 4]\n";
  f << "[[stages]]\ndevice = \"cpu2\"\nlayers = [4, 5]\n";
  return path;
}

struct Killed {
  GenerationResult result;
  double paused_s = 0;  // longest gap between two tokens
};

pid_t node_pid(const std::string& config, const std::string& name) {
  for (const auto& p : test::processes_running("node --config " + config))
    if (p.cmdline.find("--name " + name) != std::string::npos) return p.pid;
  return 0;
}

// Generates 64 tokens and SIGKILLs node `victim` when the 10th arrives.
Killed generate_and_kill(Runtime& rt, const std::string& config, const std::string& victim) {
  const pid_t pid = node_pid(config, victim);
  EXPECT_NE(pid, 0) << "no process for node " << victim;
  int seen = 0;
  auto last = std::chrono::steady_clock::now();
  Killed k;
  k.result = rt.generate({.prompt = "Once upon a time", .n_predict = 64, .ignore_eos = true},
                         [&](int32_t, const std::string&) {
                           const auto now = std::chrono::steady_clock::now();
                           k.paused_s = std::max(k.paused_s, std::chrono::duration<double>(now - last).count());
                           last = now;
                           if (++seen == 10 && pid > 0) ::kill(pid, SIGKILL);
                           return true;
                         });
  return k;
}

std::vector<int32_t> reference(const std::string& model, int n = 64) {
  auto m = Model::load(model, "");
  Context ctx(*m, {});
  return greedy_ids(ctx, m->tokenizer().encode("Once upon a time", true), n);
}

}  // namespace

// Each stage of the three in turn is killed with SIGKILL after 10 tokens. With a standby the
// generation completes with the ids of an undisturbed run; without one it ends with the
// tokens so far and names the node. No node process is left behind either way.
TEST(Failover, AKilledStageMovesToTheStandbyAndTheGenerationGoesOn) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = test::refdata("gguf-models/stories260K.gguf");
  const auto want = reference(model);
  int index = 0;
  for (bool standby : {true, false})
    for (const std::string victim : {"n0", "n1", "n2"}) {
      SCOPED_TRACE(victim + (standby ? " with a standby" : " without a standby"));
      const std::string config = write_topology(model, standby, index++);
      Killed k;
      {
        Runtime rt(Topology::load(config), test::node_options(true));
        k = generate_and_kill(rt, config, victim);
      }
      if (standby) {
        EXPECT_TRUE(k.result.ok()) << k.result.error;
        EXPECT_EQ(k.result.ids, want);
        EXPECT_EQ(k.result.metrics.failovers, 1);
        EXPECT_LT(k.paused_s, 2.0) << "the pause while the stage moved";
        std::printf("failover of %s: longest pause %.0f ms\n", victim.c_str(), k.paused_s * 1e3);
      } else {
        EXPECT_FALSE(k.result.ok());
        EXPECT_NE(k.result.error.find("node '" + victim + "' stopped answering"), std::string::npos) << k.result.error;
        EXPECT_GE(k.result.ids.size(), 10u);
        EXPECT_EQ(std::vector<int32_t>(want.begin(), want.begin() + long(k.result.ids.size())), k.result.ids);
      }
      EXPECT_TRUE(test::processes_running("node --config " + config).empty()) << "node processes left behind";
    }
}

namespace {

std::vector<int32_t> reference_of(const std::string& model, const std::string& prompt) {
  auto m = Model::load(model, "");
  Context ctx(*m, {});
  return greedy_ids(ctx, m->tokenizer().encode(prompt, true), 64);
}

}  // namespace

// Three sessions run at once when the middle stage is killed. With a standby each restarts from
// its own accepted tokens and ends with the ids it gives alone; without one every session ends
// with ErrorKind::unavailable and a prefix of its ids.
TEST(Failover, ConcurrentSessionsEachGoOnFromTheirOwnTokens) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = test::refdata("gguf-models/stories260K.gguf");
  const std::vector<std::string> prompts = {"Once upon a time", "The little dog", "Lily and Ben went"};
  std::vector<std::vector<int32_t>> want;
  for (const auto& p : prompts) want.push_back(reference_of(model, p));
  int index = 100;
  for (bool standby : {true, false}) {
    SCOPED_TRACE(standby ? "with a standby" : "without a standby");
    const std::string config = write_topology(model, standby, index++);
    std::vector<GenerationResult> results;
    {
      RuntimeOptions o = test::node_options(true);
      o.max_sessions = 3;
      Runtime rt(Topology::load(config), o);
      pid_t pid = 0;
      for (const auto& p : test::processes_running("node --config " + config))
        if (p.cmdline.find("--name n1") != std::string::npos) pid = p.pid;
      ASSERT_NE(pid, 0);
      std::atomic<int> seen{0};
      std::vector<std::unique_ptr<Generation>> gens;
      for (size_t i = 0; i < prompts.size(); ++i)
        gens.push_back(rt.submit({.prompt = prompts[i], .n_predict = 64, .ignore_eos = true},
                                 [&, i](int32_t, const std::string&) {
                                   if (i == 0 && ++seen == 10) ::kill(pid, SIGKILL);
                                   return true;
                                 }));
      for (auto& g : gens) results.push_back(g->wait());
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      const GenerationResult& r = results[i];
      if (standby) {
        EXPECT_TRUE(r.ok()) << i << ": " << r.error;
        EXPECT_EQ(r.ids, want[i]) << i;
        EXPECT_EQ(r.metrics.failovers, 1) << i;
      } else {
        EXPECT_EQ(r.error_kind, ErrorKind::unavailable) << i << ": " << r.error;
        EXPECT_NE(r.error.find("node 'n1' stopped answering"), std::string::npos) << r.error;
        EXPECT_EQ(std::vector<int32_t>(want[i].begin(), want[i].begin() + long(r.ids.size())), r.ids) << i;
      }
    }
    EXPECT_TRUE(test::processes_running("node --config " + config).empty()) << "node processes left behind";
  }
}

// The standby is silent (stopped with SIGSTOP, as a frozen or starved process is) when a
// stage's node is lost. The head waits for an answer instead of giving up: from the standby,
// which then takes the stages over, or from the lost node itself (frozen, not dead), whose
// stages then go on where they were. Either way the ids are an undisturbed run's.
TEST(Failover, ASilentStandbyIsWaitedForAndALostNodeMayComeBack) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = test::refdata("gguf-models/stories260K.gguf");
  const auto want = reference(model, 128);
  using namespace std::chrono_literals;
  using Clock = std::chrono::steady_clock;
  for (bool comes_back : {false, true}) {
    SCOPED_TRACE(comes_back ? "n1 frozen, then back" : "n2 killed, the standby back");
    const std::string config = write_topology(model, true, 200 + int(comes_back));
    GenerationResult result;
    double paused_s = 0;
    {
      Runtime rt(Topology::load(config), test::node_options(true));
      const pid_t spare = node_pid(config, "spare"), victim = node_pid(config, comes_back ? "n1" : "n2");
      ASSERT_NE(spare, 0);
      ASSERT_NE(victim, 0);
      std::thread waker;
      Clock::time_point silenced, last = Clock::now();
      int seen = 0;
      bool lost = false;
      result = rt.generate({.prompt = "Once upon a time", .n_predict = 128, .ignore_eos = true},
                           [&](int32_t, const std::string&) {
                             const auto now = Clock::now();
                             paused_s = std::max(paused_s, std::chrono::duration<double>(now - last).count());
                             last = now;
                             if (++seen == 5) {
                               ::kill(spare, SIGSTOP);
                               silenced = now;
                             }
                             // Once every node has found the standby silent, the stage's node is lost.
                             if (seen > 5 && !lost && now - silenced > 700ms) {
                               lost = true;
                               ::kill(victim, comes_back ? SIGSTOP : SIGKILL);
                               waker = std::thread([=] {
                                 std::this_thread::sleep_for(800ms);
                                 ::kill(comes_back ? victim : spare, SIGCONT);
                               });
                             }
                             return true;
                           });
      if (waker.joinable()) waker.join();
      ::kill(spare, SIGCONT);
      EXPECT_TRUE(lost) << "the generation ended before the node was lost";
    }
    EXPECT_TRUE(result.ok()) << result.error;
    EXPECT_EQ(result.ids, want);
    EXPECT_EQ(result.metrics.failovers, comes_back ? 0 : 1);
    EXPECT_GT(paused_s, 0.8) << "the sessions waited for an answer";
    EXPECT_LT(paused_s, 3.0);
    std::printf("%s: longest pause %.0f ms\n", comes_back ? "n1 back" : "standby back", paused_s * 1e3);
    EXPECT_TRUE(test::processes_running("node --config " + config).empty()) << "node processes left behind";
  }
}

// Two stages' nodes are killed together. The first failover does not wait for the other lost
// node's answer; once it ends, the second node's stages move to the second standby, and the
// ids are still an undisturbed run's.
TEST(Failover, TwoNodesLostAtOnceMoveToTwoStandbys) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = test::refdata("gguf-models/stories260K.gguf");
  const auto want = reference(model);
  const std::string config = write_topology(model, 2, 300);
  GenerationResult result;
  {
    Runtime rt(Topology::load(config), test::node_options(true));
    const pid_t n1 = node_pid(config, "n1"), n2 = node_pid(config, "n2");
    ASSERT_NE(n1, 0);
    ASSERT_NE(n2, 0);
    int seen = 0;
    result = rt.generate({.prompt = "Once upon a time", .n_predict = 64, .ignore_eos = true},
                         [&](int32_t, const std::string&) {
                           if (++seen == 10) ::kill(n1, SIGKILL), ::kill(n2, SIGKILL);
                           return true;
                         });
  }
  EXPECT_TRUE(result.ok()) << result.error;
  EXPECT_EQ(result.ids, want);
  EXPECT_EQ(result.metrics.failovers, 2);
  EXPECT_TRUE(test::processes_running("node --config " + config).empty()) << "node processes left behind";
}
