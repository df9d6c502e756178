// Run ids and run deadlines: a run's id cannot be guessed, and a run that a live peer drops
// ends the generation with a clear error instead of leaving it waiting forever.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "private_dir.hpp"
#include "actor_harness.hpp"
#include "refdata.hpp"
#include "synthetic_model.hpp"
#include "specmesh/actors/head_host.hpp"
#include "specmesh/actors/run_deadlines.hpp"
#include "specmesh/actors/run_ids.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/transport/gateway.hpp"
#include "specmesh/transport/router.hpp"

using namespace specmesh;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

TEST(RunIds, AreNonZeroDistinctAndNotACounter) {
  RunIds ids;
  std::set<uint64_t> seen;
  uint64_t prev = 0;
  int steps_of_one = 0, high_bits = 0;
  for (int i = 0; i < 20000; ++i) {
    const uint64_t id = ids.next();
    ASSERT_NE(id, 0u);
    EXPECT_TRUE(seen.insert(id).second) << "id " << id << " repeated";
    steps_of_one += id == prev + 1;
    high_bits += (id >> 63) != 0;
    prev = id;
  }
  EXPECT_EQ(steps_of_one, 0);
  // About half of uniformly random ids have the top bit set; a counter never does.
  EXPECT_GT(high_bits, 9000);
  EXPECT_LT(high_bits, 11000);
}

namespace {

std::shared_ptr<const Model> tiny_model() { return test::synthetic_model("tiny-llama", 1); }

PipelinePrice price(std::optional<DeviceProfile> profile, LinkProfile link = {}) {
  PipelinePrice p;
  const auto m = tiny_model();
  const int n = m->hparams().n_layer;
  p.stages.push_back({m, 0, n / 2, profile, 1});
  p.stages.push_back({m, n / 2, n, profile, 1});
  p.link = link;
  p.n_ctx = 256;
  return p;
}

}  // namespace

TEST(RunDeadlines, PriceGrowsWithProfileLinkAndTokens) {
  const PipelinePrice plain = price(std::nullopt);
  DeviceProfile slow;
  slow.layer_s = 0.05;
  const PipelinePrice profiled = price(slow);
  LinkProfile link;
  link.latency_s = 0.1;
  const PipelinePrice far = price(std::nullopt, link);
  EXPECT_GT(plain.run_seconds(1), 0);
  EXPECT_GT(plain.run_seconds(64), plain.run_seconds(1));
  // Each layer of the profile costs 50 ms, and three hops cross the 100 ms link.
  const int n_layer = tiny_model()->hparams().n_layer;
  EXPECT_NEAR(profiled.run_seconds(1) - plain.run_seconds(1), 0.05 * n_layer, 1e-6);
  EXPECT_NEAR(far.run_seconds(1) - plain.run_seconds(1), 0.3, 1e-6);
}

TEST(RunDeadlines, ARunIsOverdueOnlyPastItsBudgetAndQueuedRunsGetMore) {
  DeviceProfile slow;
  slow.layer_s = 0.1;
  RunDeadlines d({{"target", price(slow)}}, milliseconds(500), 2);
  const auto t0 = Clock::now();
  const double one = price(slow).run_seconds(1);
  d.launched(11, "target", 1, t0);
  d.launched(12, "target", 1, t0);  // queued behind 11: twice the modelled time
  EXPECT_EQ(d.outstanding(), 2u);
  const auto budget1 = milliseconds(500) + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(2 * one));
  const auto budget2 = milliseconds(500) + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(4 * one));
  EXPECT_FALSE(d.overdue(t0 + budget1 - milliseconds(1)));
  auto late = d.overdue(t0 + budget1 + milliseconds(1));
  ASSERT_TRUE(late);
  EXPECT_EQ(late->run, 11u);
  EXPECT_EQ(late->role, "target");
  d.settled(11);
  EXPECT_FALSE(d.overdue(t0 + budget1 + milliseconds(1)));
  late = d.overdue(t0 + budget2 + milliseconds(1));
  ASSERT_TRUE(late);
  EXPECT_EQ(late->run, 12u);
  d.settled(12);
  EXPECT_EQ(d.outstanding(), 0u);
  EXPECT_FALSE(d.overdue(t0 + std::chrono::hours(1)));
}

