// A peer that floods a stage node with valid runs ("Trust and faults", item 5): the node is a
// real child process (`specmesh node`), this test is its head, with a Gateway of its own named
// as the head node. The node must refuse what it cannot hold at once, with an Error each, log
// a few lines per second at most, give its memory back afterwards and keep serving.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "actor_harness.hpp"
#include "private_dir.hpp"
#include "processes.hpp"
#include "refdata.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/transport/gateway.hpp"

using namespace specmesh;
using namespace std::chrono_literals;

namespace {

namespace fs = std::filesystem;

// Resident memory of `pid` in KiB (VmRSS), 0 when it cannot be read.
long rss_kib(pid_t pid, const std::string& field = "VmRSS:") {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(field.size()));
  return 0;
}

size_t line_count(const std::string& path) {
  const std::string text = test::read_file(path);
  return size_t(std::count(text.begin(), text.end(), '\n'));
}

// What the node sends back to its head, counted on the gateway's thread.
struct Answers {
  std::mutex mu;
  std::map<uint64_t, std::vector<float>> logits;  // runs below kFloodBase: the normal generations
  std::atomic<uint64_t> flood_logits{0}, flood_errors{0}, refusals{0};
  std::string first_refusal, first_other_error;  // guarded by mu
};

constexpr uint64_t kFloodBase = uint64_t(1) << 40;

caf::actor spawn_collector(caf::actor_system& sys, std::shared_ptr<Answers> a) {
  return sys.spawn([a](caf::event_based_actor*) -> caf::behavior {
    return {[a](const std::string&, const Envelope& env) {
      if (const auto* l = std::get_if<Logits>(&env.payload)) {
        if (env.run_id >= kFloodBase) {
          ++a->flood_logits;
          return;
        }
        std::lock_guard<std::mutex> g(a->mu);
        a->logits[env.run_id] = l->logits.data.to_vector<float>();
      } else if (const auto* e = std::get_if<Error>(&env.payload)) {
        if (env.run_id >= kFloodBase) ++a->flood_errors;
        const bool refusal = env.run_id >= kFloodBase && e->code == ErrorCode::invalid_request && e->peer == "stage0" &&
                             e->message.find("too many runs in flight") != std::string::npos;
        std::lock_guard<std::mutex> g(a->mu);
        if (refusal && a->refusals++ == 0) a->first_refusal = e->message;
        if (!refusal && a->first_other_error.empty())
          a->first_other_error = "run " + std::to_string(env.run_id) + ": " + e->message;
      }
    }};
  });
}

}  // namespace

