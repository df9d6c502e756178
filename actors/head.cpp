#include "actors/head.hpp"

#include <chrono>
#include <deque>
#include <random>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <spdlog/spdlog.h>

#include "actors/stage.hpp"

namespace specmesh {

namespace {

using Clock = std::chrono::steady_clock;

struct Active {
  SessionPtr session;
  GenerationResult result;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamDecoder> decoder;
  int n_predict = 0;
  int32_t pos = 0;
  uint64_t awaited_run = 0;  // the run whose logits come next
  Clock::time_point t0, t_first;
};

struct HeadState {
  HeadConfig cfg;
  std::deque<SessionPtr> queue;
  std::optional<Active> active;
  uint64_t next_run = 1;
};

using HeadActor = caf::stateful_actor<HeadState>*;

void send_to_pipeline(HeadState& st, uint64_t run, Payload p) {
  if (!st.cfg.router->send(st.cfg.first_node, make_envelope(run, std::move(p))))
    throw std::runtime_error("node '" + st.cfg.first_node + "' of the first stage is not reachable");
}

void finish(HeadState& st, std::string error = {}) {
  Active& a = *st.active;
  a.result.text += a.decoder->flush();
  a.result.error = std::move(error);
  a.result.stats.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - a.t0).count();
  if (a.result.stats.generated_tokens > 1) {
    const double s = std::chrono::duration<double>(Clock::now() - a.t_first).count();
    a.result.stats.decode_tokens_per_s = (a.result.stats.generated_tokens - 1) / s;
  }
  if (!a.result.ok()) spdlog::error("generation failed after {} tokens: {}", a.result.ids.size(), a.result.error);
  a.session->done.set_value(std::move(a.result));
  st.active.reset();
}

void launch(HeadState& st, const std::vector<int32_t>& tokens, int32_t pos0) {
  // Chunks of n_batch; only the last token of the last chunk asks for logits.
  for (size_t b = 0; b < tokens.size(); b += st.cfg.n_batch) {
    const size_t e = std::min(tokens.size(), b + size_t(st.cfg.n_batch));
    Batch batch;
    for (size_t i = b; i < e; ++i) batch.add(tokens[i], pos0 + int32_t(i), seq_bit(0), i + 1 == tokens.size());
    const uint64_t run = st.next_run++;
    send_to_pipeline(st, run, to_run_start(st.cfg.pipeline, batch, false));
    st.active->awaited_run = run;
  }
}

void start_next(HeadState& st) {
  while (!st.active && !st.queue.empty()) {
    SessionPtr s = std::move(st.queue.front());
    st.queue.pop_front();
    st.active.emplace();
    Active& a = *st.active;
    a.session = s;
    a.t0 = Clock::now();
    const Tokenizer& tok = st.cfg.model->tokenizer();
    try {
      a.result.prompt_ids = tok.encode(s->request.prompt, true);
      if (a.result.prompt_ids.empty()) a.result.prompt_ids.push_back(tok.bos() >= 0 ? tok.bos() : 0);
      a.result.stats.prompt_tokens = int(a.result.prompt_ids.size());
      a.n_predict = s->request.n_predict > 0 ? s->request.n_predict : st.cfg.n_predict;
      a.sampler = std::make_unique<Sampler>(s->request.sampling.value_or(st.cfg.sampling));
      a.decoder = std::make_unique<StreamDecoder>(tok);
      for (int32_t t : a.result.prompt_ids) a.decoder->feed(t);
      // A fresh cache for every request: the removal travels down the pipeline before the run.
      KvCacheOp clear;
      clear.pipeline = st.cfg.pipeline;
      clear.layer = 0;
      clear.ops.push_back({KvOpKind::remove, -1, -1, -1, -1});
      send_to_pipeline(st, 0, std::move(clear));
      a.pos = int32_t(a.result.prompt_ids.size());
      launch(st, a.result.prompt_ids, 0);
    } catch (const std::exception& e) {
      finish(st, e.what());
    }
  }
}

void on_logits(HeadState& st, uint64_t run, const Logits& l) {
  if (!st.active || run != st.active->awaited_run) return;  // an earlier prefill chunk
  Active& a = *st.active;
  const int n_vocab = st.cfg.model->hparams().n_vocab;
  if (l.rows.size() != 1 || l.logits.numel() != size_t(n_vocab))
    return finish(st, "run " + std::to_string(run) + ": expected one row of " + std::to_string(n_vocab) + " logits");
  std::vector<float> row = l.logits.data.to_vector<float>();
  const int32_t tok = a.sampler->sample(row.data(), n_vocab);
  if (a.result.ids.empty()) {
    a.t_first = Clock::now();
    a.result.stats.ttft_ms = std::chrono::duration<double, std::milli>(a.t_first - a.t0).count();
  }
  if (!a.session->request.ignore_eos && st.cfg.model->stops_at(tok)) return finish(st);
  a.result.ids.push_back(tok);
  ++a.result.stats.generated_tokens;
  std::string piece = a.decoder->feed(tok);
  a.result.text += piece;
  bool more = !a.session->cancel.load();
  if (a.session->on_token && !a.session->on_token(tok, piece)) more = false;
  if (!more || int(a.result.ids.size()) >= a.n_predict) return finish(st);
  try {
    launch(st, {tok}, a.pos++);
  } catch (const std::exception& e) {
    finish(st, e.what());
  }
}

}  // namespace

caf::actor spawn_head(caf::actor_system& sys, HeadConfig cfg) {
  return sys.spawn([cfg = std::move(cfg)](caf::stateful_actor<HeadState>* self) -> caf::behavior {
    self->state.cfg = cfg;
    return {
        [self](generate_atom, const SessionPtr& s) {
          self->state.queue.push_back(s);
          start_next(self->state);
        },
        [self](const std::string& from, const Envelope& env) {
          auto& st = self->state;
          if (const auto* l = std::get_if<Logits>(&env.payload)) {
            if (l->pipeline == st.cfg.pipeline) on_logits(st, env.run_id, *l);
          } else if (const auto* e = std::get_if<Error>(&env.payload)) {
            if (!st.active) return;
            const bool ours = env.run_id == 0 || env.run_id >= st.active->awaited_run - 64;
            const bool pipeline_node =
                std::find(st.cfg.stage_nodes.begin(), st.cfg.stage_nodes.end(), e->peer) != st.cfg.stage_nodes.end();
            if (e->code == ErrorCode::peer_down && pipeline_node)
              finish(st, "node '" + e->peer + "' stopped answering (process gone or frozen); generation aborted");
            else if (e->code != ErrorCode::peer_down && ours)
              finish(st, "node '" + e->peer + "': " + e->message);
          }
          start_next(st);
        },
    };
  });
}

}  // namespace specmesh
