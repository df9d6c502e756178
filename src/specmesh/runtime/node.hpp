// One node of a topology hosted in this process: its gateway, its devices, the stages placed
// on them, a dispatcher that hands incoming envelopes to the right stage, and on the head
// node the head actor.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <caf/actor.hpp>

#include "specmesh/transport/dispatcher.hpp"
#include "specmesh/transport/gateway.hpp"
#include "specmesh/actors/head.hpp"
#include "specmesh/transport/router.hpp"
#include "specmesh/actors/stage.hpp"
#include "specmesh/devices/device.hpp"
#include "specmesh/model/dflash_drafter.hpp"
#include "specmesh/topology.hpp"

namespace caf {
class actor_system;
}

namespace specmesh {

// Models loaded once per process, shared by every node hosted in it (weights are mmapped).
class ModelCache {
 public:
  std::shared_ptr<const Model> get(const ModelSpec& spec);
  // A DFlash drafter directory (config.json + model.safetensors).
  std::shared_ptr<const DFlashDrafter> drafter(const ModelSpec& spec);

 private:
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<const Model>> models_;
  std::map<std::string, std::shared_ptr<const DFlashDrafter>> drafters_;
};

// The drafter of `role` when the run's strategy drafts on the target's hidden states
// (StrategyInfo::drafter_role) and `role` is that role; null otherwise.
std::shared_ptr<const DFlashDrafter> role_drafter(const Topology& topo, ModelCache& models, const std::string& role);
// The model whose vocabulary and hidden size a role's pipeline has: its own, or for a drafter
// role the target's (whose embedding and classifier the drafter borrows).
std::shared_ptr<const Model> role_model(const Topology& topo, ModelCache& models, const std::string& role);

class NodeHost {
 public:
  // On the head node the head runs up to max_sessions sessions at once, and `counters` (when
  // given) follows them.
  NodeHost(caf::actor_system& sys, const Topology& topo, const std::string& node, ModelCache& models,
           int max_sessions = 1, std::shared_ptr<HeadCounters> counters = nullptr);
  ~NodeHost();
  NodeHost(const NodeHost&) = delete;
  NodeHost& operator=(const NodeHost&) = delete;

  const std::string& name() const { return name_; }
  Gateway& gateway() { return *gateway_; }
  const std::shared_ptr<Router>& router() const { return router_; }
  caf::actor head() const { return head_; }  // only on the head node
  // Messages this node refused because their sender's role does not allow them.
  const DispatchStats& dispatch_stats() const { return *dispatch_stats_; }

  // Waits until every named peer has been heard from; false (and the first missing peer in
  // *missing) when the timeout passes first.
  bool wait_for_peers(const std::vector<std::string>& peers, std::chrono::milliseconds timeout, std::string* missing);

  struct StageInfo {
    std::string pipeline;
    int layer_begin, layer_end;
    std::string device;
    std::shared_ptr<StageStats> stats;
  };
  const std::vector<StageInfo>& stages() const { return stage_info_; }
  const std::map<std::string, std::shared_ptr<Device>>& devices() const { return devices_; }

 private:
  std::string name_;
  std::unique_ptr<Gateway> gateway_;
  std::shared_ptr<Router> router_;
  std::map<std::string, std::shared_ptr<Device>> devices_;
  caf::actor spawn_manager(caf::actor_system& sys, const Topology& topo, ModelCache& models);

  std::mutex actors_mu_;            // the manager adds stages while the node runs
  std::vector<caf::actor> actors_;  // everything spawned here, stopped in the destructor
  std::map<std::string, caf::actor> device_actors_;
  // Stages on this node (the manager's, once the constructor is done).
  struct LocalStage {
    std::string pipeline;
    int layer_begin, layer_end;
    caf::actor actor;
    std::string device;
  };
  std::vector<LocalStage> local_stages_;
  std::vector<StageInfo> stage_info_;
  caf::actor dispatcher_;
  std::shared_ptr<DispatchStats> dispatch_stats_ = std::make_shared<DispatchStats>();
  caf::actor head_;
};

// The largest frame a node of `topo` accepts: a run carries at most kMaxRunRows rows (the
// head's batch size), a frame at most one f32 row of the widest model dimension (hidden
// state or logits) per row; four times that plus 1 MiB leaves room without letting a peer
// make a node buffer gigabytes. Larger frames make ZeroMQ drop the sender's connection.
inline constexpr int64_t kMaxRunRows = 256;
int64_t max_frame_bytes(const Topology& topo, ModelCache& models);

// The head's configuration for a topology (strategy, pipelines, sampling, parameters).
HeadConfig head_config(const Topology& topo, ModelCache& models, std::shared_ptr<Router> router);

// The nodes whose stages run a role's pipeline, in pipeline order (a node may repeat).
std::vector<std::string> pipeline_nodes(const Topology& topo, const std::string& role);

// Resolves every role's stage layer ranges against its model (loaded through `models`).
void resolve_layers(Topology& topo, ModelCache& models);

}  // namespace specmesh
