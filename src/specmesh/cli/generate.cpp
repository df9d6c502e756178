// `specmesh generate`: one process; plain autoregression on the core, or a speculative
// strategy through an in-process topology (the same actors `specmesh run` uses).
#include <unistd.h>

#include <cstdio>
#include <random>
#include <sstream>
#include <thread>

#include "specmesh/cli/commands.hpp"
#include "specmesh/cli/output.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/runtime/runtime.hpp"

namespace specmesh {

namespace {

struct GenerateOptions {
  std::string model, tokenizer, draft, draft_tokenizer, prompt, strategy = "ar", metrics_csv;
  int n_predict = 128;
  int threads = 0;
  int n_ctx = 0;
  float temp = 0.8f, top_p = 1.0f, min_p = 0.0f;
  int top_k = 0;
  int64_t seed = -1;
  bool ignore_eos = false, json = false, no_cancel = false;
  SpecParams spec;
};

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// One node in this process: the target on its own device, the draft on another.
std::string in_process_topology(const GenerateOptions& o, int threads, const SamplerParams& sp) {
  std::ostringstream t;
  t << "[run]\nmodel = \"target\"\ndraft = \"draft\"\nstrategy = " << toml_string(o.strategy)
    << "\nn_predict = " << o.n_predict << "\nn_ctx = " << o.n_ctx << "\ntemperature = " << sp.temperature
    << "\nseed = " << sp.seed << "\n";
  if (!o.metrics_csv.empty()) t << "metrics_csv = " << toml_string(o.metrics_csv) << "\n";
  t << "[run.params]\nn_draft = " << o.spec.n_draft << "\nmax_micro_batch = " << o.spec.max_micro_batch
    << "\nmax_runs = " << o.spec.max_runs << "\np_accept = " << o.spec.p_accept << "\np_recovery = " << o.spec.p_recovery
    << "\np_decay = " << o.spec.p_decay << "\ncancel = " << (o.no_cancel ? 0 : 1) << "\n";
  t << "[models.target]\npath = " << toml_string(o.model) << "\ntokenizer = " << toml_string(o.tokenizer) << "\n";
  t << "[models.draft]\npath = " << toml_string(o.draft) << "\ntokenizer = "
    << toml_string(o.draft_tokenizer.empty() ? o.tokenizer : o.draft_tokenizer) << "\n";
  t << "[nodes.local]\nendpoint = \"inproc://specmesh-generate-" << ::getpid() << "\"\nhead = true\n";
  t << "[devices.target]\nnode = \"local\"\nthreads = " << threads << "\n[devices.draft]\nnode = \"local\"\nthreads = 1\n";
  t << "[[stages]]\nmodel = \"target\"\ndevice = \"target\"\nfraction = 1.0\n";
  t << "[[stages]]\nmodel = \"draft\"\ndevice = \"draft\"\nfraction = 1.0\n";
  return t.str();
}

GenerationResult generate_plain(const GenerateOptions& o, int threads, const SamplerParams& sp,
                                const StreamCallback& on_token) {
  auto model = Model::load(o.model, o.tokenizer);
  const Tokenizer& tok = model->tokenizer();
  Context ctx(*model, {.n_ctx = o.n_ctx, .n_threads = threads});
  GenerationResult r;
  r.prompt_ids = tok.encode(o.prompt, true);
  if (r.prompt_ids.empty()) r.prompt_ids.push_back(tok.bos() >= 0 ? tok.bos() : 0);  // a model needs one token to start from
  GenerateParams gp;
  gp.n_predict = o.n_predict;
  gp.ignore_eos = o.ignore_eos;
  gp.sampling = sp;
  // The decoder sees the prompt first so the continuation's spacing and UTF-8 come out right.
  StreamDecoder dec(tok);
  for (int32_t t : r.prompt_ids) dec.feed(t);
  r.stats = generate(ctx, r.prompt_ids, gp, [&](int32_t t) {
    r.ids.push_back(t);
    std::string piece = dec.feed(t);
    r.text += piece;
    return on_token(t, piece);
  });
  r.text += dec.flush();
  r.metrics.strategy = "ar";
  r.metrics.target = o.model;
  return r;
}

void run_generate(const GenerateOptions& o) {
  const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const SamplerParams sp{o.temp, o.top_k, o.top_p, o.min_p,
                         o.seed >= 0 ? uint64_t(o.seed) : uint64_t(std::random_device{}())};
  if (!o.json) {
    std::fputs(o.prompt.c_str(), stdout);
    std::fflush(stdout);
  }
  StreamCallback print = [&](int32_t, const std::string& piece) {
    if (!o.json) {
      std::fputs(piece.c_str(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  GenerationResult r;
  if (o.strategy == "ar" && o.draft.empty()) {
    r = generate_plain(o, threads, sp, print);
  } else {
    if (o.draft.empty()) throw std::invalid_argument("--strategy " + o.strategy + " needs a draft model (-d)");
    Runtime rt(Topology::parse(in_process_topology(o, threads, sp), "generate", "/"));
    r = rt.generate({.prompt = o.prompt, .n_predict = o.n_predict, .sampling = sp, .ignore_eos = o.ignore_eos}, print);
  }
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
      std::fprintf(stderr, "; acceptance %.2f, %.2f tokens per verification", r.metrics.acceptance_rate(),
                   r.metrics.tokens_per_verification());
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
  cmd->add_option("-d,--draft", o->draft, "draft model for spec / pipeinfer")->check(CLI::ExistingFile);
  cmd->add_option("--draft-tokenizer", o->draft_tokenizer, "tokenizer of a llama2.c draft (default: -z)")->check(CLI::ExistingFile);
  cmd->add_option("--strategy", o->strategy, "ar | spec | pipeinfer (default: ar, or spec with -d)")
      ->check(CLI::IsMember({"ar", "spec", "pipeinfer"}));
  cmd->add_option("-p,--prompt", o->prompt, "prompt text");
  cmd->add_option("-n,--n-predict", o->n_predict, "tokens to generate")->check(CLI::PositiveNumber);
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)");
  cmd->add_option("-c,--ctx", o->n_ctx, "context size in tokens (default: the model's, at most 4096)");
  cmd->add_option("--temp", o->temp, "temperature; 0 is greedy")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", o->top_k, "keep the k most likely tokens (0: off)");
  cmd->add_option("--top-p", o->top_p, "nucleus sampling threshold (1: off)");
  cmd->add_option("--min-p", o->min_p, "drop tokens below min-p times the top probability");
  cmd->add_option("--seed", o->seed, "sampling seed (default: random)");
  cmd->add_option("--draft-n,--n-draft", o->spec.n_draft, "spec: draft tokens per verification");
  cmd->add_option("--p-accept,--pa", o->spec.p_accept, "draft confidence cutoff");
  cmd->add_option("--p-recovery,--pr", o->spec.p_recovery, "pipeinfer: cutoff increase per speculative run in a burst");
  cmd->add_option("--p-decay,--pd", o->spec.p_decay, "pipeinfer: cutoff decrease when speculation yields nothing");
  cmd->add_option("--micro-batch", o->spec.max_micro_batch, "pipeinfer: draft tokens per speculative run (1-4)");
  cmd->add_option("--max-runs,--np", o->spec.max_runs, "pipeinfer: target runs in flight");
  cmd->add_flag("--no-cancel", o->no_cancel, "pipeinfer: keep invalid runs instead of cancelling them");
  cmd->add_option("--metrics-csv", o->metrics_csv, "append a row of metrics to this CSV file");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "do not stop at the end-of-sequence token");
  cmd->add_flag("--json", o->json, "print one JSON object with ids, text and stats");
  cmd->callback([o, cmd] {
    if (!o->draft.empty() && cmd->count("--strategy") == 0) o->strategy = "spec";
    run_generate(*o);
  });
}

}  // namespace specmesh
