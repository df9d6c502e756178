// specmesh-chat: talk to a model line by line, with replies streamed as they are generated.
//
//   specmesh-chat -m MODEL [-z TOKENIZER]      one process, model/generate.hpp directly
//   specmesh-chat -c TOPOLOGY.toml [--spawn]    through a topology (specmesh::Runtime)
//
// Every line from stdin is a turn and the conversation so far is the prompt of the next
// reply; the framing, the stop strings and trimming to the context come from chat/ (shared
// with other front ends), the generation from the backend below. Vocabularies made for chat
// get a plain "User:/Assistant:" framing, small story models just continue the text. /reset
// starts over; EOF or /quit ends.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "specmesh/chat/conversation.hpp"
#include "specmesh/chat/framing.hpp"
#include "specmesh/chat/stop.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/runtime.hpp"

namespace specmesh {
namespace {

struct Options {
  std::string model, tokenizer, topology, specmesh_binary, mode = "auto";
  bool spawn = false;
  int n_predict = 96, threads = 0, n_ctx = 0;
  float temp = 0.8f, top_p = 0.95f;
  int top_k = 40;
  int64_t seed = -1;
};

// Streams text to the caller; returning false ends the reply.
using PieceSink = std::function<bool(const std::string&)>;

// Where replies come from: a model in this process or a topology's head.
struct Backend {
  virtual ~Backend() = default;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual int context_tokens() const = 0;  // prompt and reply must fit in this many
  // Continues `prompt`; returns an error message, empty on success.
  virtual std::string complete(const std::string& prompt, const GenerateParams& p, const PieceSink& sink) = 0;
};

class DirectBackend : public Backend {
 public:
  explicit DirectBackend(const Options& o) : model_(Model::load(o.model, o.tokenizer)) {
    ContextParams cp;
    cp.n_ctx = o.n_ctx;
    cp.n_threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    ctx_ = std::make_unique<Context>(*model_, cp);
  }
  const Tokenizer& tokenizer() const override { return model_->tokenizer(); }
  int context_tokens() const override { return ctx_->kv().n_cells(); }
  std::string complete(const std::string& prompt, const GenerateParams& p, const PieceSink& sink) override {
    ctx_->kv().clear();  // generate() starts from an empty sequence
    std::vector<int32_t> ids = tokenizer().encode(prompt, true);
    StreamDecoder dec(tokenizer());
    for (int32_t t : ids) dec.feed(t);  // so the reply's first piece is spaced correctly
    bool more = true;
    try {
      generate(*ctx_, ids, p, [&](int32_t t) { return more = sink(dec.feed(t)); });
    } catch (const std::exception& e) {
      return e.what();
    }
    if (more) sink(dec.flush());
    return {};
  }

 private:
  std::unique_ptr<Model> model_;
  std::unique_ptr<Context> ctx_;
};

class RuntimeBackend : public Backend {
 public:
  explicit RuntimeBackend(const Options& o) {
    RuntimeOptions ro;
    ro.spawn_nodes = o.spawn;
    // Nodes are served by the `specmesh` binary, which is built beside this one.
    ro.specmesh_binary = o.specmesh_binary.empty()
                             ? (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "specmesh").string()
                             : o.specmesh_binary;
    rt_ = Runtime::open(o.topology, ro);
    const Topology& t = rt_->topology();
    n_ctx_ = o.n_ctx > 0 ? o.n_ctx : t.run.n_ctx;
    if (n_ctx_ <= 0) {
      // The stages size their caches as a Context does; the weights are mmapped, so this
      // second load reads little more than the header.
      const ModelSpec& m = t.models.at(t.run.model);
      n_ctx_ = std::min(Model::load(m.path, m.tokenizer)->hparams().n_ctx_train, 4096);
    }
  }
  const Tokenizer& tokenizer() const override { return rt_->tokenizer(); }
  int context_tokens() const override { return n_ctx_; }
  std::string complete(const std::string& prompt, const GenerateParams& p, const PieceSink& sink) override {
    GenerationRequest req{.prompt = prompt, .n_predict = p.n_predict, .sampling = p.sampling};
    bool more = true;
    size_t streamed = 0;
    GenerationResult r = rt_->generate(req, [&](int32_t, const std::string& piece) {
      streamed += piece.size();
      return more = sink(piece);
    });
    // Bytes of an unfinished UTF-8 character held back at the end reach only the result's text.
    if (more && r.text.size() > streamed) sink(r.text.substr(streamed));
    return r.error;
  }

 private:
  std::unique_ptr<Runtime> rt_;
  int n_ctx_ = 0;
};

int chat(const Options& o) {
  // The conversation owns stdout; runtime logs go to stderr, warnings and worse only.
  spdlog::set_default_logger(spdlog::stderr_color_mt("specmesh-chat"));
  spdlog::set_level(spdlog::level::warn);

  std::unique_ptr<Backend> backend;
  if (!o.topology.empty()) backend = std::make_unique<RuntimeBackend>(o);
  else backend = std::make_unique<DirectBackend>(o);
  const Tokenizer& tok = backend->tokenizer();
  const std::unique_ptr<ChatFormat> format = make_chat_format(o.mode, tok);
  if (o.n_predict >= backend->context_tokens())
    throw std::invalid_argument("-n " + std::to_string(o.n_predict) + " leaves no room for a prompt in a context of " +
                                std::to_string(backend->context_tokens()) + " tokens");

  GenerateParams gp;
  gp.n_predict = o.n_predict;
  gp.sampling = {o.temp, o.top_k, o.top_p, 0.0f, o.seed >= 0 ? uint64_t(o.seed) : uint64_t(std::random_device{}())};

  const bool interactive = ::isatty(STDIN_FILENO);
  if (interactive)
    std::printf("specmesh-chat (%s mode): type a line and press enter; /reset starts over, /quit or Ctrl-D ends\n",
                std::string(format->name()).c_str());
  Conversation conv;
  std::string line;
  while (true) {
    if (interactive) std::printf("> ");
    std::fflush(stdout);
    if (!std::getline(std::cin, line) || line == "/quit") break;
    if (!interactive) std::printf("> %s\n", line.c_str());  // a transcript of piped input
    if (line == "/reset") {
      conv.reset();
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
    std::string error = backend->complete(prompt, gp, [&](const std::string& piece) {
      show(stop.feed(piece));
      return !stop.stopped();
    });
    show(stop.flush());
    std::printf("\n");
    if (!error.empty()) {
      std::fprintf(stderr, "specmesh-chat: %s\n", error.c_str());
      return 1;
    }
    conv.add(ChatRole::Assistant, reply);
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
  app.add_flag("--spawn", o.spawn, "start the topology's other nodes as child processes")->needs(c);
  app.add_option("--specmesh", o.specmesh_binary, "the specmesh binary that serves spawned nodes");
  app.add_option("--mode", o.mode, "chat (User:/Assistant: turns), story (continue the text) or auto")
      ->check(CLI::IsMember({"auto", "chat", "story"}));
  app.add_option("-n,--n-predict", o.n_predict, "most tokens per reply")->check(CLI::PositiveNumber);
  app.add_option("--ctx", o.n_ctx, "context size in tokens (default: the model's / the topology's)");
  app.add_option("-t,--threads", o.threads, "compute threads for -m (default: all cores)");
  app.add_option("--temp", o.temp, "temperature; 0 is greedy")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", o.top_k, "keep the k most likely tokens (0: off)");
  app.add_option("--top-p", o.top_p, "nucleus sampling threshold (1: off)");
  app.add_option("--seed", o.seed, "sampling seed (default: random)");
  CLI11_PARSE(app, argc, argv);
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
