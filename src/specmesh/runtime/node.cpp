#include "specmesh/runtime/node.hpp"

#include <algorithm>
#include <set>
#include <filesystem>
#include <thread>

#include <spdlog/spdlog.h>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>

#include "specmesh/actors/alspec_stage.hpp"
#include "specmesh/actors/dflash_stage.hpp"
#include "specmesh/actors/head.hpp"
#include "specmesh/runtime/keys.hpp"
#include "specmesh/transport/dispatcher.hpp"

namespace specmesh {

std::shared_ptr<const Model> ModelCache::get(const ModelSpec& spec) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& m = models_[spec.path + "|" + spec.tokenizer];
  if (!m && std::filesystem::is_directory(spec.path))
    throw std::invalid_argument(spec.path + ": a directory, not a model file (a DFlash drafter's directory is the draft "
                                "of strategy dflash only)");
  if (!m) m = Model::load(spec.path, spec.tokenizer);
  return m;
}

std::shared_ptr<const DFlashDrafter> ModelCache::drafter(const ModelSpec& spec) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& d = drafters_[spec.path];
  if (!d) d = DFlashDrafter::load(spec.path);
  return d;
}

std::shared_ptr<const DFlashDrafter> role_drafter(const Topology& topo, ModelCache& models, const std::string& role) {
  const StrategyInfo* s = topo.run.strategy.empty() ? nullptr : find_strategy(topo.run.strategy);
  if (!s || s->drafter_role != role) return nullptr;
  return models.drafter(topo.models.at(topo.role_models().at(role)));
}

std::shared_ptr<const Model> role_model(const Topology& topo, ModelCache& models, const std::string& role) {
  const auto roles = topo.role_models();
  if (role_drafter(topo, models, role)) return models.get(topo.models.at(roles.at(kTargetRole)));
  return models.get(topo.models.at(roles.at(role)));
}

namespace {

// With block drafting, every stage of the target's pipeline taps the drafter's layers and sends
// them to the drafter's node (a stage keeps the taps inside its own layer range).
void tap_for_drafter(const Topology& topo, ModelCache& models, StageConfig& sc) {
  const StrategyInfo* s = topo.run.strategy.empty() ? nullptr : find_strategy(topo.run.strategy);
  if (!s || s->drafter_role.empty() || sc.pipeline != kTargetRole) return;
  const auto drafter = role_drafter(topo, models, s->drafter_role);
  const auto stages = topo.stages_of(s->drafter_role);
  if (!drafter || stages.empty()) return;
  sc.tap_layers = drafter->config().target_layer_ids;
  sc.tap_node = topo.node_of_device(stages[0]->device).name;
  sc.tap_dtype = s->resolve(topo.run.params).integer("taps") == 16 ? WireDType::f16 : WireDType::f32;
}

}  // namespace

std::vector<std::string> pipeline_nodes(const Topology& topo, const std::string& role) {
  std::vector<std::string> out;
  for (const StageSpec* s : topo.stages_of(role)) out.push_back(topo.node_of_device(s->device).name);
  return out;
}

void resolve_layers(Topology& topo, ModelCache& models) {
  for (const auto& [role, model] : topo.role_models()) {
    int n_layer = 0;
    try {
      const auto drafter = role_drafter(topo, models, role);
      n_layer = drafter ? drafter->config().n_layer : models.get(topo.models.at(model))->hparams().n_layer;
    } catch (const std::exception& e) {
      topo.fail(Topology::role_key(role), e.what());
    }
    topo.resolve_layers(role, n_layer);
  }
}

int64_t max_frame_bytes(const Topology& topo, ModelCache& models) {
  int64_t widest = 0;
  for (const auto& [role, model] : topo.role_models()) {
    const HParams& hp = role_model(topo, models, role)->hparams();
    widest = std::max<int64_t>(widest, std::max(hp.n_embd, hp.n_vocab));
  }
  const int64_t bound = (int64_t{1} << 20) + 4 * kMaxRunRows * widest * int64_t(sizeof(float));
  return std::min<int64_t>(bound, int64_t{1} << 31);
}