// Measured on a 2-core VM (stories260K, 2048 KV cells). Before the caps: 97965 error lines
// (one per failed run, "KV cache full"), RSS 17 MiB before, 109 MiB at the peak and still 109
// MiB after, no refusals. With them: 3-5 lines, ~97k refusals (Errors), RSS 17-23 MiB before,
// 20-33 at the peak, 18.5-31 after (5-8 MiB above the start on a loaded Xeon, KV cache
// included), the same after a second flood, and the node generates as before. (Under glibc's
// malloc; the node has since allocated with jemalloc, and this test turns its decay off: RSS
// 23.5 MiB before, 25.4-25.5 after, 25.3-26.0 after three more floods.)
TEST(StageFlood, HundredThousandRunsAreRefusedQuietlyAndTheNodeRecovers) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string dir = test::private_tmpdir("specmesh-flood");
  struct RemoveDir {
    std::string dir;
    ~RemoveDir() { fs::remove_all(dir); }
  } remove_dir{dir};
  const std::string head_ep = "ipc://" + dir + "/head", stage_ep = "ipc://" + dir + "/stage0";
  const std::string config = dir + "/flood.toml", output = dir + "/stage0.out";
  std::ofstream(config) << "[run]\nmodel = \"stories\"\n\n[models.stories]\npath = \""
                        << test::refdata("gguf-models/stories260K.gguf") << "\"\n\n[nodes.head]\nendpoint = \"" << head_ep
                        << "\"\nhead = true\n\n[nodes.stage0]\nendpoint = \"" << stage_ep
                        << "\"\n\n[devices.cpu0]\nnode = \"stage0\"\nthreads = 1\n\n[[stages]]\ndevice = \"cpu0\"\n"
                        << "layers = [0, 5]\n";
  // The node allocates with jemalloc (the CLI links it), which hands freed pages back to the
  // system over ten seconds: the resident set a few seconds after a flood would then count
  // pages freed or not yet depending on timing. With the decay off it counts what the node
  // holds (and what its allocator keeps in partly used slabs).
  const pid_t node = test::start_cli({"node", "--config", config, "--name", "stage0"}, output,
                                     {{"MALLOC_CONF", "dirty_decay_ms:0,muzzy_decay_ms:0"}});
  struct Stop {  // declared after RemoveDir: the node is gone before its directory
    pid_t pid;
    ~Stop() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } stop{node};

  test::System sys;
  GatewayConfig gc;
  gc.node = "head";
  gc.bind = head_ep;
  gc.peers = {{"stage0", stage_ep}};
  Gateway gw(gc);
  auto answers = std::make_shared<Answers>();
  caf::actor collector = spawn_collector(*sys.sys, answers);
  gw.subscribe(MsgType::logits, collector, Delivery::inline_io);
  gw.subscribe(MsgType::error, collector, Delivery::inline_io);
  ASSERT_TRUE(test::wait_until([&] { return gw.peer_alive("stage0"); }, 30s)) << test::read_file(output);

  // A greedy generation as the head runs it: empty the cache, the prompt, then one run per token.
  uint64_t next_run = 1;
  auto generate = [&](int n) {
    std::vector<int32_t> tokens = {1, 403, 407, 261, 378, 300};
    KvCacheOp clear;
    clear.pipeline = "target";
    clear.ops = {{KvOpKind::remove, -1, -1, -1, -1}};
    gw.send("stage0", make_envelope(0, clear));
    std::vector<int32_t> out;
    RunStart r;
    r.pipeline = "target";
    for (size_t i = 0; i < tokens.size(); ++i) {
      r.tokens.push_back(tokens[i]);
      r.positions.push_back(int32_t(i));
      r.seq_masks.push_back(1);
      r.logits.push_back(i + 1 == tokens.size());
    }
    for (int k = 0; k < n; ++k) {
      const uint64_t run = next_run++;
      gw.send("stage0", make_envelope(run, r));
      std::vector<float> row;
      if (!test::wait_until([&] {
            std::lock_guard<std::mutex> g(answers->mu);
            auto it = answers->logits.find(run);
            if (it == answers->logits.end()) return false;
            row = it->second;
            return true;
          }, 10s))
        return out;
      const int32_t next = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
      out.push_back(next);
      r.tokens = {next};
      r.positions = {int32_t(tokens.size() + out.size() - 1)};
      r.seq_masks = {1};
      r.logits = {1};
    }
    return out;
  };
  const std::vector<int32_t> before = generate(8);
  ASSERT_EQ(before.size(), 8u) << test::read_file(output);
  std::this_thread::sleep_for(500ms);
  const long baseline = rss_kib(node), baseline_anon = rss_kib(node, "RssAnon:");
  const size_t lines_before = line_count(output);
  ASSERT_GT(baseline, 0);

  // The flood: 100k valid decode runs, as fast as this process can send them, then the node
  // settles: its last held-back lines, its heap trimmed. Returns the seconds it took to answer.
  constexpr uint64_t kFlood = 100000;
  long peak = baseline;
  auto flood = [&](uint64_t first_id, uint64_t answered_before) {
    std::atomic<bool> sampling{true};
    std::thread sampler([&] {
      while (sampling) {
        peak = std::max(peak, rss_kib(node));
        std::this_thread::sleep_for(10ms);
      }
    });
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < kFlood; ++i) {
      RunStart r;
      r.pipeline = "target";
      r.tokens = {int32_t(1 + i % 500)};
      r.positions = {int32_t(6 + i % 256)};
      r.seq_masks = {1};
      r.logits = {1};
      // As fast as the gateway takes them: it refuses more than its pending cap (64k) at once.
      const Envelope env = make_envelope(first_id + i, std::move(r));
      while (!gw.send("stage0", env)) std::this_thread::sleep_for(1ms);
    }
    const bool answered = test::wait_until(
        [&] { return answers->flood_logits + answers->flood_errors >= answered_before + kFlood; }, 30s);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::this_thread::sleep_for(2500ms);
    sampling = false;
    sampler.join();
    EXPECT_TRUE(answered) << "the node answered " << answers->flood_logits + answers->flood_errors - answered_before
                          << " of " << kFlood << " runs within 30 s";
    return seconds;
  };
  const double flood_s = flood(kFloodBase, 0);
  const long after = rss_kib(node), after_anon = rss_kib(node, "RssAnon:");
  const size_t flood_lines = line_count(output) - lines_before;
  std::printf("flood: %.1f s, %llu logits, %llu errors (%llu refusals), %zu log lines; RSS KiB baseline %ld peak %ld "
              "after %ld (anonymous: %ld before, %ld after)\nfirst refusal: %s\nfirst other error: %s\n",
              flood_s, (unsigned long long)answers->flood_logits.load(), (unsigned long long)answers->flood_errors.load(),
              (unsigned long long)answers->refusals.load(), flood_lines, baseline, peak, after, baseline_anon, after_anon,
              answers->first_refusal.c_str(), answers->first_other_error.c_str());

  // Each run is answered once: logits, or an Error saying why not.
  EXPECT_EQ(answers->flood_logits + answers->flood_errors, kFlood);
  // Most runs are refused on arrival by the per-peer cap rather than queued; how many depends
  // on how fast the stage drains against the sender (57-90 % on a quiet machine, 42 % once on a
  // loaded one), the rest fail on the full KV cache.
  EXPECT_GT(answers->refusals.load(), kFlood / 4) << answers->first_other_error;
  // At most one line per second per kind of complaint (refused runs, failed runs, and room
  // for the gateway's), over the flood and the settling after it.
  EXPECT_LE(double(flood_lines), 4 * (flood_s + 2)) << test::read_file(output).substr(0, 4000);
  // The memory comes back: nothing of a refused run stays, queues that grew are released, the
  // heap is trimmed. What a flood may leave that is not held work: code run for the first time
  // (file-backed pages, ~0.3 MiB), what the allocator keeps in slabs still partly in use, and
  // the KV cache the node allocated at start (zero pages until written), resident once the
  // flood fills every cell: memory the node holds by design. Before the caps the node kept ~90
  // MiB, so a 16 MiB bound still tells them apart; and the floods after this one must find what
  // it left and reuse it (a run, queue or buffer kept per refused run would grow with each).
  const auto model = Model::load(test::refdata("gguf-models/stories260K.gguf"));
  const long kv_kib = long(KvCache::bytes_needed(context_size(*model, 0), model->hparams().n_layer,
                                                 model->hparams().kv_dim()) / 1024);
  EXPECT_LE(after, baseline + 16 * 1024 + kv_kib) << "baseline " << baseline << " KiB, peak " << peak << " KiB";
  // Three more floods: what a run, queue or buffer kept per refused run would leave grows with
  // each (at 40 bytes a run, about 4 MiB a flood), while what the allocator keeps is reused.
  // With the allocator's decay off, the resident set after each of three floods moved by -0.5
  // to +0.7 MiB (Intel Xeon, two runs); with a 40-byte allocation leaked per refused run, by
  // +3.8 to +4.1 MiB every time. (With the decay on, 2.5 s after a flood, the third flood once
  // left 8.2 MiB more than the first in the full suite.) So one flood at least must leave less
  // than half a leak's growth, and the three together less than 6 MiB.
  std::vector<long> rss = {after};
  for (uint64_t f = 1; f <= 3; ++f) {
    flood(kFloodBase + f * kFlood, f * kFlood);
    EXPECT_EQ(answers->flood_logits + answers->flood_errors, (f + 1) * kFlood);
    rss.push_back(rss_kib(node));
  }
  std::string trail = "RSS KiB after each flood:";
  long least_step = LONG_MAX;
  for (size_t i = 0; i < rss.size(); ++i) {
    trail += " " + std::to_string(rss[i]);
    if (i > 0) least_step = std::min(least_step, rss[i] - rss[i - 1]);
  }
  std::printf("%s (anonymous after the last: %ld)\n", trail.c_str(), rss_kib(node, "RssAnon:"));
  EXPECT_LT(least_step, 2 * 1024) << "every flood left more memory: " << trail;
  EXPECT_LT(rss.back(), after + 6 * 1024) << trail;

  // And the node serves on: the same tokens as before the flood.
  EXPECT_EQ(generate(8), before) << test::read_file(output).substr(0, 4000);
  gw.unsubscribe(collector);
}