// A stage node that is alive (it answers heartbeats) but drops every run: the runtime's first
// run through the pipeline must fail within its deadline, naming the pipeline and its node,
// not wait forever.
TEST(RunDeadlines, APeerThatSwallowsRunsEndsTheRunWithAClearError) {
  SPECMESH_REQUIRE_REFDATA();
  const std::filesystem::path dir = test::private_tmpdir("specmesh-swallow");
  const std::string head_ep = "ipc://" + (dir / "head.ipc").string(), sink_ep = "ipc://" + (dir / "sink.ipc").string();
  const std::string path = (dir / "t.toml").string();
  std::ofstream(path) << "[run]\nmodel = \"m\"\nn_predict = 8\n[models.m]\npath = \""
                      << test::refdata("gguf-models/stories260K.gguf") << "\"\n[nodes.head]\nendpoint = \"" << head_ep
                      << "\"\nhead = true\n[nodes.sink]\nendpoint = \"" << sink_ep
                      << "\"\n[devices.d]\nnode = \"sink\"\n[[stages]]\ndevice = \"d\"\nfraction = 1.0\n";
  GatewayConfig gc;
  gc.node = "sink";
  gc.bind = sink_ep;
  gc.peers = {{"head", head_ep}};
  Gateway sink(gc);  // subscribes to nothing: run starts are dropped
  const auto t0 = Clock::now();
  try {
    Runtime rt(Topology::load(path), RuntimeOptions{});
    FAIL() << "the first run should have failed";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("got no answer within"), std::string::npos) << what;
    EXPECT_NE(what.find("sink"), std::string::npos) << what;
  }
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(waited, 6.0);
  std::filesystem::remove_all(dir);
}

// A strategy that launched runs without bound would flood the stages (they refuse beyond
// their own cap, but the session would never end): the head's host refuses the run past
// max_runs_in_flight with an error, and takes runs again once earlier ones settle.
TEST(RunDeadlines, ASessionCannotHaveMoreThanItsCapOfRunsInFlight) {
  test::System sys;
  GatewayConfig gc;
  gc.node = "head";
  gc.bind = "inproc://session-cap-" + test::unique_tag();
  Gateway gw(gc);
  auto router = std::make_shared<Router>("head", &gw, LinkProfile{});
  router->set_local(sys.sys->spawn([](caf::event_based_actor*) -> caf::behavior {
    return {[](const std::string&, const Envelope&) {}};  // a pipeline that never answers
  }));
  HeadConfig cfg;
  cfg.strategy = &strategy("ar");
  PipelineRef p;
  p.role = kTargetRole;
  p.model = tiny_model();
  p.nodes = {"head"};
  p.first_node = "head";
  cfg.pipelines[kTargetRole] = p;
  cfg.router = router;
  cfg.max_runs_in_flight = 5;
  cfg.session_ctx = 64;
  auto session = std::make_shared<Session>();
  session->request.prompt = "hi";
  RunIds ids;
  HeadHost host(cfg, session, ids, *cfg.strategy, {}, SessionSeqs{}, nullptr);
  Batch b;
  b.add(1, 0, seq_bit(0), true);
  std::vector<uint64_t> runs;
  for (int i = 0; i < 5; ++i) runs.push_back(host.launch(kTargetRole, b, false));
  try {
    host.launch(kTargetRole, b, false);
    FAIL() << "the sixth run should be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("5 runs in flight"), std::string::npos) << e.what();
  }
  host.cancel(kTargetRole, {runs[0]});
  EXPECT_NO_THROW(host.launch(kTargetRole, b, false));
  router->close();
}
