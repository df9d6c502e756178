#include "specmesh/actors/head.hpp"

#include <cmath>
#include <deque>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <spdlog/spdlog.h>

#include "specmesh/actors/stage.hpp"
#include "specmesh/actors/strategy.hpp"

namespace specmesh {

using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ HeadCore

HeadCore::HeadCore(const HeadConfig& cfg, SessionPtr session, uint64_t& next_run)
    : cfg_(cfg), session_(std::move(session)), next_run_(next_run) {
  t0_ = t_last_ = Clock::now();
  const Tokenizer& tok = cfg_.target.model->tokenizer();
  result_.prompt_ids = tok.encode(session_->request.prompt, true);
  if (result_.prompt_ids.empty()) result_.prompt_ids.push_back(tok.bos() >= 0 ? tok.bos() : 0);
  result_.stats.prompt_tokens = int(result_.prompt_ids.size());
  tokens_ = result_.prompt_ids;
  n_predict_ = session_->request.n_predict > 0 ? session_->request.n_predict : cfg_.n_predict;
  sampler_ = std::make_unique<Sampler>(session_->request.sampling.value_or(cfg_.sampling));
  decoder_ = std::make_unique<StreamDecoder>(tok);
  for (int32_t t : result_.prompt_ids) decoder_->feed(t);
  SpecMetrics& m = result_.metrics;
  m.strategy = cfg_.strategy;
  m.target = cfg_.target.name;
  m.draft = cfg_.draft.name;
  m.prompt_tokens = result_.stats.prompt_tokens;
}

uint64_t HeadCore::launch(const PipelineRef& p, const Batch& batch, bool speculative) {
  const uint64_t run = next_run_++;
  if (!cfg_.router->send(p.first_node, make_envelope(run, to_run_start(p.name, batch, speculative))))
    throw std::runtime_error("node '" + p.first_node + "' of pipeline '" + p.name + "' is not reachable");
  if (&p == &cfg_.target) ++result_.metrics.runs_launched;
  return run;
}

void HeadCore::kv_ops(const PipelineRef& p, std::vector<KvOp> ops) {
  KvCacheOp k;
  k.pipeline = p.name;
  k.layer = 0;
  k.ops = std::move(ops);
  if (!cfg_.router->send(p.first_node, make_envelope(0, std::move(k))))
    throw std::runtime_error("node '" + p.first_node + "' of pipeline '" + p.name + "' is not reachable");
}

void HeadCore::cancel(const PipelineRef& p, const std::vector<uint64_t>& runs) {
  if (runs.empty()) return;
  std::vector<std::string> sent;
  for (const std::string& n : p.nodes) {
    if (std::find(sent.begin(), sent.end(), n) != sent.end()) continue;
    sent.push_back(n);
    cfg_.router->send(n, make_envelope(0, Cancel{runs}));
  }
  if (&p == &cfg_.target) result_.metrics.runs_cancelled += runs.size();
}

bool HeadCore::accept(int32_t token) {
  if (done_) return false;
  const auto now = Clock::now();
  if (!session_->request.ignore_eos && cfg_.target.model->stops_at(token)) {
    if (result_.ids.empty()) result_.stats.ttft_ms = std::chrono::duration<double, std::milli>(now - t0_).count();
    finish();
    return false;
  }
  if (result_.ids.empty()) {
    result_.stats.ttft_ms = std::chrono::duration<double, std::milli>(now - t0_).count();
  } else {
    itl_sum_ms_ += std::chrono::duration<double, std::milli>(now - t_last_).count();
  }
  t_last_ = now;
  tokens_.push_back(token);
  result_.ids.push_back(token);
  ++result_.stats.generated_tokens;
  std::string piece = decoder_->feed(token);
  result_.text += piece;
  bool more = !session_->cancel.load();
  if (session_->on_token && !session_->on_token(token, piece)) more = false;
  if (!more || int(result_.ids.size()) >= n_predict_) {
    finish();
    return false;
  }
  return true;
}

void HeadCore::finish(std::string error) {
  if (done_) return;
  done_ = true;
  result_.text += decoder_->flush();
  result_.error = std::move(error);
  GenerateStats& st = result_.stats;
  st.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0_).count();
  if (st.generated_tokens > 1) st.decode_tokens_per_s = (st.generated_tokens - 1) / (itl_sum_ms_ / 1000.0);
  SpecMetrics& m = result_.metrics;
  m.generated_tokens = st.generated_tokens;
  m.ttft_ms = st.ttft_ms;
  m.decode_tokens_per_s = st.decode_tokens_per_s;
  m.mean_itl_ms = st.generated_tokens > 1 ? itl_sum_ms_ / (st.generated_tokens - 1) : 0;
  if (!result_.ok()) spdlog::error("generation failed after {} tokens: {}", result_.ids.size(), result_.error);
  if (!cfg_.metrics_csv.empty() && session_->record_metrics) {
    try {
      m.append_csv(cfg_.metrics_csv);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
    }
  }
  session_->done.set_value(std::move(result_));
}

