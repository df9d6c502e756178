#include "specmesh/actors/run_merger.hpp"

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "specmesh/actors/stage.hpp"

namespace specmesh {

RunMerger::RunMerger(std::string role, std::string first_node, std::shared_ptr<Router> router, RunIds& ids,
                     size_t max_rows, size_t max_in_flight)
    : role_(std::move(role)),
      first_node_(std::move(first_node)),
      router_(std::move(router)),
      ids_(ids),
      max_rows_(std::max<size_t>(1, max_rows)),
      max_in_flight_(std::max<size_t>(1, max_in_flight)) {}

void RunMerger::add(Owner owner, uint64_t part, Batch batch) {
  waiting_.push_back({owner, part, std::move(batch)});
}

bool RunMerger::has_pending(Owner owner) const {
  return std::any_of(waiting_.begin(), waiting_.end(), [&](const Part& p) { return p.owner == owner; });
}

void RunMerger::send_pending(Owner owner) {
  std::vector<Part> mine;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->owner != owner) {
      ++it;
      continue;
    }
    mine.push_back(std::move(*it));
    it = waiting_.erase(it);
  }
  // Each part fits a run on its own; together they may not.
  std::vector<Part> run;
  size_t rows = 0;
  for (Part& p : mine) {
    if (!run.empty() && rows + p.batch.size() > max_rows_) {
      send(std::move(run));
      run.clear();
      rows = 0;
    }
    rows += p.batch.size();
    run.push_back(std::move(p));
  }
  if (!run.empty()) send(std::move(run));
}

bool RunMerger::drop(Owner owner, uint64_t part) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
    if (it->owner == owner && it->part == part) {
      waiting_.erase(it);
      return true;
    }
  for (auto it = sent_.begin(); it != sent_.end(); ++it) {
    auto p = std::find_if(it->second.begin(), it->second.end(),
                          [&](const Part& x) { return x.owner == owner && x.part == part; });
    if (p == it->second.end()) continue;
    p->dropped = true;
    if (std::all_of(it->second.begin(), it->second.end(), [](const Part& x) { return x.dropped; })) {
      router_->send(first_node_, make_envelope(0, Cancel{{it->first}}));
      sent_.erase(it);
    }
    return true;
  }
  return false;
}

void RunMerger::drop_owner(Owner owner) {
  std::erase_if(waiting_, [&](const Part& p) { return p.owner == owner; });
  std::vector<uint64_t> parts;
  for (const auto& [run, ps] : sent_)
    for (const Part& p : ps)
      if (p.owner == owner && !p.dropped) parts.push_back(p.part);
  for (uint64_t p : parts) drop(owner, p);
}

void RunMerger::flush() {
  while (!waiting_.empty() && sent_.size() < max_in_flight_) {
    std::vector<Part> run;
    size_t rows = 0;
    while (!waiting_.empty() && (run.empty() || rows + waiting_.front().batch.size() <= max_rows_)) {
      rows += waiting_.front().batch.size();
      run.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
    }
    send(std::move(run));
  }
}

void RunMerger::send(std::vector<Part> parts) {
  Batch merged;
  for (Part& p : parts) {
    p.offset = merged.size();
    const Batch& b = p.batch;
    merged.tokens.insert(merged.tokens.end(), b.tokens.begin(), b.tokens.end());
    merged.pos.insert(merged.pos.end(), b.pos.begin(), b.pos.end());
    merged.seqs.insert(merged.seqs.end(), b.seqs.begin(), b.seqs.end());
    merged.logits.insert(merged.logits.end(), b.logits.begin(), b.logits.end());
  }
  const uint64_t run = ids_.next();
  ++runs_sent_;
  parts_sent_ += parts.size();
  // A node that cannot be reached shows up as its peer going down and the parts' deadlines.
  if (!router_->send(first_node_, make_envelope(run, to_run_start(role_, merged, false))))
    spdlog::debug("head: merged run {} not sent: node '{}' is not reachable", run, first_node_);
  sent_[run] = std::move(parts);
}

std::optional<std::vector<RunMerger::Delivery>> RunMerger::split(uint64_t run, const Logits& logits) {
  auto it = sent_.find(run);
  if (it == sent_.end()) return std::nullopt;
  std::vector<Part> parts = std::move(it->second);
  sent_.erase(it);
  const int64_t n_vocab = logits.logits.shape.size() == 2 ? logits.logits.shape[1] : 0;
  const size_t row_bytes = size_t(std::max<int64_t>(0, n_vocab)) * sizeof(float);
  const bool well_formed = logits.logits.dtype == WireDType::f32 && logits.logits.shape.size() == 2 &&
                           size_t(logits.logits.shape[0]) == logits.rows.size() &&
                           logits.logits.data.size() == logits.rows.size() * row_bytes;
  std::vector<Delivery> out;
  for (const Part& p : parts) {
    if (p.dropped) continue;
    Delivery d{p.owner, p.part, {}};
    d.logits.pipeline = logits.pipeline;
    std::vector<float> values;
    if (well_formed)
      for (size_t i = 0; i < logits.rows.size(); ++i) {
        const int32_t r = logits.rows[i];
        if (r < int32_t(p.offset) || r >= int32_t(p.offset + p.batch.size())) continue;
        d.logits.rows.push_back(r - int32_t(p.offset));
        const size_t at = values.size();
        values.resize(at + size_t(n_vocab));
        std::memcpy(values.data() + at, logits.logits.data.data() + i * row_bytes, row_bytes);
      }
    // A malformed answer reaches every part empty, and each session's strategy names the problem.
    d.logits.logits = Tensor::from(WireDType::f32, {int64_t(d.logits.rows.size()), n_vocab}, std::move(values));
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<RunMerger::Owner> RunMerger::take(uint64_t run) {
  std::vector<Owner> out;
  auto it = sent_.find(run);
  if (it == sent_.end()) return out;
  for (const Part& p : it->second)
    if (!p.dropped && std::find(out.begin(), out.end(), p.owner) == out.end()) out.push_back(p.owner);
  sent_.erase(it);
  return out;
}

void RunMerger::clear() {
  waiting_.clear();
  sent_.clear();
}

}  // namespace specmesh
