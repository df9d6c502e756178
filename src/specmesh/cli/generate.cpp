// `specmesh generate`: one process. The command line fills a configuration (the same struct a
// topology file fills) with the target and any draft on devices of their own, and runs it
// through the runtime, whatever the strategy.
#include <algorithm>
#include <cstdio>
#include <limits>
#include <filesystem>
#include <random>
#include <thread>

#include "specmesh/cli/commands.hpp"
#include "specmesh/cli/output.hpp"
#include "specmesh/cli/params.hpp"
#include "specmesh/kernels/kv_rows.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {

struct GenerateOptions {
  std::string model, tokenizer, draft_tokenizer, prompt, strategy, metrics_csv;
  std::vector<std::string> drafts;  // roles draft, draft2, draft3, ...
  int n_predict = 128;
  int threads = 0;
  int tp = 1;  // devices each target-model stage is split over
  int n_ctx = 0;
  std::string kv_type;  // empty: the default (kv_rows.hpp)
  float temp = 0.8f, top_p = 1.0f, min_p = 0.0f;
  int top_k = 0;
  int64_t seed = -1;
  bool ignore_eos = false, json = false, context_shift = false;
  int n_keep = 0;
  ParamOptions params;
};

// Paths on a command line are relative to the working directory.
std::string absolute(const std::string& p) {
  return p.empty() ? p : std::filesystem::absolute(p).lexically_normal().string();
}

Topology configuration(const GenerateOptions& o, const CLI::App& cmd, int threads, const SamplingParams& sp) {
  std::map<std::string, ModelSpec> roles;
  for (size_t i = 0; i < o.drafts.size(); ++i) {
    const std::string role = draft_role(int(i));
    roles[role] = {role, absolute(o.drafts[i]), absolute(o.draft_tokenizer.empty() ? o.tokenizer : o.draft_tokenizer)};
  }
  const ModelSpec target{"target", absolute(o.model), absolute(o.tokenizer)};
  // An attention-level speculation partner runs the target's model on a device of its own.
  if (const StrategyInfo* s = o.strategy.empty() ? nullptr : find_strategy(o.strategy); s && !s->pair_role.empty())
    roles.emplace(s->pair_role, ModelSpec{s->pair_role, target.path, target.tokenizer});
  // With --tp the threads are shared out among the devices of each split stage.
  Topology t = Topology::single_process(target, roles, o.tp > 1 ? std::max(1, threads / o.tp) : threads);
  t.path = "generate";
  if (o.tp > 1) {
    // Every stage of the target's model (the target's, and an ALSpec partner's) over o.tp
    // devices: tensor-parallel ranks of this process.
    for (StageSpec& st : t.stages) {
      if (t.models.at(st.model).path != target.path) continue;
      for (int r = 1; r < o.tp; ++r) {
        DeviceSpec d = t.devices.at(st.device);
        d.name = st.device + "-tp" + std::to_string(r);
        t.devices[d.name] = d;
        st.tensor_parallel.push_back(d.name);
      }
    }
  }
  t.run.strategy = o.strategy;
  t.run.params = o.params.values(cmd);
  t.run.n_predict = o.n_predict;
  override_cache(t, o.n_ctx, o.kv_type);
  t.run.temperature = sp.temperature;
  t.run.top_k = sp.top_k;
  t.run.top_p = sp.top_p;
  t.run.min_p = sp.min_p;
  t.run.seed = sp.seed;
  t.run.metrics_csv = absolute(o.metrics_csv);
  return t;
}

