#include "specmesh/actors/admission.hpp"

#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "specmesh/model/batch.hpp"

namespace specmesh {

struct RunAdmission::Counts {
  int max = 0;
  mutable std::mutex mu;
  std::unordered_map<std::string, int> by_sender;  // only senders with runs in flight
  int total = 0;
};

class RunAdmission::Place {
 public:
  Place(std::shared_ptr<Counts> c, std::string from) : c_(std::move(c)), from_(std::move(from)) {}
  ~Place() {
    std::lock_guard<std::mutex> g(c_->mu);
    auto it = c_->by_sender.find(from_);
    if (it != c_->by_sender.end() && --it->second == 0) c_->by_sender.erase(it);
    --c_->total;
  }
  Place(const Place&) = delete;
  Place& operator=(const Place&) = delete;

 private:
  std::shared_ptr<Counts> c_;
  std::string from_;
};

RunAdmission::RunAdmission(int max_per_sender) : counts_(std::make_shared<Counts>()) {
  if (max_per_sender < 1)
    throw std::invalid_argument("max_runs_per_sender must be at least 1 (got " + std::to_string(max_per_sender) + ")");
  counts_->max = max_per_sender;
}

RunAdmission::PlacePtr RunAdmission::admit(const std::string& from) {
  {
    std::lock_guard<std::mutex> g(counts_->mu);
    int& n = counts_->by_sender[from];
    if (n >= counts_->max) return nullptr;
    ++n;
    ++counts_->total;
  }
  return std::make_shared<Place>(counts_, from);
}

int RunAdmission::max_per_sender() const { return counts_->max; }

int RunAdmission::in_flight(const std::string& from) const {
  std::lock_guard<std::mutex> g(counts_->mu);
  auto it = counts_->by_sender.find(from);
  return it == counts_->by_sender.end() ? 0 : it->second;
}

int RunAdmission::in_flight() const {
  std::lock_guard<std::mutex> g(counts_->mu);
  return counts_->total;
}

std::string run_problem(const RunStart& r, int n_cells) {
  const size_t n = r.tokens.size();
  if (r.positions.size() != n || r.seq_masks.size() != n || (!r.logits.empty() && r.logits.size() != n) ||
      (!r.parents.empty() && r.parents.size() != n) || (!r.inputs.empty() && r.inputs.size() != n) ||
      r.input_rows.size() != r.inputs.size())
    return "run batch fields have different lengths";
  if (n == 0) return "run without tokens";
  if (n > size_t(n_cells))
    return "run of " + std::to_string(n) + " tokens is larger than the KV cache (" + std::to_string(n_cells) + " cells)";
  for (size_t i = 0; i < n; ++i) {
    if (r.seq_masks[i] == 0) return "token " + std::to_string(i) + " of the run is in no sequence";
    if (r.positions[i] < 0) return "token " + std::to_string(i) + " of the run has a negative position";
  }
  return {};
}

std::string kv_ops_problem(const std::vector<KvOp>& ops) {
  auto bad = [](int32_t s) { return s < 0 || s >= kMaxSeqs; };
  for (const KvOp& op : ops) {
    // A remove, shift or unview may name -1: every sequence. The others need real ones.
    const bool seq_bad = op.kind == KvOpKind::remove || op.kind == KvOpKind::shift || op.kind == KvOpKind::unview
                             ? op.seq < -1 || op.seq >= kMaxSeqs
                             : bad(op.seq);
    const bool dst_bad = (op.kind == KvOpKind::copy && bad(op.dst_seq)) ||
                         (op.kind == KvOpKind::shift && op.dst_seq >= 0 && (op.dst_seq < op.seq || bad(op.dst_seq)));
    if (seq_bad || dst_bad)
      return "sequence id " + std::to_string(seq_bad ? op.seq : op.dst_seq) + " out of range (the KV cache has " +
             std::to_string(kMaxSeqs) + " sequences, 0.." + std::to_string(kMaxSeqs - 1) + ")";
    if (op.kind == KvOpKind::window && (op.pos_begin < 0 || op.pos_end < 1))
      return "StreamingLLM view of sequence " + std::to_string(op.seq) + ": sink " + std::to_string(op.pos_begin) +
             " and window " + std::to_string(op.pos_end) + " (need sink >= 0, window >= 1)";
    if (op.kind == KvOpKind::retrieve && (op.dst_seq < 1 || op.pos_begin < 1 || op.pos_end < op.dst_seq))
      return "retrieval view of sequence " + std::to_string(op.seq) + ": chunk " + std::to_string(op.dst_seq) +
             ", prompt " + std::to_string(op.pos_begin) + ", budget " + std::to_string(op.pos_end) +
             " (need chunk >= 1, prompt >= 1, budget >= chunk)";
  }
  return {};
}

std::string too_many_runs(const std::string& from, int max_per_sender) {
  return "too many runs in flight (" + std::to_string(max_per_sender) + ") from '" + from +
         "': refused until some of them are done";
}

}  // namespace specmesh
