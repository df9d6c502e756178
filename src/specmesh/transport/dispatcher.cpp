#include "specmesh/transport/dispatcher.hpp"

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <spdlog/spdlog.h>

namespace specmesh {

caf::actor spawn_dispatcher(caf::actor_system& sys, std::string node, std::vector<Route> routes, caf::actor head) {
  return sys.spawn([node = std::move(node), routes = std::move(routes), head](caf::event_based_actor*) -> caf::behavior {
    return {
        [node, routes, head](const std::string& from, const Envelope& env) {
          auto find = [&](const std::string& pipeline, int layer) -> const caf::actor* {
            for (const auto& r : routes)
              if (r.pipeline == pipeline && r.layer_begin == layer) return &r.stage;
            return nullptr;
          };
          const caf::actor* to = nullptr;
          if (const auto* r = std::get_if<RunStart>(&env.payload)) to = find(r->pipeline, 0);
          else if (const auto* a = std::get_if<Activations>(&env.payload)) to = find(a->pipeline, a->layer);
          else if (const auto* k = std::get_if<KvCacheOp>(&env.payload)) to = find(k->pipeline, k->layer);
          else if (const auto* s = std::get_if<AttentionSync>(&env.payload); s && s->kind != SyncKind::report)
            to = find(s->pipeline, 0);
          else if (std::holds_alternative<Cancel>(env.payload)) {
            for (const auto& r : routes) caf::anon_send<caf::message_priority::high>(r.stage, from, env);
            return;
          } else if (head) {
            to = &head;
          }
          if (to) caf::anon_send(*to, from, env);
          else spdlog::warn("node {}: no stage here for {} from {} (run {})", node, to_string(env.type()), from, env.run_id);
        },
    };
  });
}

}  // namespace specmesh
