#include "fake_host.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include "specmesh/speculation/registry.hpp"

namespace specmesh::test {

std::vector<float> peaked(int n_vocab, int32_t token, float confidence) {
  // softmax gives exp(a) / (exp(a) + n_vocab - 1) to the peak when the others are 0.
  std::vector<float> l(size_t(n_vocab), 0.0f);
  const double c = std::clamp(double(confidence), 1e-6, 1 - 1e-9);
  l[size_t(token)] = float(std::log(c * (n_vocab - 1) / (1 - c)));
  return l;
}

Oracle greedy_oracle(int n_vocab, NextToken next, float confidence) {
  return [=](const std::vector<int32_t>& seen) { return peaked(n_vocab, next(seen), confidence); };
}

NextToken history_hash(int n_vocab, int32_t avoid) {
  return [=](const std::vector<int32_t>& seen) {
    uint64_t h = 1469598103934665603ull;
    for (int32_t t : seen) h = (h ^ uint64_t(t + 1)) * 1099511628211ull;
    const int32_t n = avoid >= 0 ? n_vocab - 1 : n_vocab;
    const int32_t t = int32_t((h >> 17) % uint64_t(n));
    return avoid >= 0 && t >= avoid ? t + 1 : t;
  };
}

NextToken disagree_at(NextToken target, std::vector<int32_t> positions, int n_vocab) {
  return [=](const std::vector<int32_t>& seen) {
    const int32_t t = target(seen);
    const bool off = std::find(positions.begin(), positions.end(), int32_t(seen.size())) != positions.end();
    return off ? (t + 1) % n_vocab : t;
  };
}

std::vector<int32_t> greedy_continuation(std::vector<int32_t> seq, const NextToken& next, int n, int32_t stop) {
  std::vector<int32_t> out;
  while (int(out.size()) < n) {
    const int32_t t = next(seq);
    if (t == stop) break;
    out.push_back(t);
    seq.push_back(t);
  }
  return out;
}

std::vector<int32_t> greedy_shifting(std::vector<int32_t> seq, const NextToken& next, int n, int n_ctx, int n_keep) {
  std::vector<int32_t> out;
  while (int(out.size()) < n) {
    const int32_t t = next(seq);
    out.push_back(t);
    seq.push_back(t);
    if (int(seq.size()) > n_ctx) {
      const int cached = int(seq.size()) - 1, discard = (cached - n_keep) / 2;
      seq.erase(seq.begin() + n_keep, seq.begin() + n_keep + discard);
    }
  }
  return out;
}

FakeHost::FakeHost(std::vector<int32_t> prompt, FakeHostOptions o)
    : opt_(o), prompt_(prompt), tokens_(std::move(prompt)), sampler_(o.sampling) {}

void FakeHost::start(const std::string& name, const std::map<std::string, ParamValue>& params) {
  const StrategyInfo& info = strategy(name);
  params_ = info.resolve(params);
  strategy_ = info.make(*this);
  try {
    strategy_->start();
  } catch (const std::exception& e) {
    finish(e.what());
  }
  after_message();
}

LaunchRecord& FakeHost::record(uint64_t run) {
  for (LaunchRecord& r : launches_)
    if (r.run == run) return r;
  throw std::out_of_range("no run " + std::to_string(run) + " was launched");
}

const LaunchRecord& FakeHost::launch_of(uint64_t run) const { return const_cast<FakeHost*>(this)->record(run); }

std::vector<const LaunchRecord*> FakeHost::launches(const std::string& role) const {
  std::vector<const LaunchRecord*> out;
  for (const LaunchRecord& r : launches_)
    if (r.role == role) out.push_back(&r);
  return out;
}

std::vector<Event> FakeHost::events(EventKind kind, const std::string& role) const {
  std::vector<Event> out;
  for (const Event& e : events_)
    if (e.kind == kind && (role.empty() || e.role == role)) out.push_back(e);
  return out;
}


uint64_t FakeHost::launch(const std::string& role, const Batch& batch, bool speculative, const std::vector<TapRow>& inputs) {
  const uint64_t run = next_run_++;
  if (!inputs.empty() && inputs.size() != batch.size()) error(role + " run " + std::to_string(run) + ": inputs for some rows only");
  for (size_t i = 0; i < inputs.size() && i < batch.size(); ++i) {
    if (!inputs[i].run) continue;
    const int32_t pos = batch.pos[i];
    const LaunchRecord* src = nullptr;
    for (const LaunchRecord& l : launches_)
      if (l.run == inputs[i].run) src = &l;
    const std::string what = role + " run " + std::to_string(run) + " row " + std::to_string(i) + " (position " +
                             std::to_string(pos) + ") takes row " + std::to_string(inputs[i].row) + " of run " +
                             std::to_string(inputs[i].run);
    if (!src || src->role != kTargetRole || src->cancelled) {
      error(what + ", which is no target run going on");
      continue;
    }
    // Positions not accepted yet are a guess (the strategy cancels the run if it fails).
    const int32_t row = inputs[i].row;
    if (row < 0 || size_t(row) >= src->batch.size()) error(what + ", which it does not have");
    else if (size_t(pos) < tokens_.size() && src->batch.tokens[size_t(row)] != tokens_[size_t(pos)])
      error(what + ", which holds a token the sequence does not have there");
  }
  for (int32_t pos : batch.pos)
    if (pos >= opt_.n_ctx)
      error(role + " run " + std::to_string(run) + " at position " + std::to_string(pos) + ", past the context of " +
            std::to_string(opt_.n_ctx));
  LaunchRecord r;
  r.run = run;
  r.role = role;
  r.batch = batch;
  r.speculative = speculative;
  r.inputs = inputs;
  launches_.push_back(std::move(r));
  stages_[role].queue.emplace_back(run);
  events_.push_back({EventKind::launch, role, run});
  if (done_) error("run " + std::to_string(run) + " launched after generation ended");
  if (role == kTargetRole) ++metrics_.runs_launched;
  return run;
}

void FakeHost::kv_ops(const std::string& role, std::vector<KvOp> ops) {
  events_.push_back({EventKind::kv_ops, role, 0, ops});
  stages_[role].queue.emplace_back(std::move(ops));
}

void FakeHost::cancel(const std::string& role, const std::vector<uint64_t>& runs) {
  if (runs.empty()) return;  // the head sends nothing either
  events_.push_back({EventKind::cancel, role, 0, {}, runs});
  for (uint64_t id : runs) record(id).cancelled = true;
  if (role == kTargetRole) metrics_.runs_cancelled += runs.size();
}

bool FakeHost::accept(int32_t token) {
  events_.push_back({EventKind::accept, {}, 0, {}, {}, token});
  if (done_) {
    error("accept(" + std::to_string(token) + ") after generation ended");
    return false;
  }
  if (token < 0 || token >= opt_.vocab) error("accepted token " + std::to_string(token) + " is outside the vocabulary");
  if (token == opt_.stop_token) {
    finish();
    return false;
  }
  tokens_.push_back(token);
  emitted_.push_back(token);
  if (int(emitted_.size()) >= opt_.n_predict) {
    finish();
    return false;
  }
  if (int(tokens_.size()) <= opt_.n_ctx) return true;
  if (!opt_.context_shift) {
    finish();
    return false;
  }
  // As HeadHost::shift_context: the newest token is not cached yet.
  const int cached = int(tokens_.size()) - 1;
  const int keep = std::clamp(opt_.n_keep, 0, cached), discard = (cached - keep) / 2;
  for (const auto& [role, oracle] : oracles_) kv_ops(role, context_shift_ops(keep, discard));
  tokens_.erase(tokens_.begin() + keep, tokens_.begin() + keep + discard);
  ++shifts_;
  if (strategy_ && strategy_->context_shifted(keep, discard)) return true;
  finish("the strategy cannot follow a context shift");
  return false;
}

void FakeHost::finish(std::string err) {
  events_.push_back({EventKind::finish, {}, 0, {}, {}, -1, err});
  if (!err.empty()) error("finished with: " + err);
  done_ = true;
}

// As the head: once the session is over the strategy abandons what is in flight and is gone.
void FakeHost::after_message() {
  if (done_ && strategy_) {
    strategy_->abandon();
    strategy_.reset();
  }
}

void FakeHost::apply(Stage& st, const std::string& role, const KvOp& op) {
  if (op.seq >= kMaxSeqs || op.dst_seq >= kMaxSeqs) return error(role + ": cache operation on a sequence out of range");
  switch (op.kind) {
    case KvOpKind::window:
    case KvOpKind::retrieve:
      if (op.seq < 0) return error(role + ": a view of no sequence");
      st.views[size_t(op.seq)] = op;
      return;
    case KvOpKind::unview:
      for (int s = 0; s < kMaxSeqs; ++s)
        if (op.seq < 0 || op.seq == s) st.views[size_t(s)].reset();
      return;
    default: break;
  }
  if (op.kind == KvOpKind::remove && op.seq < 0 && op.pos_begin < 0 && op.pos_end < 0)
    for (auto& v : st.views) v.reset();
  auto in_range = [&](int32_t pos) { return pos >= std::max(op.pos_begin, 0) && (op.pos_end < 0 || pos < op.pos_end); };
  for (Cell& c : st.cells) {
    switch (op.kind) {
      case KvOpKind::remove:
        if (in_range(c.pos)) c.seqs &= op.seq < 0 ? 0 : ~seq_bit(op.seq);
        break;
      case KvOpKind::copy:
        if (op.seq != op.dst_seq && (c.seqs & seq_bit(op.seq)) && in_range(c.pos)) c.seqs |= seq_bit(op.dst_seq);
        break;
      case KvOpKind::keep: c.seqs &= seq_bit(op.seq); break;
      case KvOpKind::shift: {  // sequences op.seq..op.dst_seq (when above it), each cell once
        SeqSet which = 0;
        for (int s = std::max(op.seq, 0); s <= std::max(op.seq, op.dst_seq); ++s) which |= seq_bit(s);
        if (in_range(c.pos) && (op.seq < 0 || (c.seqs & which))) c.pos += op.delta;
        break;
      }
      default: break;
    }
  }
  std::erase_if(st.cells, [](const Cell& c) { return c.seqs == 0; });
}

const KvOp* FakeHost::view_of(const Stage& st, SeqSet seqs) {
  for (int s = 0; s < kMaxSeqs; ++s)
    if ((seqs & seq_bit(s)) && st.views[size_t(s)]) return &*st.views[size_t(s)];
  return nullptr;
}

std::vector<int32_t> FakeHost::through_view(const KvOp& view, const std::vector<int32_t>& seen) {
  const int32_t q = int32_t(seen.size()) - 1;  // the query's position
  std::vector<int32_t> rank(seen.size(), 0);   // 0: read
  int32_t keep = 1;
  if (view.kind == KvOpKind::window) {
    for (int32_t p = 0; p <= q; ++p) rank[size_t(p)] = p < view.pos_begin || p > q - view.pos_end ? 0 : 1;
  } else {
    // The retrieval stand-in: chunk 0, then the other chunks latest first.
    const int32_t chunk = view.dst_seq, fresh_from = std::min(view.pos_begin, q + 1), budget = view.pos_end;
    int32_t next = 0;
    for (int32_t p = 0; p < std::min(chunk, fresh_from); ++p) rank[size_t(p)] = next++;
    for (int32_t c = (fresh_from - 1) / chunk; c >= 1; --c)
      for (int32_t p = c * chunk; p < std::min(fresh_from, (c + 1) * chunk); ++p) rank[size_t(p)] = next++;
    keep = std::max(std::min(chunk, budget), budget - (q - fresh_from + 1));
    for (int32_t p = fresh_from; p <= q; ++p) rank[size_t(p)] = 0;
  }
  std::vector<int32_t> out;
  for (int32_t p = 0; p <= q; ++p)
    if (rank[size_t(p)] < keep) out.push_back(seen[size_t(p)]);
  return out;
}

void FakeHost::process(Stage& st, LaunchRecord& r, bool skip_if_cancelled) {
  r.processed = true;
  if (skip_if_cancelled && r.cancelled) {
    r.dropped = true;
    return;
  }
  const Batch& b = r.batch;
  const std::string name = r.role + " run " + std::to_string(r.run);
  const size_t first = st.cells.size();
  for (size_t i = 0; i < b.size(); ++i) {
    if (b.seqs[i] == 0) error(name + ": batch token without a sequence");
    st.cells.push_back({b.pos[i], b.tokens[i], b.seqs[i]});
  }
  int& peak = peak_cells_[r.role];
  peak = std::max(peak, int(st.cells.size()));
  // A tree batch: a node sees its ancestors in the batch (by parent links, independently of
  // the production mask) and the cached cells of its sequences before the tree's first position.
  auto tree_sees = [&](size_t i, size_t cell) {
    if (cell >= first) {
      for (int32_t a = int32_t(i); a >= 0; a = b.parent[size_t(a)])
        if (size_t(a) == cell - first) return true;
      return false;
    }
    return (st.cells[cell].seqs & b.seqs[i]) && st.cells[cell].pos < b.pos[0];
  };
  auto oracle = oracles_.find(r.role);
  for (size_t i = 0; i < b.size(); ++i) {
    if (!b.logits[i]) continue;
    // What row i attends to: every cell of its sequences up to its position, which must be
    // exactly one per position for the cache to be coherent.
    std::vector<const Cell*> vis;
    for (size_t k = 0; k < st.cells.size(); ++k) {
      const Cell& c = st.cells[k];
      if (b.is_tree() ? tree_sees(i, k) : (c.seqs & b.seqs[i]) && c.pos <= b.pos[i]) vis.push_back(&c);
    }
    std::stable_sort(vis.begin(), vis.end(), [](const Cell* a, const Cell* c) { return a->pos < c->pos; });
    std::vector<int32_t> seen;
    bool coherent = int32_t(vis.size()) == b.pos[i] + 1;
    for (size_t k = 0; k < vis.size(); ++k) {
      coherent = coherent && vis[k]->pos == int32_t(k);
      seen.push_back(vis[k]->token);
    }
    if (!coherent) {
      std::string at;
      for (const Cell* c : vis) at += " " + std::to_string(c->pos);
      error(name + " row " + std::to_string(i) + " at position " + std::to_string(b.pos[i]) + " sees positions" + at);
    }
    if (const KvOp* view = view_of(st, b.seqs[i])) seen = through_view(*view, seen);
    std::vector<float> l;
    if (oracle == oracles_.end()) error("no script for role " + r.role);
    else l = oracle->second(seen);
    l.resize(size_t(opt_.vocab), 0.0f);
    r.logits.insert(r.logits.end(), l.begin(), l.end());
    r.seen.push_back(std::move(seen));
  }
  // A run conditioned on another pipeline's taps keeps only the rows that took them (a block
  // drafter's context rows); the others (its block) are not cached, as the DFlash stage does.
  if (!r.inputs.empty())
    for (size_t i = b.size(); i-- > 0;)
      if (!r.inputs[i].run) st.cells.erase(st.cells.begin() + long(first + i));
}

void FakeHost::process_until(const std::string& role, uint64_t run) {
  Stage& st = stages_[role];
  while (!st.queue.empty()) {
    auto item = std::move(st.queue.front());
    st.queue.erase(st.queue.begin());
    if (auto* ops = std::get_if<std::vector<KvOp>>(&item)) {
      for (const KvOp& op : *ops) apply(st, role, op);
      continue;
    }
    const uint64_t id = std::get<uint64_t>(item);
    LaunchRecord& r = record(id);
    if (id == run) return process(st, r, false);
    process(st, r, !opt_.cancel_too_late);
  }
}

void FakeHost::deliver(uint64_t run) {
  LaunchRecord& r = record(run);
  if (!r.pending()) return error("run " + std::to_string(run) + " settled twice");
  if (!r.processed) process_until(r.role, run);
  r.delivered = true;
  if (!strategy_) return;  // the session is over: the head has nobody to hand it to
  std::vector<int32_t> rows;
  for (size_t i = 0; i < r.batch.size(); ++i)
    if (r.batch.logits[i]) rows.push_back(int32_t(i));
  Logits l;
  l.pipeline = r.role;
  l.rows = rows;
  l.logits = Tensor::from(WireDType::f32, {int64_t(rows.size()), int64_t(opt_.vocab)}, r.logits);
  try {
    strategy_->on_logits(run, l);
  } catch (const std::exception& e) {
    finish(e.what());
  }
  after_message();
}

void FakeHost::drop(uint64_t run) {
  LaunchRecord& r = record(run);
  if (!r.pending()) return error("run " + std::to_string(run) + " settled twice");
  if (!r.cancelled) return error("run " + std::to_string(run) + " dropped but never cancelled");
  if (!r.processed) process_until(r.role, run);
  r.dropped = true;
}

std::optional<uint64_t> FakeHost::oldest(const std::string& role) const {
  for (const LaunchRecord& r : launches_)
    if (r.role == role && r.pending()) return r.run;
  return std::nullopt;
}

bool FakeHost::settle_next(const std::string& role) {
  const auto run = oldest(role);
  if (!run) return false;
  const LaunchRecord& r = launch_of(*run);
  if (r.cancelled && !opt_.cancel_too_late) drop(*run);
  else deliver(*run);
  return true;
}

void FakeHost::run_to_end(const Pick& pick, const std::function<void()>& after, int max_steps) {
  for (int step = 0; !done_; ++step) {
    if (step == max_steps) return error("still generating after " + std::to_string(max_steps) + " results");
    std::vector<const LaunchRecord*> heads;
    for (const auto& [role, st] : stages_)
      if (auto run = oldest(role)) heads.push_back(&launch_of(*run));
    if (heads.empty()) return error("stalled: nothing in flight and generation not over");
    settle_next(heads[pick(heads) % heads.size()]->role);
    if (after) after();
  }
}

FakeHost::Pick FakeHost::oldest_first() {
  return [](const std::vector<const LaunchRecord*>& c) {
    return size_t(std::min_element(c.begin(), c.end(), [](auto* a, auto* b) { return a->run < b->run; }) - c.begin());
  };
}

FakeHost::Pick FakeHost::prefer(const std::string& role) {
  return [role](const std::vector<const LaunchRecord*>& c) {
    for (size_t i = 0; i < c.size(); ++i)
      if (c[i]->role == role) return i;
    return oldest_first()(c);
  };
}

FakeHost::Pick FakeHost::shuffled(uint64_t seed) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  return [rng](const std::vector<const LaunchRecord*>& c) { return size_t((*rng)() % c.size()); };
}

FakeHost::Pick FakeHost::favour(const std::string& role, double share, uint64_t seed) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  return [=](const std::vector<const LaunchRecord*>& c) {
    const bool want = std::uniform_real_distribution<double>(0, 1)(*rng) < share;
    for (size_t i = 0; i < c.size(); ++i)
      if ((c[i]->role == role) == want) return i;
    return size_t(0);
  };
}

}  // namespace specmesh::test
