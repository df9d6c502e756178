// What a target run costs on the real CPU, in one process, before any speculation:
//   - the verify cost: a forward pass over k new tokens (k rows of logits, as a verification
//     of k - 1 draft tokens computes) over the cost of one, at the context depth after the
//     prompt. Speculation gains at most tokens-per-run / this ratio, whatever the draft;
//   - the per-run overhead: what a run through the runtime (head, stage actor, messages, the
//     strategy's bookkeeping) costs beyond its forward pass, as plain decoding's time per token
//     through Runtime less the same model's forward of one token called directly.
// Direct and runtime measurements alternate round by round so that the shared machine's load
// drifts affect both alike; every figure is a median over rounds.
//
//   bench_run_cost [--refdata DIR] [--target stories-target-1M] [--k 1,2,3,4,5,8]
//                  [--tokens 128] [--rounds 5] [--reps 200] [--threads 1]
//                  [--model FILE.gguf] [--depth N]
// With --depth the forward passes run after N cached tokens (the prompt repeated), and the
// runtime's overhead, measured after the short prompt, is left out.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"
#include "specmesh/topology.hpp"

using namespace specmesh;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Median over `reps` forward passes of k tokens at positions [depth, depth + k) in sequence 0,
// each removed again after (the cache holds the prompt's depth cells throughout).
double forward_ms(Context& ctx, const std::vector<int32_t>& tokens, int32_t depth, int k, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    Batch b;
    for (int i = 0; i < k; ++i) b.add(tokens[size_t(i) % tokens.size()], depth + i, seq_bit(0), true);
    const auto t0 = Clock::now();
    ctx.forward(b);
    t.push_back(ms_since(t0));
    ctx.kv().seq_rm(0, depth, -1);
  }
  return bench::median(t);
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);
  const char* env = std::getenv("SPECMESH_REFDATA");
  std::string refdata = env && *env ? env : "../shared/refdata", target = "stories-target-1M";
  std::vector<int> ks = {1, 2, 3, 4, 5, 8};
  int tokens = 128, rounds = 5, reps = 200, threads = 1, depth = 0;
  std::string model_path;
  CLI::App app{"What a target run costs on the real CPU: k tokens against 1, and the runtime's overhead per run"};
  app.add_option("--refdata", refdata, "reference data directory (or SPECMESH_REFDATA)")->capture_default_str();
  app.add_option("--target", target, "target model (a GGUF under refdata/gguf-models, without .gguf)")->capture_default_str();
  app.add_option("--model", model_path, "a target GGUF by path instead (e.g. a long-context make-model)");
  app.add_option("--depth", depth, "cached tokens before the forward passes (0: the prompt's)")->check(CLI::NonNegativeNumber);
  app.add_option("--k", ks, "tokens per forward pass to compare with 1")->delimiter(',')->check(CLI::Range(1, 64));
  app.add_option("--tokens", tokens, "tokens plain decoding generates through the runtime per round")
      ->check(CLI::Range(8, 400))->capture_default_str();
  app.add_option("--rounds", rounds, "rounds (medians are over them)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--reps", reps, "forward passes per k per round")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--threads", threads, "threads of the target's forward, direct and in the runtime")
      ->check(CLI::Range(1, 64))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const std::string path = model_path.empty() ? refdata + "/gguf-models/" + target + ".gguf" : model_path;
  std::unique_ptr<Model> model;
  try {
    model = Model::load(path, "");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", path.c_str(), e.what());
    return 2;
  }
  const std::string prompt = "Once upon a time";
  const std::vector<int32_t> ids = model->tokenizer().encode(prompt, true);
  // The cache holds `depth` tokens (the prompt repeated), fed in chunks of 512.
  const int32_t cached = std::max(int32_t(ids.size()), int32_t(depth));
  Context ctx(*model, {.n_ctx = cached + 128, .n_threads = threads});
  std::vector<int32_t> fill(static_cast<size_t>(cached));
  for (size_t i = 0; i < fill.size(); ++i) fill[i] = ids[i % ids.size()];
  prefill(ctx, fill, 0, 512);
  // Plain decoding through the runtime, after the short prompt: only without --depth.
  std::unique_ptr<Runtime> rt;
  if (depth == 0) rt = std::make_unique<Runtime>(Topology::single_process({"target", path}, {}, threads));
  const std::string plain = default_strategy({kTargetRole}).name;  // plain decoding

  std::vector<std::vector<double>> k_ms(ks.size());
  std::vector<double> direct_ms, runtime_ms;
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < ks.size(); ++i) k_ms[i].push_back(forward_ms(ctx, ids, cached, ks[i], reps));
    direct_ms.push_back(forward_ms(ctx, ids, cached, 1, reps));
    if (!rt) continue;
    const GenerationResult r = rt->generate({.prompt = prompt, .n_predict = tokens, .ignore_eos = true, .parse_special = false, .strategy = plain});
    if (!r.ok()) {
      std::fprintf(stderr, "runtime: %s\n", r.error.c_str());
      return 1;
    }
    // Decode time per token after the first (which includes the prompt's run).
    runtime_ms.push_back((r.stats.total_ms - r.stats.ttft_ms) / (r.stats.generated_tokens - 1));
  }
  const double one = bench::median(direct_ms);
  std::printf("# %s, %d thread(s), context depth %d, medians over %d rounds (%d forward passes each)\n", path.c_str(),
              threads, cached, rounds, reps);
  std::printf("%-4s %12s %14s\n", "k", "forward us", "cost k / 1");
  for (size_t i = 0; i < ks.size(); ++i)
    std::printf("%-4d %12.1f %14.2f\n", ks[i], 1000 * bench::median(k_ms[i]), bench::median(k_ms[i]) / one);
  if (runtime_ms.empty()) return 0;
  const double per_run = bench::median(runtime_ms);
  std::printf("plain decoding through the runtime: %.1f us per token (%.0f tok/s); the forward of one token alone: %.1f us\n",
              1000 * per_run, 1000 / per_run, 1000 * one);
  std::printf("per-run overhead: %.1f us (%.2fx the forward pass)\n", 1000 * (per_run - one), (per_run - one) / one);
  return 0;
}
