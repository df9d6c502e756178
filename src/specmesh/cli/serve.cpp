// `specmesh serve`: the OpenAI-compatible HTTP server (serve/server.hpp) over a topology, or
// over models given on the command line (-m [-d] [--strategy], as `specmesh generate` takes them).
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "specmesh/cli/commands.hpp"
#include "specmesh/cli/params.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/serve/server.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/speculation/strategy.hpp"

namespace specmesh {

namespace {

struct ServeCommand {
  std::string config, model, tokenizer, strategy, chat_template, alias;
  std::vector<std::string> drafts;
  ParamOptions params;
  serve::ServeOptions server;
  std::string kv_type;  // empty: the topology's (f16 with -m)
  int threads = 0, n_ctx = 0, port_base = -1, parallel = 1, max_queued = 64;
  float temp = 0.8f, top_p = 0.95f, min_p = 0.05f;
  int top_k = 40;
  bool spawn = false;
  double connect_timeout_s = 10;
};

std::string absolute(const std::string& p) {
  return p.empty() ? p : std::filesystem::absolute(p).lexically_normal().string();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in || text.str().empty()) throw std::runtime_error("cannot read the chat template " + path + " (missing or empty)");
  return text.str();
}

// The configuration to serve: the topology file's, or one process with the models given.
Topology configuration(const ServeCommand& o, const CLI::App& cmd) {
  if (!o.config.empty()) {
    Topology t = Topology::load(o.config);
    override_run(t, o.strategy, o.params.values(cmd));
    override_cache(t, o.n_ctx > 0 ? o.n_ctx : -1, o.kv_type);
    return t;
  }
  std::map<std::string, ModelSpec> roles;
  for (size_t i = 0; i < o.drafts.size(); ++i) {
    const std::string role = draft_role(int(i));
    roles[role] = {role, absolute(o.drafts[i]), absolute(o.tokenizer)};
  }
  const ModelSpec target{"target", absolute(o.model), absolute(o.tokenizer)};
  if (const StrategyInfo* s = o.strategy.empty() ? nullptr : find_strategy(o.strategy); s && !s->pair_role.empty())
    roles.emplace(s->pair_role, ModelSpec{s->pair_role, target.path, target.tokenizer});
  const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  Topology t = Topology::single_process(target, roles, threads);
  t.path = "serve";
  t.run.strategy = o.strategy;
  t.run.params = o.params.values(cmd);
  override_cache(t, o.n_ctx, o.kv_type);
  return t;
}

// SIGINT and SIGTERM stop the server (its generations are cancelled, started nodes stopped);
// a second one ends the process at once.
class StopSignals {
 public:
  explicit StopSignals(serve::Server& server) : server_(server) {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);  // before any other thread starts
    thread_ = std::thread([this] {
      const timespec tick{0, 100 * 1000 * 1000};
      int seen = 0;
      while (!done_) {
        const int sig = sigtimedwait(&set_, nullptr, &tick);
        if (sig <= 0) continue;
        if (seen++ > 0) std::_Exit(128 + sig);
        std::fprintf(stderr, "specmesh serve: %s: stopping\n", strsignal(sig));
        server_.stop();
      }
    });
  }
  ~StopSignals() {
    done_ = true;
    thread_.join();
  }

 private:
  serve::Server& server_;
  sigset_t set_{};
  std::atomic<bool> done_{false};
  std::thread thread_;
};

void run_serve(ServeCommand& o, const CLI::App& cmd) {
  if (o.config.empty() == o.model.empty()) throw std::invalid_argument("give a topology file or a model (-m), not both");
  Topology topo = configuration(o, cmd);
  serve::ServeOptions& so = o.server;
  so.model_id = !o.alias.empty() ? o.alias
                : !o.model.empty() ? std::filesystem::path(o.model).stem().string()
                                   : topo.run.model;
  if (!o.chat_template.empty()) {
    so.chat_template = read_text(o.chat_template);
    so.chat_template_name = o.chat_template;
    if (so.chat_mode == "auto") so.chat_mode = "template";
  }
  if (so.api_key.empty())
    if (const char* key = std::getenv("SPECMESH_API_KEY")) so.api_key = key;
  so.defaults.sampling = {o.temp, o.top_k, o.top_p, o.min_p, 0};

  RuntimeOptions ro;
  ro.spawn_nodes = o.spawn;
  ro.port_base = o.port_base;
  ro.connect_timeout = std::chrono::milliseconds(int64_t(o.connect_timeout_s * 1000));
  ro.max_sessions = o.parallel;
  ro.max_queued = o.max_queued;
  so.http_threads = std::max(so.http_threads, o.parallel + o.max_queued + 8);
  serve::Server server(so, [topo, ro]() { return std::make_unique<Runtime>(topo, ro); });
  StopSignals signals(server);
  const int port = server.bind();
  std::fprintf(stderr, "specmesh serve: http://%s:%d/ (%s; loading)\n", so.host.c_str(), port, so.model_id.c_str());
  server.run();
}

}  // namespace

