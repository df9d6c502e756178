#include "specmesh/actors/head.hpp"

#include <deque>
#include <set>
#include <stdexcept>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/actors/failover.hpp"
#include "specmesh/log/rate_limited.hpp"
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
  RateLimitedLog refusals;  // a peer decides how often these lines would be written
  // A failover waiting for the nodes' answers; sessions wait with it.
  struct PendingFailover {
    FailoverPlan plan;
    uint64_t epoch = 0;
    std::set<std::string> awaiting;  // "node|pipeline|layer_begin"
    std::chrono::steady_clock::time_point began, deadline;
  };
  std::optional<PendingFailover> failover;
  uint64_t epochs = 0;
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

// Starts the session's strategy from clean caches (the removal travels ahead of the first
// run; a pair's partner gets it from the target's group, in order with the runs). The strategy
// starts from the prompt plus whatever was accepted before, which after a failover is more
// than the prompt.
void start_strategy(HeadState& st) {
  st.strategy = st.cfg.strategy->make(*st.host);
  for (const auto& [role, p] : st.cfg.pipelines)
    if (role != st.cfg.strategy->pair_role) st.host->kv_ops(role, {{KvOpKind::remove, -1, -1, -1, -1}});
  st.strategy->start();
}

// Starts queued sessions one at a time, and clears away the one that ended.
void settle(HeadState& st) {
  for (;;) {
    if (st.host && st.host->done()) {
      if (st.strategy) st.strategy->abandon();  // none when the session failed before it had one
      st.strategy.reset();
      st.host.reset();
    }
    if (st.host || st.queue.empty() || st.failover) return;
    SessionPtr s = std::move(st.queue.front());
    st.queue.pop_front();
    try {
      st.host = std::make_unique<HeadHost>(st.cfg, s, st.run_ids);
      // Its runs would wait in queues for a node that is gone or frozen: refuse now.
      if (const std::string down = node_down(st.cfg); !down.empty())
        throw std::runtime_error(stopped_answering(down) + "; request not started");
      start_strategy(st);
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

std::string replan_key(const std::string& node, const Replan& r) {
  return node + "|" + r.pipeline + "|" + std::to_string(r.layer_begin);
}

// A pipeline node stopped answering: its stages move to a standby when one is alive (the
// session pauses and goes on once every node has answered the replan), else the session ends
// with the tokens accepted so far.
void on_peer_down(HeadState& st, const std::string& node) {
  if (st.failover && st.failover->plan.down == node) return;
  bool ours = false;
  for (const Placement& p : st.cfg.placement) ours = ours || p.node == node;
  if (!ours) return;
  std::optional<FailoverPlan> plan;
  if (!st.failover)
    plan = plan_failover(st.cfg, node, [&](const std::string& n) { return st.cfg.router->reachable(n); }, ++st.epochs);
  if (!plan) {
    if (st.host) st.host->finish(stopped_answering(node) + "; generation aborted");
    return;
  }
  spdlog::warn("head: node '{}' stopped answering; its stages move to standby device '{}' on node '{}'", node,
               plan->standby.device, plan->standby.node);
  if (st.strategy) st.strategy->abandon();
  st.strategy.reset();
  if (st.host) st.host->deadlines().clear();
  HeadState::PendingFailover f;
  f.epoch = st.epochs;
  f.began = std::chrono::steady_clock::now();
  f.deadline = f.began + st.cfg.failover_timeout;
  for (const std::string& n : plan->notify)
    for (const Replan& r : plan->replans) {
      f.awaiting.insert(replan_key(n, r));
      st.cfg.router->send(n, make_envelope(0, r));
    }
  f.plan = std::move(*plan);
  st.failover = std::move(f);
}

// A node applied a replan; once all have, the session goes on from its accepted tokens.
void on_replanned(HeadState& st, const std::string& from, const Replan& r) {
  if (!r.done || !st.failover || r.epoch != st.failover->epoch) return;
  st.failover->awaiting.erase(replan_key(from, r));
  if (!st.failover->awaiting.empty()) return;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - st.failover->began).count();
  spdlog::info("head: stages of node '{}' now run on device '{}' of node '{}' ({:.0f} ms)", st.failover->plan.down,
               st.failover->plan.standby.device, st.failover->plan.standby.node, ms);
  const std::string down = st.failover->plan.down;
  st.failover.reset();
  if (!st.host || st.host->done()) return;
  ++st.host->metrics().failovers;
  try {
    start_strategy(st);
  } catch (const std::exception& e) {
    st.host->finish("after moving the stages of node '" + down + "': " + e.what());
  }
}

// A stage's error about one of this session's runs (or about no run: a cache operation) ends
// the session. An error about a run the session is not waiting for (a refused forged run, a
// run of a session already over) is none of its business.
void on_error(HeadState& st, uint64_t run, const Error& e) {
  if (run != 0 && !st.host->deadlines().awaits(run)) {
    spdlog::debug("head: error from node '{}' about run {}, which is not ours: {}", e.peer, run, e.message);
    return;
  }
  st.host->finish("node '" + e.peer + "': " + e.message);
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
  else if (const auto* e = std::get_if<Error>(&env.payload); e && (e->code == ErrorCode::peer_down ||
                                                                   e->code == ErrorCode::messages_lost))
    // Raised by this node's own gateway about that peer (session 0: never on the wire, where
    // the sending gateway stamps its session); a peer cannot report another one lost.
    ok = env.session == 0 && e->peer == from;
  else if (std::holds_alternative<HiddenStates>(env.payload) || std::holds_alternative<Error>(env.payload))
    ok = in_pipelines(st.cfg, from);
  else if (std::holds_alternative<Replan>(env.payload))
    ok = std::find(st.cfg.nodes.begin(), st.cfg.nodes.end(), from) != st.cfg.nodes.end();
  if (ok) return true;
  ++st.refused;
  st.refusals.log("refused", spdlog::level::warn,
                  fmt::format("head: refused {} of run {} from node '{}', which may not send it ({} refused so far)",
                              to_string(env.type()), env.run_id, from, st.refused));
  return false;
}

// Ends the session when one of its runs is past its deadline; keeps checking while one runs.
void check_deadlines(HeadState& st) {
  if (st.failover && std::chrono::steady_clock::now() > st.failover->deadline) {
    const std::string what = stopped_answering(st.failover->plan.down) + "; moving its stages to node '" +
                             st.failover->plan.standby.node + "' did not finish within " +
                             std::to_string(st.cfg.failover_timeout.count()) + " ms";
    st.failover.reset();
    if (st.host) st.host->finish(what);
  }
  if (!st.host || st.host->done() || !st.strategy) return;
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

// A message from a node that may send it.
void handle(HeadState& st, const std::string& from, const Envelope& env) {
  if (const auto* e = std::get_if<Error>(&env.payload); e && e->code == ErrorCode::peer_down)
    return on_peer_down(st, e->peer);
  if (const auto* r = std::get_if<Replan>(&env.payload)) return on_replanned(st, from, *r);
  if (!st.host || !st.strategy) return;  // between sessions, or paused by a failover
  try {
    if (const auto* l = std::get_if<Logits>(&env.payload)) {
      st.host->deadlines().settled(env.run_id);
      st.strategy->on_logits(env.run_id, *l);
    } else if (const auto* h = std::get_if<HiddenStates>(&env.payload)) {
      st.strategy->on_hidden_states(env.run_id, *h);
    } else if (const auto* a = std::get_if<AttentionSync>(&env.payload)) {
      st.strategy->on_attention_report(env.run_id, *a);
    } else if (const auto* e = std::get_if<Error>(&env.payload)) {
      on_error(st, env.run_id, *e);
    }
  } catch (const std::exception& ex) {
    st.host->finish(ex.what());
  }
}

// Schedules the next deadline check while a session runs.
void arm(caf::stateful_actor<HeadState>* self) {
  if (self->state.ticking || (!self->state.host && !self->state.failover)) return;
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
          if (allowed(self->state, from, env)) handle(self->state, from, env);
          settle(self->state);
          arm(self);
        },
    };
  });
}

}  // namespace specmesh
