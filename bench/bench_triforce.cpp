// TriForce measurements, every figure from runs of the real runtime (one process, inproc):
//
//   bench_triforce --table1 [--targets stories-target-1M,stories260K]
//     Table 1 of the paper in small: how often the full cache accepts the middle level's token
//     (the target over a partial cache, proposing one token at a time, use_draft = false,
//     gamma2 = 1: the acceptance per token) with the retrieval cache and with a StreamingLLM
//     cache of the same budget. Prompts fill 75-90 % of the context; budgets are 1/16, 1/8 and
//     1/4 of it; temperatures 0, 0.6 and 1; plus prompts that state a fact at their start and
//     ask for it at their end.
//
//   bench_triforce --speed TARGET.gguf --draft DRAFT.gguf --prompt-tokens 15000 --budget 1024
//     tokens/s of triforce (and its ablations) against ar on a long-context model, with the
//     acceptance at both levels; every strategy's ids are checked against ar's at temperature 0.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/registry.hpp"

using namespace specmesh;

namespace {

// The hierarchical strategy (the registered one with gamma1, gamma2 and a budget), plain
// decoding, and standard speculation, found through the registry.
const StrategyInfo& hierarchical() {
  for (const StrategyInfo& s : strategies())
    if (s.param("gamma1") && s.param("gamma2") && s.param("budget")) return s;
  throw std::runtime_error("no registered strategy takes gamma1, gamma2 and budget");
}
const std::string& plain() { return default_strategy({kTargetRole}).name; }
const std::string& standard() { return default_strategy({kTargetRole, kDraftRole}).name; }

std::string topology(const std::string& target, const std::string& draft, const std::string& strategy,
                     const std::map<std::string, double>& params, int n_ctx, int n_predict, int threads) {
  static int n = 0;
  const std::string dir = std::filesystem::temp_directory_path() / ("specmesh-triforce-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/t-" + std::to_string(n++) + ".toml";
  std::ofstream f(path);
  f << "[run]\nmodel = \"target\"\ndraft = \"draft\"\nstrategy = \"" << strategy << "\"\nn_predict = " << n_predict << "\n";
  if (n_ctx > 0) f << "n_ctx = " << n_ctx << "\n";
  f << "[run.params]\n";
  for (const auto& [k, v] : params) f << k << " = " << v << "\n";
  f << "[models.target]\npath = \"" << target << "\"\n[models.draft]\npath = \"" << draft << "\"\n";
  f << "[nodes.head]\nendpoint = \"inproc://triforce-" << ::getpid() << "-" << n << "\"\nhead = true\n";
  f << "[devices.cpu]\nnode = \"head\"\nthreads = " << threads << "\n[devices.small]\nnode = \"head\"\nthreads = 1\n";
  f << "[[stages]]\nmodel = \"target\"\ndevice = \"cpu\"\nfraction = 1.0\n";
  f << "[[stages]]\nmodel = \"draft\"\ndevice = \"small\"\nfraction = 1.0\n";
  return path;
}

// Story text the model itself writes (sampled, so each seed gives another story), cut to
// `tokens` tokens of its tokenizer.
std::string filler(const Model& m, int tokens, uint64_t seed, const std::string& start) {
  Context ctx(m, {.n_ctx = tokens + 8});
  std::vector<int32_t> ids = m.tokenizer().encode(start, true);
  GenerateParams gp;
  gp.n_predict = std::max(0, tokens - int(ids.size()));
  gp.sampling = {.temperature = 0.8f, .seed = seed};
  gp.ignore_eos = true;
  std::vector<int32_t> out;
  generate(ctx, ids, gp, [&](int32_t t) {
    out.push_back(t);
    return true;
  });
  ids.erase(ids.begin());  // BOS: the runtime adds its own
  ids.insert(ids.end(), out.begin(), out.end());
  return m.tokenizer().decode(ids);
}

struct Tally {
  double accepted = 0, drafted = 0, middle_accepted = 0, middle_drafted = 0, rebuilds = 0, tokens = 0, seconds = 0;
  double acceptance() const { return drafted > 0 ? accepted / drafted : 0; }
  double middle_acceptance() const { return middle_drafted > 0 ? middle_accepted / middle_drafted : 0; }
  void add(const GenerationResult& r) {
    accepted += double(r.metrics.accepted);
    drafted += double(r.metrics.drafted);
    middle_accepted += double(r.metrics.middle_accepted);
    middle_drafted += double(r.metrics.middle_drafted);
    rebuilds += double(r.metrics.cache_rebuilds);
    tokens += r.stats.generated_tokens - 1;
    seconds += (r.stats.total_ms - r.stats.ttft_ms) / 1000.0;
  }
};

int table1(const std::string& refdata, const std::vector<std::string>& targets, int n_predict, int seeds) {
  const int n_ctx = 512;
  std::printf("# Table 1 in small: acceptance of the middle level's tokens by the full cache (gamma2 = 1, no draft)\n");
  std::printf("# context %d, %d generated tokens per prompt, %d seed(s) per prompt at temperature > 0\n", n_ctx, n_predict, seeds);
  std::printf("%-18s %-10s %6s %5s %10s %10s %8s %9s\n", "target", "prompts", "budget", "temp", "retrieval", "streaming",
              "gap", "rebuilds");
  for (const std::string& target : targets) {
    const std::string path = refdata + "/gguf-models/" + target + ".gguf";
    const std::string draft = refdata + "/gguf-models/stories260K-draft-tiny.gguf";
    auto m = Model::load(path);
    // Prompts of 75, 82 and 90 % of the context, and fact prompts: a name at the start, asked
    // for at the end.
    std::vector<std::string> stories, facts;
    for (int pct : {75, 82, 90})
      stories.push_back(filler(*m, n_ctx * pct / 100, 100 + uint64_t(pct), "Once upon a time"));
    const std::vector<std::pair<std::string, std::string>> names = {{"Lily", "Sparky"}, {"Tom", "Bubbles"}};
    for (size_t i = 0; i < names.size(); ++i) {
      const auto& [who, pet] = names[i];
      const std::string head = "Once upon a time, " + who + " had a dog named " + pet + ". " + pet + " was a happy dog.";
      const std::string tail = " " + who + " called the dog. \"" + pet + "!\" said " + who + ". The dog's name was";
      // The story between them brings the whole prompt to about 82 % of the context.
      const int around = int(m->tokenizer().encode(head + tail, true).size());
      facts.push_back(head + " " + filler(*m, n_ctx * 82 / 100 - around, 200 + i, "One day,") + tail);
    }
    for (const auto& [label, prompts] : {std::pair{"stories", stories}, std::pair{"fact", facts}}) {
      std::string sizes;
      for (const std::string& p : prompts) sizes += " " + std::to_string(m->tokenizer().encode(p, true).size());
      std::printf("# %s %s prompts, tokens:%s\n", target.c_str(), label, sizes.c_str());
      for (int budget : {n_ctx / 16, n_ctx / 8, n_ctx / 4})
        for (float temp : {0.0f, 0.6f, 1.0f}) {
          Tally t[2];
          for (int middle : {1, 2}) {
            auto rt = Runtime::open(topology(path, draft, hierarchical().name,
                                             {{"budget", budget}, {"chunk", 8}, {"gamma1", 1}, {"gamma2", 1},
                                              {"use_draft", 0}, {"middle", middle}, {"rebuild_every", 0},
                                              {"rebuild_below", 0}, {"window", 64}},
                                             n_ctx, n_predict, 1));
            for (const std::string& p : prompts)
              for (int s = 0; s < (temp > 0 ? seeds : 1); ++s) {
                auto r = rt->generate({.prompt = p, .n_predict = n_predict,
                                       .sampling = SamplingParams{.temperature = temp, .seed = uint64_t(7 + s)},
                                       .ignore_eos = true});
                if (!r.ok()) throw std::runtime_error(target + ": " + r.error);
                t[middle - 1].add(r);
              }
          }
          std::printf("%-18s %-10s %6d %5.1f %10.3f %10.3f %+8.3f %9.0f\n", target.c_str(), label, budget, temp,
                      t[0].acceptance(), t[1].acceptance(), t[0].acceptance() - t[1].acceptance(), t[0].rebuilds);
          std::fflush(stdout);
        }
    }
  }
  return 0;
}

int speed(const std::string& target, const std::string& draft, int prompt_tokens, int n_predict, int budget,
          int gamma1, int gamma2, int threads, int reps, const std::string& only) {
  auto m = Model::load(target);
  const int n_ctx = prompt_tokens + n_predict + 64;
  // Any text will do for random weights: the sentence repeated to the prompt's length.
  const std::string sentence = " The little dog ran to the park and played with a red ball all day.";
  std::string prompt = "Once upon a time.";
  while (int(m->tokenizer().encode(prompt, true).size()) < prompt_tokens) prompt += sentence;
  const int n_prompt = int(m->tokenizer().encode(prompt, true).size());
  std::printf("# %s, context %d, prompt %d tokens, %d generated, budget %d, gamma1 %d, gamma2 %d, %d thread(s), median of %d\n",
              target.c_str(), n_ctx, n_prompt, n_predict, budget, gamma1, gamma2, threads, reps);
  std::printf("%-28s %10s %10s %9s %9s %9s %8s %8s\n", "strategy", "tok/s", "vs ar", "accept", "tok/ver", "mid acc",
              "rebuild", "lossless");
  struct Variant {
    std::string label, strategy;
    std::map<std::string, double> params;
  };
  const std::map<std::string, double> tri = {{"budget", budget}, {"chunk", 8}, {"gamma1", gamma1}, {"gamma2", gamma2},
                                             {"rebuild_every", 0}, {"rebuild_below", 0}};
  auto with = [&](std::map<std::string, double> extra) {
    std::map<std::string, double> p = tri;
    for (const auto& [k, v] : extra) p[k] = v;
    return p;
  };
  const std::string tri_name = hierarchical().name;
  std::vector<Variant> variants = {{plain(), plain(), {}},
                                   {tri_name, tri_name, tri},
                                   {tri_name + " retrieval only", tri_name, with({{"use_draft", 0}})},
                                   {tri_name + " streaming middle", tri_name, with({{"middle", 2}})},
                                   {tri_name + " draft only", tri_name, with({{"middle", 0}})},
                                   {standard(), standard(), {{"n_draft", gamma2}, {"p_accept", 0}}}};
  std::vector<int32_t> reference;
  double ar_tps = 0;
  for (const Variant& v : variants) {
    if (!only.empty() && v.label != plain() && v.label.find(only) == std::string::npos) continue;
    std::vector<double> tps;
    Tally t;
    bool lossless = true;
    auto rt = Runtime::open(topology(target, draft, v.strategy, v.params, n_ctx, n_predict, threads));
    for (int i = 0; i < reps; ++i) {
      auto r = rt->generate({.prompt = prompt, .n_predict = n_predict, .sampling = SamplingParams{}, .ignore_eos = true});
      if (!r.ok()) throw std::runtime_error(v.label + ": " + r.error);
      if (reference.empty()) reference = r.ids;
      lossless = lossless && r.ids == reference;
      Tally one;
      one.add(r);
      tps.push_back(one.tokens / one.seconds);
      t.add(r);
    }
    std::sort(tps.begin(), tps.end());
    const double med = tps[tps.size() / 2];
    if (v.label == plain()) ar_tps = med;
    const double tok_ver = t.drafted > 0 ? 1 + t.accepted / (t.drafted / gamma2) : 0;
    std::printf("%-28s %10.2f %9.2fx %9.3f %9s %9.3f %8.0f %8s\n", v.label.c_str(), med, med / ar_tps, t.acceptance(),
                t.drafted > 0 ? std::to_string(tok_ver).substr(0, 5).c_str() : "-", t.middle_acceptance(),
                t.rebuilds / reps, lossless ? "yes" : "NO");
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);
  CLI::App app{"TriForce: Table 1 in small on the refdata targets, and speed on a long-context model"};
  bool do_table1 = false;
  std::string refdata = "../shared/refdata", speed_target, draft, only;
  std::vector<std::string> targets = {"stories-target-1M", "stories260K"};
  int n_predict = 32, seeds = 2, prompt_tokens = 15000, budget = 1024, gamma1 = 2, gamma2 = 6, threads = 2, reps = 3;
  app.add_flag("--table1", do_table1, "measure Table 1 in small on the refdata targets");
  app.add_option("--refdata", refdata, "the reference data folder")->capture_default_str();
  app.add_option("--targets", targets, "refdata targets for --table1")->delimiter(',');
  app.add_option("--seeds", seeds, "seeds per prompt at temperature > 0 (--table1)")->capture_default_str();
  app.add_option("--speed", speed_target, "a long-context model: triforce vs ar tokens/s");
  app.add_option("--draft", draft, "the small draft for --speed");
  app.add_option("--prompt-tokens", prompt_tokens, "prompt length for --speed")->capture_default_str();
  app.add_option("-n,--n-predict", n_predict, "tokens to generate")->capture_default_str();
  app.add_option("--budget", budget, "retrieval cache budget for --speed")->capture_default_str();
  app.add_option("--gamma1", gamma1)->capture_default_str();
  app.add_option("--gamma2", gamma2)->capture_default_str();
  app.add_option("--threads", threads, "target device threads (--speed)")->capture_default_str();
  app.add_option("--reps", reps, "generations per strategy, the median reported (--speed)")->capture_default_str();
  app.add_option("--only", only, "besides ar, only the variants whose label contains this (--speed)");
  CLI11_PARSE(app, argc, argv);
  try {
    // The topology files go to a temporary folder: model paths in them must be absolute.
    if (do_table1) return table1(std::filesystem::absolute(refdata).string(), targets, n_predict, seeds);
    if (!speed_target.empty()) {
      if (draft.empty()) throw std::invalid_argument("--speed needs --draft");
      return speed(speed_target, draft, prompt_tokens, n_predict, budget, gamma1, gamma2, threads, reps, only);
    }
    std::fprintf(stderr, "nothing to do: --table1 or --speed MODEL --draft DRAFT\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
