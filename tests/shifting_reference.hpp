// The reference for context shift: greedy decoding over one context as llama.cpp's loop does it.
#pragma once

#include <cstdint>
#include <vector>

#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/sampler.hpp"

namespace specmesh::test {

// llama.cpp's loop with context shift over the model alone: keep n_keep tokens (and the BOS),
// drop half of the rest when the next token would not fit, move the tail down. `params` sets
// the rest of the context (an attention layout).
inline std::vector<int32_t> shifting_reference(const Model& m, int n_ctx, const std::vector<int32_t>& prompt, int n,
                                               int n_keep, ContextParams params = {}) {
  params.n_ctx = n_ctx;
  Context ctx(m, params);
  std::vector<int32_t> toks = prompt, out;
  const int keep = n_keep + (prompt[0] == m.tokenizer().bos() ? 1 : 0);
  auto logits = prefill(ctx, prompt, 0, 256);
  for (;;) {
    const int32_t t = Sampler::argmax(logits.data(), m.hparams().n_vocab);
    out.push_back(t);
    toks.push_back(t);
    if (int(out.size()) == n) return out;
    if (int(toks.size()) > n_ctx) {
      const int cached = int(toks.size()) - 1, discard = (cached - keep) / 2;
      ctx.kv().seq_rm(0, keep, keep + discard);
      ctx.shift_positions(0, keep + discard, -1, -discard);
      toks.erase(toks.begin() + keep, toks.begin() + keep + discard);
    }
    Batch d;
    d.add(t, int32_t(toks.size()) - 1, seq_bit(0), true);
    logits = ctx.forward(d).logits;
  }
}

}  // namespace specmesh::test
