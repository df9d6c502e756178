#include "specmesh/actors/dflash_stage.hpp"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <variant>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/devices/device.hpp"
#include "specmesh/kernels/quant.hpp"

namespace specmesh {

namespace {

// The draft caches, one per sequence. Only device jobs touch them, and a device runs its
// jobs one at a time, in order.
struct DraftCaches {
  std::map<int, std::unique_ptr<DFlashState>> seqs;
  DFlashState& of(int seq, const DFlashDrafter& d, ThreadPool& pool, size_t window) {
    auto& s = seqs[seq];
    if (!s) s = std::make_unique<DFlashState>(d, pool, window);
    return *s;
  }
};

// One draft run, checked on arrival: context rows [0, n_new), then the block.
struct DraftRun {
  RunStart batch;
  int seq = 0;
  size_t n_new = 0;
};

struct Work {
  uint64_t run = 0;
  std::variant<DraftRun, KvCacheOp> item;
  RunAdmission::PlacePtr place;
};

struct DFlashStageState {
  DFlashStageConfig cfg;
  std::shared_ptr<DraftCaches> caches = std::make_shared<DraftCaches>();
  std::shared_ptr<CancelSet> cancelled = std::make_shared<CancelSet>();
  std::shared_ptr<StageStats> stats;
  RunAdmission admission;
  std::deque<Work> queue;                                 // in arrival order; the front may wait for taps
  struct Tapped {
    uint64_t arrival = 0;                      // order of the run's first tapped layer here
    std::map<int32_t, HiddenStates> layers;    // tapped layer -> states
  };
  std::map<uint64_t, Tapped> taps;  // by target run (run ids carry no order)
  uint64_t arrivals = 0;
  bool settle_scheduled = false;
};

std::string name_of(const DFlashStageConfig& c) { return "DFlash drafter on " + c.stage.self_node; }

// Why a draft run's batch is not one this stage can run ("" when it is).
std::string draft_problem(const RunStart& r, int n_ctx, DraftRun& out) {
  if (std::string why = run_problem(r, n_ctx); !why.empty()) return why;
  const size_t n = r.tokens.size();
  if (r.inputs.size() != n) return "a DFlash draft run names the target run of every row (inputs)";
  if (!r.parents.empty()) return "a DFlash draft run is a block, not a token tree";
  const SeqSet s = r.seq_masks[0];
  if (s & (s - 1)) return "a DFlash draft run's rows belong to one sequence";
  size_t n_new = 0;
  while (n_new < n && r.inputs[n_new] != 0) ++n_new;
  if (n_new == n) return "a DFlash draft run has no block rows (rows with inputs 0)";
  for (size_t i = 0; i < n; ++i) {
    if (r.seq_masks[i] != s) return "a DFlash draft run's rows belong to one sequence";
    if (i > n_new && r.inputs[i] != 0) return "a DFlash draft run's context rows (inputs != 0) come before its block";
    if (i > 0 && r.positions[i] != r.positions[i - 1] + 1) return "a DFlash draft run's positions are consecutive";
    if (i < n_new && !r.logits.empty() && r.logits[i]) return "context rows of a DFlash draft run have no logits";
  }
  if (r.positions.back() >= n_ctx)
    return "position " + std::to_string(r.positions.back()) + " is beyond the context of " + std::to_string(n_ctx);
  out.batch = r;
  out.seq = std::countr_zero(s);
  out.n_new = n_new;
  return {};
}

// Whether every tapped layer of every target run the context rows name has arrived.
bool taps_arrived(const DFlashStageState& st, const DraftRun& d) {
  const std::vector<int>& layers = st.cfg.drafter->config().target_layer_ids;
  for (size_t i = 0; i < d.n_new; ++i) {
    if (i > 0 && d.batch.inputs[i] == d.batch.inputs[i - 1]) continue;
    auto it = st.taps.find(d.batch.inputs[i]);
    if (it == st.taps.end()) return false;
    for (int l : layers)
      if (!it->second.layers.count(l)) return false;
  }
  return true;
}

// The context rows' taps side by side (n_new x n_taps*H, the drafter's order), as f32.
std::vector<float> gather_taps(const DFlashStageState& st, const DraftRun& d) {
  const std::vector<int>& layers = st.cfg.drafter->config().target_layer_ids;
  const size_t H = size_t(st.cfg.drafter->config().hidden_size), T = layers.size();
  std::vector<float> out(d.n_new * T * H);
  std::vector<uint16_t> half(H);  // an f16 row, copied out: received frames need not be aligned
  for (size_t i = 0; i < d.n_new; ++i) {
    const int32_t row_of_run = d.batch.input_rows[i];
    for (size_t j = 0; j < T; ++j) {
      const HiddenStates& h = st.taps.at(d.batch.inputs[i]).layers.at(layers[j]);
      if (h.states.shape.size() != 2 || size_t(h.states.shape[1]) != H)
        throw std::invalid_argument("hidden states of layer " + std::to_string(h.layer) + " have " +
                                    std::to_string(h.states.shape.size() == 2 ? h.states.shape[1] : 0) +
                                    " values a row, the drafter's hidden size is " + std::to_string(H));
      auto row = std::find(h.rows.begin(), h.rows.end(), row_of_run);
      if (row == h.rows.end())
        throw std::invalid_argument("target run " + std::to_string(d.batch.inputs[i]) + " has no tapped row " +
                                    std::to_string(row_of_run));
      const size_t k = size_t(row - h.rows.begin());
      float* dst = out.data() + (i * T + j) * H;
      if (h.states.dtype == WireDType::f16) {
        std::memcpy(half.data(), h.states.data.data() + k * H * sizeof(uint16_t), H * sizeof(uint16_t));
        dequantize_row(DType::F16, half.data(), dst, H);
      } else {
        std::memcpy(dst, h.states.data.data() + k * H * sizeof(float), H * sizeof(float));
      }
    }
  }
  return out;
}

void schedule_step(DFlashStageState& st, uint64_t run, DraftRun d, std::vector<float> taps, RunAdmission::PlacePtr place) {
  auto job = std::make_shared<DeviceJob>();
  job->run = [caches = st.caches, cfg = st.cfg, cancelled = st.cancelled, stats = st.stats, run, d = std::move(d),
              taps = std::move(taps), place = std::move(place)](ThreadPool& pool) -> WorkCost {
    if (cancelled->contains(run)) {
      ++stats->runs_cancelled;
      return {};
    }
    try {
      const auto t0 = std::chrono::steady_clock::now();
      const DFlashDrafter& drafter = *cfg.drafter;
      const Model& model = *cfg.stage.model;
      const size_t H = size_t(model.hparams().n_embd), V = size_t(model.hparams().n_vocab);
      DFlashState& cache = caches->of(d.seq, drafter, pool, cfg.window);
      const int32_t first = d.batch.positions[0];
      if (size_t(first) != cache.n_ctx())
        throw std::invalid_argument("the run's rows start at position " + std::to_string(first) + ", but the draft cache of sequence " +
                                    std::to_string(d.seq) + " holds " + std::to_string(cache.n_ctx()) + " positions");
      const size_t n_block = d.batch.tokens.size() - d.n_new;
      std::vector<int32_t> rows;
      for (size_t i = d.n_new; i < d.batch.tokens.size(); ++i)
        if (d.batch.logits.empty() || d.batch.logits[i]) rows.push_back(int32_t(i));
      const double modelled = cfg.stage.device_state->modelled_seconds(drafter.cost(model, d.n_new, n_block, cache.n_ctx() - cache.first(), rows.size()));

      std::vector<float> embd(n_block * H);
      drafter.embed_block(model, d.batch.tokens[d.n_new], int(n_block), embd.data());
      const std::vector<float>& out = cache.step(taps.data(), d.n_new, embd.data(), n_block);
      std::vector<float> picked(rows.size() * H), logits(rows.size() * V);
      for (size_t r = 0; r < rows.size(); ++r)
        std::copy_n(out.data() + (size_t(rows[r]) - d.n_new) * H, H, picked.data() + r * H);
      if (!rows.empty()) matmul(model.output, picked.data(), rows.size(), logits.data(), pool);
      cfg.stage.device_state->pace(t0, modelled);
      ++stats->runs;
      stats->layers_computed += drafter.layers.size();
      Logits l;
      l.pipeline = cfg.stage.pipeline;
      l.rows = std::move(rows);
      l.logits = Tensor::from(WireDType::f32, {int64_t(l.rows.size()), int64_t(V)}, std::move(logits));
      cfg.stage.router->send(cfg.stage.next_node, make_envelope(run, std::move(l)));
    } catch (const std::exception& e) {
      report_error(cfg.stage, run, e.what());
    }
    return {};  // paced above
  };
  caf::anon_send(st.cfg.stage.device, compute_atom::value, std::move(job));
}

// A context-only cache takes a crop (remove to the end of a sequence, or of every one; emptying
// it is a crop from 0) and a context shift (context_shift_ops: a remove of [k, k + d) followed
// by a shift of the rest by -d). Anything else is refused.
void schedule_kv_ops(DFlashStageState& st, uint64_t run, KvCacheOp ops, RunAdmission::PlacePtr place) {
  auto job = std::make_shared<DeviceJob>();
  job->run = [caches = st.caches, cfg = st.cfg, run, ops = std::move(ops), place = std::move(place)](ThreadPool&) -> WorkCost {
    try {
      const std::vector<KvOp>& o = ops.ops;
      auto each = [&](int32_t seq, const std::function<void(DFlashState&)>& f) {
        for (auto& [s, cache] : caches->seqs)
          if (seq < 0 || seq == s) f(*cache);
      };
      for (size_t i = 0; i < o.size(); ++i) {
        const KvOp& op = o[i];
        if (op.kind == KvOpKind::unview) continue;  // it never has views
        if (const auto shift = context_shift_at(o, i)) {
          each(op.seq, [&](DFlashState& c) { c.shift(size_t(shift->first), size_t(shift->second)); });
          ++i;
          continue;
        }
        if (op.kind != KvOpKind::remove)
          throw std::invalid_argument("the DFlash draft cache holds context rows only: it takes crops and context shifts, "
                                      "not this operation");
        const size_t from = size_t(std::max(0, op.pos_begin));
        each(op.seq, [&](DFlashState& c) {
          if (op.pos_end >= 0 && size_t(op.pos_end) < c.n_ctx() && from < size_t(op.pos_end))
            throw std::invalid_argument("the DFlash draft cache can be cropped, not have positions [" + std::to_string(from) +
                                        ", " + std::to_string(op.pos_end) + ") cut out");
          if (from < c.n_ctx()) c.crop(from);
        });
      }
    } catch (const std::exception& e) {
      report_error(cfg.stage, run, std::string("KV-cache operation failed: ") + e.what());
    }
    return {};
  };
  caf::anon_send(st.cfg.stage.device, compute_atom::value, std::move(job));
}

// Hands the queued work to the device in order, up to a draft run whose taps are missing.
void pump(DFlashStageState& st) {
  while (!st.queue.empty()) {
    Work& w = st.queue.front();
    if (auto* d = std::get_if<DraftRun>(&w.item)) {
      if (st.cancelled->contains(w.run)) {
        ++st.stats->runs_cancelled;
      } else if (!taps_arrived(st, *d)) {
        return;
      } else {
        try {
          std::vector<float> taps = gather_taps(st, *d);
          // Taps that came before this run's are moot: the strategy moved past those runs.
          // Its own stay until a later run is taken, for a retry after this one is dropped
          // (an async guess that failed).
          uint64_t first = UINT64_MAX;
          for (size_t i = 0; i < d->n_new; ++i) first = std::min(first, st.taps.at(d->batch.inputs[i]).arrival);
          if (d->n_new) std::erase_if(st.taps, [&](const auto& t) { return t.second.arrival < first; });
          schedule_step(st, w.run, std::move(*d), std::move(taps), std::move(w.place));
        } catch (const std::exception& e) {
          report_error(st.cfg.stage, w.run, e.what());
        }
      }
    } else {
      schedule_kv_ops(st, w.run, std::move(std::get<KvCacheOp>(w.item)), std::move(w.place));
    }
    st.queue.pop_front();
  }
}

void handle(DFlashStageState& st, const std::string& from, const Envelope& env) {
  const uint64_t run = env.run_id;
  const StageConfig& sc = st.cfg.stage;
  auto admit = [&]() -> RunAdmission::PlacePtr {
    auto place = st.admission.admit(from);
    if (!place) report_refusal(sc, *st.stats, run, too_many_runs(from, st.admission.max_per_sender()));
    return place;
  };
  if (const auto* h = std::get_if<HiddenStates>(&env.payload)) {
    if (h->pipeline != st.cfg.tap_pipeline) return;
    auto [it, fresh] = st.taps.try_emplace(run);
    if (fresh) it->second.arrival = ++st.arrivals;
    it->second.layers[h->layer] = *h;
    if (st.taps.size() > st.cfg.max_tapped_runs)
      st.taps.erase(std::min_element(st.taps.begin(), st.taps.end(), [](const auto& a, const auto& b) {
        return a.second.arrival < b.second.arrival;
      }));
  } else if (const auto* r = std::get_if<RunStart>(&env.payload)) {
    DraftRun d;
    if (std::string why = draft_problem(*r, sc.context.n_ctx, d); !why.empty()) return report_refusal(sc, *st.stats, run, why);
    if (auto place = admit()) st.queue.push_back({run, std::move(d), std::move(place)});
  } else if (const auto* k = std::get_if<KvCacheOp>(&env.payload)) {
    if (std::string why = kv_ops_problem(k->ops); !why.empty())
      return report_refusal(sc, *st.stats, run, "KV-cache operation refused: " + why);
    if (auto place = admit()) st.queue.push_back({run, *k, std::move(place)});
  } else if (const auto* c = std::get_if<Cancel>(&env.payload)) {
    for (uint64_t id : c->run_ids) st.cancelled->add(id);
  } else {
    stage_log().log(name_of(st.cfg) + ": ignored", spdlog::level::warn,
                    name_of(st.cfg) + ": ignoring " + to_string(env.type()) + " from " + from);
    return;
  }
  pump(st);
}

}  // namespace

caf::actor spawn_dflash_stage(caf::actor_system& sys, DFlashStageConfig cfg, std::shared_ptr<StageStats> stats) {
  if (!cfg.drafter || !cfg.stage.model) throw std::invalid_argument("a DFlash stage needs its drafter and the target's model");
  cfg.drafter->check_target(*cfg.stage.model);
  if (cfg.stage.context.n_ctx <= 0) cfg.stage.context.n_ctx = context_size(*cfg.stage.model, 0);
  if (cfg.stage.max_runs_per_sender < 1) throw std::invalid_argument("max_runs_per_sender must be at least 1");
  if (!cfg.stage.tp_devices.empty())
    throw std::invalid_argument("a DFlash drafter runs on one device (its stage names tensor_parallel devices)");
  return sys.spawn([cfg = std::move(cfg), stats](caf::stateful_actor<DFlashStageState>* self) -> caf::behavior {
    auto& st = self->state;
    st.cfg = cfg;
    st.stats = stats;
    st.admission = RunAdmission(cfg.stage.max_runs_per_sender);
    return {
        [self](const std::string& from, const Envelope& env) {
          auto& st = self->state;
          handle(st, from, env);
          if (!st.settle_scheduled && stage_log().pending()) schedule_settle(self, st.settle_scheduled);
        },
        [self](retarget_atom, const std::string& next_node) { self->state.cfg.stage.next_node = next_node; },
        [self](settle_atom) { on_settle(self, self->state.settle_scheduled); },
    };
  });
}

}  // namespace specmesh
