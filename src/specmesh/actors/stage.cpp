#include "specmesh/actors/stage.hpp"

#include "specmesh/actors/tp_ranks.hpp"

#include <algorithm>
#include <chrono>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/devices/device.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/model/retrieval_cache.hpp"

namespace specmesh {

Batch to_batch(const RunStart& r) {
  const size_t n = r.tokens.size();
  if (r.positions.size() != n || r.seq_masks.size() != n || (!r.logits.empty() && r.logits.size() != n) ||
      (!r.parents.empty() && r.parents.size() != n))
    throw std::invalid_argument("run batch fields have different lengths");
  Batch b;
  b.tokens = r.tokens;
  b.pos = r.positions;
  b.seqs = r.seq_masks;
  b.logits = r.logits.empty() ? std::vector<uint8_t>(n, 1) : r.logits;
  b.parent = r.parents;
  return b;
}

RunStart to_run_start(const std::string& pipeline, const Batch& b, bool speculative) {
  RunStart r;
  r.pipeline = pipeline;
  r.tokens = b.tokens;
  r.positions = b.pos;
  r.seq_masks = b.seqs;
  r.logits = b.logits;
  r.parents = b.parent;
  r.speculative = speculative;
  return r;
}

ForwardOutput paced_forward(Context& ctx, const StageConfig& cfg, const CancelSet& cancelled, StageStats& stats,
                            uint64_t run, const Batch& batch, const float* hidden_in) {
  const auto t0 = std::chrono::steady_clock::now();
  const int n_layers = ctx.layer_end() - ctx.layer_begin();
  const double modelled = cfg.device_state->modelled_seconds(ctx.cost(batch));
  int layers_done = 0;
  ctx.set_cancel_check([&] {
    cfg.device_state->pace(t0, modelled * layers_done / std::max(1, n_layers));
    if (cancelled.contains(run)) return true;
    ++layers_done;
    return false;
  });
  try {
    ForwardOutput out = ctx.forward(batch, hidden_in);
    ctx.set_cancel_check({});
    cfg.device_state->pace(t0, modelled);
    stats.layers_computed += layers_done;
    return out;
  } catch (...) {
    ctx.set_cancel_check({});
    stats.layers_computed += layers_done;
    throw;
  }
}

namespace {

std::string stage_name(const StageConfig& cfg) {
  return "stage " + cfg.pipeline + "[" + std::to_string(cfg.context.layer_begin) + "," +
         std::to_string(cfg.context.layer_end) + ") on " + cfg.self_node;
}

}  // namespace

RateLimitedLog& stage_log() {
  static RateLimitedLog log;
  return log;
}

void schedule_settle(caf::event_based_actor* self, bool& scheduled) {
  if (scheduled) return;
  scheduled = true;
  self->delayed_send(self, std::chrono::seconds(1), settle_atom::value);
}

void on_settle(caf::event_based_actor* self, bool& scheduled) {
  scheduled = false;
  stage_log().flush();
#ifdef __GLIBC__
  ::malloc_trim(0);
#endif
  if (stage_log().pending()) schedule_settle(self, scheduled);
}

void report_error(const StageConfig& cfg, uint64_t run, const std::string& what) {
  const std::string who = stage_name(cfg);
  stage_log().log(who + ": run failed", spdlog::level::err, who + ": run " + std::to_string(run) + ": " + what);
  cfg.router->send(cfg.head_node, make_envelope(run, Error{ErrorCode::invalid_request, cfg.self_node, what}));
}

void report_refusal(const StageConfig& cfg, StageStats& stats, uint64_t run, const std::string& what) {
  ++stats.runs_refused;
  const std::string who = stage_name(cfg);
  stage_log().log(who + ": run refused", spdlog::level::warn, who + ": refused run " + std::to_string(run) + ": " + what);
  // To the head, like every stage error: it launched the run, whoever passed it on.
  cfg.router->send(cfg.head_node, make_envelope(run, Error{ErrorCode::invalid_request, cfg.self_node, what}));
}

void apply_kv_ops(Context& ctx, const std::vector<KvOp>& ops) {
  if (std::string why = kv_ops_problem(ops); !why.empty()) throw std::invalid_argument(why);
  KvCache& kv = ctx.kv();
  auto unview = [&](int seq) {
    for (int s = seq < 0 ? 0 : seq; s < (seq < 0 ? kMaxSeqs : seq + 1); ++s) ctx.set_view(s, nullptr);
  };
  for (const KvOp& op : ops) {
    switch (op.kind) {
      case KvOpKind::copy: kv.seq_cp(op.seq, op.dst_seq, op.pos_begin, op.pos_end); break;
      case KvOpKind::remove:
        kv.seq_rm(op.seq, op.pos_begin, op.pos_end);
        if (op.seq < 0 && op.pos_begin < 0 && op.pos_end < 0) unview(-1);  // a new session
        break;
      case KvOpKind::keep: kv.seq_keep(op.seq); break;
      case KvOpKind::shift: ctx.shift_positions(op.seq, op.pos_begin, op.pos_end, op.delta, op.dst_seq); break;
      case KvOpKind::window: ctx.set_view(op.seq, std::make_shared<SinkWindowView>(op.pos_begin, op.pos_end)); break;
      case KvOpKind::retrieve:
        ctx.set_view(op.seq, build_retrieval_view(ctx, op.pos_begin, op.dst_seq, op.pos_end));
        break;
      case KvOpKind::unview: unview(op.seq); break;
    }
  }
}

namespace {

struct StageState {
  StageConfig cfg;
  std::shared_ptr<TpRanks> ranks;  // one, or a tensor-parallel stage's
  std::shared_ptr<CancelSet> cancelled = std::make_shared<CancelSet>();
  std::shared_ptr<StageStats> stats;
  RunAdmission admission;
  int n_cells = 0;
  bool settle_scheduled = false;
};

// Sends the tapped layers this pass computed (captured[i] is tap_layers[i], empty when that
// layer belongs to another stage) to the tap node.
void send_taps(const StageConfig& cfg, uint64_t run, const RunStart& meta, ForwardOutput& out, int64_t n_embd) {
  for (size_t i = 0; i < out.captured.size(); ++i) {
    std::vector<float>& states = out.captured[i];
    if (states.empty()) continue;
    HiddenStates h;
    h.pipeline = cfg.pipeline;
    h.layer = cfg.tap_layers[i];
    h.positions = meta.positions;
    h.rows.resize(meta.positions.size());
    for (size_t r = 0; r < h.rows.size(); ++r) h.rows[r] = int32_t(r);
    const std::vector<int64_t> shape{int64_t(h.rows.size()), n_embd};
    if (cfg.tap_dtype == WireDType::f16) {
      std::vector<uint16_t> half(states.size());
      quantize_row(DType::F16, states.data(), half.data(), states.size());
      h.states = Tensor::from(WireDType::f16, shape, std::move(half));
    } else {
      h.states = Tensor::from(WireDType::f32, shape, std::move(states));
    }
    cfg.router->send(cfg.tap_node, make_envelope(run, std::move(h)));
  }
}

// Queues the forward pass of one run on the device (every rank's); the job sends the result on
// itself (rank 0).
// `place` is the run's admission: held by the job until it is done or dropped.
void schedule_forward(StageState& st, uint64_t run, RunStart meta, std::optional<Tensor> hidden_in,
                      RunAdmission::PlacePtr place) {
  auto in = std::make_shared<const std::optional<Tensor>>(std::move(hidden_in));
  auto m = std::make_shared<const RunStart>(std::move(meta));
  auto work = [ranks = st.ranks, cfg = st.cfg, cancelled = st.cancelled, run, m, in](int r) {
    TpRanks::Rank& rank = ranks->rank(r);
    Context& ctx = *rank.ctx;
    Batch batch = to_batch(*m);
    std::vector<float> hidden_copy;
    const float* hidden = nullptr;
    if (const std::optional<Tensor>& hidden_in = *in) {
      const size_t want = batch.size() * size_t(ctx.model().hparams().n_embd);
      if (hidden_in->dtype != WireDType::f32 || hidden_in->numel() != want)
        throw std::invalid_argument("activations do not match the batch (" + std::to_string(hidden_in->numel()) +
                                    " values, expected " + std::to_string(want) + ")");
      if (hidden_in->data.aligned_for<float>()) {
        hidden = hidden_in->data.view<float>().data();
      } else {
        hidden_copy = hidden_in->data.to_vector<float>();
        hidden = hidden_copy.data();
      }
    }
    ForwardOutput out = paced_forward(ctx, rank.stage, *cancelled, *rank.stats, run, batch, hidden);
    if (r != 0) return;  // every rank has the output; rank 0 sends it
    ++rank.stats->runs;
    const int64_t n_embd = ctx.model().hparams().n_embd;
    // Taps leave first: on a shared link the receiver then has them before the run's logits.
    send_taps(cfg, run, *m, out, n_embd);
    if (ctx.has_head()) {
      const int64_t n_vocab = ctx.model().hparams().n_vocab;
      Logits l;
      l.pipeline = cfg.pipeline;
      l.rows = out.rows;
      l.logits = Tensor::from(WireDType::f32, {int64_t(out.rows.size()), n_vocab}, std::move(out.logits));
      cfg.router->send(cfg.next_node, make_envelope(run, std::move(l)));
    } else {
      Activations a;
      a.pipeline = cfg.pipeline;
      a.layer = ctx.layer_end();
      a.tensors.push_back(Tensor::from(WireDType::f32, {int64_t(batch.size()), n_embd}, std::move(out.hidden)));
      a.batch = *m;
      cfg.router->send(cfg.next_node, make_envelope(run, std::move(a)));
    }
  };
  auto failed = [cfg = st.cfg, stats = st.stats, run](const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const ForwardCancelled&) {
      ++stats->runs_cancelled;
    } catch (const std::exception& x) {
      report_error(cfg, run, x.what());
    }
  };
  st.ranks->schedule([cancelled = st.cancelled, run] { return cancelled->contains(run); }, std::move(work),
                     [stats = st.stats] { ++stats->runs_cancelled; }, std::move(failed), std::move(place));
}

void schedule_kv_ops(StageState& st, uint64_t run, KvCacheOp ops, RunAdmission::PlacePtr place) {
  auto shared_ops = std::make_shared<const KvCacheOp>(std::move(ops));
  auto work = [ranks = st.ranks, cfg = st.cfg, run, shared_ops](int r) {
    Context& ctx = *ranks->rank(r).ctx;
    apply_kv_ops(ctx, shared_ops->ops);
    // Cache operations travel down the pipeline in order with the runs.
    if (r == 0 && !ctx.has_head()) {
      KvCacheOp next = *shared_ops;
      next.layer = ctx.layer_end();
      cfg.router->send(cfg.next_node, make_envelope(run, std::move(next)));
    }
  };
  auto failed = [cfg = st.cfg, run](const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      report_error(cfg, run, std::string("KV-cache operation failed: ") + x.what());
    }
  };
  st.ranks->schedule({}, std::move(work), {}, std::move(failed), std::move(place));
}