NodeHost::NodeHost(caf::actor_system& sys, const Topology& topo, const std::string& node, ModelCache& models,
                   int max_sessions, std::shared_ptr<HeadCounters> counters)
    : name_(node) {
  const NodeSpec& self = topo.nodes.at(node);
  GatewayConfig gc;
  gc.node = node;
  gc.bind = self.endpoint;
  for (const auto& [n, spec] : topo.nodes)
    if (n != node) gc.peers[n] = spec.endpoint;
  gc.max_message_bytes = max_frame_bytes(topo, models);
  gc.allow_non_loopback = topo.security.allow_remote;
  gc.curve = node_curve(topo, node);  // every tcp:// link runs CURVE
  gateway_ = std::make_unique<Gateway>(gc);
  router_ = std::make_shared<Router>(node, gateway_.get(), topo.link);

  for (const auto& [dn, d] : topo.devices) {
    if (d.node != node) continue;
    auto dev = std::make_shared<Device>(dn, d.threads, d.profile);
    devices_[dn] = dev;
  }
  std::map<std::string, caf::actor>& device_actors = device_actors_;
  for (const auto& [dn, dev] : devices_) {
    device_actors[dn] = spawn_device_actor(sys, dev);
    actors_.push_back(device_actors[dn]);
  }

  // With attention-level speculation the target's stage and its partner's are the two groups
  // of a pair (group 0 and 1), built as pair stages.
  const StrategyInfo* strat = topo.run.strategy.empty() ? nullptr : find_strategy(topo.run.strategy);
  const std::string pair_role = strat ? strat->pair_role : "";
  auto pair_group = [&](const std::string& role) {
    return pair_role.empty() ? -1 : role == kTargetRole ? 0 : role == pair_role ? 1 : -1;
  };
  if (!pair_role.empty()) {
    const auto target = topo.stages_of(kTargetRole), partner = topo.stages_of(pair_role);
    if (target.size() != 1 || partner.size() != 1)
      throw ConfigError(topo.path + ": strategy \"" + strat->name + "\" runs roles \"" + kTargetRole + "\" and \"" +
                        pair_role + "\" as one stage each (they have " + std::to_string(target.size()) + " and " +
                        std::to_string(partner.size()) + ")");
    const auto roles = topo.role_models();
    const ModelSpec &tm = topo.models.at(roles.at(kTargetRole)), &pm = topo.models.at(roles.at(pair_role));
    if (tm.path != pm.path || tm.tokenizer != pm.tokenizer)
      throw ConfigError(topo.path + ": role \"" + pair_role + "\" must run the target's model (" + tm.path + "), not " +
                        pm.path);
    if (target[0]->device == partner[0]->device)
      throw ConfigError(topo.path + ": roles \"" + kTargetRole + "\" and \"" + pair_role +
                        "\" speculate on each other's attention and need devices of their own (both use \"" +
                        target[0]->device + "\")");
    // A device shared through a tensor-parallel stage is refused with the file (Topology).
  }

  // Block drafting: the drafter's role is one DFlash stage, fed by the target's stages' taps.
  const std::string drafter_role = strat ? strat->drafter_role : "";
  const auto drafter = drafter_role.empty() ? nullptr : role_drafter(topo, models, drafter_role);
  if (drafter) {
    const size_t n = topo.stages_of(drafter_role).size();
    if (n != 1)
      throw ConfigError(topo.path + ": strategy \"" + strat->name + "\" runs its drafter (role \"" + drafter_role +
                        "\") as one stage (it has " + std::to_string(n) + ")");
  }

  std::vector<Route> routes;
  for (const auto& [role, model] : topo.role_models()) {
    auto stages = topo.stages_of(role);
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageSpec& s = *stages[i];
      if (topo.devices.at(s.device).node != node) continue;
      StageConfig sc;
      sc.pipeline = role;
      sc.self_node = node;
      sc.head_node = topo.head_node;
      sc.next_node = i + 1 < stages.size() ? topo.node_of_device(stages[i + 1]->device).name : topo.head_node;
      sc.model = role_model(topo, models, role);
      sc.context.n_ctx = topo.run.n_ctx;
      sc.context.kv_type = parse_kv_type(topo.run.kv_type);
      sc.context.layer_begin = s.layer_begin;
      sc.context.layer_end = s.layer_end;
      sc.device = device_actors.at(s.device);
      sc.device_state = devices_.at(s.device);
      sc.router = router_;
      tap_for_drafter(topo, models, sc);
      for (const std::string& d : s.tensor_parallel) {
        sc.tp_devices.push_back(device_actors.at(d));
        sc.tp_device_states.push_back(devices_.at(d));
      }
      auto stats = std::make_shared<StageStats>();
      caf::actor a;
      try {
        if (drafter && role == drafter_role) {
          DFlashStageConfig dc{sc, drafter, kTargetRole};
          dc.window = strat->param("window") ? size_t(strat->resolve(topo.run.params).integer("window")) : 0;
          a = spawn_dflash_stage(sys, dc, stats);
        } else if (const int group = pair_group(role); group >= 0) {
          AlspecStageConfig pc;
          pc.stage = sc;
          pc.self = group;
          pc.run_pipeline = kTargetRole;
          pc.peer_pipeline = group == 0 ? pair_role : kTargetRole;
          pc.peer_node = topo.node_of_device(topo.stages_of(pc.peer_pipeline)[0]->device).name;
          pc.settings = strat->pair_settings(strat->resolve(topo.run.params));
          a = spawn_alspec_stage(sys, pc, stats);
        } else {
          a = spawn_stage(sys, sc, stats);
        }
      } catch (const std::invalid_argument& e) {
        // What the stage cannot be built with is the file's error (a group too large to split).
        if (s.tensor_parallel.empty()) throw;
        throw ConfigError(topo.path + (s.line > 0 ? ":" + std::to_string(s.line) : "") + ": stages: " + e.what());
      }
      actors_.push_back(a);
      // Work reaches a stage from the one before it; the first stage's from the head, or for
      // the pair's partner from the target's group, which forwards it.
      Route r{role, s.layer_begin, a, i == 0 ? topo.head_node : topo.node_of_device(stages[i - 1]->device).name, "", "", {}};
      if (const int group = pair_group(role); group >= 0) {
        const std::string peer_role = group == 0 ? pair_role : kTargetRole;
        const std::string peer = topo.node_of_device(topo.stages_of(peer_role)[0]->device).name;
        r.sync_peer = peer;
        if (group == 1) r.upstream = peer;
      }
      if (drafter && role == drafter_role) {
        // The target's stages, and the standbys that may take one over, send the taps.
        r.taps_of = kTargetRole;
        r.tap_senders = pipeline_nodes(topo, kTargetRole);
        for (const auto& [dn, d] : topo.devices)
          if (d.standby) r.tap_senders.push_back(d.node);
      }
      routes.push_back(std::move(r));
      stage_info_.push_back({role, s.layer_begin, s.layer_end, s.device, stats});
      local_stages_.push_back({role, s.layer_begin, s.layer_end, a, s.device});
    }
  }
  // Hidden states for a stage here go through the dispatcher; otherwise they are the head's.
  const bool takes_taps = std::any_of(routes.begin(), routes.end(), [](const Route& r) { return !r.taps_of.empty(); });
  if (node == topo.head_node) {
    HeadConfig hc = head_config(topo, models, router_);
    hc.max_sessions = std::max(1, max_sessions);
    hc.session_ctx = hc.target().price.n_ctx / hc.max_sessions;
    if (counters) hc.counters = std::move(counters);
    head_ = spawn_head(sys, std::move(hc));
    actors_.push_back(head_);
    // The head's handlers are short (sample, launch the next run): running them on the
    // gateway thread saves a thread wake-up per token.
    if (takes_taps) gateway_->subscribe({MsgType::logits, MsgType::error}, head_, Delivery::inline_io);
    else gateway_->subscribe({MsgType::logits, MsgType::error, MsgType::hidden_states}, head_, Delivery::inline_io);
  }
  const caf::actor manager = spawn_manager(sys, topo, models);
  dispatcher_ = spawn_dispatcher(sys, node, topo.head_node, routes, head_, manager, dispatch_stats_);
  actors_.push_back(manager);
  actors_.push_back(dispatcher_);
  router_->set_local(dispatcher_);
  // One call: work held from before keeps its order across types (a run never overtakes the
  // cache operation sent before it).
  std::vector<MsgType> work{MsgType::run_start, MsgType::activations, MsgType::kv_cache_op,
                            MsgType::cancel,    MsgType::attention_sync, MsgType::replan};
  if (takes_taps) work.push_back(MsgType::hidden_states);
  gateway_->subscribe(work, dispatcher_, Delivery::inline_io);  // it only forwards
}

