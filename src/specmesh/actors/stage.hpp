// A pipeline stage: a layer range of one model on one device, with its share of the KV cache.
// It turns run starts (first stage) or activations into device jobs, in arrival order, and
// sends the result on: activations to the next stage, logits to the head, and when asked the
// hidden states after chosen layers to whichever node consumes them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/atom.hpp>

#include "specmesh/actors/admission.hpp"
#include "specmesh/actors/cancel_set.hpp"
#include "specmesh/log/rate_limited.hpp"
#include "specmesh/transport/router.hpp"
#include "specmesh/model/context.hpp"

namespace caf {
class actor_system;
class event_based_actor;
}

namespace specmesh {

struct StageConfig {
  std::string pipeline;             // the model this stage belongs to
  std::string self_node;            // node hosting this stage
  std::string next_node;            // node of the next stage, or the head node after the last
  std::string head_node;            // where logits and errors go
  std::shared_ptr<const Model> model;
  ContextParams context;            // layer range and KV size (capture_layers comes from tap_layers)
  // Hidden-state taps: absolute layer indices. After a forward pass that computed one of
  // them, this stage sends one HiddenStates per such layer (ascending, every batch row) to
  // tap_node before it sends the run's activations or logits on. Taps of layers outside this
  // stage's range belong to the stage that computes them, so every stage of a pipeline can be
  // given the same list. Empty: nothing is captured or sent.
  std::vector<int> tap_layers;
  std::string tap_node;
  WireDType tap_dtype = WireDType::f32;  // f32 (exact) or f16 (half the bytes, rounded)
  // Runs (run starts, activations, cache operations) one peer may have queued or running on
  // this stage; more are refused at once, each with an Error to the head (see admission.hpp
  // for the default and why).
  int max_runs_per_sender = kDefaultMaxRunsPerSender;
  caf::actor device;                // device actor that runs the jobs
  std::shared_ptr<class Device> device_state;
  // A tensor-parallel stage: the devices of ranks 1.. on this node (rank 0 is `device`), each
  // with its share of every layer (tp_ranks.hpp). Rank 0 sends the stage's output.
  std::vector<caf::actor> tp_devices;
  std::vector<std::shared_ptr<class Device>> tp_device_states;
  std::shared_ptr<Router> router;
};

// Counters a stage keeps (read by tests and metrics).
struct StageStats {
  std::atomic<uint64_t> runs{0};
  std::atomic<uint64_t> layers_computed{0};
  std::atomic<uint64_t> runs_cancelled{0};
  std::atomic<uint64_t> runs_refused{0};  // refused on arrival (too many in flight, or not computable)
};

using retarget_atom = caf::atom_constant<caf::atom("retarget")>;

// The stage actor takes (const std::string& from, const Envelope&) messages carrying
// RunStart, Activations, KvCacheOp or Cancel, and (retarget_atom, node): send the output of
// the runs scheduled from now on to `node` (failover moved the next stage there). What it
// cannot take (admission.hpp) it refuses on arrival with an Error to the head; it never queues
// a job or claims a cache cell for it. Throws std::invalid_argument for taps of layers the
// model does not have, taps without a tap_node, a tap_dtype other than f32 or f16, or
// max_runs_per_sender below 1.
caf::actor spawn_stage(caf::actor_system& sys, StageConfig cfg, std::shared_ptr<StageStats> stats);

// Applies cache operations in order (llama.cpp sequence semantics; a shift re-rotates the keys
// of the context's layers; the view kinds of protocol.hpp set KV views on the context); throws
// std::invalid_argument for a sequence id out of range or a view that cannot be built.
void apply_kv_ops(Context& ctx, const std::vector<KvOp>& ops);

// Runs a batch through a stage's context the way every stage kind does: with a timing
// profile each layer takes its modelled share of the time, a cancel of `run` is honoured
// between layers (ForwardCancelled), and the layers computed are counted in `stats`.
ForwardOutput paced_forward(Context& ctx, const StageConfig& cfg, const CancelSet& cancelled, StageStats& stats,
                            uint64_t run, const Batch& batch, const float* hidden_in = nullptr);

// Logs a run's failure and tells the head (Error, invalid_request). The log line goes through
// stage_log() (at most one line per second per stage and kind), the Error always.
void report_error(const StageConfig& cfg, uint64_t run, const std::string& what);
// The same for a run refused on arrival; counted in `stats`.
void report_refusal(const StageConfig& cfg, StageStats& stats, uint64_t run, const std::string& what);

// The log stages write repeated complaints to, one per process.
RateLimitedLog& stage_log();
// After a burst of complaints (a flood): a stage actor that handled a message while lines were
// held back calls schedule_settle; a second later on_settle reports the held-back lines, gives
// the heap memory freed since back to the system (glibc keeps it otherwise), and schedules
// itself again while lines remain held back.
using settle_atom = caf::atom_constant<caf::atom("settle")>;
void schedule_settle(caf::event_based_actor* self, bool& scheduled);
void on_settle(caf::event_based_actor* self, bool& scheduled);

// Conversions between the wire batch and the model's batch.
Batch to_batch(const RunStart& r);
RunStart to_run_start(const std::string& pipeline, const Batch& b, bool speculative);

}  // namespace specmesh
