#include "specmesh/actors/alspec_stage.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/devices/device.hpp"
#include "specmesh/actors/tp_ranks.hpp"

namespace specmesh {

namespace {

// The partner's messages, filled by the actor and taken by the step running on the device
// thread, which blocks between layers until the message it needs is there.
class SyncInbox {
 public:
  void put(uint64_t run, AttentionSync s) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      box_[{run, s.kind, s.layer}] = std::move(s);
    }
    cv_.notify_all();
  }
  // Throws ForwardCancelled when give_up() says so, std::runtime_error after `timeout`.
  AttentionSync take(uint64_t run, SyncKind kind, int layer, std::chrono::milliseconds timeout,
                     const std::function<bool()>& give_up) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      auto it = box_.find({run, kind, layer});
      if (it != box_.end()) {
        AttentionSync s = std::move(it->second);
        box_.erase(it);
        return s;
      }
      if (give_up()) throw ForwardCancelled();
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("ALSpec partner sent nothing for layer " + std::to_string(layer) + " within " +
                                 std::to_string(timeout.count()) + " ms");
      cv_.wait_for(lk, std::chrono::milliseconds(20));
    }
  }
  // Drops what is left of earlier (cancelled or failed) runs.
  void forget_before(uint64_t run) {
    std::lock_guard<std::mutex> lk(mu_);
    box_.erase(box_.begin(), box_.lower_bound({run, SyncKind::priority, 0}));
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::tuple<uint64_t, SyncKind, int>, AttentionSync> box_;
};

// Everything the device jobs share. The group's stage may be tensor-parallel: its ranks
// (tp_ranks.hpp) each run an AlspecDevice over their share of every layer.
struct Group {
  AlspecStageConfig cfg;
  std::shared_ptr<TpRanks> ranks;
  std::vector<std::unique_ptr<AlspecDevice>> devs;  // per rank
  SyncInbox inbox;
  CancelSet cancelled;
  std::atomic<bool> stopping{false};  // the actor is gone: a waiting step gives up
  std::shared_ptr<StageStats> stats;

  int size() const { return ranks->size(); }
  Context& ctx() { return ranks->ctx(); }
  TpLink* link(int r) { return ranks->rank(r).ctx->tp_link(); }
};

// The groups of one node, by pipeline. Two groups on one node (one Router) put their syncs
// straight into each other's inbox: a message from one device thread to the other, instead of
// the two actor hops it takes through the router (the node's dispatcher, then the partner's
// stage actor), each a thread wake-up. On the 2 shared cores of the development machine that
// cut the per-layer sync from about 190 us to about 140 us (bench_alspec --cpu). Groups on
// other nodes, in this process or not, go through the router as before.
class LocalGroups {
 public:
  void add(const Router* node, const std::string& pipeline, const std::shared_ptr<Group>& g) {
    std::lock_guard<std::mutex> lk(mu_);
    groups_[{node, pipeline}] = g;
  }
  // Only `g`'s own entry: a group added later under the same name stays.
  void remove(const Router* node, const std::string& pipeline, const Group* g) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = groups_.find({node, pipeline});
    if (it == groups_.end()) return;
    const std::shared_ptr<Group> there = it->second.lock();
    if (!there || there.get() == g) groups_.erase(it);
  }
  std::shared_ptr<Group> find(const Router* node, const std::string& pipeline) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = groups_.find({node, pipeline});
    return it == groups_.end() ? nullptr : it->second.lock();
  }

 private:
  std::mutex mu_;
  std::map<std::pair<const Router*, std::string>, std::weak_ptr<Group>> groups_;
};

LocalGroups& local_groups() {
  static LocalGroups groups;
  return groups;
}

struct PairState {
  std::shared_ptr<Group> g;
  RunAdmission admission;
  int n_cells = 0;
  bool settle_scheduled = false;
  ~PairState() {
    if (!g) return;
    g->stopping = true;
    local_groups().remove(g->cfg.stage.router.get(), g->cfg.stage.pipeline, g.get());
  }
};

Tensor f32_vector(std::vector<float> v) {
  const int64_t n = int64_t(v.size());
  return Tensor::from(WireDType::f32, {n}, std::move(v));
}

// A tensor's floats: a view of the message when it is aligned, else a copy into `scratch`.
std::span<const float> floats(const Tensor& t, std::vector<float>& scratch) {
  if (t.data.aligned_for<float>()) return t.data.view<float>();
  scratch = t.data.to_vector<float>();
  return scratch;
}