// The node's side of a failover: starts the moved stage when its device is here, retargets
// the local stage upstream of it, lets the local stage downstream of it take work from its new
// node, and answers the head. Messages to the dispatcher and stages are sent before the answer,
// so they are in those actors' mailboxes before any run the head starts after it.
caf::actor NodeHost::spawn_manager(caf::actor_system& sys, const Topology& topo, ModelCache& models) {
  return sys.spawn([this, &sys, topo, &models](caf::event_based_actor*) -> caf::behavior {
    return {
        [this, &sys, topo, &models](const std::string&, const Envelope& env) {
          const auto* r = std::get_if<Replan>(&env.payload);
          if (!r) return;
          try {
            const bool here = device_actors_.count(r->device) != 0;
            const bool have = std::any_of(local_stages_.begin(), local_stages_.end(), [&](const LocalStage& l) {
              return l.pipeline == r->pipeline && l.layer_begin == r->layer_begin && l.device == r->device;
            });
            if (here && !have) {
              const auto roles = topo.role_models();
              auto role = roles.find(r->pipeline);
              if (role == roles.end()) throw std::invalid_argument("no pipeline '" + r->pipeline + "'");
              StageConfig sc;
              sc.pipeline = r->pipeline;
              sc.self_node = name_;
              sc.head_node = topo.head_node;
              sc.next_node = r->next_node;
              if (role_drafter(topo, models, r->pipeline))
                throw std::invalid_argument("a drafter's stage does not move (its draft cache is not rebuilt)");
              sc.model = models.get(topo.models.at(role->second));
              sc.context.n_ctx = topo.run.n_ctx;
              sc.context.kv_type = parse_kv_type(topo.run.kv_type);
              sc.context.layer_begin = r->layer_begin;
              sc.context.layer_end = r->layer_end;
              sc.device = device_actors_.at(r->device);
              sc.device_state = devices_.at(r->device);
              sc.router = router_;
              tap_for_drafter(topo, models, sc);
              // A tensor-parallel stage moves to one device: its output is the same bits.
              caf::actor a = spawn_stage(sys, sc, std::make_shared<StageStats>());
              {
                std::lock_guard<std::mutex> lk(actors_mu_);
                actors_.push_back(a);
              }
              local_stages_.push_back({r->pipeline, r->layer_begin, r->layer_end, a, r->device});
              caf::anon_send(dispatcher_, route_atom::value, Route{r->pipeline, r->layer_begin, a, r->upstream, "", "", {}});
              spdlog::info("node {}: took over stage {}[{},{}) on device {}", name_, r->pipeline, r->layer_begin,
                           r->layer_end, r->device);
            }
            for (const LocalStage& l : local_stages_)
              if (l.pipeline == r->pipeline && l.layer_end == r->layer_begin)
                caf::anon_send(l.actor, retarget_atom::value, r->node);
            caf::anon_send(dispatcher_, upstream_atom::value, r->pipeline, int(r->layer_end), r->node);
            Replan done = *r;
            done.done = true;
            router_->send(topo.head_node, make_envelope(0, std::move(done)));
          } catch (const std::exception& e) {
            spdlog::error("node {}: cannot take over stage {}[{},{}): {}", name_, r->pipeline, r->layer_begin,
                          r->layer_end, e.what());
            router_->send(topo.head_node, make_envelope(0, Error{ErrorCode::internal, name_,
                                                                 "failover: cannot start stage " + r->pipeline +
                                                                     " on device " + r->device + ": " + e.what()}));
          }
        },
    };
  });
}