// Work is admitted (admission.hpp) or refused here, on arrival: a refused run costs an Error
// and a count, never a queued job or a cache cell.
void handle(StageState& st, const std::string& from, const Envelope& env) {
  const uint64_t run = env.run_id;
  auto admit = [&]() -> RunAdmission::PlacePtr {
    auto place = st.admission.admit(from);
    if (!place) report_refusal(st.cfg, *st.stats, run, too_many_runs(from, st.admission.max_per_sender()));
    return place;
  };
  if (const auto* r = std::get_if<RunStart>(&env.payload)) {
    if (std::string why = run_problem(*r, st.n_cells); !why.empty()) return report_refusal(st.cfg, *st.stats, run, why);
    if (!r->inputs.empty())
      return report_refusal(st.cfg, *st.stats, run, "this stage takes tokens, not another pipeline's hidden states (inputs)");
    if (auto place = admit()) schedule_forward(st, run, *r, std::nullopt, std::move(place));
  } else if (const auto* a = std::get_if<Activations>(&env.payload)) {
    if (a->tensors.empty())
      return report_refusal(st.cfg, *st.stats, run, "activations without a hidden-state tensor");
    if (std::string why = run_problem(a->batch, st.n_cells); !why.empty())
      return report_refusal(st.cfg, *st.stats, run, why);
    if (auto place = admit()) schedule_forward(st, run, a->batch, a->tensors[0], std::move(place));
  } else if (const auto* k = std::get_if<KvCacheOp>(&env.payload)) {
    if (std::string why = kv_ops_problem(k->ops); !why.empty())
      return report_refusal(st.cfg, *st.stats, run, "KV-cache operation refused: " + why);
    if (auto place = admit()) schedule_kv_ops(st, run, *k, std::move(place));
  } else if (const auto* c = std::get_if<Cancel>(&env.payload)) {
    for (uint64_t id : c->run_ids) st.cancelled->add(id);
  } else {
    stage_log().log(stage_name(st.cfg) + ": ignored", spdlog::level::warn,
                    "stage on " + st.cfg.self_node + ": ignoring " + to_string(env.type()) + " from " + from);
  }
}

}  // namespace

