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

HeadHost::HeadHost(const HeadConfig& cfg, SessionPtr session, RunIds& ids, const StrategyInfo& strategy,
                   StrategyParams params, SessionSeqs seqs, RunMerger* merger)
    : cfg_(cfg),
      session_(session),
      strategy_(strategy),
      params_(std::move(params)),
      seqs_(seqs),
      merger_(merger),
      stream_(session, *cfg.target().model, cfg.n_predict, cfg.metrics_csv),
      sampler_(session->request.sampling.value_or(cfg.sampling)),
      ids_(ids),
      deadlines_(prices(cfg), cfg.run_deadline_floor, cfg.run_deadline_factor) {
  SpecMetrics& m = stream_.metrics();
  m.strategy = strategy.name;
  m.target = cfg.target().model_name;
  auto draft = cfg.pipelines.find("draft");
  if (draft != cfg.pipelines.end()) m.draft = draft->second.model_name;
  const int spare = strategy.spare_cells_for(params_, cfg.roles());
  n_ctx_ = cfg.session_ctx - spare;
  if (n_ctx_ < 2)
    throw std::invalid_argument("strategy \"" + strategy.name + "\" with these parameters may hold " + std::to_string(spare) +
                                " KV cells beyond one per token, which leaves no context in a session's share of " +
                                std::to_string(cfg.session_ctx) +
                                " cells: use fewer sessions, a larger context or less speculation (a smaller tree, fewer "
                                "branches or runs in flight)");
  stream_.set_context(n_ctx_);
}

const PipelineRef& HeadHost::pipeline(const std::string& role) const {
  auto it = cfg_.pipelines.find(role);
  if (it == cfg_.pipelines.end()) throw std::logic_error("strategy used role '" + role + "', which has no pipeline");
  return it->second;
}

bool HeadHost::has_role(const std::string& role) const { return cfg_.pipelines.count(role) > 0; }

SeqSet HeadHost::translate(SeqSet s) const {
  if (seqs_.whole()) return s;
  if (s >> seqs_.count)
    throw std::logic_error("strategy used a sequence beyond the " + std::to_string(seqs_.count) + " it has");
  return s << seqs_.base;
}

int HeadHost::translate(int seq) const {
  if (seq < 0 || seq >= seqs_.count)
    throw std::logic_error("strategy used sequence " + std::to_string(seq) + ", beyond the " +
                           std::to_string(seqs_.count) + " it has");
  return seq + seqs_.base;
}

// Operations on "every sequence" (remove -1, unview -1, keep) become operations on each of the
// session's sequences, a shift -1 one shift of its range (each cell moves once); the others
// move into its range.
std::vector<KvOp> HeadHost::translate(std::vector<KvOp> ops) const {
  if (seqs_.whole()) return ops;
  std::vector<KvOp> out;
  for (KvOp op : ops) {
    if (op.kind == KvOpKind::shift && op.seq < 0) {
      op.seq = seqs_.base;
      op.dst_seq = seqs_.base + seqs_.count - 1;
      out.push_back(op);
    } else if ((op.kind == KvOpKind::remove || op.kind == KvOpKind::unview) && op.seq < 0) {
      // Emptying every sequence (a new session) also drops their views, as it does unscoped.
      const bool emptied = op.kind == KvOpKind::remove && op.pos_begin < 0 && op.pos_end < 0;
      for (int s = 0; s < seqs_.count; ++s) {
        op.seq = seqs_.base + s;
        out.push_back(op);
        if (emptied) out.push_back({KvOpKind::unview, op.seq, -1, -1, -1});
      }
    } else if (op.kind == KvOpKind::keep) {
      const int kept = translate(op.seq);
      for (int s = seqs_.base; s < seqs_.base + seqs_.count; ++s)
        if (s != kept) out.push_back({KvOpKind::remove, s, -1, -1, -1});
    } else {
      op.seq = translate(op.seq);
      if (op.kind == KvOpKind::copy) op.dst_seq = translate(op.dst_seq);
      out.push_back(op);
    }
  }
  return out;
}

