// `specmesh run` (the head of a topology) and `specmesh node` (one node as its own process).
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/runtime/keys.hpp"
#include "specmesh/runtime/load_checks.hpp"
#include "specmesh/runtime/node.hpp"
#include "specmesh/runtime/port_base.hpp"
#include "specmesh/cli/commands.hpp"
#include "specmesh/cli/interrupt.hpp"
#include "specmesh/cli/output.hpp"
#include "specmesh/cli/params.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/runtime.hpp"

namespace specmesh {

namespace {

struct RunOptions {
  std::string config, prompt, strategy, kv_type;
  int n_ctx = -1;  // -1: the file's
  ParamOptions params;
  int n_predict = 0;
  int port_base = -1;
  bool json = false, spawn = false, ignore_eos = false, allow_remote = false;
  double timeout_s = 10;
};

int run_topology(const RunOptions& o, const CLI::App& cmd) {
  Interrupts interrupts;  // before the runtime starts any thread
  RuntimeOptions ro;
  ro.spawn_nodes = o.spawn;
  ro.connect_timeout = std::chrono::milliseconds(int64_t(o.timeout_s * 1000));
  ro.port_base = o.port_base;
  ro.allow_remote = o.allow_remote;
  Topology topo = Topology::load(o.config);
  override_run(topo, o.strategy, o.params.values(cmd));
  override_cache(topo, o.n_ctx, o.kv_type);
  auto rt = std::make_unique<Runtime>(std::move(topo), ro);
  GenerationRequest req;
  req.prompt = o.prompt;
  req.n_predict = o.n_predict;
  req.ignore_eos = o.ignore_eos;
  if (!o.json) {
    std::fputs(o.prompt.c_str(), stdout);
    std::fflush(stdout);
  }
  auto generation = rt->submit(req, [&](int32_t, const std::string& piece) {
    if (!o.json) {
      std::fputs(piece.c_str(), stdout);
      std::fflush(stdout);
    }
    return true;
  });
  interrupts.watch(generation.get());
  GenerationResult r = generation->wait();
  interrupts.watch(nullptr);
  if (o.json) {
    std::puts(dump(result_json(r)).c_str());
  } else {
    std::printf("\n");
  }
  if (!r.ok()) {
    std::fprintf(stderr, "specmesh: error: %s\n", r.error.c_str());
    return 1;
  }
  if (const int sig = interrupts.received()) {
    std::fprintf(stderr, "specmesh: %s: stopped after %zu tokens\n", strsignal(sig), r.ids.size());
    rt.reset();  // stops the started nodes before the exit status says why
    return 128 + sig;
  }
  return 0;
}

int run_node(const std::string& config, const std::string& name, int port_base, const std::string& keys,
             bool allow_remote, const std::string& strategy, const std::map<std::string, ParamValue>& params,
             int n_ctx, const std::string& kv_type) {
  // Block the stop signals before any thread starts, then wait for one of them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  Topology topo = Topology::load(config);
  if (!topo.nodes.count(name)) throw ConfigError(config + ": no node named '" + name + "' in [nodes]");
  override_run(topo, strategy, params);
  override_cache(topo, n_ctx, kv_type);
  topo.check();  // again, for the strategy given (a role it does not take may not be built)
  if (port_base > 0) move_endpoints(topo, port_base);
  if (!keys.empty()) topo.security.keys = std::filesystem::absolute(keys).string();
  if (allow_remote) topo.security.allow_remote = true;
  check_security(topo, {name});
  check_endpoints_free(topo, {name});
  ModelCache models;
  resolve_layers(topo, models);
  check_kv_memory(topo, models, {name});
  caf::actor_system_config cfg;
  configure_low_latency_scheduler(cfg);
  caf::actor_system sys{cfg};
  {
    NodeHost host(sys, topo, name, models);
    spdlog::info("node {} serving at {} ({} stages, {} KV cache)", name, topo.nodes.at(name).endpoint,
                 host.stages().size(), topo.run.kv_type);
    int sig = 0;
    sigwait(&set, &sig);
    spdlog::info("node {} stopping (signal {})", name, sig);
  }
  return 0;
}

}  // namespace

void register_run(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  CLI::App* cmd = app.add_subcommand("run", "Run a topology: the head here, stages wherever the config puts them");
  cmd->add_option("config", o->config, "topology file (TOML)")->required()->check(CLI::ExistingFile);
  cmd->add_option("-p,--prompt", o->prompt, "prompt text");
  cmd->add_option("-n,--n-predict", o->n_predict, "tokens to generate (default: the topology's run.n_predict)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "do not stop at the end-of-sequence token");
  cmd->add_flag("--json", o->json, "print one JSON object with ids, text and stats");
  cmd->add_flag("--spawn", o->spawn, "start the topology's other nodes as child processes");
  cmd->add_option("--connect-timeout", o->timeout_s, "seconds to wait for the other nodes");
  cmd->add_option("--port-base", o->port_base,
                  "move the endpoints of the nodes that are not inproc:// (tcp ports N, N+2, ... in node-name order; ipc "
                  "paths get -pN) so runs of one file can share a host; 0 picks free ones")
      ->check(CLI::Range(0, 65533));
  cmd->add_flag("--allow-remote", o->allow_remote,
                "let tcp:// nodes listen on addresses other than loopback (as [security] allow_remote; needs keys)");
  cmd->add_option("--strategy", o->strategy, "override run.strategy (" + strategy_names() + ")");
  o->params.add_to(*cmd);
  cmd->add_option("-c,--ctx", o->n_ctx, "override run.n_ctx (0: the model's)")->check(CLI::NonNegativeNumber);
  add_kv_type_option(*cmd, o->kv_type, "the file's run.kv_type, f16 when it has none");
  cmd->callback([o, cmd] {
    int rc = run_topology(*o, *cmd);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

void register_node(CLI::App& app) {
  struct Opts {
    std::string config, name;
    int port_base = -1;
    std::string keys;
    bool allow_remote = false;
    std::string strategy, kv_type;
    int n_ctx = -1;
    ParamOptions params;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("node", "Serve one node of a topology in this process until SIGTERM/SIGINT");
  cmd->add_option("--config", o->config, "topology file (TOML)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--name", o->name, "node name in [nodes]")->required();
  cmd->add_option("--port-base", o->port_base, "the port base of the run this node belongs to (specmesh run --port-base)")
      ->check(CLI::Range(1, 65533));
  cmd->add_option("--keys", o->keys,
                  "the key directory (instead of the topology's [security] keys): this node's NAME.key_secret and every "
                  "node's NAME.key");
  cmd->add_flag("--allow-remote", o->allow_remote,
                "listen on an address other than loopback (as [security] allow_remote; needs keys)");
  cmd->add_option("--strategy", o->strategy,
                  "override run.strategy (" + strategy_names() + "; `specmesh run --spawn` passes its own)");
  o->params.add_to(*cmd);
  cmd->add_option("-c,--ctx", o->n_ctx, "override run.n_ctx (`specmesh run --spawn` passes its own)")
      ->check(CLI::NonNegativeNumber);
  add_kv_type_option(*cmd, o->kv_type, "the file's run.kv_type; `specmesh run --spawn` passes its own");
  cmd->callback([o, cmd] {
    run_node(o->config, o->name, o->port_base, o->keys, o->allow_remote, o->strategy, o->params.values(*cmd),
             o->n_ctx, o->kv_type);
  });
}

}  // namespace specmesh
