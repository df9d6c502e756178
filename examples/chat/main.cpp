// specmesh-chat: talk to a model line by line, with replies streamed as they are generated.
//
//   specmesh-chat -m MODEL [-z TOKENIZER] [-d DRAFT] [--strategy S]   one process
//   specmesh-chat -c TOPOLOGY.toml [--spawn]                            a topology's nodes
// Both go through specmesh::Runtime; -m builds its configuration in code.
//
// Every line from stdin is a turn and the conversation so far is the prompt of the next
// reply; the framing, the stop strings and trimming to the context come from chat/ (shared
// with other front ends), the generation from the backend below. A model with a chat template
// (GGUF tokenizer.chat_template, or --chat-template FILE) gets its prompts rendered by it;
// other vocabularies made for chat get a plain "User:/Assistant:" framing, small story models
// just continue the text. /reset starts over, /stats tells how the last reply went,
// /strategy NAME decodes the next replies with another strategy; EOF or /quit ends. Ctrl-C
// stops the reply being written (the conversation goes on); at the prompt it ends the program.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "specmesh/chat/conversation.hpp"
#include "specmesh/chat/framing.hpp"
#include "specmesh/chat/jinja.hpp"
#include "specmesh/chat/stop.hpp"
#include "specmesh/cli/interrupt.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {
namespace {

struct Options {
  std::string model, tokenizer, draft, strategy, topology, specmesh_binary, mode = "auto", chat_template;
  std::string log_level;
  bool spawn = false, ignore_eos = false;
  int n_predict = 96, threads = 0, n_ctx = 0;
  float temp = 0.8f, top_p = 0.95f;
  int top_k = 40;
  int64_t seed = -1;
};

// Streams text to the caller; returning false ends the reply.
using PieceSink = std::function<bool(const std::string&)>;

// Replies come from a runtime: a topology file's (-c), or one built here for -m [-d] (the
// same configuration struct, filled in code).
class Backend {
 public:
  explicit Backend(const Options& o) {
    RuntimeOptions ro;
    ro.spawn_nodes = o.spawn;
    // Nodes are served by the `specmesh` binary, which is built beside this one.
    ro.specmesh_binary = o.specmesh_binary.empty()
                             ? (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "specmesh").string()
                             : o.specmesh_binary;
    if (!o.topology.empty()) {
      Topology t = Topology::load(o.topology);
      if (o.n_ctx > 0) t.run.n_ctx = o.n_ctx;
      rt_ = std::make_unique<Runtime>(std::move(t), ro);
    } else {
      auto abs = [](const std::string& p) { return p.empty() ? p : std::filesystem::absolute(p).string(); };
      std::map<std::string, ModelSpec> roles;
      if (!o.draft.empty()) roles["draft"] = {"draft", abs(o.draft), abs(o.tokenizer)};
      const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
      Topology t = Topology::single_process({"target", abs(o.model), abs(o.tokenizer)}, roles, threads);
      t.run.strategy = o.strategy;
      t.run.n_ctx = o.n_ctx;
      rt_ = std::make_unique<Runtime>(std::move(t), ro);
    }
  }
  const Tokenizer& tokenizer() const { return rt_->tokenizer(); }
  int context_tokens() const { return rt_->session_context(); }  // prompt and reply must fit in this many
  const std::string& default_strategy() const { return rt_->topology().run.strategy; }
  // Continues `prompt` with `strategy` (empty: the configuration's); a signal watched by
  // `interrupts` cancels it. The result keeps the text and statistics of what was generated.
  GenerationResult complete(const std::string& prompt, bool parse_special, const GenerateParams& p, bool ignore_eos,
                            const std::string& strategy, Interrupts& interrupts, const PieceSink& sink) {
    GenerationRequest req;
    req.prompt = prompt;
    req.n_predict = p.n_predict;
    req.sampling = p.sampling;
    req.ignore_eos = ignore_eos;
    req.parse_special = parse_special;
    req.strategy = strategy;
    bool more = true;
    size_t streamed = 0;
    auto generation = rt_->submit(req, [&](int32_t, const std::string& piece) {
      streamed += piece.size();
      return more = sink(piece);
    });
    interrupts.watch(generation.get());
    GenerationResult r = generation->wait();
    interrupts.watch(nullptr);
    // Bytes of an unfinished UTF-8 character held back at the end reach only the result's text.
    if (more && r.text.size() > streamed) sink(r.text.substr(streamed));
    return r;
  }

