#include "specmesh/actors/failover.hpp"

#include <algorithm>

namespace specmesh {

bool can_fail_over(const HeadConfig& cfg, const std::string& down) {
  // A pair's two groups hold each other's attention state: one cannot move alone.
  if (cfg.strategy && !cfg.strategy->pair_role.empty()) return false;
  return std::any_of(cfg.placement.begin(), cfg.placement.end(), [&](const Placement& p) { return p.node == down; }) &&
         std::any_of(cfg.standbys.begin(), cfg.standbys.end(), [&](const Standby& s) { return s.node != down; });
}

std::optional<FailoverPlan> plan_failover(HeadConfig& cfg, const std::string& down,
                                          const std::function<bool(const std::string&)>& alive, uint64_t epoch) {
  if (!can_fail_over(cfg, down)) return std::nullopt;
  auto sb = std::find_if(cfg.standbys.begin(), cfg.standbys.end(),
                         [&](const Standby& s) { return s.node != down && alive(s.node); });
  if (sb == cfg.standbys.end()) return std::nullopt;
  FailoverPlan plan;
  plan.down = down;
  plan.standby = *sb;
  cfg.standbys.erase(sb);

  std::vector<size_t> moved;
  for (size_t i = 0; i < cfg.placement.size(); ++i)
    if (cfg.placement[i].node == down) {
      cfg.placement[i].node = plan.standby.node;
      cfg.placement[i].device = plan.standby.device;
      moved.push_back(i);
    }
  for (auto& [role, p] : cfg.pipelines) {
    std::vector<const Placement*> stages;
    for (const Placement& s : cfg.placement)
      if (s.role == role) stages.push_back(&s);
    p.nodes.clear();
    for (size_t k = 0; k < stages.size(); ++k) {
      const Placement& s = *stages[k];
      p.nodes.push_back(s.node);
      if (s.device == plan.standby.device && k < p.price.stages.size()) {
        p.price.stages[k].profile = plan.standby.profile;
        p.price.stages[k].threads = plan.standby.threads;
      }
      if (std::find(moved.begin(), moved.end(), size_t(&s - cfg.placement.data())) == moved.end()) continue;
      Replan r;
      r.pipeline = role;
      r.layer_begin = s.layer_begin;
      r.layer_end = s.layer_end;
      r.device = plan.standby.device;
      r.node = plan.standby.node;
      r.upstream = k == 0 ? cfg.head_node : stages[k - 1]->node;
      r.next_node = k + 1 < stages.size() ? stages[k + 1]->node : cfg.head_node;
      r.epoch = epoch;
      plan.replans.push_back(std::move(r));
    }
    if (!p.nodes.empty()) p.first_node = p.nodes.front();
  }
  for (const std::string& n : cfg.nodes) {
    if (n == down) continue;
    plan.notify.push_back(n);
    if (alive(n)) plan.awaited.push_back(n);
  }
  return plan;
}

}  // namespace specmesh
