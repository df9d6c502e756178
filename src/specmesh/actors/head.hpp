// The head: takes client requests, runs each through its strategy over the pipelines of its
// roles, and streams accepted tokens back. It is the single owner of the session state;
// gateway threads and clients only post messages to it.
//
// Several sessions run at once (HeadConfig::max_sessions), each with its own strategy
// instance, sampler, token stream, run deadlines and range of KV sequences (head_host.hpp).
// Decode steps of mergeable strategies (ar) that are ready together share one target run
// (run_merger.hpp); the other strategies' runs interleave in the pipelines. Requests beyond
// the running ones wait in a FIFO queue (the runtime bounds it). KV cells: each session may
// hold session_ctx of the target's cells (its context; the runtime makes it n_ctx /
// max_sessions, as llama.cpp's server splits its context between slots), so sessions that
// keep to their context never run another out of cells.
//
// Faults: a stage's error about a run ends the sessions that run belongs to; a run past its
// deadline ends its session. A node that stops answering ends every running session with
// ErrorKind::unavailable, unless a standby takes its stages over: then every session pauses,
// drops its runs in flight and restarts its strategy from its accepted tokens once the stages
// have moved (each session's tokens stay exactly what they would have been).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>

#include "specmesh/generation.hpp"
#include "specmesh/actors/run_deadlines.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/transport/router.hpp"

namespace caf {
class actor_system;
}

namespace specmesh {

// One client request as the head works on it.
struct Session {
  GenerationRequest request;
  StreamCallback on_token;
  std::promise<GenerationResult> done;
  std::atomic<bool> cancel{false};
  bool record_metrics = true;  // false for the runtime's own warm-up run
  // The strategy and its checked parameters (the runtime resolves the request's); null: the
  // head's configured one.
  const StrategyInfo* strategy = nullptr;
  StrategyParams params;
  std::function<void()> on_finished;  // the runtime's, called first when the result is handed over
  DoneCallback on_done;               // the client's (Runtime::submit), called next
  // Hands the result over: on_finished, on_done, then `done`.
  void hand_over(GenerationResult result) {
    if (on_finished) on_finished();
    if (on_done) on_done(result);
    done.set_value(std::move(result));
  }
};
using SessionPtr = std::shared_ptr<Session>;
// (generate_atom, SessionPtr): start or queue a session. (cancel_atom, SessionPtr): end it now
// (queued: without starting), cancelling its runs in the pipelines.
using generate_atom = caf::atom_constant<caf::atom("generate")>;
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;

// Sessions running and waiting, for status queries from other threads.
struct HeadCounters {
  std::atomic<int> running{0};
  std::atomic<int> queued{0};
  std::atomic<uint64_t> merged_runs{0};   // target runs that carried merged decode steps
  std::atomic<uint64_t> merged_steps{0};  // decode steps they carried
};

// A role's pipeline as the head sees it.
struct PipelineRef {
  std::string role;                     // the pipeline's name on the wire
  std::string model_name;               // model entry in the configuration
  std::shared_ptr<const Model> model;
  std::string first_node;               // node of the first stage
  std::vector<std::string> nodes;       // every node with a stage of it (cancels go to all)
  PipelinePrice price;                  // what a run costs on it, for run deadlines
};

// Where a stage of a pipeline runs (HeadConfig::placement lists every stage, each role's in
// pipeline order), and a standby device that can take stages over (see actors/failover.hpp).
struct Placement {
  std::string role;
  int layer_begin = 0, layer_end = 0;
  std::string device, node;
};
struct Standby {
  std::string device, node;
  std::optional<DeviceProfile> profile;
  int threads = 1;
};

struct HeadConfig {
  const StrategyInfo* strategy = nullptr;
  StrategyParams params;
  std::map<std::string, PipelineRef> pipelines;  // by role; "target" always
  std::set<std::string> roles() const {
    std::set<std::string> out;
    for (const auto& [role, p] : pipelines) out.insert(role);
    return out;
  }
  std::shared_ptr<Router> router;
  SamplingParams sampling;
  int n_predict = 128;
  int n_batch = 256;
  int max_sessions = 1;   // sessions running at once
  int session_ctx = 0;    // KV cells one session may hold (its context)
  std::shared_ptr<HeadCounters> counters = std::make_shared<HeadCounters>();
  std::string metrics_csv;      // append a row per generation when set
  std::string head_node;
  std::vector<std::string> nodes;       // every node of the topology
  std::vector<Placement> placement;
  std::vector<Standby> standbys;        // not yet used
  std::chrono::milliseconds failover_timeout{5000};  // replan answered and pipeline restarted
  // Runs one session may have launched and not yet seen answered or cancelled: far above
  // what any strategy keeps in flight (pipeinfer: about 30), so reaching it is a bug that
  // ends the session instead of flooding the stages.
  std::size_t max_runs_in_flight = 512;
  // How long a run may take before it is called lost (see actors/run_deadlines.hpp).
  std::chrono::milliseconds run_deadline_floor{2000};
  double run_deadline_factor = 4;

  const PipelineRef& target() const { return pipelines.at(kTargetRole); }
};

// Messages: (generate_atom, SessionPtr) from clients; (from, Envelope) from the gateway
// carrying Logits, HiddenStates, AttentionSync reports or Error.
//
// Who may say what: logits and attention reports only from the node that ends their
// pipeline (for a pair, either of its groups), hidden states and errors only from nodes of
// the pipelines; anything else is dropped and logged. Run ids are random (actors/run_ids.hpp)
// and every run has a deadline; a run past it ends the generation with the tokens so far.
caf::actor spawn_head(caf::actor_system& sys, HeadConfig cfg);

}  // namespace specmesh

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(specmesh::SessionPtr)
