#include "specmesh/runtime/node.hpp"

#include <thread>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/actors/head.hpp"
#include "specmesh/transport/dispatcher.hpp"

namespace specmesh {

std::shared_ptr<const Model> ModelCache::get(const ModelSpec& spec) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& m = models_[spec.path + "|" + spec.tokenizer];
  if (!m) m = Model::load(spec.path, spec.tokenizer);
  return m;
}

std::vector<std::string> pipeline_nodes(const Topology& topo, const std::string& model) {
  std::vector<std::string> out;
  for (const StageSpec* s : topo.stages_of(model)) out.push_back(topo.node_of_device(s->device).name);
  return out;
}

NodeHost::NodeHost(caf::actor_system& sys, const Topology& topo, const std::string& node, ModelCache& models)
    : name_(node) {
  const NodeSpec& self = topo.nodes.at(node);
  GatewayConfig gc;
  gc.node = node;
  gc.bind = self.endpoint;
  for (const auto& [n, spec] : topo.nodes)
    if (n != node) gc.peers[n] = spec.endpoint;
  gateway_ = std::make_unique<Gateway>(gc);
  router_ = std::make_shared<Router>(node, gateway_.get(), topo.link);

  for (const auto& [dn, d] : topo.devices) {
    if (d.node != node) continue;
    auto dev = std::make_shared<Device>(dn, d.threads, d.profile);
    devices_[dn] = dev;
  }
  std::map<std::string, caf::actor> device_actors;
  for (const auto& [dn, dev] : devices_) {
    device_actors[dn] = spawn_device_actor(sys, dev);
    actors_.push_back(device_actors[dn]);
  }

  std::vector<Route> routes;
  for (const std::string& model : {topo.run.model, topo.run.draft}) {
    if (model.empty()) continue;
    auto stages = topo.stages_of(model);
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageSpec& s = *stages[i];
      if (topo.devices.at(s.device).node != node) continue;
      StageConfig sc;
      sc.pipeline = model;
      sc.self_node = node;
      sc.head_node = topo.head_node;
      sc.next_node = i + 1 < stages.size() ? topo.node_of_device(stages[i + 1]->device).name : topo.head_node;
      sc.model = models.get(topo.models.at(model));
      sc.context.n_ctx = topo.run.n_ctx;
      sc.context.layer_begin = s.layer_begin;
      sc.context.layer_end = s.layer_end;
      sc.device = device_actors.at(s.device);
      sc.device_state = devices_.at(s.device);
      sc.router = router_;
      auto stats = std::make_shared<StageStats>();
      caf::actor a = spawn_stage(sys, sc, stats);
      actors_.push_back(a);
      routes.push_back({model, s.layer_begin, a});
      stage_info_.push_back({model, s.layer_begin, s.layer_end, s.device, stats});
    }
  }
  if (node == topo.head_node) {
    head_ = spawn_head(sys, head_config(topo, models, router_));
    actors_.push_back(head_);
    // The head's handlers are short (sample, launch the next run): running them on the
    // gateway thread saves a thread wake-up per token.
    gateway_->subscribe(MsgType::logits, head_, Delivery::inline_io);
    gateway_->subscribe(MsgType::error, head_, Delivery::inline_io);
  }
  dispatcher_ = spawn_dispatcher(sys, node, routes, head_);
  actors_.push_back(dispatcher_);
  router_->set_local(dispatcher_);
  for (MsgType t : {MsgType::run_start, MsgType::activations, MsgType::kv_cache_op, MsgType::cancel})
    gateway_->subscribe(t, dispatcher_, Delivery::inline_io);  // it only forwards
}

HeadConfig head_config(const Topology& topo, ModelCache& models, std::shared_ptr<Router> router) {
  auto pipeline = [&](const std::string& model) {
    PipelineRef p;
    if (model.empty()) return p;
    p.name = model;
    p.model = models.get(topo.models.at(model));
    p.nodes = pipeline_nodes(topo, model);
    p.first_node = p.nodes.front();
    return p;
  };
  const RunSpec& run = topo.run;
  HeadConfig hc;
  hc.strategy = run.strategy;
  hc.target = pipeline(run.model);
  hc.draft = pipeline(run.draft);
  if (!hc.draft.name.empty() && hc.draft.model->hparams().n_vocab != hc.target.model->hparams().n_vocab)
    throw ConfigError(topo.path + ": run.draft: the draft's vocabulary (" + std::to_string(hc.draft.model->hparams().n_vocab) +
                      " tokens) differs from the target's (" + std::to_string(hc.target.model->hparams().n_vocab) + ")");
  hc.router = std::move(router);
  hc.sampling = {run.temperature, run.top_k, run.top_p, run.min_p, run.seed};
  hc.n_predict = run.n_predict;
  hc.metrics_csv = run.metrics_csv;
  auto param = [&](const char* k, double fallback) {
    auto it = run.params.find(k);
    return it == run.params.end() ? fallback : it->second;
  };
  SpecParams& sp = hc.spec;
  sp.n_draft = int(param("n_draft", sp.n_draft));
  sp.max_micro_batch = int(param("max_micro_batch", sp.max_micro_batch));
  sp.max_runs = int(param("max_runs", sp.max_runs));
  sp.p_accept = float(param("p_accept", sp.p_accept));
  sp.p_recovery = float(param("p_recovery", sp.p_recovery));
  sp.p_decay = float(param("p_decay", sp.p_decay));
  sp.cancel = param("cancel", 1) != 0;
  return hc;
}

NodeHost::~NodeHost() {
  for (const auto& a : actors_) gateway_->unsubscribe(a);
  for (const auto& a : actors_) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  router_->close();
  gateway_.reset();
}

bool NodeHost::wait_for_peers(const std::vector<std::string>& peers, std::chrono::milliseconds timeout, std::string* missing) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const std::string& p : peers) {
    if (p == name_) continue;
    while (!gateway_->peer_alive(p)) {
      if (std::chrono::steady_clock::now() > deadline) {
        if (missing) *missing = p;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return true;
}

}  // namespace specmesh
