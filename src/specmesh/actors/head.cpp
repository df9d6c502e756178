#include "specmesh/actors/head.hpp"

#include <algorithm>
#include <deque>
#include <set>
#include <stdexcept>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/actors/failover.hpp"
#include "specmesh/actors/head_host.hpp"
#include "specmesh/actors/run_merger.hpp"
#include "specmesh/log/rate_limited.hpp"

namespace specmesh {

namespace {

// A session the head works on.
struct Running {
  SessionPtr session;
  std::unique_ptr<HeadHost> host;
  std::unique_ptr<Strategy> strategy;  // none while a failover pauses the session
};

struct HeadState {
  HeadConfig cfg;
  std::deque<SessionPtr> queue;
  std::vector<std::unique_ptr<Running>> running;
  SeqSet seqs_used = 0;  // sequences of the running sessions
  RunIds run_ids;
  std::unique_ptr<RunMerger> merger;
  bool ticking = false;  // a deadline check is scheduled
  uint64_t refused = 0;  // messages from nodes that may not send them
  RateLimitedLog refusals;  // a peer decides how often these lines would be written
  // A failover under way; sessions wait with it. Without a plan it waits for a standby to
  // answer (one may be silent for a moment on a loaded host), with one for the nodes' answers.
  struct PendingFailover {
    std::string down;
    std::optional<FailoverPlan> plan;
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

// The lowest free range of `count` sequences, if one is free.
std::optional<SessionSeqs> free_seqs(SeqSet used, int count) {
  for (int base = 0; base + count <= kMaxSeqs; ++base) {
    const SessionSeqs s{base, count};
    if (!(used & s.mask())) return s;
  }
  return std::nullopt;
}

// Starts a session's strategy from clean caches (the removal travels ahead of the first run; a
// pair's partner gets it from the target's group, in order with the runs). The strategy
// starts from the prompt plus whatever was accepted before, which after a failover is more
// than the prompt.
void start_strategy(Running& r) {
  r.strategy = r.host->strategy_info().make(*r.host);
  r.host->set_strategy(r.strategy.get());
  r.host->clear_caches();
  r.strategy->start();
}

// Drops a session's strategy and whatever it has in flight.
void stop_strategy(HeadState& st, Running& r, bool cancel_runs) {
  if (r.strategy) r.strategy->abandon();
  if (cancel_runs) r.host->cancel_outstanding();
  r.host->set_strategy(nullptr);
  r.strategy.reset();
}

void finish_unstarted(const SessionPtr& s, std::string error, ErrorKind kind) {
  GenerationResult r;
  r.error = std::move(error);
  r.error_kind = r.error.empty() ? ErrorKind::none : kind;
  r.finish_reason = r.error.empty() ? FinishReason::cancelled : FinishReason::error;
  s->hand_over(std::move(r));
}

void publish(HeadState& st) {
  st.cfg.counters->running = int(st.running.size());
  st.cfg.counters->queued = int(st.queue.size());
}

// Clears away the sessions that ended and starts queued ones while there is room: a free
// session and a free range of the sequences its strategy needs (first come, first served).
void settle(HeadState& st) {
  for (auto it = st.running.begin(); it != st.running.end();) {
    Running& r = **it;
    if (!r.host->done()) {
      ++it;
      continue;
    }
    stop_strategy(st, r, true);
    try {
      if (!st.failover) r.host->clear_caches();  // its cells are free for the next session
    } catch (const std::exception& e) {
      spdlog::debug("head: caches of an ended session not cleared: {}", e.what());
    }
    st.seqs_used &= ~r.host->seqs().mask();
    it = st.running.erase(it);
  }
  while (!st.failover && !st.queue.empty() && int(st.running.size()) < st.cfg.max_sessions) {
    SessionPtr s = st.queue.front();
    const StrategyInfo& info = s->strategy ? *s->strategy : *st.cfg.strategy;
    const StrategyParams& params = s->strategy ? s->params : st.cfg.params;
    const auto seqs = free_seqs(st.seqs_used, info.sequences_for(params, st.cfg.roles()));
    if (!seqs) break;  // waits for a session to end
    st.queue.pop_front();
    auto r = std::make_unique<Running>();
    r->session = s;
    try {
      const bool merge = info.mergeable_runs && st.merger;
      r->host = std::make_unique<HeadHost>(st.cfg, s, st.run_ids, info, params, *seqs, merge ? st.merger.get() : nullptr);
    } catch (const std::exception& e) {
      finish_unstarted(s, e.what(), ErrorKind::invalid_request);
      continue;
    }
    HeadHost& h = *r->host;
    st.seqs_used |= seqs->mask();
    st.running.push_back(std::move(r));
    Running& run = *st.running.back();
    if (int(h.prompt().size()) > h.n_ctx()) {
      h.finish("the prompt has " + std::to_string(h.prompt().size()) + " tokens, more than the session's context of " +
                   std::to_string(h.n_ctx()) + " tokens",
               ErrorKind::context_full);
      continue;
    }
    try {
      // Its runs would wait in queues for a node that is gone or frozen: refuse now.
      if (const std::string down = node_down(st.cfg); !down.empty()) {
        h.finish(stopped_answering(down) + "; request not started", ErrorKind::unavailable);
        continue;
      }
      start_strategy(run);
    } catch (const ContextFull& e) {
      h.finish(e.what(), ErrorKind::context_full);
    } catch (const std::exception& e) {
      h.finish(e.what(), ErrorKind::internal);
    }
  }
  // Sessions that ended while starting are cleared on the next pass.
  if (std::any_of(st.running.begin(), st.running.end(), [](const auto& r) { return r->host->done(); })) return settle(st);
  if (st.merger) st.merger->flush();
  publish(st);
}

std::string replan_key(const std::string& node, const Replan& r) {
  return node + "|" + r.pipeline + "|" + std::to_string(r.layer_begin);
}

void finish_all(HeadState& st, const std::string& what, ErrorKind kind) {
  for (auto& r : st.running) r->host->finish(what, kind);
}

// Restarts every session from its accepted tokens once the pipelines can run again.
void resume_sessions(HeadState& st, const std::string& down) {
  st.failover.reset();
  for (auto& run : st.running) {
    if (run->host->done()) continue;
    try {
      start_strategy(*run);
    } catch (const std::exception& e) {
      run->host->finish("after node '" + down + "' stopped answering: " + e.what(), ErrorKind::internal);
    }
  }
}

// Plans the move of the lost node's stages onto a standby that answers now and sends the
// replans; false when no standby answers.
bool send_replans(HeadState& st) {
  HeadState::PendingFailover& f = *st.failover;
  auto plan =
      plan_failover(st.cfg, f.down, [&](const std::string& n) { return st.cfg.router->reachable(n); }, st.epochs + 1);
  if (!plan) return false;
  ++st.epochs;
  spdlog::warn("head: node '{}' stopped answering; its stages move to standby device '{}' on node '{}'", f.down,
               plan->standby.device, plan->standby.node);
  f.epoch = st.epochs;
  for (const std::string& n : plan->awaited)
    for (const Replan& r : plan->replans) f.awaiting.insert(replan_key(n, r));
  for (const std::string& n : plan->notify)
    for (const Replan& r : plan->replans) st.cfg.router->send(n, make_envelope(0, r));
  f.plan = std::move(plan);
  return true;
}

// A pipeline node stopped answering: its stages move to a standby (every session pauses and
// goes on once every node has answered the replan). A standby that is silent too is waited
// for until failover_timeout; without any standby every session ends with the tokens accepted
// so far. A node lost while another one's failover is under way is taken up when that ends.
void on_replans_answered(HeadState& st);

void on_peer_down(HeadState& st, const std::string& node) {
  if (st.failover) {
    // A node lost meanwhile answers no replan: the move goes on without its answer.
    if (!st.failover->plan || node == st.failover->down) return;
    std::erase_if(st.failover->awaiting, [&](const std::string& k) { return k.rfind(node + "|", 0) == 0; });
    return on_replans_answered(st);
  }
  bool ours = false;
  for (const Placement& p : st.cfg.placement) ours = ours || p.node == node;
  if (!ours) return;
  if (!can_fail_over(st.cfg, node))
    return finish_all(st, stopped_answering(node) + "; generation aborted", ErrorKind::unavailable);
  // The runs in flight are lost with the stages; the sessions restart from their tokens.
  for (auto& r : st.running) {
    stop_strategy(st, *r, false);
    r->host->deadlines().clear();
    r->host->cancel_outstanding();
  }
  if (st.merger) st.merger->clear();
  HeadState::PendingFailover f;
  f.down = node;
  f.began = std::chrono::steady_clock::now();
  f.deadline = f.began + st.cfg.failover_timeout;
  st.failover = std::move(f);
  if (!send_replans(st))
    spdlog::warn("head: node '{}' stopped answering and no standby answers now; waiting up to {} ms for one", node,
                 st.cfg.failover_timeout.count());
}

// While no standby answered: goes on where the lost node is back, moves its stages where a
// standby is.
void retry_failover(HeadState& st) {
  if (!st.failover || st.failover->plan) return;
  const std::string down = st.failover->down;
  if (st.cfg.router->reachable(down)) {
    spdlog::info("head: node '{}' answers again; the sessions go on", down);
    return resume_sessions(st, down);
  }
  send_replans(st);
}

// A node applied a replan.
void on_replanned(HeadState& st, const std::string& from, const Replan& r) {
  if (!r.done || !st.failover || !st.failover->plan || r.epoch != st.failover->epoch) return;
  st.failover->awaiting.erase(replan_key(from, r));
  on_replans_answered(st);
}

// Once every live node has applied the replans, every session goes on from its accepted
// tokens, or, when another pipeline node was lost meanwhile, that one's failover begins.
void on_replans_answered(HeadState& st) {
  if (!st.failover->awaiting.empty()) return;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - st.failover->began).count();
  const FailoverPlan& plan = *st.failover->plan;
  spdlog::info("head: stages of node '{}' now run on device '{}' of node '{}' ({:.0f} ms)", plan.down,
               plan.standby.device, plan.standby.node, ms);
  const std::string down = plan.down;
  for (auto& run : st.running)
    if (!run->host->done()) ++run->host->metrics().failovers;
  if (const std::string next = node_down(st.cfg); !next.empty()) {
    st.failover.reset();
    return on_peer_down(st, next);
  }
  resume_sessions(st, down);
}

Running* owner_of(HeadState& st, uint64_t run) {
  for (auto& r : st.running)
    if (r->host->launched(run)) return r.get();
  return nullptr;
}

Running* running_of(HeadState& st, const void* host) {
  for (auto& r : st.running)
    if (r->host.get() == host) return r.get();
  return nullptr;
}

ErrorKind kind_of(const Error& e) {
  return e.code == ErrorCode::peer_down || e.code == ErrorCode::messages_lost ? ErrorKind::unavailable
                                                                              : ErrorKind::internal;
}

// A stage's error about a run ends the sessions the run belongs to; an error about no run (a
// cache operation, which carries none) ends every session, as any of them may have sent it.
// An error about a run no session waits for (a refused forged run, a run of a session already
// over) is none of their business.
void on_error(HeadState& st, uint64_t run, const Error& e) {
  const std::string what = "node '" + e.peer + "': " + e.message;
  if (run == 0) return finish_all(st, what, kind_of(e));
  if (st.merger)
    for (const void* owner : st.merger->take(run))
      if (Running* r = running_of(st, owner)) r->host->finish(what, kind_of(e));
  if (Running* r = owner_of(st, run); r && r->host->deadlines().awaits(run)) return r->host->finish(what, kind_of(e));
  spdlog::debug("head: error from node '{}' about run {}, which is not ours: {}", e.peer, run, e.message);
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

// Ends a session when one of its runs is past its deadline; keeps checking while one runs.
void check_deadlines(HeadState& st) {
  retry_failover(st);
  if (st.failover && std::chrono::steady_clock::now() > st.failover->deadline) {
    const auto& f = *st.failover;
    const std::string within = " within " + std::to_string(st.cfg.failover_timeout.count()) + " ms";
    const std::string why = f.plan ? "; moving its stages to node '" + f.plan->standby.node + "' did not finish" + within
                                   : "; no standby answered" + within + "; generation aborted";
    const std::string what = stopped_answering(f.down) + why;
    st.failover.reset();
    finish_all(st, what, ErrorKind::unavailable);
  }
  for (auto& r : st.running) {
    if (r->host->done() || !r->strategy) continue;
    if (auto late = r->host->deadlines().overdue()) {
      const PipelineRef& p = st.cfg.pipelines.at(late->role);
      std::string nodes;
      for (const std::string& n : p.nodes) nodes += (nodes.empty() ? "" : ", ") + n;
      r->host->finish("run on pipeline '" + late->role + "' (nodes " + nodes + ") got no answer within " +
                          std::to_string(int64_t(late->budget_ms)) + " ms; generation aborted",
                      ErrorKind::unavailable);
    }
  }
}

// Hands a message about one of a session's runs to its strategy; a strategy's exception ends
// that session alone.
template <class F>
void deliver(Running& r, F&& f) {
  if (r.host->done() || !r.strategy) return;
  try {
    f(*r.strategy);
  } catch (const ContextFull& ex) {
    r.host->finish(ex.what(), ErrorKind::context_full);
  } catch (const std::exception& ex) {
    r.host->finish(ex.what(), ErrorKind::internal);
  }
}

// A message from a node that may send it.
void handle(HeadState& st, const std::string& from, const Envelope& env) {
  if (const auto* e = std::get_if<Error>(&env.payload); e && e->code == ErrorCode::peer_down)
    return on_peer_down(st, e->peer);
  if (const auto* r = std::get_if<Replan>(&env.payload)) return on_replanned(st, from, *r);
  if (st.failover) return;  // paused
  if (const auto* e = std::get_if<Error>(&env.payload)) return on_error(st, env.run_id, *e);
  const uint64_t run = env.run_id;
  if (const auto* l = std::get_if<Logits>(&env.payload)) {
    if (st.merger) {
      if (auto parts = st.merger->split(run, *l)) {
        ++st.cfg.counters->merged_runs;
        st.cfg.counters->merged_steps += parts->size();
        for (RunMerger::Delivery& d : *parts)
          if (Running* r = running_of(st, d.owner)) {
            r->host->deadlines().settled(d.part);
            r->host->logits_arrived(d.logits);
            deliver(*r, [&](Strategy& s) { s.on_logits(d.part, d.logits); });
          }
        return;
      }
    }
    if (Running* r = owner_of(st, run)) {
      r->host->deadlines().settled(run);
      r->host->answered(run);
      r->host->logits_arrived(*l);
      deliver(*r, [&](Strategy& s) { s.on_logits(run, *l); });
    }
    return;
  }
  Running* r = owner_of(st, run);
  if (!r) return;
  if (const auto* h = std::get_if<HiddenStates>(&env.payload))
    deliver(*r, [&](Strategy& s) { s.on_hidden_states(run, *h); });
  else if (const auto* a = std::get_if<AttentionSync>(&env.payload))
    deliver(*r, [&](Strategy& s) { s.on_attention_report(run, *a); });
}

// A client's cancel: a queued session ends without starting, a running one after the token
// being computed, its runs cancelled in the pipelines.
void on_cancel(HeadState& st, const SessionPtr& s) {
  s->cancel = true;
  auto q = std::find(st.queue.begin(), st.queue.end(), s);
  if (q != st.queue.end()) {
    st.queue.erase(q);
    return finish_unstarted(s, {}, ErrorKind::none);
  }
  for (auto& r : st.running)
    if (r->session == s) r->host->finish();
}

// Schedules the next deadline check while a session runs.
void arm(caf::stateful_actor<HeadState>* self) {
  if (self->state.ticking || (self->state.running.empty() && !self->state.failover)) return;
  self->state.ticking = true;
  self->delayed_send(self, kDeadlineCheck, deadline_atom::value);
}

}  // namespace

caf::actor spawn_head(caf::actor_system& sys, HeadConfig cfg) {
  if (cfg.max_sessions < 1) throw std::invalid_argument("max_sessions must be at least 1");
  if (cfg.session_ctx <= 0) cfg.session_ctx = cfg.target().price.n_ctx / cfg.max_sessions;
  return sys.spawn([cfg = std::move(cfg)](caf::stateful_actor<HeadState>* self) -> caf::behavior {
    auto& st = self->state;
    st.cfg = cfg;
    const PipelineRef& target = st.cfg.target();
    // One merged run per target stage keeps every stage of the pipeline busy.
    if (st.cfg.strategy->pair_role.empty())
      st.merger = std::make_unique<RunMerger>(target, st.cfg.router, st.run_ids, size_t(st.cfg.n_batch),
                                              std::max<size_t>(1, target.price.stages.size()));
    return {
        [self](generate_atom, const SessionPtr& s) {
          self->state.queue.push_back(s);
          settle(self->state);
          arm(self);
        },
        [self](cancel_atom, const SessionPtr& s) {
          on_cancel(self->state, s);
          settle(self->state);
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