std::vector<float> rows_of(const Logits& l, size_t want_rows, int n_vocab, uint64_t run) {
  if (l.rows.size() != want_rows || l.logits.numel() != want_rows * size_t(n_vocab))
    throw std::runtime_error("run " + std::to_string(run) + ": expected " + std::to_string(want_rows) + " rows of " +
                             std::to_string(n_vocab) + " logits, got " + std::to_string(l.rows.size()));
  return l.logits.data.to_vector<float>();
}

namespace {
size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}
}  // namespace

std::vector<int32_t> sync_cache(HeadCore& core, const PipelineRef& p, std::vector<int32_t>& cached,
                                const std::vector<int32_t>& want) {
  // The last wanted token is always fed again: its logits are what the caller is after.
  const size_t keep = std::min(common_prefix(cached, want), want.empty() ? 0 : want.size() - 1);
  if (keep < cached.size()) core.kv_ops(p, {{KvOpKind::remove, 0, -1, int32_t(keep), -1}});
  cached.resize(keep);
  return {want.begin() + keep, want.end()};
}

uint64_t feed(HeadCore& core, const PipelineRef& p, std::vector<int32_t>& cached, const std::vector<int32_t>& toks,
              size_t tail) {
  uint64_t last = 0;
  const size_t n_batch = size_t(core.cfg().n_batch);
  size_t i = 0;
  while (i < toks.size()) {
    // The rows that need logits stay in the final chunk.
    size_t e = std::min(toks.size(), i + n_batch);
    if (e < toks.size() && toks.size() - e < tail) e = toks.size() - tail;
    if (e <= i) e = toks.size();
    Batch b;
    for (size_t k = i; k < e; ++k)
      b.add(toks[k], int32_t(cached.size() + (k - i)), seq_bit(0), k + tail >= toks.size());
    cached.insert(cached.end(), toks.begin() + i, toks.begin() + e);
    last = core.launch(p, b, false);
    i = e;
  }
  return last;
}

float top_probability(const float* logits, int n_vocab) {
  float m = logits[0];
  for (int i = 1; i < n_vocab; ++i) m = std::max(m, logits[i]);
  double sum = 0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(double(logits[i]) - m);
  return float(1.0 / sum);
}

// ------------------------------------------------------------------ the actor

namespace {

struct HeadState {
  HeadConfig cfg;
  std::deque<SessionPtr> queue;
  std::unique_ptr<HeadCore> core;
  std::unique_ptr<Strategy> strategy;
  uint64_t next_run = 1;
};

void settle(HeadState& st) {
  for (;;) {
    if (st.core && st.core->done()) {
      st.strategy->abandon();
      st.strategy.reset();
      st.core.reset();
    }
    if (st.core || st.queue.empty()) return;
    SessionPtr s = std::move(st.queue.front());
    st.queue.pop_front();
    try {
      st.core = std::make_unique<HeadCore>(st.cfg, s, st.next_run);
      st.strategy = make_strategy(*st.core);
      // Every request starts from clean caches; the removal travels ahead of the first run.
      st.core->kv_ops(st.cfg.target, {{KvOpKind::remove, -1, -1, -1, -1}});
      if (!st.cfg.draft.name.empty()) st.core->kv_ops(st.cfg.draft, {{KvOpKind::remove, -1, -1, -1, -1}});
      st.strategy->start();
    } catch (const std::exception& e) {
      if (st.core) st.core->finish(e.what());
      else {
        GenerationResult r;
        r.error = e.what();
        s->done.set_value(std::move(r));
      }
    }
  }
}

}  // namespace

caf::actor spawn_head(caf::actor_system& sys, HeadConfig cfg) {
  return sys.spawn([cfg = std::move(cfg)](caf::stateful_actor<HeadState>* self) -> caf::behavior {
    self->state.cfg = cfg;
    return {
        [self](generate_atom, const SessionPtr& s) {
          self->state.queue.push_back(s);
          settle(self->state);
        },
        [self](const std::string& from, const Envelope& env) {
          auto& st = self->state;
          if (!st.core) return;
          try {
            if (const auto* l = std::get_if<Logits>(&env.payload)) {
              st.strategy->on_logits(env.run_id, *l);
            } else if (const auto* e = std::get_if<Error>(&env.payload)) {
              auto in = [&](const PipelineRef& p) {
                return std::find(p.nodes.begin(), p.nodes.end(), e->peer) != p.nodes.end();
              };
              if (e->code == ErrorCode::peer_down) {
                if (in(st.cfg.target) || in(st.cfg.draft))
                  st.core->finish("node '" + e->peer + "' stopped answering (process gone or frozen); generation aborted");
              } else {
                st.core->finish("node '" + e->peer + "': " + e->message);
              }
            }
          } catch (const std::exception& ex) {
            st.core->finish(ex.what());
          }
          settle(st);
        },
    };
  });
}

}  // namespace specmesh
