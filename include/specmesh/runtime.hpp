// The embedding API: load a topology, submit prompts, receive tokens, cancel.
//
//   auto rt = specmesh::Runtime::open("topology.toml");
//   auto result = rt->generate({.prompt = "Once upon a time", .n_predict = 64},
//                              [](int32_t id, const std::string& piece) {
//                                std::cout << piece << std::flush;
//                                return true;  // false stops generation
//                              });
//   if (!result.ok()) std::cerr << result.error << "\n";
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "specmesh/generation.hpp"
#include "specmesh/topology.hpp"

namespace specmesh {

struct RuntimeOptions {
  // Start the topology's out-of-process nodes as child processes of this one (running
  // `specmesh node`); otherwise they must already be running.
  bool spawn_nodes = false;
  std::string specmesh_binary;  // for spawn_nodes; default: this executable
  std::chrono::milliseconds connect_timeout{10000};
  // At least 0: move the endpoints of the nodes that are not inproc:// so runs of one file can
  // share a host (tcp ports port_base, port_base + 2, ... in node-name order; ipc paths get
  // "-pBASE"); 0 picks a base whose endpoints are free. Started nodes get the same base.
  int port_base = -1;
  // Let tcp:// nodes bind addresses other than loopback, as [security] allow_remote does
  // (needs keys); passed on to started nodes.
  bool allow_remote = false;
  // Sessions the head runs at once. The target's KV cells are split evenly between them, as
  // llama.cpp's server splits n_ctx between its slots: each session's context is
  // context_size() / max_sessions cells (session_context()). Decode steps of `ar` sessions that
  // are ready together share one target run; other strategies interleave their runs.
  int max_sessions = 1;
  // Requests waiting for a session beyond those running; a request past this bound fails at
  // once with ErrorKind::busy. 0: none wait.
  int max_queued = 64;
};

// A runtime's state for health checks. Runtime's constructor returns once every node
// answered, so a server reports `loading` itself until it has the Runtime.
enum class Health {
  loading,   // starting: nodes connecting, models loading
  ready,     // every node of every pipeline answers
  degraded,  // a node of a pipeline does not answer (requests fail with ErrorKind::unavailable
             // unless a standby took its stages over)
};
inline const char* to_string(Health h) {
  return h == Health::loading ? "loading" : h == Health::ready ? "ready" : "degraded";
}

struct RuntimeStatus {
  Health health = Health::ready;
  std::vector<std::string> nodes_down;  // nodes of the topology that do not answer now
  int sessions_running = 0;             // generations the head works on
  int sessions_queued = 0;              // admitted generations waiting for a session
};

class Tokenizer;  // specmesh/tokenizer/tokenizer.hpp, for in-tree tools

// A generation in progress.
class Generation {
 public:
  struct State;
  explicit Generation(std::shared_ptr<State> state);
  ~Generation();
  // Blocks until the generation ends; call once.
  GenerationResult wait();
  // Stops after the token being computed and drops the session's runs still in the pipeline;
  // the result keeps what was accepted (FinishReason::cancelled). A queued generation ends
  // without starting.
  void cancel();

 private:
  std::shared_ptr<State> state_;
};

class Runtime {
 public:
  // Starts the topology (a file's, or one built in code: TOML is only one way to fill it).
  explicit Runtime(Topology topology, RuntimeOptions options = {});
  static std::unique_ptr<Runtime> open(const std::string& topology_path, RuntimeOptions options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Starts a generation; on_token runs on a runtime thread for every accepted token (the head's,
  // which every session shares: a callback that blocks holds all of them up). Never
  // throws for a bad request: the result carries the error and its ErrorKind (invalid_request
  // for an unknown strategy, a strategy whose roles the topology lacks, or a parameter outside
  // its schema; busy past RuntimeOptions::max_queued; context_full for a prompt longer than
  // session_context()).
  // on_done, when given, runs once with the result when the generation ends (on a runtime
  // thread, or on this one for a request refused at once), before wait() returns; like
  // on_token, it must not block.
  std::unique_ptr<Generation> submit(GenerationRequest request, StreamCallback on_token = {}, DoneCallback on_done = {});
  // Blocking form of submit().
  GenerationResult generate(GenerationRequest request, StreamCallback on_token = {});

  // Work done by the stages hosted in this process (for metrics and tests).
  struct StageCounters {
    std::string node, pipeline;
    int layer_begin = 0, layer_end = 0;
    uint64_t runs = 0, layers_computed = 0, runs_cancelled = 0;
  };
  std::vector<StageCounters> stage_counters() const;

  const Topology& topology() const;
  // KV cells of the target's context, shared by the sessions.
  int context_size() const;
  // KV cells one session may hold: context_size() / max_sessions.
  int session_context() const;
  // Tokens the context of a session of this request holds: session_context(), less the cells
  // its strategy's speculation may hold beyond one per token (token trees, parallel branches,
  // TriForce's middle level). Prompt and reply together must fit in this many (or the context
  // shifts, GenerationRequest::context_shift). Throws std::invalid_argument for a request
  // submit() would refuse as invalid_request, with the same message.
  int session_context(const GenerationRequest& request) const;
  // Whether every node answers, and how many sessions run and wait.
  RuntimeStatus status() const;
  Health health() const { return status().health; }
  const RuntimeOptions& options() const;
  const Tokenizer& tokenizer() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The level of the runtime's log on stderr: "trace", "debug", "info", "warn" (the default for
// tools), "error", "critical" or "off".
void set_log_level(const std::string& level);

}  // namespace specmesh
