#include "specmesh/actors/head.hpp"

#include <deque>
#include <stdexcept>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>

#include "specmesh/actors/head_host.hpp"

namespace specmesh {

namespace {

struct HeadState {
  HeadConfig cfg;
  std::deque<SessionPtr> queue;
  std::unique_ptr<HeadHost> host;
  std::unique_ptr<Strategy> strategy;
  uint64_t next_run = 1;
};

std::string stopped_answering(const std::string& node) {
  return "node '" + node + "' stopped answering (process gone or frozen)";
}

// A node of some pipeline that does not answer now, or empty.
std::string node_down(const HeadConfig& cfg) {
  for (const auto& [role, p] : cfg.pipelines)
    for (const std::string& n : p.nodes)
      if (!cfg.router->reachable(n)) return n;
  return {};
}

// Starts queued sessions one at a time, and clears away the one that ended.
void settle(HeadState& st) {
  for (;;) {
    if (st.host && st.host->done()) {
      if (st.strategy) st.strategy->abandon();  // none when the session failed before it had one
      st.strategy.reset();
      st.host.reset();
    }
    if (st.host || st.queue.empty()) return;
    SessionPtr s = std::move(st.queue.front());
    st.queue.pop_front();
    try {
      st.host = std::make_unique<HeadHost>(st.cfg, s, st.next_run);
      // Its runs would wait in queues for a node that is gone or frozen: refuse now.
      if (const std::string down = node_down(st.cfg); !down.empty())
        throw std::runtime_error(stopped_answering(down) + "; request not started");
      st.strategy = st.cfg.strategy->make(*st.host);
      // Every request starts from clean caches; the removal travels ahead of the first run. A
      // pair's partner gets it from the target's group, in order with the runs.
      for (const auto& [role, p] : st.cfg.pipelines)
        if (role != st.cfg.strategy->pair_role) st.host->kv_ops(role, {{KvOpKind::remove, -1, -1, -1, -1}});
      st.strategy->start();
    } catch (const std::exception& e) {
      if (st.host) {
        st.host->finish(e.what());
      } else {
        GenerationResult r;
        r.error = e.what();
        s->done.set_value(std::move(r));
      }
    }
  }
}

void on_error(HeadState& st, const Error& e) {
  bool ours = false;
  for (const auto& [role, p] : st.cfg.pipelines)
    ours = ours || std::find(p.nodes.begin(), p.nodes.end(), e.peer) != p.nodes.end();
  if (e.code != ErrorCode::peer_down) st.host->finish("node '" + e.peer + "': " + e.message);
  else if (ours) st.host->finish(stopped_answering(e.peer) + "; generation aborted");
}

}  // namespace

caf::actor spawn_head(caf::actor_system& sys, HeadConfig cfg) {
  return sys.spawn([cfg = std::move(cfg)](caf::stateful_actor<HeadState>* self) -> caf::behavior {
    self->state.cfg = cfg;
    return {
        [self](generate_atom, const SessionPtr& s) {
          self->state.queue.push_back(s);
          settle(self->state);
        },
        [self](const std::string& from, const Envelope& env) {
          auto& st = self->state;
          if (!st.host) return;
          try {
            if (const auto* l = std::get_if<Logits>(&env.payload)) st.strategy->on_logits(env.run_id, *l);
            else if (const auto* h = std::get_if<HiddenStates>(&env.payload)) st.strategy->on_hidden_states(env.run_id, *h);
            else if (const auto* a = std::get_if<AttentionSync>(&env.payload)) st.strategy->on_attention_report(env.run_id, *a);
            else if (const auto* e = std::get_if<Error>(&env.payload)) on_error(st, *e);
          } catch (const std::exception& ex) {
            st.host->finish(ex.what());
          }
          settle(st);
        },
    };
  });
}

}  // namespace specmesh
