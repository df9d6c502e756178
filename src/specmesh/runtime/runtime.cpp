#include "specmesh/runtime.hpp"

#include <caf/actor_system.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/send.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/model/context.hpp"
#include "specmesh/runtime/keys.hpp"
#include "specmesh/runtime/load_checks.hpp"
#include "specmesh/runtime/node.hpp"
#include "specmesh/runtime/node_processes.hpp"
#include "specmesh/runtime/port_base.hpp"
#include "specmesh/runtime/request.hpp"
#include "specmesh/speculation/params.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

struct Runtime::Impl {
  Topology topo;
  RuntimeOptions opts;
  std::unique_ptr<EphemeralKeys> keys;  // removed after the children have stopped
  NodeProcesses children;
  int port_base = -1;  // applied to the topology and passed on to started nodes
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  ModelCache models;
  std::vector<std::unique_ptr<NodeHost>> nodes;  // hosted in this process; [0] is the head
  std::shared_ptr<const Model> head_model;
  std::shared_ptr<HeadCounters> counters = std::make_shared<HeadCounters>();
  // Requests admitted and not yet finished (running and queued); shared with their sessions,
  // which may finish after the runtime is gone.
  std::shared_ptr<std::atomic<int>> open = std::make_shared<std::atomic<int>>(0);
};

