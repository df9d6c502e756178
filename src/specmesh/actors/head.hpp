// The head: tokenises prompts, launches runs into the target pipeline, samples the logits
// that come back, keeps the FIFO of runs in flight and streams accepted tokens to clients.
#pragma once

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>

#include "specmesh/transport/router.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/speculation/metrics.hpp"

namespace caf {
class actor_system;
}

namespace specmesh {

struct GenerationRequest {
  std::string prompt;
  int n_predict = 0;                     // 0: the topology's default
  std::optional<SamplerParams> sampling; // default: the topology's
  bool ignore_eos = false;
};

struct GenerationResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> ids;  // accepted tokens, also when generation failed part-way
  std::string text;
  GenerateStats stats;
  SpecMetrics metrics;       // timing and speculation counters of this generation
  std::string error;         // empty on success
  bool ok() const { return error.empty(); }
};

// Called with each accepted token and its text; returning false stops generation.
using StreamCallback = std::function<bool(int32_t id, const std::string& piece)>;

// One client request as the head works on it.
struct Session {
  GenerationRequest request;
  StreamCallback on_token;
  std::promise<GenerationResult> done;
  std::atomic<bool> cancel{false};
  bool record_metrics = true;  // false for the runtime's own warm-up run
};
using SessionPtr = std::shared_ptr<Session>;
using generate_atom = caf::atom_constant<caf::atom("generate")>;

// A model's pipeline as the head sees it.
struct PipelineRef {
  std::string name;                     // model name in the topology
  std::shared_ptr<const Model> model;
  std::string first_node;               // node of the first stage
  std::vector<std::string> nodes;       // every node with a stage of it (cancels go to all)
};

// Strategy parameters (topology [run.params] / CLI), PipeInfer's meanings where they exist.
struct SpecParams {
  int n_draft = 4;          // standard: draft tokens per verification
  int max_micro_batch = 4;  // pipeinfer: draft tokens per speculative run (1-4)
  int max_runs = 4;         // pipeinfer: target runs in flight
  float p_accept = 0.5f;    // draft confidence cutoff
  float p_recovery = 0.05f; // added to the cutoff per speculative run in a burst
  float p_decay = 0.05f;    // subtracted when speculation yields nothing
  bool cancel = true;       // pipeinfer: early cancellation of invalid/superfluous runs
};

struct HeadConfig {
  std::string strategy = "ar";  // ar | spec | pipeinfer
  PipelineRef target;
  PipelineRef draft;            // spec / pipeinfer
  std::shared_ptr<Router> router;
  SamplerParams sampling;
  SpecParams spec;
  int n_predict = 128;
  int n_batch = 256;
  std::string metrics_csv;      // append a row per generation when set
};

// Messages: (generate_atom, SessionPtr) from clients; (from, Envelope) from the gateway
// carrying Logits or Error.
caf::actor spawn_head(caf::actor_system& sys, HeadConfig cfg);

}  // namespace specmesh

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(specmesh::SessionPtr)
