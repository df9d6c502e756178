#include "specmesh/transport/dispatcher.hpp"

#include "specmesh/log/rate_limited.hpp"

#include <algorithm>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <spdlog/spdlog.h>

namespace specmesh {

namespace {

struct Dispatch {
  std::string node, head_node;
  std::vector<Route> routes;
  caf::actor head, manager;
  std::shared_ptr<DispatchStats> stats;
  RateLimitedLog log;  // a peer decides how often these lines would be written

  const Route* find(const std::string& pipeline, int layer) const {
    for (const auto& r : routes)
      if (r.pipeline == pipeline && r.layer_begin == layer) return &r;
    return nullptr;
  }

  void refuse(const std::string& from, const Envelope& env, const char* why) {
    const uint64_t n = ++stats->refused;
    log.log("refused", spdlog::level::warn,
            fmt::format("node {}: refused {} of run {} from '{}': {} ({} refused so far)", node, to_string(env.type()),
                        env.run_id, from, why, n));
  }

  void unrouted(const std::string& from, const Envelope& env) {
    const uint64_t n = ++stats->unrouted;
    log.log("unrouted", spdlog::level::warn,
            fmt::format("node {}: no stage here for {} from {} (run {}; {} so far)", node, to_string(env.type()), from,
                        env.run_id, n));
  }

  // Work for one stage: delivered only when `from` may send it.
  void work(const Route* r, const std::string& from, const Envelope& env, bool sync) {
    if (!r) return unrouted(from, env);
    if (from != (sync ? r->sync_peer : r->upstream))
      return refuse(from, env, sync ? "only the other group of the pair sends attention syncs"
                                    : "only the node upstream of the stage sends it work");
    caf::anon_send(r->stage, from, env);
  }

  void operator()(const std::string& from, const Envelope& env) {
    if (const auto* s = std::get_if<RunStart>(&env.payload)) return work(find(s->pipeline, 0), from, env, false);
    if (const auto* a = std::get_if<Activations>(&env.payload)) return work(find(a->pipeline, a->layer), from, env, false);
    if (const auto* k = std::get_if<KvCacheOp>(&env.payload)) return work(find(k->pipeline, k->layer), from, env, false);
    if (const auto* y = std::get_if<AttentionSync>(&env.payload); y && y->kind != SyncKind::report)
      return work(find(y->pipeline, 0), from, env, true);
    if (const auto* p = std::get_if<Replan>(&env.payload)) {
      if (p->done) {
        if (head) return caf::anon_send(head, from, env);
        return unrouted(from, env);
      }
      if (from != head_node) return refuse(from, env, "only the head moves stages");
      if (manager) return caf::anon_send(manager, from, env);
      return unrouted(from, env);
    }
    if (const auto* h = std::get_if<HiddenStates>(&env.payload))
      for (const auto& r : routes)
        if (!r.taps_of.empty() && r.taps_of == h->pipeline) {
          if (std::find(r.tap_senders.begin(), r.tap_senders.end(), from) == r.tap_senders.end())
            return refuse(from, env, "only the nodes of the tapped pipeline send its hidden states");
          return caf::anon_send(r.stage, from, env);
        }
    if (std::holds_alternative<Cancel>(env.payload)) {
      bool any = false;
      for (const auto& r : routes)
        if (from == head_node || (!r.sync_peer.empty() && from == r.upstream)) {
          caf::anon_send<caf::message_priority::high>(r.stage, from, env);
          any = true;
        }
      if (!any && !routes.empty()) refuse(from, env, "only the head cancels runs");
      return;
    }
    if (head) return caf::anon_send(head, from, env);
    unrouted(from, env);
  }
};

}  // namespace

caf::actor spawn_dispatcher(caf::actor_system& sys, std::string node, std::string head_node, std::vector<Route> routes,
                            caf::actor head, caf::actor manager, std::shared_ptr<DispatchStats> stats) {
  auto d = std::make_shared<Dispatch>();
  d->node = std::move(node);
  d->head_node = std::move(head_node);
  d->routes = std::move(routes);
  d->head = std::move(head);
  d->manager = std::move(manager);
  d->stats = stats ? std::move(stats) : std::make_shared<DispatchStats>();
  return sys.spawn([d](caf::event_based_actor*) -> caf::behavior {
    return {
        [d](const std::string& from, const Envelope& env) { (*d)(from, env); },
        [d](route_atom, const Route& r) {
          for (Route& old : d->routes)
            if (old.pipeline == r.pipeline && old.layer_begin == r.layer_begin) {
              old = r;
              return;
            }
          d->routes.push_back(r);
        },
        [d](upstream_atom, const std::string& pipeline, int layer_begin, const std::string& node) {
          for (Route& r : d->routes)
            if (r.pipeline == pipeline && r.layer_begin == layer_begin) r.upstream = node;
        },
    };
  });
}

}  // namespace specmesh
