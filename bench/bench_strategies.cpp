// Every registered strategy that runs on a target and a draft, on an emulated 4-node cluster, with real tokens from the refdata
// model pairs: the head and the draft on a fast node, the target split over three slow
// nodes joined by a gigabit link. Device timing profiles stand in for the slow hardware;
// every token is really computed and checked against plain autoregression.
//
//   bench_strategies [--refdata DIR] [--tokens 64] [--layer-ms 4] [--draft-layer-ms 0.25]
//                    [--max-runs 8] [--n-draft 4] [--p-accept 0.4] [--csv results.csv]
//                    [--tree 1,1,3,1]   (also runs every strategy that takes a tree with that shape)
//                    [--n-parallel 3 --p-split 0.1]   (also runs every strategy that takes
//                                                      n_parallel, with these branches per run)
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "specmesh/runtime.hpp"
#include "specmesh/speculation/registry.hpp"

using namespace specmesh;

namespace {

struct Options {
  std::string refdata = "../shared/refdata";
  int tokens = 64;
  double layer_ms = 4.0, token_ms = 0.05, draft_layer_ms = 0.25;
  int max_runs = 8, n_draft = 4;
  double p_accept = 0.4;
  std::string csv, tree;
  int n_parallel = 1;
  double p_split = 0.8;
};

// One row of the table: a strategy, with a token-tree shape for those that take one.
struct Variant {
  const StrategyInfo* info;
  std::string label, tree;
  bool parallel = false;  // with the bench's n_parallel and p_split
};

std::string write_topology(const Options& o, const std::string& target, const std::string& draft,
                           const StrategyInfo& strategy, const Variant& variant) {
  static int n = 0;
  const std::string dir = std::filesystem::temp_directory_path() / ("specmesh-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/cluster-" + std::to_string(n++) + ".toml";
  std::ofstream f(path);
  f << "link = \"gigabit\"\n";
  f << "[run]\nmodel = \"target\"\ndraft = \"draft\"\nstrategy = \"" << strategy.name << "\"\nn_predict = " << o.tokens << "\n";
  if (!o.csv.empty()) f << "metrics_csv = \"" << std::filesystem::absolute(o.csv).string() << "\"\n";
  // The bench's settings, for the strategies that take them.
  f << "[run.params]\n";
  const std::map<std::string, double> settings = {
      {"n_draft", o.n_draft}, {"p_accept", o.p_accept}, {"max_runs", o.max_runs}, {"max_micro_batch", 4}};
  for (const auto& [k, v] : settings)
    if (strategy.param(k)) f << k << " = " << v << "\n";
  if (!variant.tree.empty()) f << "tree = \"" << variant.tree << "\"\n";
  if (variant.parallel) f << "n_parallel = " << o.n_parallel << "\np_split = " << o.p_split << "\n";
  f << "[models.target]\npath = \"" << o.refdata << "/gguf-models/" << target << ".gguf\"\n";
  f << "[models.draft]\npath = \"" << o.refdata << "/gguf-models/" << draft << ".gguf\"\n";
  const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(n);
  f << "[nodes.head]\nendpoint = \"inproc://bench-head-" << tag << "\"\nhead = true\n";
  for (int i = 0; i < 3; ++i) f << "[nodes.slow" << i << "]\nendpoint = \"inproc://bench-slow" << i << "-" << tag << "\"\n";
  f << "[devices.fast]\nnode = \"head\"\nprofile = { layer_ms = " << o.draft_layer_ms << ", layer_token_ms = 0.01 }\n";
  for (int i = 0; i < 3; ++i)
    f << "[devices.slow" << i << "]\nnode = \"slow" << i << "\"\nprofile = { layer_ms = " << o.layer_ms
      << ", layer_token_ms = " << o.token_ms << " }\n";
  for (int i = 0; i < 3; ++i) f << "[[stages]]\nmodel = \"target\"\ndevice = \"slow" << i << "\"\nfraction = 0.3334\n";
  f << "[[stages]]\nmodel = \"draft\"\ndevice = \"fast\"\nfraction = 1.0\n";
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);  // the table is the output; connection chatter is not
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i], v = argv[i + 1];
    if (a == "--refdata") o.refdata = v;
    else if (a == "--tokens") o.tokens = std::stoi(v);
    else if (a == "--layer-ms") o.layer_ms = std::stod(v);
    else if (a == "--draft-layer-ms") o.draft_layer_ms = std::stod(v);
    else if (a == "--csv") o.csv = v;
    else if (a == "--max-runs") o.max_runs = std::stoi(v);
    else if (a == "--n-draft") o.n_draft = std::stoi(v);
    else if (a == "--p-accept") o.p_accept = std::stod(v);
    else if (a == "--tree") o.tree = v;
    else if (a == "--n-parallel") o.n_parallel = std::stoi(v);
    else if (a == "--p-split") o.p_split = std::stod(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (const char* env = std::getenv("SPECMESH_REFDATA")) o.refdata = env;
  o.refdata = std::filesystem::absolute(o.refdata).string();
  if (!std::filesystem::exists(o.refdata + "/gguf-models/stories260K.gguf")) {
    std::fprintf(stderr, "reference models not found under %s (--refdata DIR)\n", o.refdata.c_str());
    return 2;
  }
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"stories-target-1M", "stories260K"},
      {"stories-target-1M", "stories260K-draft-small"},
      {"stories-target-1M", "stories260K-draft-tiny"},
      {"stories260K", "stories260K-draft-small"},
  };
  const std::vector<std::string> prompts = {"Once upon a time", "Lily and Tom", "Tom had a big red ball"};
  std::printf("# emulated cluster: 3 slow target nodes (%.2f ms/layer), draft on a fast node (%.2f ms/layer), gigabit link, %d tokens x %zu prompts\n",
              o.layer_ms, o.draft_layer_ms, o.tokens, prompts.size());
  std::printf("%-20s %-24s %-12s %10s %10s %8s %8s %8s %9s %10s %10s\n", "target", "draft", "strategy", "tok/s", "ttft ms",
              "accept", "tok/ver", "tree", "max depth", "cancelled", "lossless");
  // Plain decoding (the registry's default for a lone target) is the reference the others
  // must reproduce; then every strategy that needs no role beyond target and draft.
  const StrategyInfo& plain = default_strategy({kTargetRole});
  std::vector<Variant> runs{{&plain, plain.name, ""}};
  for (const StrategyInfo& s : strategies()) {
    const bool fits = std::all_of(s.roles.begin(), s.roles.end(), [](const std::string& r) { return r == kTargetRole || r == "draft"; });
    if (fits && &s != &plain) runs.push_back({&s, s.name, ""});
    if (fits && !o.tree.empty() && s.param("tree")) runs.push_back({&s, s.name + "-tree", o.tree});
    if (fits && o.n_parallel > 1 && s.param("n_parallel"))
      runs.push_back({&s, s.name + "-np" + std::to_string(o.n_parallel), "", true});
  }
  for (const auto& [target, draft] : pairs) {
    std::map<std::string, double> tps, ttft;
    std::vector<std::vector<int32_t>> reference;
    for (const Variant& variant : runs) {
      const StrategyInfo* info = variant.info;
      const std::string& strategy = variant.label;
      double tokens = 0, seconds = 0, first = 0, accepted = 0, drafted = 0, verifs = 0, cancelled = 0, deepest = 0;
      bool lossless = true;
      for (size_t i = 0; i < prompts.size(); ++i) {
        // Each request meets an idle cluster, as a user's would; fresh endpoint names, since
        // the previous runtime's inproc sockets may not be released yet.
        auto rt = Runtime::open(write_topology(o, target, draft, *info, variant));
        auto r = rt->generate({.prompt = prompts[i], .n_predict = o.tokens, .ignore_eos = true});
        if (!r.ok()) {
          std::fprintf(stderr, "%s: %s\n", strategy.c_str(), r.error.c_str());
          return 1;
        }
        if (&variant == &runs.front()) reference.push_back(r.ids);
        else lossless = lossless && r.ids == reference[i];
        tokens += r.stats.generated_tokens - 1;
        seconds += (r.stats.total_ms - r.stats.ttft_ms) / 1000.0;
        first += r.stats.ttft_ms;
        accepted += r.metrics.accepted;
        drafted += r.metrics.drafted;
        verifs += r.metrics.verifications;
        cancelled += r.metrics.runs_cancelled;
        deepest = std::max(deepest, double(r.metrics.max_accepted_depth));
      }
      tps[strategy] = tokens / seconds;
      ttft[strategy] = first / prompts.size();
      // tree: draft tokens per verification (a chain's length, or a tree's nodes).
      std::printf("%-20s %-24s %-12s %10.2f %10.2f %8.2f %8.2f %8.2f %9.0f %10.0f %10s\n", target.c_str(), draft.c_str(),
                  strategy.c_str(), tps[strategy], ttft[strategy], drafted > 0 ? accepted / drafted : 0.0,
                  verifs > 0 ? (accepted + verifs) / verifs : 0.0, verifs > 0 ? drafted / verifs : 0.0, deepest,
                  cancelled, lossless ? "yes" : "NO");
      std::fflush(stdout);
    }
    // Every ratio measured in this run: each strategy against the reference and against the
    // strategies listed before it.
    std::string line;
    for (size_t a = 1; a < runs.size(); ++a)
      for (size_t b = 0; b < a; ++b) {
        const std::string &x = runs[a].label, &y = runs[b].label;
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s%s/%s tok/s %.2fx, ttft %.2f", line.empty() ? "" : "; ", x.c_str(), y.c_str(),
                      tps[x] / tps[y], ttft[x] / ttft[y]);
        line += buf;
      }
    std::printf("%-20s %-24s %s\n", "", "", line.c_str());
  }
  return 0;
}