Tensor f32_vector(std::span<const float> v) { return f32_vector(std::vector<float>(v.begin(), v.end())); }

void send_logits(const Group& g, uint64_t run, std::vector<int32_t> rows, std::vector<float> logits) {
  const int64_t n_vocab = g.cfg.stage.model->hparams().n_vocab;
  Logits l;
  l.pipeline = g.cfg.run_pipeline;
  l.rows = std::move(rows);
  l.logits = Tensor::from(WireDType::f32, {int64_t(l.rows.size()), n_vocab}, std::move(logits));
  g.cfg.stage.router->send(g.cfg.stage.head_node, make_envelope(run, std::move(l)));
}

// Modelled time an accepted speculation saves at this context length: a hit layer against a
// missed one (the timing model's own formulas). 0 without measured timing.
double saved_ms(const Group& g, int64_t context) {
  const auto& profile = g.cfg.stage.device_state->profile();
  if (!profile || !profile->times) return 0;
  const double k = profile->effective_context(context);
  return 1e3 * std::max(0.0, profile->times->alspec_miss_layer(k) - profile->times->alspec_hit_layer(k));
}

// Rank 0's value of a vector to every rank of the group (an all-gather in which only rank 0 has
// a share). Without tensor parallelism, nothing to do.
void broadcast(Group& g, int r, std::vector<float>& v, size_t n) {
  TpLink* link = g.link(r);
  if (!link) return;
  std::vector<size_t> shares(size_t(g.size()), 0);
  shares[0] = n;
  std::vector<float> out(n);
  link->all_gather(v.data(), 1, shares.data(), n, out.data());
  v = std::move(out);
}