 private:
  std::unique_ptr<Runtime> rt_;
};

// /stats: how the last reply went.
void print_stats(const GenerationResult& r) {
  const Metrics& m = r.metrics;
  std::printf("strategy %s: %zu prompt tokens, %zu generated; first token %.1f ms; %.1f tokens/s", m.strategy.c_str(),
              r.prompt_ids.size(), r.ids.size(), m.ttft_ms, m.decode_tokens_per_s);
  if (m.drafted > 0)
    std::printf("; acceptance %.2f (%lld of %lld drafted), %.2f tokens per verification", m.acceptance_rate(),
                static_cast<long long>(m.accepted), static_cast<long long>(m.drafted), m.tokens_per_verification());
  std::printf("\n");
}

std::string read_template(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read chat template " + path);
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().empty()) throw std::runtime_error("chat template " + path + " is empty");
  return text.str();
}

int chat(const Options& o) {
  Interrupts interrupts;  // before the runtime starts any thread
  auto backend = std::make_unique<Backend>(o);
  const Tokenizer& tok = backend->tokenizer();
  const std::string chat_template = o.chat_template.empty() ? std::string() : read_template(o.chat_template);
  std::unique_ptr<ChatFormat> format;
  try {
    format = make_chat_format(o.mode, tok, chat_template);
  } catch (const jinja::Error& e) {  // name the file the line and column are in
    throw std::runtime_error((o.chat_template.empty() ? std::string("the model's chat template") : o.chat_template) + ": " + e.what());
  }
  if (o.n_predict >= backend->context_tokens())
    throw std::invalid_argument("-n " + std::to_string(o.n_predict) + " leaves no room for a prompt in a context of " +
                                std::to_string(backend->context_tokens()) + " tokens");

  GenerateParams gp;
  gp.n_predict = o.n_predict;
  gp.sampling = {o.temp, o.top_k, o.top_p, 0.0f, o.seed >= 0 ? uint64_t(o.seed) : uint64_t(std::random_device{}())};

  const bool interactive = ::isatty(STDIN_FILENO);
  if (interactive)
    std::printf("specmesh-chat (%s mode, strategy %s): type a line and press enter; Ctrl-C stops a reply; /reset, "
                "/stats, /strategy NAME; /quit or Ctrl-D ends\n",
                std::string(format->name()).c_str(), backend->default_strategy().c_str());
  Conversation conv;
  std::string strategy;  // empty: the configuration's
  std::optional<GenerationResult> last;
  std::string line;
  while (true) {
    if (interactive) std::printf("> ");
    std::fflush(stdout);
    if (!std::getline(std::cin, line) || line == "/quit") break;
    if (!interactive) std::printf("> %s\n", line.c_str());  // a transcript of piped input
    if (line == "/reset") {
      conv.reset();
      std::printf("(conversation cleared)\n");
      continue;
    }
    if (line == "/stats") {
      if (last) print_stats(*last);
      else std::printf("(no reply yet)\n");
      continue;
    }
    if (line == "/strategy" || line.rfind("/strategy ", 0) == 0) {
      const std::string name = line.size() > 10 ? line.substr(10) : "";
      if (name.empty()) {
        std::printf("strategy %s (registered: %s)\n", (strategy.empty() ? backend->default_strategy() : strategy).c_str(),
                    strategy_names().c_str());
      } else if (!find_strategy(name)) {
        std::printf("unknown strategy '%s' (registered: %s)\n", name.c_str(), strategy_names().c_str());
      } else {
        strategy = name;
        std::printf("(strategy %s from the next reply on)\n", name.c_str());
      }
      continue;
    }
    if (line.empty()) continue;
    conv.add(ChatRole::User, line);
    const std::string prompt = conv.fit(*format, tok, backend->context_tokens() - gp.n_predict);

    StopFilter stop(format->stop_strings());
    std::string reply;
    auto show = [&](const std::string& text) {
      reply += text;
      std::fputs(text.c_str(), stdout);
      std::fflush(stdout);
    };
    GenerationResult r = backend->complete(prompt, format->parse_special(), gp, o.ignore_eos, strategy, interrupts,
                                           [&](const std::string& piece) {
                                             show(stop.feed(piece));
                                             return !stop.stopped();
                                           });
    show(stop.flush());
    if (r.finish_reason == FinishReason::cancelled) std::printf(" [stopped]");
    std::printf("\n");
    if (!r.ok()) {
      // The conversation goes on without this turn: a refused strategy, a full context, a
      // node that went down and came back are not the end of the chat.
      std::fprintf(stderr, "specmesh-chat: %s\n", r.error.c_str());
      conv = Conversation(std::vector<ChatMessage>(conv.messages().begin(), conv.messages().end() - 1));
      continue;
    }
    conv.add(ChatRole::Assistant, reply);
    last = std::move(r);
  }
  return 0;
}

}  // namespace
}  // namespace specmesh