Runtime::Runtime(Topology topology, RuntimeOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.topo = std::move(topology);
  m.opts = options;
  if (m.opts.max_sessions < 1)
    throw std::invalid_argument("max_sessions must be at least 1 (got " + std::to_string(m.opts.max_sessions) + ")");
  if (m.opts.max_queued < 0)
    throw std::invalid_argument("max_queued must not be negative (got " + std::to_string(m.opts.max_queued) + ")");
  m.topo.check();
  resolve_layers(m.topo, m.models);
  check_vocabularies(m.topo, m.models);
  // The nodes this process hosts or starts share this machine's memory.
  std::vector<std::string> here;
  for (const auto& [name, node] : m.topo.nodes)
    if (name == m.topo.head_node || node.endpoint.rfind("inproc://", 0) == 0 || m.opts.spawn_nodes) here.push_back(name);
  check_kv_memory(m.topo, m.models, here);
  if (m.opts.port_base >= 0) {
    m.port_base = m.opts.port_base > 0 ? m.opts.port_base : free_port_base(m.topo);
    move_endpoints(m.topo, m.port_base);
  }
  // tcp:// always runs CURVE. Without keys in the file, a runtime that starts or hosts every
  // node itself makes throwaway ones and hands them to the nodes it starts.
  std::vector<std::string> child_args;
  if (m.opts.allow_remote) {
    m.topo.security.allow_remote = true;
    child_args.push_back("--allow-remote");
  }
  if (uses_tcp(m.topo) && m.topo.security.keys.empty() && !m.topo.security.allow_remote) {
    bool all_local = true;
    for (const auto& [name, node] : m.topo.nodes)
      all_local = all_local && (name == m.topo.head_node || node.endpoint.rfind("inproc://", 0) == 0);
    if (m.opts.spawn_nodes || all_local) {
      m.keys = std::make_unique<EphemeralKeys>(m.topo);
      m.topo.security.keys = m.keys->dir();
      child_args.insert(child_args.end(), {"--keys", m.keys->dir()});
    }
  }
  // The nodes it starts read the file: the strategy, parameters and cache settings this run was
  // given on top of it go with them, so every node builds the same strategy with the same
  // settings and the same caches.
  if (m.opts.spawn_nodes)
    child_args.insert(child_args.end(), {"--ctx", std::to_string(m.topo.run.n_ctx), "--kv-type", m.topo.run.kv_type});
  if (m.opts.spawn_nodes && !m.topo.run.strategy.empty()) {
    const StrategyInfo& info = strategy(m.topo.run.strategy);
    child_args.insert(child_args.end(), {"--strategy", m.topo.run.strategy});
    for (const auto& [key, value] : m.topo.run.params)
      if (const ParamSpec* spec = info.param(key))
        child_args.insert(child_args.end(), {"--param", key + "=" + format_value(*spec, value)});
  }
  check_security(m.topo, here);
  // A second run of the same file must not take the first one's addresses (ZeroMQ would
  // silently replace an ipc socket file, and its nodes would join the first run's mesh).
  check_endpoints_free(m.topo, here);
  m.head_model = m.models.get(m.topo.models.at(m.topo.run.model));
  try {
    if (m.opts.spawn_nodes) m.children.start(m.topo, m.opts.specmesh_binary, m.port_base, child_args);
    configure_low_latency_scheduler(m.cfg);
    m.sys = std::make_unique<caf::actor_system>(m.cfg);
    m.nodes.push_back(
        std::make_unique<NodeHost>(*m.sys, m.topo, m.topo.head_node, m.models, m.opts.max_sessions, m.counters));
    for (const auto& [name, node] : m.topo.nodes)
      if (name != m.topo.head_node && node.endpoint.rfind("inproc://", 0) == 0)
        m.nodes.push_back(std::make_unique<NodeHost>(*m.sys, m.topo, name, m.models));
    std::vector<std::string> peers;
    for (const auto& [name, node] : m.topo.nodes) peers.push_back(name);
    std::string missing;
    if (!m.nodes[0]->wait_for_peers(peers, m.opts.connect_timeout, &missing))
      throw std::runtime_error("node '" + missing + "' at " + m.topo.nodes.at(missing).endpoint + " did not answer within " +
                               std::to_string(m.opts.connect_timeout.count()) + " ms (is `specmesh node --name " + missing +
                               "` running?)");
    // Stage processes started together connect to each other only after ZeroMQ's reconnect
    // interval (100 ms) when the downstream one bound last: push one token through every
    // pipeline now, so that wait is not the first request's, and a broken pipeline fails here.
    bool remote = false;
    for (const auto& [name, node] : m.topo.nodes) remote = remote || node.endpoint.rfind("inproc://", 0) != 0;
    if (remote) {
      auto s = std::make_shared<Session>();
      s->request.n_predict = 1;
      s->request.ignore_eos = true;
      s->record_metrics = false;
      auto warm = s->done.get_future();
      caf::anon_send(m.nodes[0]->head(), generate_atom::value, s);
      if (warm.wait_for(m.opts.connect_timeout) != std::future_status::ready)
        throw std::runtime_error("the pipelines did not answer a first run within " +
                                 std::to_string(m.opts.connect_timeout.count()) + " ms");
      GenerationResult r = warm.get();
      if (!r.ok()) throw std::runtime_error("first run through the pipelines failed: " + r.error);
    }
  } catch (...) {
    m.nodes.clear();
    m.sys.reset();
    m.children.stop();
    throw;
  }
}

std::unique_ptr<Runtime> Runtime::open(const std::string& path, RuntimeOptions options) {
  return std::make_unique<Runtime>(Topology::load(path), options);
}

Runtime::~Runtime() {
  impl_->nodes.clear();
  impl_->sys.reset();
  impl_->children.stop();
  impl_->keys.reset();
}

struct Generation::State {
  SessionPtr session;
  std::future<GenerationResult> result;
  caf::actor_addr head;  // weak: a Generation may outlive its runtime
};

Generation::Generation(std::shared_ptr<State> state) : state_(std::move(state)) {}
Generation::~Generation() = default;
GenerationResult Generation::wait() { return state_->result.get(); }
void Generation::cancel() {
  state_->session->cancel = true;
  // The head ends the session now and cancels its runs in the pipelines.
  if (auto head = caf::actor_cast<caf::actor>(state_->head)) caf::anon_send(head, cancel_atom::value, state_->session);
}