caf::actor spawn_stage(caf::actor_system& sys, StageConfig cfg, std::shared_ptr<StageStats> stats) {
  const int n_layer = cfg.model->hparams().n_layer;
  for (int l : cfg.tap_layers)
    if (l < 0 || l >= n_layer)
      throw std::invalid_argument("tap layer " + std::to_string(l) + " is outside the model's " +
                                  std::to_string(n_layer) + " layers");
  if (!cfg.tap_layers.empty() && cfg.tap_node.empty())
    throw std::invalid_argument("hidden-state taps need a tap_node to send them to");
  if (cfg.tap_dtype != WireDType::f32 && cfg.tap_dtype != WireDType::f16)
    throw std::invalid_argument(std::string("tap_dtype ") + to_string(cfg.tap_dtype) + ": expected f32 or f16");
  if (cfg.max_runs_per_sender < 1)
    throw std::invalid_argument("max_runs_per_sender must be at least 1 (got " + std::to_string(cfg.max_runs_per_sender) +
                                ")");
  std::sort(cfg.tap_layers.begin(), cfg.tap_layers.end());
  cfg.tap_layers.erase(std::unique(cfg.tap_layers.begin(), cfg.tap_layers.end()), cfg.tap_layers.end());
  // The context keeps only the taps inside its own range; the others stay empty in captured.
  cfg.context.capture_layers = cfg.tap_layers;
  // Built here, not in the actor, so a cache that cannot be allocated is the caller's error.
  auto ranks = TpRanks::make(cfg, cfg.context, stats);
  return sys.spawn([cfg = std::move(cfg), stats, ranks](caf::stateful_actor<StageState>* self) -> caf::behavior {
    auto& st = self->state;
    st.cfg = cfg;
    st.stats = stats;
    st.ranks = ranks;
    st.admission = RunAdmission(cfg.max_runs_per_sender);
    st.n_cells = ranks->ctx().kv().n_cells();
    return {
        [self](const std::string& from, const Envelope& env) {
          auto& st = self->state;
          handle(st, from, env);
          if (!st.settle_scheduled && stage_log().pending()) schedule_settle(self, st.settle_scheduled);
        },
        [self](retarget_atom, const std::string& next_node) { self->state.cfg.next_node = next_node; },
        [self](settle_atom) { on_settle(self, self->state.settle_scheduled); },
    };
  });
}

}  // namespace specmesh