void run_generate(const GenerateOptions& o, const CLI::App& cmd) {
  const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const SamplingParams sp{o.temp, o.top_k, o.top_p, o.min_p,
                          o.seed >= 0 ? uint64_t(o.seed) : uint64_t(std::random_device{}())};
  Runtime rt(configuration(o, cmd, threads, sp));
  if (!o.json) {
    std::fputs(o.prompt.c_str(), stdout);
    std::fflush(stdout);
  }
  GenerationResult r = rt.generate({.prompt = o.prompt,
                                    .n_predict = o.n_predict,
                                    .sampling = sp,
                                    .ignore_eos = o.ignore_eos,
                                    .context_shift = o.context_shift,
                                    .n_keep = o.n_keep},
                                   [&](int32_t, const std::string& piece) {
                                     if (!o.json) {
                                       std::fputs(piece.c_str(), stdout);
                                       std::fflush(stdout);
                                     }
                                     return true;
                                   });
  if (o.json) {
    nlohmann::json j = result_json(r);
    j["stats"]["threads"] = threads;
    j["stats"]["seed"] = sp.seed;
    std::puts(dump(j).c_str());
  } else {
    std::printf("\n");
    std::fprintf(stderr, "\n[%d prompt tokens, %d generated; first token %.1f ms; %.1f tokens/s", r.stats.prompt_tokens,
                 r.stats.generated_tokens, r.stats.ttft_ms, r.stats.decode_tokens_per_s);
    if (r.metrics.drafted > 0)
      std::fprintf(stderr, "; acceptance %.2f, %.2f tokens per verification (%.1f drafted, %.2f accepted deep, at most %lld)",
                   r.metrics.acceptance_rate(), r.metrics.tokens_per_verification(), r.metrics.tree_size(),
                   r.metrics.accepted_depth(), static_cast<long long>(r.metrics.max_accepted_depth));
    if (r.metrics.attention_checks > 0)
      std::fprintf(stderr, "; attention speculations accepted %.2f", r.metrics.attention_hit_rate());
    std::fprintf(stderr, "]\n");
  }
  if (!r.ok()) throw std::runtime_error(r.error);
}

}  // namespace

void register_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a prompt in this process");
  cmd->add_option("-m,--model", o->model, "target: GGUF file or llama2.c checkpoint")->required()->check(CLI::ExistingFile);
  cmd->add_option("-z,--tokenizer", o->tokenizer, "tokenizer of a llama2.c checkpoint (tok512.bin)")->check(CLI::ExistingFile);
  cmd->add_option("-d,--draft", o->drafts, "draft model (role \"draft\"); repeat for more drafts (draft2, ...), "
                  "whose token trees spec merges; for dflash, the drafter's directory")->check(CLI::ExistingPath);
  cmd->add_option("--draft-tokenizer", o->draft_tokenizer, "tokenizer of a llama2.c draft (default: -z)")->check(CLI::ExistingFile);
  std::vector<std::string> names;
  for (const StrategyInfo& s : strategies()) names.push_back(s.name);
  cmd->add_option("--strategy", o->strategy, strategy_names() + " (default: the registry's for the models given)")
      ->check(CLI::IsMember(names));
  cmd->add_option("-p,--prompt", o->prompt, "prompt text");
  cmd->add_option("-n,--n-predict", o->n_predict, "tokens to generate; -1: until the end-of-sequence token or a full context")
      ->check(CLI::Validator(
          [](std::string& v) { return v == "0" ? std::string("must be positive or -1") : std::string(); }, "-1 or N>0"))
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  cmd->add_flag("--context-shift", o->context_shift,
                "when the context is full, drop the oldest half of the tokens after --keep and go on (llama.cpp's "
                "context shift); without it a full context ends generation with an error");
  cmd->add_option("--keep", o->n_keep, "tokens of the prompt a context shift keeps (-1: all of it)")
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--tp", o->tp,
                  "split the target's model over this many devices (tensor parallelism, at most its KV heads; "
                  "the threads are shared among them; each keeps 1/N of the KV cache); the output is the same")
      ->check(CLI::Range(1, 256));
  cmd->add_option("-c,--ctx", o->n_ctx, "context size in tokens (default: the model's, at most 4096)")->check(CLI::NonNegativeNumber);
  add_kv_type_option(*cmd, o->kv_type, kv_type_name(kDefaultKvType));
  cmd->add_option("--temp", o->temp, "temperature; 0 is greedy")->check(finite_in(0, 1e6));
  cmd->add_option("--top-k", o->top_k, "keep the k most likely tokens (0: off)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", o->top_p, "nucleus sampling threshold (1: off)")->check(finite_in(0, 1));
  cmd->add_option("--min-p", o->min_p, "drop tokens below min-p times the top probability")->check(finite_in(0, 1));
  cmd->add_option("--seed", o->seed, "sampling seed (default: random)");
  o->params.add_to(*cmd);
  cmd->add_option("--metrics-csv", o->metrics_csv, "append a row of metrics to this CSV file");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "do not stop at the end-of-sequence token");
  cmd->add_flag("--json", o->json, "print one JSON object with ids, text and stats");
  cmd->callback([o, cmd] { run_generate(*o, *cmd); });
}

}  // namespace specmesh