uint64_t HeadHost::launch(const std::string& role, const Batch& batch, bool speculative, const std::vector<TapRow>& inputs) {
  const PipelineRef& p = pipeline(role);
  if (deadlines_.outstanding() >= cfg_.max_runs_in_flight)
    throw std::runtime_error("the session has " + std::to_string(deadlines_.outstanding()) +
                             " runs in flight, the most one may have; generation aborted");
  for (int32_t pos : batch.pos)
    if (pos >= n_ctx_)
      throw ContextFull("the context of " + std::to_string(n_ctx_) + " tokens is full (strategy \"" +
                        strategy_.name + "\" needs position " + std::to_string(pos) + ")");
  Batch b = batch;
  for (SeqSet& s : b.seqs) s = translate(s);
  const uint64_t run = ids_.next();
  if (merger_ && role == kTargetRole && !speculative && !b.is_tree() && inputs.empty()) {
    merger_->add(this, run, std::move(b));
  } else {
    RunStart start = to_run_start(p.role, b, speculative);
    for (const TapRow& t : inputs) {
      start.inputs.push_back(t.run);
      start.input_rows.push_back(t.row);
    }
    if (!cfg_.router->send(p.first_node, make_envelope(run, std::move(start))))
      throw std::runtime_error("node '" + p.first_node + "' of pipeline '" + p.role + "' is not reachable");
    runs_.insert(run);
  }
  deadlines_.launched(run, role, int(batch.size()));
  if (role == kTargetRole) ++metrics().runs_launched;
  return run;
}

void HeadHost::send_kv_ops(const PipelineRef& p, std::vector<KvOp> ops) {
  // The session's runs still waiting to be merged go first: cache operations follow runs in order.
  if (merger_ && p.role == kTargetRole && merger_->has_pending(this)) merger_->send_pending(this);
  KvCacheOp k;
  k.pipeline = p.role;
  k.layer = 0;
  k.ops = std::move(ops);
  if (!cfg_.router->send(p.first_node, make_envelope(0, std::move(k))))
    throw std::runtime_error("node '" + p.first_node + "' of pipeline '" + p.role + "' is not reachable");
}

void HeadHost::kv_ops(const std::string& role, std::vector<KvOp> ops) { send_kv_ops(pipeline(role), translate(std::move(ops))); }

void HeadHost::clear_caches() {
  for (const auto& [role, p] : cfg_.pipelines)
    if (role != strategy_.pair_role) send_kv_ops(p, translate({{KvOpKind::remove, -1, -1, -1, -1}}));
}

void HeadHost::cancel(const std::string& role, const std::vector<uint64_t>& runs) {
  if (runs.empty()) return;
  const PipelineRef& p = pipeline(role);
  std::vector<uint64_t> own;
  for (uint64_t r : runs) {
    if (!(merger_ && role == kTargetRole && merger_->drop(this, r))) own.push_back(r);
    deadlines_.settled(r);
    runs_.erase(r);
  }
  if (!own.empty()) {
    std::vector<std::string> sent;
    for (const std::string& n : p.nodes) {
      if (std::find(sent.begin(), sent.end(), n) != sent.end()) continue;
      sent.push_back(n);
      cfg_.router->send(n, make_envelope(0, Cancel{own}));
    }
  }
  if (role == kTargetRole) metrics().runs_cancelled += runs.size();
}

void HeadHost::cancel_outstanding() {
  for (auto& [role, runs] : deadlines_.outstanding_by_role()) cancel(role, runs);
  if (merger_) merger_->drop_owner(this);
  runs_.clear();
}

bool HeadHost::accept(int32_t token) {
  if (!stream_.accept(token)) return false;
  // The next step needs a cell for every token so far: the prompt and all accepted but the
  // newest are cached, the newest goes in with the next run.
  if (int(tokens().size()) <= n_ctx_) return true;
  if (session_->request.context_shift && shift_context()) return true;
  const int n = int(tokens().size()) - 1;
  stream_.finish("the context of " + std::to_string(n_ctx_) + " tokens is full (" + std::to_string(n) +
                     " tokens cached)" +
                     (session_->request.context_shift
                          ? "; strategy \"" + strategy_.name + "\" cannot shift it"
                          : "; set context_shift (--context-shift) to drop older tokens and go on"),
                 ErrorKind::context_full);
  return false;
}

// llama.cpp's context shift: the first n_keep tokens stay, half of the others after them go,
// and the positions after the gap move down by its size in every cache of the session.
bool HeadHost::shift_context() {
  if (!strategy_instance_) return false;
  const std::vector<int32_t>& toks = tokens();
  const int cached = int(toks.size()) - 1;
  const GenerationRequest& req = session_->request;
  const int bos = cfg_.target().model->tokenizer().bos();
  int n_keep = req.n_keep < 0 ? int(prompt().size()) : req.n_keep + (!toks.empty() && toks[0] == bos && bos >= 0 ? 1 : 0);
  n_keep = std::clamp(n_keep, 0, cached);
  const int n_discard = (cached - n_keep) / 2;
  if (n_discard <= 0) return false;
  const std::vector<KvOp> ops = context_shift_ops(n_keep, n_discard);
  for (const auto& [role, p] : cfg_.pipelines)
    if (role != strategy_.pair_role) send_kv_ops(p, translate(ops));
  stream_.shift(n_keep, n_discard);
  return strategy_instance_->context_shifted(n_keep, n_discard);
}

}  // namespace specmesh
