// The head's implementation of StrategyHost: runs and cache operations go to a role's
// pipeline through the router; tokens go to the session's TokenStream.
#pragma once

#include <memory>

#include "specmesh/actors/head.hpp"
#include "specmesh/actors/run_ids.hpp"
#include "specmesh/actors/token_stream.hpp"

namespace specmesh {

class HeadHost final : public StrategyHost {
 public:
  // Run ids come from `ids`, shared by all sessions of a head.
  HeadHost(const HeadConfig& cfg, SessionPtr session, RunIds& ids);

  uint64_t launch(const std::string& role, const Batch& batch, bool speculative) override;
  void kv_ops(const std::string& role, std::vector<KvOp> ops) override;
  void cancel(const std::string& role, const std::vector<uint64_t>& runs) override;
  bool accept(int32_t token) override { return stream_.accept(token); }
  void finish(std::string error = {}) override { stream_.finish(std::move(error)); }
  bool done() const override { return stream_.done(); }
  Sampler& sampler() override { return sampler_; }
  SpecMetrics& metrics() override { return stream_.metrics(); }
  const std::vector<int32_t>& prompt() const override { return stream_.prompt(); }
  const std::vector<int32_t>& tokens() const override { return stream_.tokens(); }
  bool has_role(const std::string& role) const override;
  int vocab() const override { return cfg_.target().model->hparams().n_vocab; }
  int n_batch() const override { return cfg_.n_batch; }
  const StrategyParams& params() const override { return cfg_.params; }

  const HeadConfig& cfg() const { return cfg_; }
  // Runs launched and not yet answered or cancelled, with their deadlines.
  RunDeadlines& deadlines() { return deadlines_; }

 private:
  const PipelineRef& pipeline(const std::string& role) const;

  const HeadConfig& cfg_;
  TokenStream stream_;
  Sampler sampler_;
  RunIds& ids_;
  RunDeadlines deadlines_;
};

}  // namespace specmesh
