// Aggregate decode throughput of concurrent `ar` sessions in one runtime, where the head merges
// the decode steps that are ready together into one target run (continuous batching): N
// clients each generate the same number of tokens at once, and the aggregate tokens/s is set
// against one client's, measured in the same run.
//
//   bench_sessions [--refdata DIR] [--clients 1,4] [--tokens 64] [--reps 3] [--threads 1]
//                  [--dir DIR] [--only stories260K|synthetic]
//
// Models: stories260K from the reference data, and a synthetic llama of about 100M parameters
// (q8_0, written once into DIR, default /tmp/specmesh-bench) whose decode reads its weights
// from memory, as a real model's does.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/runtime.hpp"

using namespace specmesh;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<int> int_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoi(item));
  return out;
}

const char* const kPrompts[] = {"Once upon a time", "The little dog", "Lily and Ben went", "One day, a girl",
                                "Tom had a red ball", "The sun was", "A cat sat", "Mom said"};

// Tokens per second of `clients` sessions generating `tokens` each at once: every generated
// token over the wall time from the first submit to the last result.
double aggregate_tokens_per_s(Runtime& rt, int clients, int tokens) {
  std::vector<std::unique_ptr<Generation>> gens;
  const auto t0 = Clock::now();
  for (int c = 0; c < clients; ++c)
    gens.push_back(rt.submit({.prompt = kPrompts[c % 8], .n_predict = tokens, .ignore_eos = true}));
  int64_t generated = 0;
  for (auto& g : gens) {
    GenerationResult r = g->wait();
    if (!r.ok()) throw std::runtime_error(r.error);
    generated += r.stats.generated_tokens;
  }
  return double(generated) / std::chrono::duration<double>(Clock::now() - t0).count();
}

void bench_model(const std::string& name, const ModelSpec& model, const std::vector<int>& clients, int tokens,
                 int reps, int threads) {
  std::map<int, double> tps;
  for (int n : clients) {
    Topology t = Topology::single_process(model, {}, threads);
    t.run.strategy = "ar";
    t.run.temperature = 0;
    t.run.n_ctx = n * 256;
    RuntimeOptions o;
    o.max_sessions = n;
    Runtime rt(t, o);
    aggregate_tokens_per_s(rt, n, 8);  // warm-up
    std::vector<double> runs;
    for (int r = 0; r < reps; ++r) runs.push_back(aggregate_tokens_per_s(rt, n, tokens));
    tps[n] = bench::median(runs);
    std::printf("%-12s clients %d: %8.1f tokens/s aggregate (median of %d; %d tokens each)\n", name.c_str(), n, tps[n],
                reps, tokens);
    std::fflush(stdout);
  }
  if (tps.count(1))
    for (const auto& [n, v] : tps)
      if (n != 1) std::printf("%-12s %d clients / 1 client: %.2fx\n", name.c_str(), n, v / tps[1]);
}

}  // namespace

int main(int argc, char** argv) {
  std::string refdata = "../shared/refdata", dir = "/tmp/specmesh-bench", only;
  std::vector<int> clients = {1, 4};
  int tokens = 64, reps = 3, threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--refdata") refdata = next();
    else if (a == "--clients") clients = int_list(next());
    else if (a == "--tokens") tokens = std::stoi(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--dir") dir = next();
    else if (a == "--only") only = next();
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  set_log_level("warn");
  try {
    if (only.empty() || only == "stories260K") {
      const std::string path = refdata + "/gguf-models/stories260K.gguf";
      if (std::filesystem::exists(path))
        bench_model("stories260K", {"target", std::filesystem::absolute(path).string(), ""}, clients, tokens, reps, threads);
      else
        std::printf("stories260K: %s not found, skipped\n", path.c_str());
    }
    if (only.empty() || only == "synthetic") {
      std::filesystem::create_directories(dir);
      const std::string path = dir + "/sessions-llama-100m-q8_0.gguf";
      if (!std::filesystem::exists(path)) {
        SyntheticSpec s;
        s.arch = "llama";
        s.n_vocab = 4096;
        s.n_embd = 1024;
        s.n_layer = 8;
        s.n_head = 16;
        s.n_head_kv = 4;
        s.n_ff = 2816;
        s.n_ctx = 2048;
        s.weight_type = DType::Q8_0;
        s.embd_type = DType::Q8_0;
        write_synthetic_model(s, path);
      }
      bench_model("synthetic", {"target", path, ""}, clients, tokens, reps, threads);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sessions: %s\n", e.what());
    return 1;
  }
  return 0;
}
