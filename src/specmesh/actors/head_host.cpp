#include "specmesh/actors/head_host.hpp"

#include <algorithm>
#include <stdexcept>

#include "specmesh/actors/stage.hpp"

namespace specmesh {

namespace {

std::map<std::string, PipelinePrice> prices(const HeadConfig& cfg) {
  std::map<std::string, PipelinePrice> out;
  for (const auto& [role, p] : cfg.pipelines) out[role] = p.price;
  return out;
}

}  // namespace

HeadHost::HeadHost(const HeadConfig& cfg, SessionPtr session, RunIds& ids)
    : cfg_(cfg),
      stream_(session, *cfg.target().model, cfg.n_predict, cfg.metrics_csv),
      sampler_(session->request.sampling.value_or(cfg.sampling)),
      ids_(ids),
      deadlines_(prices(cfg), cfg.run_deadline_floor, cfg.run_deadline_factor) {
  SpecMetrics& m = stream_.metrics();
  m.strategy = cfg.strategy->name;
  m.target = cfg.target().model_name;
  auto draft = cfg.pipelines.find("draft");
  if (draft != cfg.pipelines.end()) m.draft = draft->second.model_name;
}

const PipelineRef& HeadHost::pipeline(const std::string& role) const {
  auto it = cfg_.pipelines.find(role);
  if (it == cfg_.pipelines.end()) throw std::logic_error("strategy used role '" + role + "', which has no pipeline");
  return it->second;
}

bool HeadHost::has_role(const std::string& role) const { return cfg_.pipelines.count(role) > 0; }

uint64_t HeadHost::launch(const std::string& role, const Batch& batch, bool speculative) {
  const PipelineRef& p = pipeline(role);
  if (deadlines_.outstanding() >= cfg_.max_runs_in_flight)
    throw std::runtime_error("the session has " + std::to_string(deadlines_.outstanding()) +
                             " runs in flight, the most one may have; generation aborted");
  const uint64_t run = ids_.next();
  if (!cfg_.router->send(p.first_node, make_envelope(run, to_run_start(p.role, batch, speculative))))
    throw std::runtime_error("node '" + p.first_node + "' of pipeline '" + p.role + "' is not reachable");
  deadlines_.launched(run, role, int(batch.size()));
  if (role == kTargetRole) ++metrics().runs_launched;
  return run;
}

void HeadHost::kv_ops(const std::string& role, std::vector<KvOp> ops) {
  const PipelineRef& p = pipeline(role);
  KvCacheOp k;
  k.pipeline = p.role;
  k.layer = 0;
  k.ops = std::move(ops);
  if (!cfg_.router->send(p.first_node, make_envelope(0, std::move(k))))
    throw std::runtime_error("node '" + p.first_node + "' of pipeline '" + p.role + "' is not reachable");
}

void HeadHost::cancel(const std::string& role, const std::vector<uint64_t>& runs) {
  if (runs.empty()) return;
  const PipelineRef& p = pipeline(role);
  std::vector<std::string> sent;
  for (const std::string& n : p.nodes) {
    if (std::find(sent.begin(), sent.end(), n) != sent.end()) continue;
    sent.push_back(n);
    cfg_.router->send(n, make_envelope(0, Cancel{runs}));
  }
  for (uint64_t r : runs) deadlines_.settled(r);
  if (role == kTargetRole) metrics().runs_cancelled += runs.size();
}

}  // namespace specmesh