// One decode token on rank r of this group, in lockstep with the partner group's rank r and
// with the other ranks of this group. Rank 0 talks to the partner and the head; the other ranks
// get what it received through the group's exchange.
void step(Group& g, int r, uint64_t run, const Batch& batch) {
  TpRanks::Rank& rank = g.ranks->rank(r);
  AlspecDevice& dev = *g.devs[size_t(r)];
  const StageConfig& sc = g.cfg.stage;
  const AlspecSettings& st = g.cfg.settings;
  const HParams& hp = rank.ctx->model().hparams();
  const int n_layer = hp.n_layer;
  const int32_t pos = batch.pos[0];
  const bool lead = r == 0;
  TpLink* link = g.link(r);
  using Clock = std::chrono::steady_clock;
  Device& hw = *rank.stage.device_state;
  const bool per_op = hw.profile() && hw.profile()->times;
  // Without per-op timing the whole pass is priced as a plain forward pass on each group.
  const auto t_step = Clock::now();
  const double whole = per_op ? 0.0 : hw.modelled_seconds(rank.ctx->cost(batch));
  // Waits, after an op's real compute since t0, until its modelled time has passed.
  auto pace = [&](Clock::time_point t0, LayerPart part, AttnMode mode, bool head = false) {
    if (!per_op) return;
    WorkCost c;
    c.tokens = 1;
    c.layers = head ? 0 : 1;
    c.context = int64_t(pos) + 1;
    c.part = part;
    c.attn = mode;
    c.head = head;
    hw.pace(t0, hw.modelled_seconds(c));
  };
  auto give_up = [&] { return g.stopping || g.cancelled.contains(run); };
  const std::shared_ptr<Group> local_peer =
      lead && g.cfg.peer_node == sc.self_node ? local_groups().find(sc.router.get(), g.cfg.peer_pipeline) : nullptr;
  auto send = [&](SyncKind kind, int layer, std::vector<Tensor> tensors) {
    AttentionSync s{g.cfg.peer_pipeline, kind, layer, pos, dev.gate().priority(), std::move(tensors), 0};
    if (local_peer) return local_peer->inbox.put(run, std::move(s));
    sc.router->send(g.cfg.peer_node, make_envelope(run, std::move(s)));
  };
  // The all-gather; returns the partner's priority. After a hand-off half of it is known
  // without a message: a receiver always sets 1 (AlspecGate::received), so the group that sent
  // at the previous layer takes that without waiting, and the group that received sends
  // nothing; only the sender's verdict (0 or 2) travels. That keeps one blocking message per
  // layer instead of two.
  bool sent_last = false, received_last = false;
  auto gather = [&](int layer) {
    int other = AlspecGate::kReceiver;
    if (!sent_last) {
      std::vector<float> p(1, 0.0f);
      if (lead) {
        if (!received_last) send(SyncKind::priority, layer, {});
        p[0] = float(g.inbox.take(run, SyncKind::priority, layer, g.cfg.peer_timeout, give_up).priority);
      }
      broadcast(g, r, p, 1);
      other = int(p[0]);
    } else if (lead && !received_last) {
      send(SyncKind::priority, layer, {});
    }
    dev.gather(other);
    sent_last = received_last = false;
    return other;
  };
  // This rank's columns of the K/V rows and the attention output, and each rank's share of the
  // three together: the sender's ranks gather them in one exchange.
  const RowRange heads = rank.ctx->kv_heads();
  const size_t D = size_t(hp.head_dim), group = size_t(hp.n_head / hp.n_head_kv);
  const size_t E = size_t(hp.n_embd), KV = size_t(hp.kv_dim()), Q = size_t(hp.q_dim());
  std::vector<size_t> kv_shares, handoff_shares;
  tp_head_shares(hp.n_head_kv, D, g.size(), kv_shares);
  tp_head_shares(hp.n_head_kv, D * (2 + group), g.size(), handoff_shares);
  // The whole K and V rows and speculative output from every rank's share of them.
  auto whole_handoff = [&](const AlspecHandoff& h, std::vector<float>& k, std::vector<float>& v,
                           std::vector<float>& spec) {
    if (!link) {
      k.assign(h.k.begin(), h.k.end());
      v.assign(h.v.begin(), h.v.end());
      spec.assign(h.spec.begin(), h.spec.end());
      return;
    }
    std::vector<float> mine(h.k.begin(), h.k.end());
    mine.insert(mine.end(), h.v.begin(), h.v.end());
    mine.insert(mine.end(), h.spec.begin(), h.spec.end());
    std::vector<float> all(2 * KV + Q);
    link->all_gather(mine.data(), 1, handoff_shares.data(), all.size(), all.data());
    const float* part = all.data();  // rank by rank: its K, V and speculative output
    for (size_t kv : kv_shares) {
      k.insert(k.end(), part, part + kv);
      v.insert(v.end(), part + kv, part + 2 * kv);
      spec.insert(spec.end(), part + 2 * kv, part + 2 * kv + kv * group);
      part += (2 + group) * kv;
    }
  };

  if (lead) g.inbox.forget_before(run);
  dev.begin(batch);
  std::vector<uint8_t> hits(n_layer, 0);
  int received_at = -1;  // the layer this group last received at: its verdict shows at the next gather
  for (int il = 0; il <= n_layer; ++il) {
    if (il < n_layer) dev.pre(il);
    const int other = gather(il);
    if (received_at >= 0) hits[received_at] = other == AlspecGate::kHit;
    received_at = -1;
    if (il == n_layer) break;
    if (dev.is_sender()) {
      const auto t0 = Clock::now();
      // The hand-off leaves as soon as the sink + window output is ready, while this group
      // still computes the middle of the full attention: that is the overlap. On modelled
      // hardware the speculated output is ready at SFD_R, the full one at SFD_S. A
      // tensor-parallel group first gathers its ranks' K/V rows and speculative outputs: the
      // message carries whole rows, whatever the groups' sizes.
      dev.attend(il, [&](const AlspecHandoff& h) {
        std::vector<float> k, v, spec;
        whole_handoff(h, k, v, spec);
        pace(t0, LayerPart::attention, AttnMode::spec_receiver);
        if (lead)
          send(SyncKind::handoff, il,
               {f32_vector(h.residual), f32_vector(std::move(k)), f32_vector(std::move(v)),
                f32_vector(std::move(spec))});
      });
      pace(t0, LayerPart::attention, AttnMode::spec_sender);
      const bool hit = !st.force_miss &&
                       (st.emulate_hit_rate > 0 ? emulated_hit(il, n_layer, st.emulate_hit_rate) : dev.check().accept);
      const auto t1 = Clock::now();
      dev.settle(il, hit);
      if (!hit) pace(t1, LayerPart::rest, AttnMode::flash);  // a hit skips the post-attention ops
      hits[il] = hit;
      sent_last = true;
    } else {
      if (!link) {  // one device: the message's vectors, viewed where aligned
        const AttentionSync m = g.inbox.take(run, SyncKind::handoff, il, g.cfg.peer_timeout, give_up);
        const auto t0 = Clock::now();
        std::vector<float> scratch[4];
        dev.receive(il, {floats(m.tensors[0], scratch[0]), floats(m.tensors[1], scratch[1]),
                         floats(m.tensors[2], scratch[2]), floats(m.tensors[3], scratch[3])});
        pace(t0, LayerPart::rest, AttnMode::flash);
        received_at = il;
        received_last = true;
        continue;
      }
      // Rank 0 takes the hand-off; every rank gets it whole and takes its heads' columns (the
      // sharing is part of the receiver's paced time).
      std::vector<float> packed;
      auto t0 = Clock::now();
      if (lead) {
        const AttentionSync m = g.inbox.take(run, SyncKind::handoff, il, g.cfg.peer_timeout, give_up);
        t0 = Clock::now();
        const size_t want[4] = {E, KV, KV, Q};
        std::vector<float> scratch;
        for (size_t t = 0; t < 4; ++t) {
          const std::span<const float> part = floats(m.tensors[t], scratch);
          if (part.size() != want[t])
            throw std::invalid_argument("ALSpec: the hand-off does not match the model's dimensions");
          packed.insert(packed.end(), part.begin(), part.end());
        }
      }
      packed.resize(E + 2 * KV + Q);
      broadcast(g, r, packed, packed.size());
      const float* base = packed.data();
      const size_t kv0 = heads.begin * D, kv_n = heads.size() * D;
      dev.receive(il, {{base, E},
                       {base + E + kv0, kv_n},
                       {base + E + KV + kv0, kv_n},
                       {base + E + 2 * KV + kv0 * group, kv_n * group}});
      pace(t0, LayerPart::rest, AttnMode::flash);
      received_at = il;
      received_last = true;
    }
  }
  if (!dev.is_sender()) {
    dev.abort();
    hw.pace(t_step, whole);
    return;
  }
  int n_hits = 0;
  for (uint8_t h : hits) n_hits += h;
  if (lead) {
    AttentionSync report{g.cfg.run_pipeline, SyncKind::report, n_layer, pos, dev.gate().priority(),
                         {Tensor::from(WireDType::u8, {int64_t(n_layer)}, std::move(hits))},
                         n_hits * saved_ms(g, int64_t(pos) + 1)};
    sc.router->send(sc.head_node, make_envelope(run, std::move(report)));
  }
  const auto t0 = Clock::now();
  std::vector<float> logits = dev.output();
  pace(t0, LayerPart::whole, AttnMode::flash, true);
  hw.pace(t_step, whole);
  if (!lead) return;
  send_logits(g, run, {0}, std::move(logits));
  g.stats->layers_computed += n_layer;
}

