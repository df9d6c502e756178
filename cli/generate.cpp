// `specmesh generate`: plain autoregressive generation on one process.
#include <cstdio>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "model/context.hpp"
#include "model/generate.hpp"

namespace specmesh {

namespace {

struct GenerateOptions {
  std::string model, tokenizer, prompt;
  int n_predict = 128;
  int threads = 0;
  int n_ctx = 0;
  float temp = 0.8f, top_p = 1.0f, min_p = 0.0f;
  int top_k = 0;
  int64_t seed = -1;
  bool ignore_eos = false, json = false;
};

void run_generate(const GenerateOptions& o) {
  auto model = Model::load(o.model, o.tokenizer);
  const Tokenizer& tok = model->tokenizer();
  ContextParams cp;
  cp.n_threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  cp.n_ctx = o.n_ctx;
  Context ctx(*model, cp);

  std::vector<int32_t> prompt = tok.encode(o.prompt, true);
  if (prompt.empty()) prompt.push_back(tok.bos() >= 0 ? tok.bos() : 0);  // a model needs one token to start from

  GenerateParams gp;
  gp.n_predict = o.n_predict;
  gp.ignore_eos = o.ignore_eos;
  gp.sampling = {o.temp, o.top_k, o.top_p, o.min_p,
                 o.seed >= 0 ? uint64_t(o.seed) : uint64_t(std::random_device{}())};

  // The decoder sees the prompt first so the continuation's spacing and UTF-8 come out right.
  StreamDecoder dec(tok);
  for (int32_t t : prompt) dec.feed(t);
  std::vector<int32_t> ids;
  std::string text;
  if (!o.json) {
    std::fputs(o.prompt.c_str(), stdout);
    std::fflush(stdout);
  }
  GenerateStats st = generate(ctx, prompt, gp, [&](int32_t t) {
    ids.push_back(t);
    std::string piece = dec.feed(t);
    text += piece;
    if (!o.json) {
      std::fputs(piece.c_str(), stdout);
      std::fflush(stdout);
    }
    return true;
  });
  std::string rest = dec.flush();
  text += rest;

  if (o.json) {
    nlohmann::json j;
    j["prompt_ids"] = prompt;
    j["ids"] = ids;
    j["text"] = text;
    j["stats"] = {{"prompt_tokens", st.prompt_tokens},
                  {"generated_tokens", st.generated_tokens},
                  {"ttft_ms", st.ttft_ms},
                  {"decode_tokens_per_s", st.decode_tokens_per_s},
                  {"total_ms", st.total_ms},
                  {"threads", cp.n_threads},
                  {"seed", gp.sampling.seed}};
    std::puts(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("%s\n", rest.c_str());
    std::fprintf(stderr, "\n[%d prompt tokens, %d generated; first token %.1f ms; %.1f tokens/s]\n", st.prompt_tokens,
                 st.generated_tokens, st.ttft_ms, st.decode_tokens_per_s);
  }
}

}  // namespace

void register_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a prompt (autoregressive)");
  cmd->add_option("-m,--model", o->model, "GGUF file or llama2.c checkpoint")->required()->check(CLI::ExistingFile);
  cmd->add_option("-z,--tokenizer", o->tokenizer, "tokenizer of a llama2.c checkpoint (tok512.bin)")->check(CLI::ExistingFile);
  cmd->add_option("-p,--prompt", o->prompt, "prompt text");
  cmd->add_option("-n,--n-predict", o->n_predict, "tokens to generate")->check(CLI::PositiveNumber);
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)");
  cmd->add_option("-c,--ctx", o->n_ctx, "context size in tokens (default: the model's, at most 4096)");
  cmd->add_option("--temp", o->temp, "temperature; 0 is greedy")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", o->top_k, "keep the k most likely tokens (0: off)");
  cmd->add_option("--top-p", o->top_p, "nucleus sampling threshold (1: off)");
  cmd->add_option("--min-p", o->min_p, "drop tokens below min-p times the top probability");
  cmd->add_option("--seed", o->seed, "sampling seed (default: random)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "do not stop at the end-of-sequence token");
  cmd->add_flag("--json", o->json, "print one JSON object with ids, text and stats");
  cmd->callback([o] { run_generate(*o); });
}

}  // namespace specmesh