HeadConfig head_config(const Topology& topo, ModelCache& models, std::shared_ptr<Router> router) {
  const RunSpec& run = topo.run;
  HeadConfig hc;
  hc.strategy = &strategy(run.strategy);
  try {
    std::map<std::string, ParamValue> given = run.params;
    // A drafter's block size is the default of the strategy's `block`.
    if (!hc.strategy->drafter_role.empty() && hc.strategy->resolve(given).integer("block") == 0)
      given["block"] = ParamValue(double(role_drafter(topo, models, hc.strategy->drafter_role)->block_size()));
    hc.params = hc.strategy->resolve(given);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(topo.path + ": run.params: " + e.what());
  }
  // Checked again now that the context size is known (the model's own when n_ctx is 0).
  if (hc.strategy->check) {
    SetupFacts facts{context_size(*models.get(topo.models.at(run.model)), run.n_ctx), {}};
    facts.roles = topo.roles();
    try {
      hc.strategy->check(hc.params, facts);
    } catch (const ParamConflict& c) {
      throw ConfigError(topo.path + ": run.params." + c.key + ": " + c.what());
    }
  }
  for (const auto& [role, model] : topo.role_models()) {
    PipelineRef p;
    p.role = role;
    p.model_name = model;
    p.model = role_model(topo, models, role);
    p.nodes = pipeline_nodes(topo, role);
    p.first_node = p.nodes.front();
    p.price.link = topo.link;
    p.price.n_ctx = context_size(*p.model, run.n_ctx);
    // A drafter is priced as as many of the target's layers (deadlines only need a bound).
    const int n_layer = p.model->hparams().n_layer;
    for (const StageSpec* s : topo.stages_of(role)) {
      const DeviceSpec& d = topo.devices.at(s->device);
      p.price.stages.push_back({p.model, std::min(s->layer_begin, n_layer - 1), std::min(s->layer_end, n_layer), d.profile, d.threads});
    }
    hc.pipelines[role] = std::move(p);
  }
  hc.n_batch = int(kMaxRunRows);
  hc.head_node = topo.head_node;
  for (const auto& [n, spec] : topo.nodes) hc.nodes.push_back(n);
  for (const auto& [role, model] : topo.role_models())
    for (const StageSpec* s : topo.stages_of(role))
      hc.placement.push_back({role, s->layer_begin, s->layer_end, s->device, topo.devices.at(s->device).node});
  for (const auto& [dn, d] : topo.devices)
    if (d.standby) hc.standbys.push_back({dn, d.node, d.profile, d.threads});
  hc.router = std::move(router);
  hc.sampling = {run.temperature, run.top_k, run.top_p, run.min_p, run.seed};
  hc.n_predict = run.n_predict;
  hc.metrics_csv = run.metrics_csv;
  return hc;
}

NodeHost::~NodeHost() {
  std::lock_guard<std::mutex> lk(actors_mu_);
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
