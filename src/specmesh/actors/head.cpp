#include "specmesh/actors/head.hpp"

#include <deque>
#include <stdexcept>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/actors/head_host.hpp"

namespace specmesh {

namespace {

struct HeadState {
  HeadConfig cfg;
  std::deque<SessionPtr> queue;
  std::unique_ptr<HeadHost> host;
  std::unique_ptr<Strategy> strategy;
  RunIds run_ids;
  bool ticking = false;  // a deadline check is scheduled
  uint64_t refused = 0;  // messages from nodes that may not send them
  std::chrono::steady_clock::time_point refusal_logged{};
};

using deadline_atom = caf::atom_constant<caf::atom("deadline")>;
constexpr std::chrono::milliseconds kDeadlineCheck{100};

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
      st.host = std::make_unique<HeadHost>(st.cfg, s, st.run_ids);
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

bool in_pipelines(const HeadConfig& cfg, const std::string& node) {
  for (const auto& [role, p] : cfg.pipelines)
    if (std::find(p.nodes.begin(), p.nodes.end(), node) != p.nodes.end()) return true;
  return false;
}

// Whether `from` may send a run's result for `pipeline`: the node of its last stage, or for a
// pair either group's node (the pair decides per token which group answers).
bool ends_pipeline(const HeadConfig& cfg, const std::string& from, const std::string& pipeline) {
  auto ends = [&](const std::string& role) {
    auto it = cfg.pipelines.find(role);
    return it != cfg.pipelines.end() && !it->second.nodes.empty() && it->second.nodes.back() == from;
  };
  if (ends(pipeline)) return true;
  const std::string& pair = cfg.strategy ? cfg.strategy->pair_role : std::string();
  return !pair.empty() && (pipeline == kTargetRole || pipeline == pair) && (ends(kTargetRole) || ends(pair));
}

// A node of the topology sent something its role does not allow (a forged result, an error
// from a node outside the pipelines): it is dropped, and logged at most once a second.
bool allowed(HeadState& st, const std::string& from, const Envelope& env) {
  bool ok = true;
  if (const auto* l = std::get_if<Logits>(&env.payload)) ok = ends_pipeline(st.cfg, from, l->pipeline);
  else if (const auto* a = std::get_if<AttentionSync>(&env.payload)) ok = ends_pipeline(st.cfg, from, a->pipeline);
  else if (std::holds_alternative<HiddenStates>(env.payload) || std::holds_alternative<Error>(env.payload))
    ok = in_pipelines(st.cfg, from);
  if (ok) return true;
  ++st.refused;
  if (const auto now = std::chrono::steady_clock::now(); now - st.refusal_logged > std::chrono::seconds(1)) {
    st.refusal_logged = now;
    spdlog::warn("head: refused {} of run {} from node '{}', which may not send it ({} refused so far)",
                 to_string(env.type()), env.run_id, from, st.refused);
  }
  return false;
}

// Ends the session when one of its runs is past its deadline; keeps checking while one runs.
void check_deadlines(HeadState& st) {
  if (!st.host || st.host->done()) return;
  if (auto late = st.host->deadlines().overdue()) {
    const PipelineRef& p = st.cfg.pipelines.at(late->role);
    std::string nodes;
    for (const std::string& n : p.nodes) nodes += (nodes.empty() ? "" : ", ") + n;
    st.host->finish("run on pipeline '" + late->role + "' (nodes " + nodes + ") got no answer within " +
                    std::to_string(int64_t(late->budget_ms)) + " ms; generation aborted");
  }
}

}  // namespace

namespace {

// Schedules the next deadline check while a session runs.
void arm(caf::stateful_actor<HeadState>* self) {
  if (self->state.ticking || !self->state.host) return;
  self->state.ticking = true;
  self->delayed_send(self, kDeadlineCheck, deadline_atom::value);
}

}  // namespace

caf::actor spawn_head(caf::actor_system& sys, HeadConfig cfg) {
  return sys.spawn([cfg = std::move(cfg)](caf::stateful_actor<HeadState>* self) -> caf::behavior {
    self->state.cfg = cfg;
    return {
        [self](generate_atom, const SessionPtr& s) {
          self->state.queue.push_back(s);
          settle(self->state);
          arm(self);
        },
        [self](deadline_atom) {
          self->state.ticking = false;
          check_deadlines(self->state);
          settle(self->state);
          arm(self);
        },
        [self](const std::string& from, const Envelope& env) {
          auto& st = self->state;
          if (!st.host || !allowed(st, from, env)) return;
          try {
            if (const auto* l = std::get_if<Logits>(&env.payload)) {
              st.host->deadlines().settled(env.run_id);
              st.strategy->on_logits(env.run_id, *l);
            }
            else if (const auto* h = std::get_if<HiddenStates>(&env.payload)) st.strategy->on_hidden_states(env.run_id, *h);
            else if (const auto* a = std::get_if<AttentionSync>(&env.payload)) st.strategy->on_attention_report(env.run_id, *a);
            else if (const auto* e = std::get_if<Error>(&env.payload)) on_error(st, *e);
          } catch (const std::exception& ex) {
            st.host->finish(ex.what());
          }
          settle(st);
          arm(self);
        },
    };
  });
}

}  // namespace specmesh