void schedule_run(const std::shared_ptr<Group>& g, uint64_t run, RunStart meta, RunAdmission::PlacePtr place) {
  auto batch = std::make_shared<Batch>(to_batch(meta));
  auto work = [g, run, batch](int r) {
    TpRanks::Rank& rank = g->ranks->rank(r);
    AlspecDevice& dev = *g->devs[size_t(r)];
    try {
      if (batch->size() == 1 && !batch->is_tree() && batch->logits[0]) {
        step(*g, r, run, *batch);
      } else {
        // A prompt chunk: both groups compute it in full, as a plain stage would; the current
        // sender answers.
        ForwardOutput out = paced_forward(*rank.ctx, rank.stage, g->cancelled, *rank.stats, run, *batch);
        if (r == 0 && dev.is_sender()) send_logits(*g, run, out.rows, std::move(out.logits));
      }
      if (r == 0) ++g->stats->runs;
    } catch (...) {
      dev.abort();
      throw;
    }
  };
  auto failed = [g, run](const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const ForwardCancelled&) {
      ++g->stats->runs_cancelled;
    } catch (const std::exception& x) {
      report_error(g->cfg.stage, run, x.what());
    }
  };
  g->ranks->schedule([g, run] { return g->cancelled.contains(run); }, std::move(work),
                     [g] { ++g->stats->runs_cancelled; }, std::move(failed), std::move(place));
}

void schedule_kv_ops(const std::shared_ptr<Group>& g, uint64_t run, KvCacheOp ops, RunAdmission::PlacePtr place) {
  auto shared_ops = std::make_shared<KvCacheOp>(std::move(ops));
  auto work = [g, shared_ops](int r) {
    apply_kv_ops(*g->ranks->rank(r).ctx, shared_ops->ops);
    // An emptied cache starts a new session: both groups go back to the first priorities.
    for (const KvOp& op : shared_ops->ops)
      if (op.kind == KvOpKind::remove && op.seq < 0 && op.pos_begin < 0 && op.pos_end < 0) g->devs[size_t(r)]->reset();
  };
  auto failed = [g, run](const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      report_error(g->cfg.stage, run, std::string("KV-cache operation failed: ") + x.what());
    }
  };
  g->ranks->schedule({}, std::move(work), {}, std::move(failed), std::move(place));
}