void register_serve(CLI::App& app) {
  auto o = std::make_shared<ServeCommand>();
  CLI::App* cmd = app.add_subcommand(
      "serve", "Serve a topology, or models, over an OpenAI-compatible HTTP API with a chat page at /");
  cmd->add_option("config", o->config, "topology file (TOML); or give -m")->check(CLI::ExistingFile);
  cmd->add_option("-m,--model", o->model, "target: GGUF file or llama2.c checkpoint (one process)")->check(CLI::ExistingFile);
  cmd->add_option("-z,--tokenizer", o->tokenizer, "tokenizer of llama2.c checkpoints")->check(CLI::ExistingFile);
  cmd->add_option("-d,--draft", o->drafts, "draft model (for dflash, the drafter's directory); repeat for more drafts (with -m)")
      ->check(CLI::ExistingPath);
  std::vector<std::string> names;
  for (const StrategyInfo& s : strategies()) names.push_back(s.name);
  cmd->add_option("--strategy", o->strategy, "default strategy (" + strategy_names() + "); a request may ask for another")
      ->check(CLI::IsMember(names));
  o->params.add_to(*cmd);
  cmd->add_option("--host", o->server.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o->server.port, "port to listen on (0: any free one)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o->server.api_key,
                  "require \"Authorization: Bearer KEY\" on /v1/* and /metrics (default: $SPECMESH_API_KEY, if set)");
  cmd->add_option("--alias", o->alias, "the model name /v1/models lists (default: the model file's name)");
  cmd->add_option("--chat-template", o->chat_template, "Jinja chat template file to use instead of the model's")
      ->check(CLI::ExistingFile);
  cmd->add_option("--chat-format", o->server.chat_mode,
                  "how chat messages become a prompt: template, chat (User:/Assistant:), story, or auto (the "
                  "template when there is one)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "template", "chat", "story"}));
  cmd->add_option("-n,--n-predict", o->server.defaults.max_tokens,
                  "max_tokens of requests that give none (-1: until the end of sequence or the context is full)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1 << 30) & !CLI::IsMember({0}));
  cmd->add_option("--parallel", o->parallel,
                  "sessions generated at once; each gets an equal share of the context (ctx / parallel)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd->add_option("--max-queued", o->max_queued, "requests that may wait for a session; past them: 429")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  cmd->add_flag("--context-shift", o->server.context_shift,
                "a reply that fills its context drops the oldest half of it and goes on (else it ends, \"length\")");
  cmd->add_option("-c,--ctx", o->n_ctx, "context size in tokens (default: the model's / the topology's)")
      ->check(CLI::NonNegativeNumber);
  add_kv_type_option(*cmd, o->kv_type, "the topology's run.kv_type; f16 with -m");
  cmd->add_option("-t,--threads", o->threads, "compute threads with -m (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--temp", o->temp, "temperature of requests that give none")->capture_default_str()->check(finite_in(0, 2));
  cmd->add_option("--top-k", o->top_k, "top_k of requests that give none (0: off)")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", o->top_p, "top_p of requests that give none")->capture_default_str()->check(finite_in(0, 1));
  cmd->add_option("--min-p", o->min_p, "min_p of requests that give none")->capture_default_str()->check(finite_in(0, 1));
  cmd->add_option("--http-threads", o->server.http_threads,
                  "connections served at once (at least --parallel + --max-queued + 8)")
      ->capture_default_str()
      ->check(CLI::Range(4, 8192));
  cmd->add_flag("--spawn", o->spawn, "start the topology's other nodes as child processes");
  cmd->add_option("--port-base", o->port_base, "move the topology's endpoints (as `specmesh run --port-base`)")
      ->check(CLI::Range(0, 65533));
  cmd->add_option("--connect-timeout", o->connect_timeout_s, "seconds to wait for the other nodes");
  cmd->callback([o, cmd] { run_serve(*o, *cmd); });
}

}  // namespace specmesh
