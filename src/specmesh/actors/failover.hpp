// Failover: when a node with stages stops answering, its stages move onto a standby device
// and the generation goes on.
//
// The head plans the move (plan_failover, below): every stage of the lost node goes to the
// first standby whose node answers, and every live node is sent one Replan per moved stage.
// The standby's node starts the stage, the stage upstream of it retargets its output, the
// stage downstream of it takes work from the new node (protocol.hpp, Replan). Once every node
// has answered, the head wipes the caches of all pipelines and starts the strategy again from
// the prompt plus the tokens accepted so far: each stage's KV cache is rebuilt by that one
// prefill. Nothing accepted is lost and nothing is repeated, since strategies start from
// StrategyHost::tokens(). Wiping every stage, not only the new one, keeps the rule simple: a
// stage's cache always holds exactly the positions its pipeline has run.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "specmesh/actors/head.hpp"

namespace specmesh {

struct FailoverPlan {
  std::string down;                   // the node that stopped answering
  Standby standby;                    // where its stages go
  std::vector<Replan> replans;        // one per moved stage
  // Every node but `down` gets every replan; a node unreachable now gets them (queued by the
  // gateway) when it comes back, so it never keeps refusing the standby's work.
  std::vector<std::string> notify;
  std::vector<std::string> awaited;   // the live ones of `notify`: the sessions wait for their answers
};

// Whether plan_failover can move the stages of `down` once a standby answers: `down` has a
// stage, a standby lives on another node, and the strategy does not run a pair.
bool can_fail_over(const HeadConfig& cfg, const std::string& down);

// Moves every stage placed on `down` onto the first standby whose node is alive and not
// `down`, and updates cfg: placement, each pipeline's nodes, first node and price, and the
// standbys left. Nothing when `down` has no stage, no standby is alive, or the strategy runs a
// pair (attention-level speculation), whose groups cannot move apart.
std::optional<FailoverPlan> plan_failover(HeadConfig& cfg, const std::string& down,
                                          const std::function<bool(const std::string&)>& alive, uint64_t epoch);

}  // namespace specmesh