int main(int argc, char** argv) {
  specmesh::Options o;
  CLI::App app{"specmesh-chat: an interactive conversation, streamed token by token"};
  auto* m = app.add_option("-m,--model", o.model, "GGUF file or llama2.c checkpoint (runs in this process)")
                ->check(CLI::ExistingFile);
  auto* c = app.add_option("-c,--config", o.topology, "topology file (runs through specmesh::Runtime)")
                ->check(CLI::ExistingFile);
  m->excludes(c);
  app.add_option("-z,--tokenizer", o.tokenizer, "tokenizer of a llama2.c checkpoint")->check(CLI::ExistingFile)->needs(m);
  app.add_option("-d,--draft", o.draft, "draft model for speculative decoding (with -m)")->check(CLI::ExistingFile)->needs(m);
  app.add_option("--strategy", o.strategy, "decoding strategy with -m (default: the registry's for the models given; `specmesh strategies` lists them)")->needs(m);
  app.add_flag("--spawn", o.spawn, "start the topology's other nodes as child processes")->needs(c);
  app.add_option("--specmesh", o.specmesh_binary, "the specmesh binary that serves spawned nodes");
  app.add_option("--mode", o.mode,
                 "template (the model's chat template), chat (User:/Assistant: turns), story (continue the text) or auto "
                 "(template when there is one, else chat for chat vocabularies, else story)")
      ->check(CLI::IsMember({"auto", "template", "chat", "story"}));
  app.add_option("--chat-template", o.chat_template, "Jinja chat template file to use instead of the model's")
      ->check(CLI::ExistingFile);
  app.add_option("-n,--n-predict", o.n_predict, "most tokens per reply")->check(CLI::PositiveNumber);
  app.add_option("--ctx", o.n_ctx, "context size in tokens (default: the model's / the topology's)");
  app.add_option("-t,--threads", o.threads, "compute threads for -m (default: all cores)");
  app.add_option("--temp", o.temp, "temperature; 0 is greedy")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", o.top_k, "keep the k most likely tokens (0: off)");
  app.add_option("--top-p", o.top_p, "nucleus sampling threshold (1: off)");
  app.add_option("--seed", o.seed, "sampling seed (default: random)");
  app.add_flag("--ignore-eos", o.ignore_eos, "do not end a reply at the end-of-sequence token");
  app.add_option("--log-level", o.log_level, "runtime log on stderr (default: $SPECMESH_LOG, else warn)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  CLI11_PARSE(app, argc, argv);
  // The conversation owns stdout; runtime logs go to stderr, warnings and worse unless asked.
  spdlog::set_default_logger(spdlog::stderr_color_mt("specmesh-chat"));
  const char* env_level = std::getenv("SPECMESH_LOG");
  spdlog::set_level(spdlog::level::from_str(!o.log_level.empty() ? o.log_level : env_level ? env_level : "warn"));
  if (o.model.empty() && o.topology.empty()) {
    std::fprintf(stderr, "specmesh-chat: give a model (-m) or a topology (-c)\n%s", app.help().c_str());
    return 2;
  }
  try {
    return specmesh::chat(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "specmesh-chat: error: %s\n", e.what());
    return 1;
  }
}