// Runs and cache operations are admitted (admission.hpp) or refused on arrival, before group 0
// passes them on to its partner.
void handle(PairState& ps, const std::string& from, const Envelope& env) {
  const std::shared_ptr<Group>& g = ps.g;
  const StageConfig& sc = g->cfg.stage;
  const uint64_t run = env.run_id;
  auto admit = [&]() -> RunAdmission::PlacePtr {
    auto place = ps.admission.admit(from);
    if (!place) report_refusal(sc, *g->stats, run, too_many_runs(from, ps.admission.max_per_sender()));
    return place;
  };
  // Group 0 hands the work it takes on to its partner, addressed to the partner's pipeline.
  auto to_partner = [&](auto work) {
    if (g->cfg.self != 0) return;
    work.pipeline = g->cfg.peer_pipeline;
    sc.router->send(g->cfg.peer_node, make_envelope(run, std::move(work)));
  };
  if (const auto* s = std::get_if<AttentionSync>(&env.payload)) {
    g->inbox.put(run, *s);
  } else if (const auto* r = std::get_if<RunStart>(&env.payload)) {
    if (std::string why = run_problem(*r, ps.n_cells); !why.empty()) return report_refusal(sc, *g->stats, run, why);
    auto place = admit();
    if (!place) return;
    to_partner(*r);
    schedule_run(g, run, *r, std::move(place));
  } else if (const auto* k = std::get_if<KvCacheOp>(&env.payload)) {
    if (std::string why = kv_ops_problem(k->ops); !why.empty())
      return report_refusal(sc, *g->stats, run, "KV-cache operation refused: " + why);
    auto place = admit();
    if (!place) return;
    to_partner(*k);
    schedule_kv_ops(g, run, *k, std::move(place));
  } else if (const auto* c = std::get_if<Cancel>(&env.payload)) {
    if (g->cfg.self == 0 && from != g->cfg.peer_node) sc.router->send(g->cfg.peer_node, env);
    for (uint64_t id : c->run_ids) g->cancelled.add(id);
  } else {
    stage_log().log("ALSpec group on " + sc.self_node + ": ignored", spdlog::level::warn,
                    "ALSpec group on " + sc.self_node + ": ignoring " + to_string(env.type()) + " from " + from);
  }
}

}  // namespace

caf::actor spawn_alspec_stage(caf::actor_system& sys, AlspecStageConfig cfg, std::shared_ptr<StageStats> stats) {
  const int n_layer = cfg.stage.model->hparams().n_layer;
  if (cfg.stage.context.layer_begin != 0 || cfg.stage.context.layer_end != n_layer)
    throw std::invalid_argument("an ALSpec group's stage holds every layer of its model (this one: [" +
                                std::to_string(cfg.stage.context.layer_begin) + ", " +
                                std::to_string(cfg.stage.context.layer_end) + "))");
  if (!cfg.stage.tap_layers.empty()) throw std::invalid_argument("an ALSpec group does not tap hidden states");
  RunAdmission admission(cfg.stage.max_runs_per_sender);  // throws for a cap below 1
  // Built here, not in the actor, so a cache that cannot be allocated is the caller's error.
  auto g = std::make_shared<Group>();
  g->cfg = std::move(cfg);
  g->stats = std::move(stats);
  // Plain attention uses the speculative kernel's layout, so a rejected speculation leaves
  // what plain decoding computes.
  ContextParams cp = g->cfg.stage.context;
  cp.attention_layout = g->cfg.settings.spec.layout;
  g->ranks = TpRanks::make(g->cfg.stage, cp, g->stats);
  for (int r = 0; r < g->ranks->size(); ++r)
    g->devs.push_back(std::make_unique<AlspecDevice>(*g->ranks->rank(r).ctx, g->cfg.self, g->cfg.settings.spec));
  local_groups().add(g->cfg.stage.router.get(), g->cfg.stage.pipeline, g);
  return sys.spawn([g, admission](caf::stateful_actor<PairState>* self) -> caf::behavior {
    auto& ps = self->state;
    ps.g = g;
    ps.admission = admission;
    ps.n_cells = g->ctx().kv().n_cells();
    return {
        [self](const std::string& from, const Envelope& env) {
          auto& ps = self->state;
          handle(ps, from, env);
          if (!ps.settle_scheduled && stage_log().pending()) schedule_settle(self, ps.settle_scheduled);
        },
        [self](settle_atom) { on_settle(self, self->state.settle_scheduled); },
    };
  });
}

}  // namespace specmesh