std::unique_ptr<Generation> Runtime::submit(GenerationRequest request, StreamCallback on_token, DoneCallback on_done) {
  Impl& m = *impl_;
  auto s = std::make_shared<Session>();
  s->request = std::move(request);
  s->on_token = std::move(on_token);
  s->on_done = std::move(on_done);
  auto state = std::make_shared<Generation::State>();
  state->session = s;
  state->result = s->done.get_future();
  auto refuse = [&](std::string error, ErrorKind kind) {
    GenerationResult r;
    r.error = std::move(error);
    r.error_kind = kind;
    r.finish_reason = FinishReason::error;
    s->hand_over(std::move(r));
    return std::make_unique<Generation>(std::move(state));
  };
  try {
    RequestStrategy rs = request_strategy(m.topo, context_size(), s->request);
    s->strategy = rs.info;
    s->params = std::move(rs.params);
  } catch (const std::invalid_argument& e) {
    return refuse(e.what(), ErrorKind::invalid_request);
  }
  if (s->request.n_predict < -1)
    return refuse("n_predict must be -1 (until the end or a full context), 0 (the default) or positive, not " +
                      std::to_string(s->request.n_predict),
                  ErrorKind::invalid_request);
  const int bound = m.opts.max_sessions + m.opts.max_queued;
  if (m.open->fetch_add(1) >= bound) {
    --*m.open;
    return refuse("busy: " + std::to_string(m.opts.max_sessions) + " sessions running and " +
                      std::to_string(m.opts.max_queued) + " waiting, the most this runtime admits; try again later",
                  ErrorKind::busy);
  }
  s->on_finished = [open = m.open] { --*open; };
  state->head = m.nodes[0]->head().address();
  caf::anon_send(m.nodes[0]->head(), generate_atom::value, s);
  return std::make_unique<Generation>(std::move(state));
}

GenerationResult Runtime::generate(GenerationRequest request, StreamCallback on_token) {
  return submit(std::move(request), std::move(on_token))->wait();
}

std::vector<Runtime::StageCounters> Runtime::stage_counters() const {
  std::vector<StageCounters> out;
  for (const auto& n : impl_->nodes)
    for (const auto& s : n->stages())
      out.push_back({n->name(), s.pipeline, s.layer_begin, s.layer_end, s.stats->runs.load(),
                     s.stats->layers_computed.load(), s.stats->runs_cancelled.load()});
  return out;
}

const Topology& Runtime::topology() const { return impl_->topo; }
const RuntimeOptions& Runtime::options() const { return impl_->opts; }

int Runtime::session_context() const { return context_size() / impl_->opts.max_sessions; }

int Runtime::session_context(const GenerationRequest& request) const {
  const Topology& topo = impl_->topo;
  RequestStrategy rs = request_strategy(topo, context_size(), request);
  if (!rs.info) {  // the configuration's
    rs.info = &strategy(topo.run.strategy);
    rs.params = rs.info->resolve(topo.run.params);
  }
  return session_context() - rs.info->spare_cells_for(rs.params, topo.roles());
}

RuntimeStatus Runtime::status() const {
  RuntimeStatus s;
  Router& router = *impl_->nodes[0]->router();
  for (const auto& [name, node] : impl_->topo.nodes)
    if (name != impl_->topo.head_node && !router.reachable(name)) s.nodes_down.push_back(name);
  s.health = s.nodes_down.empty() ? Health::ready : Health::degraded;
  s.sessions_running = impl_->counters->running.load();
  s.sessions_queued = impl_->counters->queued.load();
  return s;
}
int Runtime::context_size() const {
  return specmesh::context_size(*impl_->head_model, impl_->topo.run.n_ctx);
}

const Tokenizer& Runtime::tokenizer() const { return impl_->head_model->tokenizer(); }

void set_log_level(const std::string& level) { spdlog::set_level(spdlog::level::from_str(level)); }

}  // namespace specmesh
