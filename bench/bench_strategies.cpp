// Every registered strategy that runs on a target and a draft, on an emulated cluster, with real tokens from the refdata
// model pairs: the head and the draft on a fast node, the target split over N slow nodes
// (3 by default: a 4-node cluster) joined by a gigabit link. Device timing profiles stand in for
// the slow hardware; every token is really computed and checked against plain autoregression.
//
//   bench_strategies --help
//   bench_strategies --tree 1,1,3,1 --n-parallel 3 --p-split 0.2 --csv build/strategies.csv
//   python3 bench/plot_strategies.py build/strategies.csv build/strategies.png
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/model/model.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/registry.hpp"

using namespace specmesh;

namespace {

struct Options {
  std::string refdata = "../shared/refdata";
  int tokens = 64;
  int stages = 3;
  double layer_ms = 4.0, token_ms = 0.05, draft_layer_ms = 0.25;
  int max_runs = 8, n_draft = 4;
  double p_accept = 0.4;
  std::string csv, metrics_csv, tree;
  std::vector<std::string> pairs;
  bool tune = false;
  std::vector<std::string> only;
  int n_parallel = 1;
  double p_split = 0.8;
  bool adaptive = false;
  std::string drafter = std::string(SPECMESH_SOURCE_DIR) + "/models/dflash-stories-target-1M";
  std::map<std::string, double> params;  // --param: settings for every strategy that takes them
};

// The draft device's cost per layer and token of a run, beside --draft-layer-ms per run.
constexpr double kDraftTokenMs = 0.01;

// Block-drafter strategies (dflash) draft with a drafter directory trained for the target, not
// the pair's draft: the committed drafter exists for stories-target-1M only.
const std::string kDrafterTarget = "stories-target-1M";

// The refdata target/draft pairs (they share one tokenizer).
const std::vector<std::pair<std::string, std::string>> kPairs = {
    {"stories-target-1M", "stories260K"},
    {"stories-target-1M", "stories260K-draft-small"},
    {"stories-target-1M", "stories260K-draft-tiny"},
    {"stories260K", "stories260K-draft-small"},
};

// One row of the table: a strategy, with a token-tree shape for those that take one.
struct Variant {
  const StrategyInfo* info;
  std::string label, tree;
  bool parallel = false;                 // with the bench's n_parallel and p_split
  bool defaults = false;                 // the registry's defaults instead of the bench's settings
  std::map<std::string, double> params;  // settings that override the bench's (a --tune point)
};

// What one variant measured over the prompts.
struct Measured {
  double tps = 0, ttft = 0, prefill = 0, paper_ttft = 0, acceptance = 0, tokens_per_ver = 0, tree = 0, deepest = 0, cancelled = 0;
  bool lossless = true;
  bool ran = true;  // false: a figure derived from runs (the chain bound), with no output to check
  std::vector<std::vector<int32_t>> ids;  // per prompt
};

// --tune's grid, per parameter, for the strategies that take it. No best point may sit on an
// edge the grid could move: spec's best chains were 8 long at p_accept 0.1, both edges of the
// grid before, so n_draft goes to 12 and p_accept to 0 (draft the whole chain). pipeinfer's
// branches (1: a chain, 3: the artifact's -np 3, 5) and the probability a candidate needs to
// become one are part of its grid; max_runs 4 is not (never the best point on any pair), nor
// are micro-batches of 12 or 16 (never better than 8 on the two strongest pairs). plain_runs
// off (the corrected token rides the next speculative run) is part of it: it gains most where
// the draft fills a micro-batch faster than a target stage takes a run (README).
// spec's trees are not: none of 1,1,3,1 / 2,2,1,1,1,1 / 1,3,1,1,1,1,1,1 beat its best chain
// on any pair (0.78-0.97x; README), since the draft grows a tree level by level.
const std::map<std::string, std::vector<double>> kTuneGrid = {
    {"n_draft", {2, 4, 6, 8, 10, 12}}, {"p_accept", {0.0, 0.1, 0.3, 0.5}}, {"max_runs", {8}},
    {"max_micro_batch", {4, 8}},      {"n_parallel", {1, 3, 5}},          {"p_split", {0.1, 0.5}},
    {"plain_runs", {0, 1}}};

// A grid point that differs from another only where it cannot matter: p_split without branches.
bool redundant(const std::map<std::string, double>& pt) {
  const auto np = pt.find("n_parallel"), ps = pt.find("p_split");
  return np != pt.end() && np->second == 1 && ps != pt.end() && ps->second != kTuneGrid.at("p_split").front();
}

std::string write_topology(const Options& o, const std::string& target, int n_layer, const std::string& draft,
                           const StrategyInfo& strategy, const Variant& variant) {
  static int n = 0;
  const std::string dir = std::filesystem::temp_directory_path() / ("specmesh-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/cluster-" + std::to_string(n++) + ".toml";
  std::ofstream f(path);
  f << "link = \"gigabit\"\n";
  f << "[run]\nmodel = \"target\"\ndraft = \"draft\"\nstrategy = \"" << strategy.name << "\"\nn_predict = " << o.tokens << "\n";
  if (!o.metrics_csv.empty()) f << "metrics_csv = \"" << std::filesystem::absolute(o.metrics_csv).string() << "\"\n";
  // The bench's settings (or a tune point's), for the strategies that take them.
  f << "[run.params]\n";
  std::map<std::string, double> settings = {
      {"n_draft", o.n_draft}, {"p_accept", o.p_accept}, {"max_runs", o.max_runs}, {"max_micro_batch", 4}};
  for (const auto& [k, v] : o.params) settings[k] = v;
  if (variant.defaults) settings.clear();
  for (const auto& [k, v] : variant.params) settings[k] = v;
  for (const auto& [k, v] : settings)
    if (strategy.param(k)) f << k << " = " << v << "\n";
  if (!variant.tree.empty()) f << "tree = \"" << variant.tree << "\"\n";
  if (variant.parallel) f << "n_parallel = " << o.n_parallel << "\np_split = " << o.p_split << "\n";
  f << "[models.target]\npath = \"" << o.refdata << "/gguf-models/" << target << ".gguf\"\n";
  if (strategy.drafter_role.empty()) f << "[models.draft]\npath = \"" << o.refdata << "/gguf-models/" << draft << ".gguf\"\n";
  else f << "[models.draft]\npath = \"" << o.drafter << "\"\n";
  const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(n);
  f << "[nodes.head]\nendpoint = \"inproc://bench-head-" << tag << "\"\nhead = true\n";
  for (int i = 0; i < o.stages; ++i) f << "[nodes.slow" << i << "]\nendpoint = \"inproc://bench-slow" << i << "-" << tag << "\"\n";
  f << "[devices.fast]\nnode = \"head\"\nprofile = { layer_ms = " << o.draft_layer_ms << ", layer_token_ms = " << kDraftTokenMs
    << " }\n";
  for (int i = 0; i < o.stages; ++i)
    f << "[devices.slow" << i << "]\nnode = \"slow" << i << "\"\nprofile = { layer_ms = " << o.layer_ms
      << ", layer_token_ms = " << o.token_ms << " }\n";
  // Explicit layer ranges, as even as the target's layers allow (the first stages take the rest).
  for (int i = 0, begin = 0; i < o.stages; ++i) {
    const int end = begin + n_layer / o.stages + (i < n_layer % o.stages ? 1 : 0);
    f << "[[stages]]\nmodel = \"target\"\ndevice = \"slow" << i << "\"\nlayers = [" << begin << ", " << end << "]\n";
    begin = end;
  }
  f << "[[stages]]\nmodel = \"draft\"\ndevice = \"fast\"\nfraction = 1.0\n";
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);  // the table is the output; connection chatter is not
  Options o;
  CLI::App app{"Every strategy that takes a target and a draft, on an emulated cluster of paced devices, with the refdata model pairs"};
  app.add_option("--refdata", o.refdata, "reference data directory (or SPECMESH_REFDATA)")->capture_default_str();
  app.add_option("--tokens", o.tokens, "tokens generated per prompt")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--stages", o.stages, "target stages, one slow node each (at most the target's layers)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--layer-ms", o.layer_ms, "target device: ms per layer per run")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--layer-token-ms", o.token_ms, "target device: ms per layer per token of a run")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--draft-layer-ms", o.draft_layer_ms, "draft device: ms per layer per run")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--max-runs", o.max_runs, "pipeinfer: target runs in flight")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--n-draft", o.n_draft, "spec: draft tokens per verification")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--p-accept", o.p_accept, "draft confidence cutoff")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_option("--tree", o.tree, "also run every strategy that takes a tree with this shape (e.g. 1,1,3,1)");
  app.add_option("--n-parallel", o.n_parallel, "also run every strategy that takes n_parallel with this many branches")
      ->check(CLI::Range(1, 8))->capture_default_str();
  app.add_option("--p-split", o.p_split, "with --n-parallel: the probability a candidate needs to become a branch")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_flag("--adaptive", o.adaptive, "also run every strategy that takes `adaptive` in that mode, from the same settings");
  app.add_option("--pairs", o.pairs, "only these target/draft pairs (e.g. stories-target-1M/stories260K-draft-tiny)")->delimiter(',');
  app.add_option("--only", o.only, "only these strategies (and plain decoding, the reference), e.g. pipeinfer")->delimiter(',');
  app.add_flag("--tune", o.tune, "also run spec and pipeinfer at the registry's defaults and at their best point of a small grid, "
                                 "and measure the bound on any chain (row chain-bound)")
      ->capture_default_str();
  app.add_option("--drafter", o.drafter, "dflash: the drafter directory (trained for " + kDrafterTarget + ")")
      ->check(CLI::ExistingDirectory)->capture_default_str();
  std::vector<std::string> params;
  app.add_option("--param", params, "KEY=VALUE: set a numeric strategy parameter for every strategy that takes it "
                                    "(e.g. max_micro_batch=8); --tune's grid points and its rows at the registry's defaults override it");
  app.add_option("--csv", o.csv, "write the table (one row per pair and strategy) to this CSV file");
  app.add_option("--metrics-csv", o.metrics_csv, "append every request's metrics to this CSV file");
  CLI11_PARSE(app, argc, argv);
  for (const std::string& p : params) {
    const size_t eq = p.find('=');
    char* end = nullptr;
    const double v = eq == std::string::npos ? 0 : std::strtod(p.c_str() + eq + 1, &end);
    if (eq == std::string::npos || eq == 0 || end == p.c_str() + eq + 1 || *end != '\0') {
      std::fprintf(stderr, "--param %s: expected KEY=NUMBER (e.g. max_micro_batch=8)\n", p.c_str());
      return 2;
    }
    const std::string key = p.substr(0, eq);
    const auto specs = all_params();
    if (std::none_of(specs.begin(), specs.end(), [&](const ParamSpec& s) { return s.name == key; })) {
      std::fprintf(stderr, "--param %s: no strategy takes '%s' (specmesh strategies lists them)\n", p.c_str(), key.c_str());
      return 2;
    }
    o.params[key] = v;
  }
  if (const char* env = std::getenv("SPECMESH_REFDATA")) o.refdata = env;
  o.refdata = std::filesystem::absolute(o.refdata).string();
  if (!std::filesystem::exists(o.refdata + "/gguf-models/stories260K.gguf")) {
    std::fprintf(stderr, "reference models not found under %s (--refdata DIR)\n", o.refdata.c_str());
    return 2;
  }
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& [target, draft] : kPairs)
    if (o.pairs.empty() || std::find(o.pairs.begin(), o.pairs.end(), target + "/" + draft) != o.pairs.end())
      pairs.push_back({target, draft});
  for (const std::string& p : o.pairs)
    if (std::none_of(kPairs.begin(), kPairs.end(), [&](const auto& k) { return k.first + "/" + k.second == p; })) {
      std::fprintf(stderr, "--pairs: unknown pair '%s' (the pairs: stories-target-1M/stories260K, "
                           "stories-target-1M/stories260K-draft-small, stories-target-1M/stories260K-draft-tiny, "
                           "stories260K/stories260K-draft-small)\n", p.c_str());
      return 2;
    }
  std::map<std::string, int> layers;  // per model, each loaded once (models serve several pairs)
  for (const auto& [target, draft] : pairs)
    for (const std::string& model : {target, draft})
      if (!layers.contains(model))
        layers[model] = Model::load(o.refdata + "/gguf-models/" + model + ".gguf")->hparams().n_layer;
  for (const auto& [target, draft] : pairs) {
    const int n = layers.at(target);
    if (o.stages > n) {
      std::fprintf(stderr, "--stages %d: %s has only %d layers, and each stage needs at least one\n", o.stages, target.c_str(), n);
      return 2;
    }
  }
  // --csv appends to a table with the same columns (runs at several --stages make one file).
  const std::string header =
      "target,draft,strategy,stages,layer_ms,draft_layer_ms,tokens_per_s,ttft_ms,acceptance,tokens_per_verification,"
      "tree_size,max_accepted_depth,runs_cancelled,lossless,prefill_ms,ttft_after_prefill_ms";
  std::FILE* csv = nullptr;
  if (!o.csv.empty()) {
    std::string first;
    std::getline(std::ifstream(o.csv) >> std::ws, first);
    if (!first.empty() && first != header) {
      std::fprintf(stderr, "--csv: %s holds a different table (its header: %s)\n", o.csv.c_str(), first.c_str());
      return 2;
    }
    csv = std::fopen(o.csv.c_str(), "a");
    if (!csv) {
      std::fprintf(stderr, "--csv: cannot write %s\n", o.csv.c_str());
      return 2;
    }
    if (first.empty()) std::fprintf(csv, "%s\n", header.c_str());
  }
  const std::vector<std::string> prompts = {"Once upon a time", "Lily and Tom", "Tom had a big red ball"};
  std::printf("# emulated cluster: %d slow target nodes (%.2f ms/layer), draft on a fast node (%.2f ms/layer), gigabit link, %d tokens x %zu prompts\n",
              o.stages, o.layer_ms, o.draft_layer_ms, o.tokens, prompts.size());
  std::printf("%-20s %-24s %-12s %10s %10s %8s %8s %8s %9s %10s %10s\n", "target", "draft", "strategy", "tok/s", "ttft ms",
              "accept", "tok/ver", "tree", "max depth", "cancelled", "lossless");
  // Plain decoding (the registry's default for a lone target) is the reference the others
  // must reproduce; then every strategy that needs no role beyond target and draft.
  const StrategyInfo& plain = default_strategy({kTargetRole});
  std::vector<Variant> runs{{&plain, plain.name, ""}};
  for (const StrategyInfo& s : strategies()) {
    const bool fits = std::all_of(s.roles.begin(), s.roles.end(), [](const std::string& r) { return r == kTargetRole || r == "draft"; }) &&
                      (o.only.empty() || std::find(o.only.begin(), o.only.end(), s.name) != o.only.end());
    if (fits && &s != &plain) runs.push_back({&s, s.name, ""});
    if (fits && !o.tree.empty() && s.param("tree")) runs.push_back({&s, s.name + "-tree", o.tree});
    if (fits && s.param("async")) runs.push_back({&s, s.name + "-async", "", false, false, {{"async", 1}}});
    if (fits && o.n_parallel > 1 && s.param("n_parallel"))
      runs.push_back({&s, s.name + "-np" + std::to_string(o.n_parallel), "", true});
    if (fits && o.adaptive && s.param("adaptive")) {
      runs.push_back({&s, s.name + "-adaptive", "", false, false, {{"adaptive", 1}}});
      if (o.n_parallel > 1 && s.param("n_parallel"))
        runs.push_back({&s, s.name + "-np" + std::to_string(o.n_parallel) + "-adaptive", "", true, false, {{"adaptive", 1}}});
    }
  }
  for (const auto& [target, draft] : pairs) {
    const int n_layer = layers.at(target);
    std::map<std::string, double> tps, ttft;
    std::vector<std::vector<int32_t>> reference;
    // Runs a variant over the prompts; the first one run (plain decoding) is the reference.
    auto measure = [&](const Variant& variant) {
      Measured m;
      double tokens = 0, seconds = 0, first = 0, prefill = 0, after = 0, accepted = 0, drafted = 0, verifs = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        // Each request meets an idle cluster, as a user's would; fresh endpoint names, since
        // the previous runtime's inproc sockets may not be released yet.
        auto rt = Runtime::open(write_topology(o, target, n_layer, draft, *variant.info, variant));
        auto r = rt->generate({.prompt = prompts[i], .n_predict = o.tokens, .ignore_eos = true});
        if (!r.ok()) throw std::runtime_error(variant.label + ": " + r.error);
        if (reference.size() < prompts.size()) reference.push_back(r.ids);
        else m.lossless = m.lossless && r.ids == reference[i];
        tokens += r.stats.generated_tokens - 1;
        seconds += (r.stats.total_ms - r.stats.ttft_ms) / 1000.0;
        first += r.stats.ttft_ms;
        prefill += r.metrics.prefill_ms;
        after += r.metrics.ttft_after_prefill_ms;
        accepted += r.metrics.accepted;
        drafted += r.metrics.drafted;
        verifs += r.metrics.verifications;
        m.cancelled += r.metrics.runs_cancelled;
        m.deepest = std::max(m.deepest, double(r.metrics.max_accepted_depth));
      }
      m.tps = tokens / seconds;
      m.ttft = first / prompts.size();
      m.prefill = prefill / prompts.size();
      m.paper_ttft = after / prompts.size();
      m.acceptance = drafted > 0 ? accepted / drafted : 0.0;
      m.tokens_per_ver = verifs > 0 ? (accepted + verifs) / verifs : 0.0;
      m.tree = verifs > 0 ? drafted / verifs : 0.0;  // draft tokens per verification (a chain's length, or a tree's nodes)
      return m;
    };
    auto report = [&](const std::string& label, const Measured& m, const std::string& note = "") {
      tps[label] = m.tps;
      ttft[label] = m.ttft;
      std::printf("%-20s %-24s %-12s %10.2f %10.2f %8.2f %8.2f %8.2f %9.0f %10.0f %10s %s\n", target.c_str(), draft.c_str(),
                  label.c_str(), m.tps, m.ttft, m.acceptance, m.tokens_per_ver, m.tree, m.deepest, m.cancelled,
                  !m.ran ? "-" : m.lossless ? "yes" : "NO", note.c_str());
      std::fflush(stdout);
      if (csv)
        std::fprintf(csv, "%s,%s,%s,%d,%g,%g,%.3f,%.3f,%.4f,%.4f,%.4f,%.0f,%.0f,%s,%.3f,%.3f\n", target.c_str(), draft.c_str(),
                     label.c_str(), o.stages, o.layer_ms, o.draft_layer_ms, m.tps, m.ttft, m.acceptance, m.tokens_per_ver,
                     m.tree, m.deepest, m.cancelled, !m.ran ? "-" : m.lossless ? "yes" : "no", m.prefill, m.paper_ttft);
    };
    std::vector<std::string> labels;
    try {
      for (const Variant& variant : runs) {
        if (!variant.info->drafter_role.empty() && target != kDrafterTarget) continue;
        report(variant.label, measure(variant), variant.info->drafter_role.empty() ? "" : "(drafter " + o.drafter.substr(o.drafter.rfind('/') + 1) + ")");
        labels.push_back(variant.label);
        if (!o.tune || &variant == &runs.front() || !variant.tree.empty() || variant.parallel) continue;
        // --tune: the strategy at the registry's defaults, and at its best point of the grid
        // (every combination of the grid's parameters the strategy takes).
        const StrategyInfo& info = *variant.info;
        std::vector<std::map<std::string, double>> points{{}};
        for (const auto& [k, values] : kTuneGrid) {
          if (!info.param(k)) continue;
          std::vector<std::map<std::string, double>> next;
          for (const auto& pt : points)
            for (double v : values) {
              next.push_back(pt);
              next.back()[k] = v;
            }
          points = std::move(next);
        }
        std::erase_if(points, redundant);
        if (points.front().empty()) continue;  // the grid has none of its parameters: nothing to tune
        Variant d = variant;
        d.defaults = true;
        d.label = info.name + "@default";
        report(d.label, measure(d));
        labels.push_back(d.label);
        Measured best;
        std::string best_note;
        size_t left_out = 0;
        for (const auto& pt : points) {
          Variant t = variant;
          t.params = pt;
          std::string note;
          for (const auto& [k, v] : pt) {
            char buf[48];
            std::snprintf(buf, sizeof buf, "%s%s=%g", note.empty() ? "" : " ", k.c_str(), v);
            note += buf;
          }
          Measured m;
          try {
            m = measure(t);
          } catch (const std::exception& e) {
            // A point that cannot run here (e.g. wide trees in flight hold more KV cells than
            // a long generation leaves free) is left out of the grid, and said so.
            std::fprintf(stderr, "%s at %s: left out of the grid: %s\n", info.name.c_str(), note.c_str(), e.what());
            ++left_out;
            continue;
          }
          if (!m.lossless) throw std::runtime_error(info.name + " at " + note + " is not lossless");
          if (m.tps > best.tps) best = m, best_note = note;
        }
        if (left_out == points.size()) throw std::runtime_error(info.name + ": no point of the grid could run");
        d.label = info.name + "@best";
        report(d.label, best,
               "(" + best_note + ", best of " + std::to_string(points.size() - left_out) +
                   (left_out > 0 ? ", " + std::to_string(left_out) + " left out" : std::string()) + ")");
        labels.push_back(d.label);
      }
      if (o.tune) {
        // The strategy that drafts chains of n_draft tokens (spec), on its own row.
        const auto chains = [](const Variant& v) {
          return v.info->param("n_draft") && v.tree.empty() && !v.parallel && v.params.empty();
        };
        if (const auto spec = std::find_if(runs.begin(), runs.end(), chains); spec != runs.end()) {
          // The bound on any chain (one branch, pipelined or not) at temperature 0: it yields
          // tokens in epochs, from a token the target corrected to the next draft token it
          // rejects, the same epochs for every chain method. An epoch of j tokens takes the
          // draft's j steps (d each) before the run holding the rejected token can leave, and
          // that run's trip through the target (at least ar's time per token, L) before the next
          // one begins: tokens/s <= E[j] / (E[j] d + L). spec drafting (nearly) unbounded
          // chains measures E[j] as its tokens per verification; d is the draft device's time
          // for a one-token run. Branches can pass the bound where they foresee a rejection.
          Variant whole = *spec;
          whole.params = {{"n_draft", 48}, {"p_accept", 0}};
          whole.label = spec->label + "@n48";
          const Measured w = measure(whole);
          report(whole.label, w, "(n_draft=48 p_accept=0: tokens per verification = E[j])");
          const double d = layers.at(draft) * (o.draft_layer_ms + kDraftTokenMs), L = 1000.0 / tps.at(plain.name);
          Measured bound;
          bound.ran = false;
          bound.tps = 1000.0 * w.tokens_per_ver / (w.tokens_per_ver * d + L);
          bound.tokens_per_ver = w.tokens_per_ver;
          char note[160];
          std::snprintf(note, sizeof note, "(chain bound: E[j] %.2f / (E[j] x d %.2f ms + L %.2f ms); not a run)",
                        w.tokens_per_ver, d, L);
          report("chain-bound", bound, note);
          labels.push_back("chain-bound");
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    // Every ratio measured in this run: each row against the reference and against the rows
    // listed before it.
    std::string line;
    for (size_t a = 1; a < labels.size(); ++a)
      for (size_t b = 0; b < a; ++b) {
        const std::string &x = labels[a], &y = labels[b];
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s%s/%s tok/s %.2fx", line.empty() ? "" : "; ", x.c_str(), y.c_str(),
                      tps[x] / tps[y]);
        line += buf;
        if (ttft[x] > 0 && ttft[y] > 0) {  // the chain bound has no time to first token
          std::snprintf(buf, sizeof buf, ", ttft %.2f", ttft[x] / ttft[y]);
          line += buf;
        }
      }
    std::printf("%-20s %-24s %s\n", "", "", line.c_str());
  }
  if (csv && std::fclose(csv) != 0) {
    std::fprintf(stderr, "--csv: cannot write %s\n", o.csv.c_str());
    return 1;
  }
  return 0;
}
